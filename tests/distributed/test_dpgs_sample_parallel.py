"""A sample-parallel group as one DPGS worker (``dpgs.sample_parallel``): config checks, the flat layout
and bag-of-images loss against ``TileMIL`` (gloo, float64), and DPGS steps on synthetic tile bags that
equal single-process ``packed`` steps (two-node local Ray cluster)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import h5py
import numpy as np
import pytest
import torch

from dpgs.config import load_config
from dpgs.config.schema import ModelConfig
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.spatial.partition import Grid, Partition
from dpgs.spatial.rank import RankState
from dpgs.workers.sample_parallel import check_layout, replica_names, spatial_spec, tilemil_names
from tests.spatial_helpers import run_ranks

TILES_PER_SLIDE = [6, 4, 8, 5]  # bag lengths (tiles of 32 px)
TILE = 32


def _tiles_config(*overrides: str):
    base = ["data.kind=tiles", "model.encoder=resnet18", "train.mode=dpgs", "dpgs.sample_parallel=2"]
    return load_config(None, [*base, *overrides])


@pytest.mark.parametrize(("override", "message"), [
    ("data.kind=features", r"dpgs.sample_parallel=2 needs data.kind=tiles"),
    ("model.freeze_encoder=true", r"dpgs.sample_parallel=2 .*model.freeze_encoder=true"),
    ("train.mode=packed", r"dpgs.sample_parallel=2 needs train.mode=dpgs \(got packed\)"),
    ("model.amp=true", r"dpgs.sample_parallel=2 .*model.amp=true"),
    ("dpgs.sample_grid=[2, 2]", r"dpgs.sample_grid \[2, 2\] .*rows \* cols = dpgs.sample_parallel=2"),
])
def test_config_errors_name_the_key(override, message):
    extra = ["model.encoder=null"] if override == "data.kind=features" else []
    with pytest.raises(Exception, match=message):
        _tiles_config(override, *extra)
    assert _tiles_config("dpgs.sample_grid=[1, 2]").dpgs.sample_grid == (1, 2)


def _tilemil_spec() -> ModelSpec:
    cfg = ModelConfig(name="abmil", params={"dropout": 0.0}, encoder="resnet18", big_stages=1)
    return ModelSpec(cfg, None, 2)


def _bag_of_images_rank(rank: int, world: int, spec64) -> None:
    """Rank ``rank`` of a 2 x 1 grid: one bag of 5 tiles; rank 0 checks against ``TileMIL.loss``."""
    torch.manual_seed(3)
    model = _tilemil_spec().build().double()
    x = torch.randn(5, 3, TILE, TILE, dtype=torch.float64)
    y = 1
    state = RankState(rank, Grid(world, 1), spec64)
    state.model.load_state_dict({k.removeprefix("encoder."): v for k, v in model.state_dict().items()})
    rect = Partition(Grid(world, 1), TILE, TILE).owned(rank)
    out = state.step(x[:, :, rect.r0:rect.r1, rect.c0:rect.c1], TILE, TILE, torch.tensor([y]), step=0)
    if rank != 0:
        return
    model.train()
    # TileMIL.loss's maths (one encoder pass over the bag, then the head) without its float32 cast of
    # the embeddings, so that the reference stays in float64
    ref = model.head.loss(model.encoder(x), torch.tensor(y))
    ref["per_bag"].sum().backward()
    torch.testing.assert_close(out["losses"], ref["per_bag"].detach().reshape(1), rtol=1e-9, atol=1e-12)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    assert out["grad"].shape == grads.shape
    err = (out["grad"] - grads).abs().max().item()
    assert err <= 1e-9 * grads.abs().max().item(), f"flat gradient differs by {err}"
    floats = [b for b in out["buffers"] if b.is_floating_point()]
    refs = [b for b in model.buffers() if b.is_floating_point()]
    for a, b in zip(floats, refs, strict=True):  # running statistics over the bag's 5 tiles
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_flat_layout_and_bag_of_images_loss_match_tilemil():
    """The replica's trainable parameters and float buffers are TileMIL's (names less ``encoder.``,
    shapes, order), and two row-band ranks give TileMIL's loss and flat gradient of one bag (float64)."""
    spec = _tilemil_spec()
    model = spec.build()
    sp = spatial_spec(spec, seed=0)
    assert sp.instances == "images" and sp.head == "abmil" and sp.partitioned_stages == 1
    ours, theirs = replica_names(sp), tilemil_names(model)
    assert ours == theirs
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names[0] == "encoder.conv1.weight" and names[-1].startswith("head.")
    assert [n for n, _ in ours[0]] == [n.removeprefix("encoder.") for n in names]
    check_layout(model, sp)
    with pytest.raises(ValueError, match="disagree on their trainable parameters"):
        check_layout(model, dataclasses.replace(sp, arch="resnet50"))
    run_ranks(2, _bag_of_images_rank, dataclasses.replace(sp, dtype="float64"))


