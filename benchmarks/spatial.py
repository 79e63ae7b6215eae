"""Sample parallelism: strong and weak scaling of one input over G Ray ranks (gloo on CPU).

    python benchmarks/spatial.py [--size 512] [--stages 4] [--steps 3] [--max-ranks 2] \
        [--out docs/benchmarks/spatial.md]
    python benchmarks/spatial.py --dpgs [--tile 128] [--tiles 16] [--bags 2] [--steps 3]

A ResNet-18 whose stem and first ``--stages`` stages are partitioned into row bands; one image per step,
forward + backward of the sum of losses, float32, one torch thread per rank. Baselines in the same run:
the single-process big-layer model (``dpgs.biglayers.resnet18``, no Ray) and the G=1 group.

* strong scaling: fixed ``size x size`` image, G = 1 .. max-ranks. Speed-up = T(G=1) / T(G),
  efficiency = speed-up / G.
* weak scaling: image height ``size * G`` (area proportional to G), so every rank owns a ``size x size``
  band. Efficiency = T(G=1) / T(G) (ideal: constant step time); throughput in megapixels per second.

``--dpgs``: one DPGS step (``train.mode=dpgs``, ``data.kind=tiles``, TileMIL = ResNet-18 with
``big_stages=1`` + ABMIL) on bags of ``--tiles`` random-pixel tiles of ``--tile`` px, ``--bags`` bags per
step, compression off, P = 1 worker: a ``BagWorker`` (G = 1, all CPUs of the run as its threads) against a
``GroupWorker`` with G = 2 row-band ranks (one CPU and one thread each). Step time = the driver's wall
time of a step (weight update in, bags read, forward/backward, gradient out, master step), median of
``--steps`` after a warm-up step.

"step s" is the driver's wall time of ``group.compute`` (Ray calls, the input bands going out and the
flat gradient coming back included); "rank s" is the slowest rank's own forward + backward + all-reduce.
Halo bytes are the activation rows (forward) and their gradients (backward) sent between ranks per step,
summed over the ranks; gather = downsampled activation to rank 0 and its gradient back; all-reduce =
partitioned weight gradients plus BatchNorm statistics.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import ray
import torch
from _common import emit, fmt, machine_line, markdown

from dpgs.biglayers import resnet18
from dpgs.spatial.rank import SpatialModelSpec
from dpgs.spatial.sample_group import SampleParallelGroup


def _median_step(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _local(spec: SpatialModelSpec, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    model = resnet18(big_stages=spec.partitioned_stages, num_classes=spec.num_classes, device="cpu")
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()

    return _median_step(step, steps)


def _group(spec: SpatialModelSpec, ranks: int, x: torch.Tensor, y: torch.Tensor, steps: int):
    with SampleParallelGroup(spec, ranks, threads=1, call_timeout_s=600) as group:
        last: dict = {}
        slowest_rank: list[float] = []

        def step():
            _, stats = group.compute(x, y)
            last.update(stats)
            slowest_rank.append(max(stats["rank_seconds"]))

        total = _median_step(step, steps)
        return total, statistics.median(slowest_rank[1:]), last


def _tile_data(root, tile: int, tiles: int, n_slides: int):
    """``n_slides`` random-pixel slides with ``tiles`` tiles of ``tile`` px each, and their manifest."""
    import h5py
    import numpy as np

    from dpgs.wsi.synthetic import write_pyramid_tiff

    side = 64 * ((int(np.ceil(np.sqrt(tiles))) * tile + 63) // 64)
    slides, patches = root / "slides", root / "tiles" / "patches"
    slides.mkdir(parents=True)
    patches.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_row = side // tile
    coords = [[(i % per_row) * tile, (i // per_row) * tile] for i in range(tiles)]
    rows = ["slide_id,label,split"]
    for k in range(n_slides):
        write_pyramid_tiff(slides / f"s{k}.tif", rng.integers(0, 256, (side, side, 3), dtype=np.uint8), 2,
                           128, 20, 0.5)
        with h5py.File(patches / f"s{k}.h5", "w") as fh:
            fh.create_dataset("coords", data=np.asarray(coords, np.int64)).attrs.update(
                patch_size=tile, patch_level=0, read_size=tile)
        rows.append(f"s{k},{k % 2},{'train' if k < n_slides - 2 else ('val', 'test')[k - n_slides + 2]}")
    (root / "manifest.csv").write_text("\n".join(rows) + "\n")
    return root / "manifest.csv", slides, root / "tiles"


def _dpgs_step(paths, out, g: int, bags: int, steps: int, cpus: int) -> tuple[float, dict]:
    """Median step seconds of a P=1 DPGS run with ``g`` ranks per worker (1: a BagWorker)."""
    from dpgs.config import load_config
    from dpgs.distributed.session import DpgsSession
    from dpgs.experiment import load_experiment_data
    from dpgs.modeling import ModelSpec
    from dpgs.train.engine import FoldSetup

    manifest, slides, tiles = paths
    config = load_config(None, [
        "data.kind=tiles", f"data.manifest={manifest}", f"data.slides_dir={slides}",
        f"data.tiles_dir={tiles}", "data.tiles_per_bag=null", "data.prefetch=0", "data.read_threads=1",
        "data.augment.enabled=false",
        "model.encoder=resnet18", "model.big_stages=1", "model.name=abmil", "train.mode=dpgs",
        "train.optimizer=sgd", "train.scheduler=none", f"train.output_dir={out}", "dpgs.workers=1",
        f"dpgs.sample_parallel={g}", f"dpgs.cpus_per_worker={cpus // g}", "dpgs.compression.keep_ratio=1.0",
        "train.checkpoint_every=1"])
    data = load_experiment_data(config.data, seed=0)
    spec = ModelSpec(config.model, None, len(data.manifest.classes))
    torch.manual_seed(0)
    session = DpgsSession(config)
    engine = session.engine(FoldSetup(config, spec, spec.build(), None, data.dataset, data.splits[0].train,
                                      torch.device("cpu"), Path(out)))
    marks = [time.perf_counter()]
    engine.hooks.after_chunk = lambda *_: marks.append(time.perf_counter())  # chunks of one step
    try:
        n = len(data.dataset)
        stats = engine.run_epoch([[(s * bags + b) % n for b in range(bags)] for s in range(steps + 1)], 1, [])
    finally:
        session.close()
    times = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)][1:]
    return statistics.median(times), stats


def dpgs_section(args) -> str:
    """One DPGS step, P=1: BagWorker (G=1) vs GroupWorker (G=2), on tile bags (see module docstring)."""
    import tempfile
    from pathlib import Path

    cpus = 2
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = _tile_data(Path(tmp) / "data", args.tile, args.tiles, max(4, args.bags + 2))
        for g in (1, 2):
            t, st = _dpgs_step(paths, Path(tmp) / f"run{g}", g, args.bags, args.steps, cpus)
            halo = st.get("sample_parallel_halo_bytes", 0.0)
            rows.append([f"P=1, G={g}" + (" (BagWorker)" if g == 1 else " (GroupWorker, 2x1 bands)"),
                         str(g), f"{cpus // g} x {g}", fmt(t), fmt(args.bags * args.tiles / t),
                         fmt(halo / 1e6, ".2f"), fmt(st["comm_bytes_per_step"] / 1e6, ".1f")])
    ray.shutdown()
    header = ["run", "ranks", "threads x ranks", "step s", "tiles/s", "halo MB/step", "DPGS MB/step"]
    return (f"## One DPGS step with a sample-parallel worker (`benchmarks/spatial.py --dpgs`)\n\nMachine: "
            f"{machine_line()}; TileMIL = ResNet-18 (big_stages=1, stem + layer1 partitioned) + ABMIL, "
            f"{args.bags} bags x {args.tiles} tiles of {args.tile} px per step, float32, compression off, "
            f"median of {args.steps} steps after a warm-up.\n\n" + markdown(header, rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--stages", type=int, default=4, help="partitioned stages (0 = stem only .. 4)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-ranks", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--dpgs", action="store_true", help="only the DPGS step section (tile bags)")
    p.add_argument("--tile", type=int, default=128, help="--dpgs: tile size in px")
    p.add_argument("--tiles", type=int, default=16, help="--dpgs: tiles per bag")
    p.add_argument("--bags", type=int, default=2, help="--dpgs: bags per step")
    args = p.parse_args(argv)
    if args.dpgs:
        emit(dpgs_section(args), args.out)
        return 0
    ray.init(address="local", num_cpus=args.max_ranks, include_dashboard=False, log_to_driver=False)
    spec = SpatialModelSpec("resnet18", partitioned_stages=args.stages, num_classes=2)
    y = torch.tensor([1])
    ranks = list(range(1, args.max_ranks + 1))
    header = ["run", "image", "ranks", "step s", "rank s", "img/s", "Mpx/s", "speed-up", "efficiency",
              "halo MB/step", "gather MB/step", "all-reduce MB/step"]
    sections = []
    for mode in ("strong", "weak"):
        rows, base = [], None
        x1 = torch.randn(1, 3, args.size, args.size)
        local = _local(spec, x1, y, args.steps)
        mpx = args.size * args.size / 1e6
        rows.append(["big layers, 1 process", f"{args.size}x{args.size}", "1", fmt(local), "", fmt(1 / local),
                     fmt(mpx / local), "", "", "0", "0", "0"])
        for g in ranks:
            h = args.size * (g if mode == "weak" else 1)
            x = torch.randn(1, 3, h, args.size)
            t, rank_t, st = _group(spec, g, x, y, args.steps)
            base = base or t
            speed = base / t
            eff = speed / g if mode == "strong" else base / t
            rows.append([f"group G={g}", f"{h}x{args.size}", str(g), fmt(t), fmt(rank_t), fmt(1 / t),
                         fmt(h * args.size / 1e6 / t), fmt(speed, ".2f") if mode == "strong" else "",
                         fmt(eff, ".2f"), fmt(st["halo_bytes"] / 1e6, ".2f"),
                         fmt(st["gather_bytes"] / 1e6, ".2f"),
                         fmt((st["grad_bytes"] + st["stats_bytes"]) / 1e6, ".2f")])
        title = ("Strong scaling (fixed image)" if mode == "strong"
                 else "Weak scaling (image area proportional to G)")
        sections.append(f"### {title}\n\n" + markdown(header, rows))
    text = (f"## Sample parallelism (`benchmarks/spatial.py`)\n\nMachine: {machine_line()}; ResNet-18, "
            f"stages 0..{args.stages} partitioned in row bands, one image per step, float32, forward + "
            f"backward, one torch thread per rank, median of {args.steps} steps after a warm-up.\n\n"
            + "\n\n".join(sections))
    emit(text, args.out)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
