"""A whole k-fold ``dpgs train`` command, timed as a user runs it: DPGS against packed mode.

    python benchmarks/kfold_command.py [--data musk1|musk2|synthetic] [--folds 10] [--epochs 40]
        [--repeats 3] [--rows packed,auto,dense,keep1] [--out FILE]

The data: the real MUSK1 (92 bags, 476 instances, 166 features) or MUSK2 (102 bags, 6598 instances) of
UCI, read from a package registry's wheel (``benchmarks/musk_data.py``), or ``synthetic`` bags shaped like
MUSK1 (``--bags``, 2-40 instances; positive bags hold a few instances from a shifted distribution). Each
command is a subprocess (``dpgs train ...`` start to finish: Python start, imports, Ray start, every
fold); the table gives the median wall seconds, the ratio to packed mode, and the cross-validated test
accuracy and AUC.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
from _common import emit, fmt, machine_line, markdown
from musk_data import write_musk

DPGS = str(Path(sys.executable).with_name("dpgs"))


def write_musk_like(root: Path, bags: int, dim: int = 166, seed: int = 0) -> Path:
    """``bags`` feature bags of 2-40 instances; label 1 bags hold 1-4 instances shifted by +1.5 in the
    first 10 features. Returns the manifest (slide_id,label,case_id; no split column)."""
    rng = np.random.default_rng(seed)
    (root / "features").mkdir(parents=True)
    rows = []
    for i in range(bags):
        label = int(i % 2)
        n = int(rng.integers(2, 41))
        x = rng.standard_normal((n, dim)).astype(np.float32)
        if label:
            hits = rng.choice(n, size=min(n, int(rng.integers(1, 5))), replace=False)
            x[hits, :10] += 1.5
        with h5py.File(root / "features" / f"b{i}.h5", "w") as fh:
            fh.create_dataset("features", data=x)
        rows.append([f"b{i}", label, f"case{i}"])
    manifest = root / "manifest.csv"
    with manifest.open("w", newline="") as fh:
        csv.writer(fh).writerows([["slide_id", "label", "case_id"], *rows])
    return manifest


def command_overrides(manifest: Path, work: Path, name: str, folds: int, epochs: int) -> list[str]:
    """The k-fold command's ``dpgs train`` overrides (without the mode's): ABMIL, B = 8, ``folds`` x
    ``epochs``, outputs in ``work / name``, MLflow in ``work / mlflow.db``."""
    return [f"data.manifest={manifest}", f"data.features_dir={manifest.parent / 'features'}",
            f"data.folds={folds}", "data.val_fraction=0.2", f"train.epochs={epochs}", "train.batch_size=8",
            "train.lr=1e-3", "model.name=abmil", "eval.sample_k=null", f"train.output_dir={work / name}",
            f"tracking.uri=sqlite:///{work / 'mlflow.db'}"]


def timed_command(manifest: Path, work: Path, name: str, folds: int, epochs: int, extra: list[str]) -> dict:
    cmd = [DPGS, "train", *command_overrides(manifest, work, name, folds, epochs), "experiment=kfold-command",
           *extra]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    metric = lambda key: float(re.search(rf"{key}\s+([0-9.]+)", result.stdout).group(1))
    return {"wall": wall, "acc": metric("cv_mean_test_acc"), "auc": metric("cv_mean_test_auc")}


ROWS = {
    "packed": ("packed (1 process)", ["train.mode=packed"]),
    "auto": ("DPGS P=2 defaults (keep_ratio auto)", ["train.mode=dpgs", "dpgs.workers=2"]),
    "dense": ("DPGS P=2 keep 100%", ["train.mode=dpgs", "dpgs.workers=2", "dpgs.compression.keep_ratio=1.0"]),
    "keep1": ("DPGS P=2 keep 1%", ["train.mode=dpgs", "dpgs.workers=2", "dpgs.compression.keep_ratio=0.01",
                                   "dpgs.compression.value_dtype=fp16",
                                   "dpgs.compression.dense_min_numel=1024"]),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=["musk1", "musk2", "synthetic"], default="musk1")
    p.add_argument("--bags", type=int, default=92, help="--data synthetic: how many bags")
    p.add_argument("--folds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated, the first is the reference "
                                                           "(default: %(default)s)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown} (have {', '.join(ROWS)})")
    runs = [ROWS[key] for key in args.rows.split(",")]
    results: dict[str, list[dict]] = {name: [] for name, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = (write_musk_like(work / "data", args.bags) if args.data == "synthetic"
                    else write_musk(args.data, work / "data"))
        for repeat in range(args.repeats):
            for i, (name, extra) in enumerate(runs):
                out = f"run{repeat}-{i}"
                results[name].append(timed_command(manifest, work, out, args.folds, args.epochs, extra))
    packed = statistics.median(r["wall"] for r in results[runs[0][0]])
    rows = []
    for name, _ in runs:
        wall = statistics.median(r["wall"] for r in results[name])
        each = ", ".join(fmt(r["wall"], ".1f") for r in results[name])
        ratio = fmt(wall / packed, ".2f") + "x"
        rows.append([name, fmt(wall, ".1f"), each, ratio, fmt(wall / args.folds, ".2f"),
                     fmt(statistics.median(r["acc"] for r in results[name])),
                     fmt(statistics.median(r["auc"] for r in results[name]))])
    header = ["command", "wall s (median)", "each repeat", "vs packed", "s per fold", "CV test acc",
              "CV test AUC"]
    table = markdown(header, rows)
    data = f"{args.bags} MUSK-like bags (2-40 instances, 166 features)" if args.data == "synthetic" \
        else f"{args.data.upper()} (UCI)"
    emit(f"{data}, ABMIL, {args.folds}-fold CV x "
         f"{args.epochs} epochs, B=8, {args.repeats} repeats of each whole `dpgs train` command. "
         f"{machine_line()}.\n\n{table}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
