"""Batch-size sweep of DPGS on the demo bags (DPGS paper, Figure 4).

    python benchmarks/batch_size.py [--bags 400] [--epochs 8] [--out docs/benchmarks/batch_size.md]

P=2 virtual nodes, keep 1% (fp16), B in 4..64 with the learning rate scaled linearly from B=16
(lr = 5e-4 * B / 16): epoch time, steps per epoch, best validation AUC, time to best, test AUC.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import ray
from _common import demo_manifest, emit, fmt, machine_line, markdown, run

SIZES = (4, 8, 16, 32, 64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, args.bags)
        for b in SIZES:
            r = run(
                manifest,
                work,
                f"B-{b}",
                "train.mode=dpgs",
                "dpgs.workers=2",
                f"train.batch_size={b}",
                f"train.epochs={args.epochs}",
                f"train.lr={5e-4 * b / 16}",
                "dpgs.compression.keep_ratio=0.01",
                "dpgs.compression.value_dtype=fp16",
                "dpgs.compression.dense_min_numel=1024",
            )
            best = max(r["history"], key=lambda row: row.get("val_auc", -1))
            rows.append(
                [
                    str(b),
                    fmt(r["train_s"]),
                    fmt(r["mean"]("step_seconds"), ".3f"),
                    fmt(r["history"][0]["optimizer_steps"], ".0f"),
                    fmt(r["best_val_auc"]),
                    fmt(best["elapsed_seconds"], ".1f"),
                    fmt(r["test"].get("test_auc")),
                ]
            )
    ray.shutdown()
    table = markdown(
        ["B", "train s/epoch", "s/step", "steps/epoch", "best val AUC", "s to best", "test AUC"], rows
    )
    emit(
        f"Demo bags {args.bags}, ABMIL, P=2, keep 1%, {args.epochs} epochs. {machine_line()}.\n\n{table}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