# ----------------------------------------------------------------------------------------------- DPGS
@pytest.fixture(scope="module")
def tile_bags(tmp_path_factory):
    """Four 256 x 256 two-level slides of random pixels with 6, 4, 8 and 5 tiles of 32 px.

    Random pixels rather than synthetic tissue: tiles of near-constant background make the gradients of
    the layers before BatchNorm sums of nearly cancelling terms, where two float32 implementations (the
    packed reference and the ranks) round apart by more than the 1e-4 this test asks for; the exact
    equality of the group's arithmetic is checked in float64 above.
    """
    from dpgs.wsi.synthetic import write_pyramid_tiff

    root = tmp_path_factory.mktemp("sp_tiles")
    slides, patches = root / "slides", root / "tiles" / "patches"
    slides.mkdir()
    patches.mkdir(parents=True)
    rng = np.random.default_rng(0)
    grid = [[x, y] for y in range(0, 256, 64) for x in range(16, 256, 64)]
    rows = ["slide_id,label,split"]
    for k, n in enumerate(TILES_PER_SLIDE):
        image = rng.integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
        write_pyramid_tiff(slides / f"s{k}.tif", image, 2, 128, 20, 0.5)
        with h5py.File(patches / f"s{k}.h5", "w") as fh:
            dset = fh.create_dataset("coords", data=np.asarray(grid[:n], np.int64))
            dset.attrs.update(patch_size=TILE, patch_level=0, read_size=TILE)
        rows.append(f"s{k},{k % 2},{('train', 'train', 'val', 'test')[k]}")
    manifest = root / "manifest.csv"
    manifest.write_text("\n".join(rows) + "\n")
    return manifest, slides, root / "tiles"


def _dpgs_config(tile_bags, out, *overrides):
    manifest, slides, tiles = tile_bags
    return load_config(None, [
        "data.kind=tiles", f"data.manifest={manifest}", f"data.slides_dir={slides}",
        f"data.tiles_dir={tiles}",
        "data.tiles_per_bag=null", "data.prefetch=0", "data.read_threads=1",
        "model.encoder=resnet18", "model.big_stages=1", "model.name=abmil", "model.params={dropout: 0.0}",
        "train.mode=dpgs", "train.optimizer=sgd", "train.lr=0.005", "train.lr_scaling=none",
        "train.scheduler=none",
        f"train.output_dir={out}", "dpgs.workers=1", "dpgs.sample_parallel=2", "dpgs.cpus_per_worker=1",
        "dpgs.compression.keep_ratio=1.0", "dpgs.compression.value_dtype=fp32",
        "train.checkpoint_every=1", "dpgs.call_timeout_s=120", *overrides,
    ])


def _start_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return spec.build()


def _float_state(state: dict) -> dict:
    return {k: v.detach().clone().double() for k, v in state.items() if v.is_floating_point()}


def _assert_close(a: dict, b: dict, rtol: float, what: str, global_rtol: float | None = None) -> None:
    """Every tensor within ``rtol`` (relative to its norm) and, if given, the whole vector of parameters
    and statistics within ``global_rtol``."""
    assert a.keys() == b.keys()
    errors = {key: ((a[key] - b[key]).norm() / b[key].norm().clamp(min=1e-12)).item() for key in a}
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= rtol, f"{what}: relative errors above {rtol}: {worst}"
    if global_rtol is not None:
        va, vb = (torch.cat([d[k].reshape(-1) for k in sorted(d)]) for d in (a, b))
        err = ((va - vb).norm() / vb.norm()).item()
        assert err <= global_rtol, f"{what}: relative error of all parameters {err:.1e} > {global_rtol}"


