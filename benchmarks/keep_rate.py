"""Keep-rate sweep of DPGS compression on the demo bags (DPGS paper, Table 6), both downlinks.

    python benchmarks/keep_rate.py [--bags 1000] [--epochs 10] [--seeds 0 1] [--out FILE]

P=2 virtual nodes, B=16, the built-in defaults (learning rate 5e-4 at one bag per step scaled by
sqrt(16), DGC keep-ratio warm-up over 2 epochs, fp16 values, tensors under 1024 elements sent dense) at
keep ratios 100% (dense float32) down to 0.01% with ``downlink=gradients`` (workers take the master's step
on the relayed payloads), and at 1% and 0.1% with ``downlink=delta`` (the master's top-k weight deltas with
its residual). Per row, means over the seeds: training seconds per epoch (first epoch excluded), best
validation AUC and the epoch reaching it, final test AUC (best checkpoint), bytes per optimizer step (up +
down, all epochs, DGC warm-up included) and the ratio to dense float32 transfers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import ray
from _common import demo_manifest, emit, fmt, machine_line, markdown, run

ROWS = [(1.0, "gradients"), (0.1, "gradients"), (0.01, "gradients"), (0.001, "gradients"),
        (0.0001, "gradients"), (0.01, "delta"), (0.001, "delta")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out")
    args = p.parse_args(argv)
    results: dict[tuple[float, str], list[dict]] = {row: [] for row in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, args.bags)
        for seed in args.seeds:
            for keep, downlink in ROWS:
                r = run(manifest, work, f"keep-{keep}-{downlink}-{seed}", "train.mode=dpgs", "dpgs.workers=2",
                        "train.batch_size=16", f"train.epochs={args.epochs}", f"seed={seed}",
                        "eval.bootstrap=0", f"dpgs.compression.keep_ratio={keep}",
                        f"dpgs.compression.downlink={downlink}")
                hist = r["history"]
                best = max(hist, key=lambda row: row["val_auc"])
                sent = sum(row["comm_bytes_up"] + row["comm_bytes_down"] for row in hist)
                steps = sum(row["optimizer_steps"] for row in hist)
                dense = sum(row["comm_dense_bytes"] for row in hist)
                results[(keep, downlink)].append({
                    "train_s": r["train_s"], "best": best["val_auc"], "epoch": best["epoch"],
                    "test": r["test"].get("test_auc", float("nan")), "kib": sent / steps / 1024,
                    "ratio": dense / sent,
                })
    ray.shutdown()
    mean = statistics.fmean
    rows = [[f"{keep:.2%}", downlink, fmt(mean(x["train_s"] for x in rs)), fmt(mean(x["best"] for x in rs)),
             fmt(mean(x["epoch"] for x in rs), ".1f"), fmt(mean(x["test"] for x in rs), ".4f"),
             fmt(mean(x["kib"] for x in rs), ".1f"), fmt(mean(x["ratio"] for x in rs), ".1f") + "x"]
            for (keep, downlink), rs in results.items()]
    table = markdown(["keep", "downlink", "train s/epoch", "best val AUC", "epoch of best", "test AUC",
                      "KiB/step (up+down)", "vs dense fp32"], rows)
    emit(f"Demo bags {args.bags}, ABMIL, P=2, B=16, {args.epochs} epochs, built-in defaults, "
         f"seeds {args.seeds} (means). {machine_line()}.\n\n{table}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
