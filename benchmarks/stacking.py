"""Training modes side by side on the demo bags (DPGS paper, Table 2).

    python benchmarks/stacking.py [--bags 400] [--epochs 8] [--out docs/benchmarks/stacking.md]

classic (B=1), padding, sampling, packed, and DPGS with P=2 virtual nodes at keep 100%, 1% and 0.1%,
all B=16 except classic. Prints epoch time, ratio to classic, time to reach the classic run's best
validation AUC, Ray overhead share of a DPGS step, bytes per step and compression ratio, test AUC.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import ray
from _common import demo_manifest, emit, fmt, machine_line, markdown, run, time_to


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--classic-lr", type=float, default=5e-4)
    p.add_argument("--batch-lr", type=float, default=2e-3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    common = [f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", "train.sample_size=32"]
    batch_lr = f"train.lr={args.batch_lr}"  # B bags per step: fewer, larger steps
    runs = [
        ("classic", ["train.mode=classic", f"train.lr={args.classic_lr}"]),
        ("padding", ["train.mode=padding", batch_lr]),
        ("sampling", ["train.mode=sampling", batch_lr]),
        ("packed", ["train.mode=packed", batch_lr]),
    ]
    for keep in (1.0, 0.01, 0.001):
        dtype = "fp32" if keep == 1.0 else "fp16"
        runs.append(
            (
                f"dpgs P=2 keep {keep:.1%}",
                [
                    "train.mode=dpgs",
                    "dpgs.workers=2",
                    batch_lr,
                    f"dpgs.compression.keep_ratio={keep}",
                    f"dpgs.compression.value_dtype={dtype}",
                    "dpgs.compression.dense_min_numel=1024",
                    f"dpgs.compression.warmup_epochs={0 if keep == 1.0 else 2}",
                ],
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, args.bags)
        results = [run(manifest, work, name, *common, *extra) for name, extra in runs]
    if ray.is_initialized():
        ray.shutdown()
    classic = results[0]
    target = classic["best_val_auc"]
    rows = []
    for (name, _), r in zip(runs, results, strict=True):
        hist = r["history"]
        steps = r["mean"]("step_seconds") if "step_seconds" in hist[-1] else None
        overhead = r["mean"]("step_overhead_seconds") if steps else None
        rows.append(
            [
                name,
                fmt(r["train_s"]),
                fmt(r["train_s"] / classic["train_s"], ".2f") + "x",
                fmt(time_to(hist, "val_auc", target), ".1f"),
                fmt(r["best_val_auc"]),
                fmt(r["test"].get("test_auc")),
                fmt(100 * overhead / steps, ".0f") + "%" if steps else "-",
                fmt(r["mean"]("comm_bytes_per_step") / 1024, ".1f") if steps else "-",
                fmt(r["mean"]("compression_ratio"), ".1f") + "x" if steps else "-",
            ]
        )
    table = markdown(
        [
            "run",
            "train s/epoch",
            "vs classic",
            f"s to classic best val AUC ({target:.3f})",
            "best val AUC",
            "test AUC",
            "Ray overhead / step",
            "KiB per step (up+down)",
            "compression",
        ],
        rows,
    )
    emit(
        f"Demo bags: {args.bags}, ABMIL, {args.epochs} epochs, B={args.batch_size} "
        f"(lr {args.batch_lr}; classic "
        f"B=1, lr {args.classic_lr}). Times exclude the first epoch. {machine_line()}.\n\n{table}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
