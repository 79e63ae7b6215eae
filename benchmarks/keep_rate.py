"""Keep-rate sweep of DPGS compression on the demo bags (DPGS paper, Table 6).

    python benchmarks/keep_rate.py [--bags 400] [--epochs 6] [--out docs/benchmarks/keep_rate.md]

P=2 virtual nodes, B=16, keep ratio 100% (fp32, lossless) down to 0.01% (fp16 values): epoch time,
best validation AUC, test AUC, bytes per step (up + down) and compression ratio vs dense fp32.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import ray
from _common import demo_manifest, emit, fmt, machine_line, markdown, run

KEEPS = (1.0, 0.1, 0.01, 0.001, 0.0001)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--out")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, args.bags)
        for keep in KEEPS:
            r = run(
                manifest,
                work,
                f"keep-{keep}",
                "train.mode=dpgs",
                "dpgs.workers=2",
                "train.batch_size=16",
                f"train.epochs={args.epochs}",
                f"dpgs.compression.keep_ratio={keep}",
                f"dpgs.compression.value_dtype={'fp32' if keep == 1.0 else 'fp16'}",
                "dpgs.compression.dense_min_numel=1024",
            )
            rows.append(
                [
                    f"{keep:.2%}",
                    fmt(r["train_s"]),
                    fmt(r["best_val_auc"]),
                    fmt(r["test"].get("test_auc")),
                    fmt(r["mean"]("comm_bytes_per_step") / 1024, ".1f"),
                    fmt(r["mean"]("compression_ratio"), ".1f") + "x",
                ]
            )
    ray.shutdown()
    table = markdown(
        ["keep", "train s/epoch", "best val AUC", "test AUC", "KiB/step", "ratio vs dense fp32"], rows
    )
    emit(
        f"Demo bags {args.bags}, ABMIL, P=2, B=16, {args.epochs} epochs. {machine_line()}.\n\n{table}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