@pytest.mark.ray
def test_dpgs_steps_equal_packed_steps_and_survive_a_killed_group_worker(ray_cluster, tile_bags, tmp_path):
    """P=1 group of G=2 row-band ranks. Step 1: B=1 bag; step 2: B=3 bags of 8, 5 and 4 tiles (already in
    the LPT order, so BatchNorm's running statistics see the bags in the order of the packed step), with
    the group's coordinator SIGKILLed mid-step: Ray restarts it with a fresh group, it is resynchronised
    and its bags re-run. Parameters and running statistics equal single-process packed steps (SGD)."""
    import ray
    from ray.util.placement_group import placement_group_table

    from dpgs.train.local_engine import LocalEngine
    from tests.dpgs_helpers import dpgs_engine

    config = _dpgs_config(tile_bags, tmp_path / "run")
    data = load_experiment_data(config.data, seed=config.seed)
    spec = ModelSpec(config.model, None, len(data.manifest.classes))
    batches = [[0], [2, 3, 1]]
    assert [len(data.dataset.get(i, 1).tiles) for i in batches[1]] == [8, 5, 4]

    packed = config.train.model_copy(update={"mode": "packed"})
    local = LocalEngine(_start_model(spec, config.seed), packed, torch.device("cpu"), None, config.seed,
                        data.dataset, 0)
    before = _float_state(local.state_dict())
    reference = []
    for batch in batches:
        local.run_epoch([batch], 1)
        reference.append(_float_state(local.state_dict()))
    names = [k for k in before if "running" not in k]
    moved = (torch.cat([(reference[0][k] - before[k]).reshape(-1) for k in names]).norm()
             / torch.cat([before[k].reshape(-1) for k in names]).norm()).item()
    assert moved > 1e-3, f"the step moved the parameters by {moved:.1e} only: the comparison proves nothing"

    captured, killed = [], []

    def capture(eng, epoch, step):  # chunks of one step (train.checkpoint_every=1)
        captured.append(_float_state(eng.state_dict()))

    start = _start_model(spec, config.seed)
    with dpgs_engine(config, spec, start, data.dataset, data.splits[0].train) as engine:
        # asked now: during a step the actor is busy
        pid = ray.get(engine.group.workers.handles[0].ping.remote())

        def kill_coordinator(group):
            if len(captured) == 1 and not killed:
                killed.append(pid)
                time.sleep(1.0)  # inside the step's first bag
                os.kill(pid, signal.SIGKILL)

        engine.hooks.after_chunk = capture
        engine.group.hooks.after_submit = kill_coordinator
        stats = engine.run_epoch(batches, 1, [])
    _assert_close(captured[0], reference[0], 1e-4, "B=1")
    # Second step: BatchNorm biases start at zero and their gradients are sums of nearly cancelling terms;
    # after two float32 steps they carry ~1.5e-4 relative rounding noise even between the BagWorker and
    # the packed step (same code), so the per-tensor bound is 1e-3 and the whole vector's is 1e-4.
    _assert_close(captured[1], reference[1], 1e-3, "B=3 after a killed coordinator", global_rtol=1e-4)
    for got, ref, start in ((captured[0], reference[0], before), (captured[1], reference[1], reference[0])):
        delta = torch.cat([(got[k] - start[k]).reshape(-1) for k in names])
        want = torch.cat([(ref[k] - start[k]).reshape(-1) for k in names])
        assert ((delta - want).norm() / want.norm()).item() <= 1e-3, "the updates differ"
    assert stats["worker_restarts"] == 1.0
    assert stats["sample_parallel_halo_bytes"] > 0 and stats["sample_parallel_restarts"] == 0.0
    live = [v["name"] for v in placement_group_table().values()
            if v["name"].startswith("dpgs-group-") and v["state"] != "REMOVED"]
    assert not live, f"placement groups left behind: {live}"
