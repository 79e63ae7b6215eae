"""Sample parallelism: strong and weak scaling of one input over G Ray ranks (gloo on CPU).

    python benchmarks/spatial.py [--size 512] [--stages 4] [--steps 3] [--max-ranks 2] \
        [--out docs/benchmarks/spatial.md]

A ResNet-18 whose stem and first ``--stages`` stages are partitioned into row bands; one image per step,
forward + backward of the sum of losses, float32, one torch thread per rank. Baselines in the same run:
the single-process big-layer model (``dpgs.biglayers.resnet18``, no Ray) and the G=1 group.

* strong scaling: fixed ``size x size`` image, G = 1 .. max-ranks. Speed-up = T(G=1) / T(G),
  efficiency = speed-up / G.
* weak scaling: image height ``size * G`` (area proportional to G), so every rank owns a ``size x size``
  band. Efficiency = T(G=1) / T(G) (ideal: constant step time); throughput in megapixels per second.

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

import ray
import torch
from _common import emit, fmt, machine_line, markdown

from dpgs.biglayers import resnet18
from dpgs.spatial.group import SampleParallelGroup
from dpgs.spatial.rank import SpatialModelSpec


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--stages", type=int, default=4, help="partitioned stages (0 = stem only .. 4)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-ranks", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args(argv)
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
