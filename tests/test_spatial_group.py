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
from dpgs.spatial.group import SampleParallelGroup
from dpgs.spatial.rank import SpatialModelSpec
from dpgs.spatial.sources import NpySource

pytestmark = pytest.mark.ray
TOL = 1e-9


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= TOL * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def _reference_step(model, x, y, head=None):
    """Single-process step: per-image losses, logits, input gradient, per-parameter gradients."""
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


def _check_against(group_grad, stats, model, state_before, ref, params, what):
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
        _check_against(grad, stats, model, state, ref, list(model.named_parameters()), what)
        for name, value in model.state_dict().items():  # running statistics and counters after the step
            _close(after[name].double(), value.double(), f"{what}: {name}")


def test_two_column_ranks_with_abmil_head_from_npy(ray_cluster, tmp_path):
    spec = SpatialModelSpec("resnet18", partitioned_stages=1, num_classes=2, head="abmil",
                            head_params={"dropout": 0.0}, dtype="float64")
    rng = np.random.default_rng(0)
    path = tmp_path / "slide.npy"
    np.save(path, rng.standard_normal((2, 3, 45, 67)))
    x = torch.from_numpy(np.load(path))
    y = torch.tensor([1, 0])
    with SampleParallelGroup(spec, 2, grid=(1, 2), call_timeout_s=120) as group:
        state = group.state_dict()
        grad, stats = group.compute(NpySource(path), y, input_grad=True)
    model = resnet18(big_stages=-1, num_classes=0, device="cpu", dtype=torch.float64)
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")})
    head = build_head("abmil", 512, 2, dropout=0.0).double()
    head.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("head.")})
    model.avgpool = torch.nn.Identity()  # the head sees the feature map's positions
    model.forward = lambda t, m=model: m.layer4(m.layer3(m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(t))))))))
    ref = _reference_step(model, x, y, head)
    params = list(model.named_parameters()) + [(f"head.{n}", p) for n, p in head.named_parameters()]
    _check_against(grad, stats, model, state, ref, params, "abmil")


def test_killed_rank_is_rebuilt_and_the_step_counts_once(ray_cluster):
    spec = SpatialModelSpec("resnet18", partitioned_stages=1, num_classes=2, dtype="float64")
    torch.manual_seed(7)
    x = torch.randn(2, 3, 33, 30, dtype=torch.float64)
    y = torch.tensor([0, 1])
    killed = []

    def kill_rank_one(group, attempt):
        if attempt == 0:
            killed.append(group.where[1]["pid"])
            os.kill(group.where[1]["pid"], signal.SIGKILL)

    with SampleParallelGroup(spec, 2, call_timeout_s=60, hooks={"after_submit": kill_rank_one}) as group:
        state = group.state_dict()
        grad, stats = group.compute(x, y, step=0, input_grad=True)
        after = group.state_dict()
        assert group.restarts == 1 and stats["restarts"] == 1
        assert killed and group.where[1]["pid"] != killed[0]
    model = resnet18(big_stages=-1, num_classes=2, device="cpu", dtype=torch.float64)
    model.load_state_dict(state)
    ref = _reference_step(model, x, y)
    _check_against(grad, stats, model, state, ref, list(model.named_parameters()), "after a restart")
    for name, value in model.state_dict().items():
        _close(after[name].double(), value.double(), f"after a restart: {name}")
    assert int(after["bn1.num_batches_tracked"]) == 1  # one step, counted once


def test_nccl_needs_a_whole_gpu_per_rank():
    with pytest.raises(ValueError, match="never two ranks on one GPU"):
        SampleParallelGroup(SpatialModelSpec(), 2, device="cuda", gpus_per_rank=0.5)
