"""The CPU work around a DPGS step's exchange, phase by phase, on one thread as a rank runs it.

    python benchmarks/step_apply.py [--encoder resnet18] [--keep 0.01] [--steps 9] [--out FILE]

With ``downlink=gradients`` every rank forms the step's gradient itself (``dpgs.distributed.sync.relay``):
a worker encodes its gradient sum (top-k with error feedback), then, with the frame, sums the P = 2
payloads in worker order, takes the mean and steps its Adam replica; the master sums, takes the norm
(the clip factor), the mean and the same step. Each phase runs on the real code (``Uplink``,
``norm_and_clip``, ``Replica``) on ResNet-18-sized gradients (random, ``--steps`` steps, the median of all
but the first two), two ways:

* **reused** (what the ranks do): the sum is formed in the replica's one gradient vector
  (``Replica.gradient_buffer``), the mean taken in place, the norm accumulated chunk by chunk in float64
  (``dpgs.train.optim.l2_norm``);
* **allocated** (before 2026-11-28, the baseline): a fresh zero vector for the sum, the mean as a new
  vector and the norm over a float64 copy of the whole mean, each a fresh 46-92 MB on CPU, whose page
  faults are paid every step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import emit, machine_line, markdown

from dpgs.compression import ParamLayout
from dpgs.config import load_config
from dpgs.config.schema import ModelConfig
from dpgs.distributed.codec import Uplink
from dpgs.distributed.replica import Replica
from dpgs.distributed.sync.relay import norm_and_clip
from dpgs.modeling import build_model

WORKERS = 2


class Timer:
    def __init__(self):
        self.ms: dict[str, list[float]] = {}

    def __call__(self, phase: str, fn):
        start = time.perf_counter()
        out = fn()
        self.ms.setdefault(phase, []).append(1e3 * (time.perf_counter() - start))
        return out

    def medians(self, skip: int) -> dict[str, float]:
        return {phase: statistics.median(v[skip:]) for phase, v in self.ms.items()}


def run(encoder: str, keep: float, steps: int) -> dict[str, dict[str, float]]:
    model = build_model(ModelConfig(encoder=encoder), None, 2)
    config = load_config(None, [])
    replica = Replica(model, config.train)
    replica.restart(model.state_dict(), with_optimizer=True)
    layout = ParamLayout.from_module(model, dense_min_numel=config.dpgs.compression.dense_min_numel)
    uplinks = [Uplink(config.dpgs.compression, layout) for _ in range(WORKERS)]
    generator = torch.Generator().manual_seed(0)
    timers = {"reused": Timer(), "allocated": Timer()}
    for _ in range(steps):
        grads = [torch.randn(replica.numel, generator=generator) * 1e-3 for _ in range(WORKERS)]
        for way, t in timers.items():
            payloads = [torch.frombuffer(bytearray(t("encode", lambda u=u, g=g: u.encode(g, keep))),
                                         dtype=torch.uint8) for u, g in zip(uplinks, grads, strict=True)]
            if way == "reused":
                total = t("sum (2 payloads)", lambda p=payloads: uplinks[0].sum_into(
                    replica.gradient_buffer().zero_(), p, [1] * WORKERS, keep))
                t("norm", lambda total=total: norm_and_clip(total, WORKERS, None))
                mean = t("mean", lambda total=total: total.div_(WORKERS))
            else:
                total = t("sum (2 payloads)", lambda p=payloads: uplinks[0].sum_into(
                    torch.zeros(replica.numel), p, [1] * WORKERS, keep))
                mean = t("mean", lambda total=total: total / WORKERS)
                t("norm", lambda mean=mean: float(torch.linalg.vector_norm(mean, dtype=torch.float64)))
            t("Adam step", lambda mean=mean: replica.step(mean, 1e-4, 1.0))
    return {way: t.medians(skip=2) for way, t in timers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder", default="resnet18", choices=["resnet18", "resnet50"])
    parser.add_argument("--keep", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.encoder, args.keep, args.steps)
    phases = ["encode", "sum (2 payloads)", "norm", "mean", "Adam step"]
    rows = [[p, f"{result['allocated'][p]:.1f}", f"{result['reused'][p]:.1f}",
             f"{result['reused'][p] / result['allocated'][p]:.2f}x"] for p in phases]
    worker = ["encode", "sum (2 payloads)", "mean", "Adam step"]
    master = ["sum (2 payloads)", "norm", "mean", "Adam step"]
    for name, part in (("worker (encode, then apply)", worker), ("master", master)):
        before, after = (sum(result[w][p] for p in part) for w in ("allocated", "reused"))
        rows.append([f"**{name}**", f"{before:.1f}", f"{after:.1f}", f"{after / before:.2f}x"])
    text = (f"{machine_line()}; {args.encoder} + ABMIL, keep {args.keep:g}, P = {WORKERS}, medians of "
            f"{args.steps - 2} steps, ms\n\n" + markdown(["phase", "allocated", "reused", "ratio"], rows))
    emit(text, args.out)


if __name__ == "__main__":
    main()
