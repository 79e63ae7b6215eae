"""Epoch time and accuracy of the single-process training modes on the demo digits bags.

    python benchmarks/modes.py [--bags 400] [--epochs 5] [--model abmil] [--out docs/benchmarks/modes.md]

Writes the demo data to a temporary directory, trains the same head with classic (B=1), padding,
sampling (K instances per bag) and packed (B bags, exact) and prints, side by side: mean epoch time,
ratio to classic, optimizer steps per epoch, best validation AUC and test AUC.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import torch

from dpgs.config import load_config
from dpgs.data import write_demo_data
from dpgs.runner import run_training


def train(mode: str, manifest: Path, work: Path, args, extra=()) -> dict:
    out = work / mode
    cfg = load_config(
        None,
        [
            "experiment=bench-modes",
            f"data.manifest={manifest}",
            f"data.features_dir={manifest.parent / 'features'}",
            f"model.name={args.model}",
            f"train.mode={mode}",
            f"train.epochs={args.epochs}",
            f"train.batch_size={args.batch_size}",
            f"train.sample_size={args.sample_size}",
            "train.lr=5e-4",
            f"train.output_dir={out}",
            f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
            *extra,
        ],
    )
    result = run_training(cfg)
    fold = result.folds[0]
    epochs = [row["epoch_seconds"] for row in fold.history]
    train_s = [row["train_seconds"] for row in fold.history if "train_seconds" in row]
    return {
        "mode": mode,
        "epoch_s": sum(epochs[1:]) / max(len(epochs) - 1, 1) if len(epochs) > 1 else epochs[0],
        "train_s": sum(train_s[1:]) / max(len(train_s) - 1, 1) if len(train_s) > 1 else train_s[0],
        "best_val_auc": max(row.get("val_auc", float("nan")) for row in fold.history),
        "test_auc": fold.test_metrics.get("test_auc", float("nan")),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--sample-size", type=int, default=32)
    p.add_argument("--model", default="abmil")
    p.add_argument("--out", help="also write the table as Markdown to this file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = write_demo_data(work / "demo", bags=args.bags, seed=0)
        rows = [train(mode, manifest, work, args) for mode in ("classic", "padding", "sampling", "packed")]
    base = rows[0]["train_s"]
    header = "| mode | B | train s/epoch | epoch s (incl. eval) | vs classic | best val AUC | test AUC |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = 1 if r["mode"] == "classic" else args.batch_size
        lines.append(
            f"| {r['mode']} | {b} | {r['train_s']:.3f} | {r['epoch_s']:.3f} | {r['train_s'] / base:.2f}x "
            f"| {r['best_val_auc']:.3f} | {r['test_auc']:.3f} |"
        )
    machine = f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
    text = (
        f"Demo digits bags: {args.bags} bags, model {args.model}, {args.epochs} epochs "
        f"(first epoch excluded from times), sampling K={args.sample_size}. Machine: {machine}.\n\n"
        + "\n".join(lines)
    )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
