"""SampleParallelGroup on the two-node Ray cluster: exactness against the single-process models, a MIL
head over column bands read from a memory-mapped file, and a rank killed mid-step."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpgs.biglayers import resnet18
from dpgs.models import build_head
from dpgs.spatial.rank import SpatialModelSpec
from dpgs.spatial.sample_group import SampleParallelGroup
from dpgs.spatial.sources import NpySource

pytestmark = pytest.mark.ray
TOL = 1e-9


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= TOL * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def _reference_step(model, x, y, head=None):
    """Single-process step of ``model`` (+ ``head``): per-image losses, logits, input gradient."""
    model.train()
    xr = x.clone().requires_grad_()
    out = model(xr)
    if head is None:
        per_bag, logits = F.cross_entropy(out, y, reduction="none"), out
    else:
        res = [head.loss(out[i].flatten(1).T, y[i]) for i in range(x.shape[0])]
        per_bag = torch.stack([r["per_bag"].reshape(()) for r in res])
        logits = torch.stack([r["logits"].reshape(-1) for r in res])
    per_bag.sum().backward()
    return per_bag.detach(), logits.detach(), xr.grad


def _check_against(group_grad, stats, ref, params, what):
    per_bag, logits, xgrad = ref
    _close(stats["losses"], per_bag, f"{what}: losses")
    _close(stats["logits"], logits, f"{what}: logits")
    _close(stats["input_grad"], xgrad, f"{what}: input gradient")
    offset = 0
    for name, p in params:
        _close(group_grad[offset:offset + p.numel()].view_as(p), p.grad, f"{what}: gradient of {name}")
        offset += p.numel()
    assert offset == group_grad.numel()


def test_three_ranks_match_dense_and_big_layer_resnet18(ray_cluster):
    spec = SpatialModelSpec("resnet18", partitioned_stages=3, num_classes=3, dtype="float64")
    torch.manual_seed(5)
    x = torch.randn(1, 3, 37, 35, dtype=torch.float64)  # layer3 has 3 rows: one row per rank
    y = torch.tensor([2])
    with SampleParallelGroup(spec, 3, call_timeout_s=120) as group:
        state = group.state_dict()
        grad, stats = group.compute(x, y, input_grad=True)
        after = group.state_dict()
    assert stats["restarts"] == 0 and stats["halo_bytes"] > 0 and stats["gather_bytes"] > 0
    for big_stages, max_elements in ((-1, 1 << 24), (3, 20_000)):
        model = resnet18(big_stages=big_stages, max_elements=max_elements, num_classes=3, device="cpu",
                         dtype=torch.float64)
        model.load_state_dict(state)
        ref = _reference_step(model, x, y)
        what = "dense" if big_stages < 0 else "big-layer"
        _check_against(grad, stats, ref, list(model.named_parameters()), what)
        for name, value in model.state_dict().items():  # running statistics and counters after the step
            _close(after[name].double(), value.double(), f"{what}: {name}")


def test_column_ranks_abmil_head_npy_reader_and_a_killed_rank(ray_cluster, tmp_path):
    """Step 0 runs clean; step 1 (same input and weights) loses rank 1 mid-step, is rebuilt and re-run:
    same gradient, and BatchNorm statistics updated exactly twice (the reference's two steps)."""
    spec = SpatialModelSpec("resnet18", partitioned_stages=1, num_classes=2, head="abmil",
                            head_params={"dropout": 0.0}, dtype="float64")
    rng = np.random.default_rng(0)
    path = tmp_path / "slide.npy"
    np.save(path, rng.standard_normal((2, 3, 45, 67)))
    x = torch.from_numpy(np.load(path))
    y = torch.tensor([1, 0])
    killed = []

    def kill_rank_one(group, attempt):
        if group.hooks.get("armed") and attempt == 0:
            killed.append(group.where[1]["pid"])
            os.kill(killed[-1], signal.SIGKILL)

    with SampleParallelGroup(spec, 2, grid=(1, 2), call_timeout_s=60,
                             hooks={"after_submit": kill_rank_one}) as group:
        state = group.state_dict()
        grad, stats = group.compute(NpySource(path), y, step=0, input_grad=True)
        group.hooks["armed"] = True
        grad_again, stats_again = group.compute(NpySource(path), y, step=1, input_grad=True)
        after = group.state_dict()
        assert stats["restarts"] == 0 and stats_again["restarts"] == 1 and group.restarts == 1
        assert killed and group.where[1]["pid"] != killed[0]
    model = resnet18(big_stages=-1, num_classes=0, device="cpu", dtype=torch.float64)
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")})
    head = build_head("abmil", 512, 2, dropout=0.0).double()
    head.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("head.")})
    # the head sees the positions of the final feature map (no pooling)
    features = torch.nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1,
                                   model.layer2, model.layer3, model.layer4)
    ref = _reference_step(features, x, y, head)
    params = list(model.named_parameters()) + [(f"head.{n}", p) for n, p in head.named_parameters()]
    _check_against(grad, stats, ref, params, "abmil")
    _check_against(grad_again, stats_again, ref, params, "abmil, re-run after a killed rank")
    _reference_step(features, x, y, head)  # the reference's second step updates the statistics again
    for name, value in model.state_dict().items():
        _close(after[name].double(), value.double(), f"after a restart: {name}")
    assert int(after["bn1.num_batches_tracked"]) == 2  # two steps, each counted once


def test_bad_settings_are_refused_before_any_actor_starts():
    with pytest.raises(ValueError, match="never two ranks on one GPU"):
        SampleParallelGroup(SpatialModelSpec(), 2, device="cuda", gpus_per_rank=0.5)
    with pytest.raises(ValueError, match=r"sample_grid \[2, 3\] has 6 ranks but dpgs.sample_parallel=4"):
        SampleParallelGroup(SpatialModelSpec(), 4, grid=[2, 3])
