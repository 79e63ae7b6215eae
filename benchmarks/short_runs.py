"""Keep 1 % against dense in short runs (issue 22, point 3): does a compression setting learn as much?

    python benchmarks/short_runs.py --data bags --bags 400 --seeds 0 1 2 --methods classic dense keep1 ...
    python benchmarks/short_runs.py --data tiles --seeds 0 --methods classic dense keep1 ...
    python benchmarks/short_runs.py --data musk1 --methods classic packed dense keep1 ...   (10-fold CV)
    python benchmarks/short_runs.py --table --results FILE      (the Markdown tables of a results file)

Every run is a real ``dpgs train`` (``dpgs.runner.run_training`` in this process; DPGS runs on Ray with
P=2 workers) of the dataset's config with only the method's overrides; results are appended to
``--results`` (JSON lines) as each run ends, and runs already there are skipped, so a stopped sweep
continues where it was.

* ``bags``: ``configs/demo.yaml`` on ``dpgs demo-data --bags N --seed S`` (data seed = training seed),
  ``--epochs`` epochs (8), B=16, P=2.
* ``tiles``: ``configs/tiles-demo.yaml`` on the tile demo (100 synthetic slides, data seed 0).
* ``musk1`` / ``musk2``: the real UCI data (``benchmarks/musk_data.py``), ABMIL, 10-fold CV x 40 epochs,
  B=8, ``train.lr=1e-3``, as ``benchmarks/kfold_command.py``.

Per run: the validation AUC per epoch (k-folds: the mean over folds), the first epoch at which it reaches
the classic run's best - 0.01 (same seed; where no classic run was made, the packed run's), the final test
AUC (best checkpoint; k-folds: the CV mean), test accuracy and the bytes sent up (one fold).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from _common import fmt, machine_line, markdown

from dpgs.config import load_config
from dpgs.runner import run_training

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.01
DPGS = ("train.mode=dpgs", "dpgs.workers=2")
KEEP1 = (*DPGS, "dpgs.compression.keep_ratio=0.01")
METHODS: dict[str, tuple[str, ...]] = {
    "classic": ("train.mode=classic",),
    "packed": ("train.mode=packed",),
    "dense": (*DPGS, "dpgs.compression.keep_ratio=1.0"),
    # keep 1 % with every other default (second_moment=auto: frozen for a head, live for a trained encoder)
    "keep1": KEEP1,
    # gradient compression with live Adam (fp16, DGC warm-up 2 epochs, dense_min_numel 1024)
    "keep1-grad": (*KEEP1, "dpgs.compression.second_moment=live"),
    "keep1-grad-warm4": (*KEEP1, "dpgs.compression.second_moment=live", "dpgs.compression.warmup_epochs=4"),
    "keep1-grad-fp32": (*KEEP1, "dpgs.compression.second_moment=live", "dpgs.compression.value_dtype=fp32"),
    "keep1-grad-nowarm": (*KEEP1, "dpgs.compression.second_moment=live", "dpgs.compression.warmup_epochs=0"),
    # Adam's second moment frozen after the dense warm-up epochs (dpgs.train.frozen_adam)
    "keep1-frozen": (*KEEP1, "dpgs.compression.second_moment=frozen"),
    "keep1-frozen-warm1": (*KEEP1, "dpgs.compression.second_moment=frozen",
                           "dpgs.compression.warmup_epochs=1"),
    "keep10-grad": (*DPGS, "dpgs.compression.keep_ratio=0.1", "dpgs.compression.second_moment=live"),
    "keep30-grad": (*DPGS, "dpgs.compression.keep_ratio=0.3", "dpgs.compression.second_moment=live"),
    "auto": (*DPGS, "dpgs.compression.keep_ratio=auto"),
    # DGC: SGD with momentum correction on the workers (and masking), plain SGD on the master
    # (train.lr 0.125 at one bag: 0.5 at B=16 with sqrt scaling, the rate of docs/convergence.md's SGD runs)
    "keep1-dgc-sgd": (*KEEP1, "train.optimizer=sgd", "train.momentum=0",
                      "dpgs.compression.momentum_correction=0.9", "train.lr=0.125"),
    "dense-sgd": (*DPGS, "dpgs.compression.keep_ratio=1.0", "train.optimizer=sgd", "train.lr=0.125"),
}


def data_overrides(args, seed: int, work: Path) -> tuple[Path, list[str]]:
    """(config file, overrides pointing it at the data) for one seed."""
    if args.data == "bags":
        from dpgs.data import write_demo_data

        root = work / f"bags{args.bags}-seed{seed}"
        manifest = root / "manifest.csv"
        if not manifest.is_file():
            write_demo_data(root, bags=args.bags, seed=seed)
        return ROOT / "configs" / "demo.yaml", [
            f"data.manifest={manifest}", f"data.features_dir={root / 'features'}",
            f"train.epochs={args.epochs}", "train.batch_size=16", "eval.sample_k=null"]
    if args.data == "tiles":
        from dpgs.wsi.synthetic import write_synthetic_slides
        from dpgs.wsi.tiling import TilingParams, tile_directory

        root = work / "slides"
        manifest = root / "manifest.csv"
        if not (root / "tiles").is_dir():
            manifest = write_synthetic_slides(root, n_slides=100, seed=0)
            tiling = TilingParams(tile_size=32, level=1)
            tile_directory(root / "slides", root / "tiles", tiling, progress=False)
        return ROOT / "configs" / "tiles-demo.yaml", [
            f"data.manifest={manifest}", f"data.slides_dir={root / 'slides'}",
            f"data.tiles_dir={root / 'tiles'}", "eval.sample_k=null"]
    from musk_data import write_musk

    root = work / args.data
    manifest = root / "manifest.csv"
    if not manifest.is_file():
        write_musk(args.data, root)
    return None, [
        f"data.manifest={manifest}", f"data.features_dir={root / 'features'}", "data.folds=10",
        "data.val_fraction=0.2", "train.epochs=40", "train.batch_size=8", "train.lr=1e-3", "model.name=abmil",
        "eval.sample_k=null"]


def curve(folds) -> list[float]:
    """Validation AUC per epoch (mean over folds)."""
    epochs = min(len(f.history) for f in folds)
    return [statistics.fmean(f.history[e]["val_auc"] for f in folds) for e in range(epochs)]


def train_one(args, method: str, seed: int, work: Path) -> dict:
    config_file, overrides = data_overrides(args, seed, work)
    name = f"{args.data}-{method}-seed{seed}"
    config = load_config(config_file, [
        *overrides, *METHODS[method], f"seed={seed}", f"experiment=short-runs-{args.data}",
        f"tracking.run_name={name}", f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        f"train.output_dir={work / 'runs' / name}", "eval.bootstrap=0", *args.set])
    start = time.perf_counter()
    result = run_training(config)
    folds = result.folds
    test = (lambda key: statistics.fmean(f.test_metrics.get(key, math.nan) for f in folds))
    return {
        "data": args.data, "bags": args.bags if args.data == "bags" else None, "method": method, "seed": seed,
        "set": args.set, "val_auc": curve(folds),
        "train_loss": [statistics.fmean(f.history[e]["train_loss"] for f in folds)
                       for e in range(min(len(f.history) for f in folds))],
        "test_auc": test("test_auc"), "test_acc": test("test_acc"), "wall_s": time.perf_counter() - start,
        "comm_bytes_up": statistics.fmean(sum(row.get("comm_bytes_up", 0.0) for row in f.history)
                                          for f in folds),
    }


def key(r: dict) -> tuple:
    return (r["data"], r.get("bags"), r["method"], r["seed"], tuple(r.get("set", [])))


def epoch_reaching(values: list[float], target: float) -> int | None:
    return next((e + 1 for e, v in enumerate(values) if v >= target - 1e-12), None)


def tables(results: list[dict]) -> str:
    out = []
    groups = sorted({(r["data"], r.get("bags"), tuple(r.get("set", []))) for r in results}, key=str)
    for data, bags, extra in groups:
        rows_in = [r for r in results
                   if (r["data"], r.get("bags"), tuple(r.get("set", []))) == (data, bags, extra)]
        dense = {r["seed"]: r for r in rows_in if r["method"] == "dense"}
        packed = {r["seed"]: r for r in rows_in if r["method"] == "packed"}
        reference = "classic" if any(r["method"] == "classic" for r in rows_in) else "packed"
        classic = {r["seed"]: r for r in rows_in if r["method"] == reference}  # the target's run
        header = ["method", "seed", "best val AUC", f"epoch reaching {reference} best - 0.01",
                  "dense's epoch",
                  "final train loss", "test AUC", "test AUC - dense", "test acc", "MB up"]
        if packed:
            header.append("test acc - packed")
        rows = []
        for r in sorted(rows_in, key=lambda r: (list(METHODS).index(r["method"]) if r["method"] in METHODS
                                                else 99, r["seed"])):
            target = classic[r["seed"]]["val_auc"] and max(classic[r["seed"]]["val_auc"]) - MARGIN \
                if r["seed"] in classic else math.nan
            reach = epoch_reaching(r["val_auc"], target) if not math.isnan(target) else None
            d = dense.get(r["seed"])
            dense_reach = epoch_reaching(d["val_auc"], target) if d and not math.isnan(target) else None
            known = not math.isnan(target)
            row = [r["method"], str(r["seed"]), fmt(max(r["val_auc"])),
                   str(reach or "never") if known else f"n/a (no {reference} run)",
                   str(dense_reach or "never") if d and known else "n/a", fmt(r["train_loss"][-1]),
                   fmt(r["test_auc"], ".4f"),
                   fmt(r["test_auc"] - d["test_auc"], "+.4f") if d else "n/a", fmt(r["test_acc"]),
                   fmt(r.get("comm_bytes_up", math.nan) / 1e6, ".1f") if r.get("comm_bytes_up") else "-"]
            if packed:
                p = packed.get(r["seed"])
                row.append(fmt(r["test_acc"] - p["test_acc"], "+.3f") if p else "n/a")
            rows.append(row)
        title = f"{data}" + (f" ({bags} bags)" if bags else "") + (f" with {' '.join(extra)}" * bool(extra))
        out.append(f"#### {title}\n\n{markdown(header, rows)}")
    return "\n\n".join(out) + f"\n\n{machine_line()}."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=["bags", "tiles", "musk1", "musk2"], default="bags")
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=["classic", "dense", "keep1-grad",
                                                                            "auto"])
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for every run of this call")
    p.add_argument("--work", default="/tmp/dpgs-short-runs")
    p.add_argument("--results", default="/tmp/dpgs-short-runs/results.jsonl")
    p.add_argument("--table", action="store_true", help="print the tables of --results and exit")
    args = p.parse_args(argv)
    results_path = Path(args.results)
    lines = results_path.read_text().splitlines() if results_path.is_file() else []
    done = [json.loads(line) for line in lines]
    if args.table:
        print(tables(done))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    have = {key(r) for r in done}
    for seed in args.seeds:
        for method in args.methods:
            probe = {"data": args.data, "bags": args.bags if args.data == "bags" else None, "method": method,
                     "seed": seed, "set": args.set}
            if key(probe) in have:
                continue
            r = train_one(args, method, seed, work)
            with results_path.open("a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(f"[short-runs] {args.data} {method} seed {seed}: val AUC "
                  f"{' '.join(f'{v:.3f}' for v in r['val_auc'])} test AUC {r['test_auc']:.4f} "
                  f"acc {r['test_acc']:.3f} ({r['wall_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
