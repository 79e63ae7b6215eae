"""Time to accuracy: validation AUC against wall seconds for every way of training the same model.

    python benchmarks/convergence.py --data bags|tiles [--seeds 0 1 2] [--epochs N] [--runs NAME ...]
        [--out docs/benchmarks/convergence-bags.md] [--png docs/convergence-bags.png] [--work DIR]

Each run trains the demo's model on the demo's data with the defaults ``dpgs train`` gives it: the
demo config (``configs/demo.yaml`` for the digits bags, ``configs/tiles-demo.yaml`` for the tile demo)
with only the mode, the batch size, the workers and the keep ratio set per run:

* ``classic``: one bag per optimizer step (B=1), the CLAM-style baseline;
* ``packed``: B=16 bags per step in one process;
* ``ddp``: PyTorch DDP with P=2 gloo processes, one packed pass per rank (``benchmarks/ddp_baseline.py``,
  feature bags only);
* ``dpgs-keep100``, ``dpgs-keep1``, ``dpgs-keep0.1``: DPGS with P=2 workers, B=16, keep ratio 100 %
  (dense float32), 1 % and 0.1 %.

Seeds are the outer loop (every mode runs once per seed before the next seed), so a change of machine load
affects all modes alike, and each run starts once the 1-minute load average is below ``--quiet-load``
(1.3; the table reports the highest load a mode started at). For seed ``s`` the target is the classic
run's best validation AUC minus 0.01, and each run's **time to target** is its ``elapsed_seconds`` (wall
time since training started, including validation; Ray and process start-up excluded, as ``dpgs train``
logs it) at the first epoch reaching it.
The table gives, per mode, the median over seeds of the time to target and of its ratios to the classic
run's time to best and to the classic run's own time to target, how many seeds reached the target, the
mean best validation AUC and the mean final test AUC (best checkpoint) with its difference to classic and
to DPGS keep 100 %.

Every run is logged to the MLflow experiment ``convergence-<data>`` (``--tracking-uri``, default a
``mlflow.db`` in ``--work``); the comparison (``dpgs compare`` with ``--target`` = the median classic
target) is logged as a run of that experiment with ``comparison.*``, ``metric_vs_time.png`` and the curves
of this script (``--png``) as artifacts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import emit, fmt, machine_line, markdown, time_to  # noqa: E402

from dpgs.compare import compare, log_comparison, write_outputs  # noqa: E402
from dpgs.config import config_to_dict, flatten, load_config  # noqa: E402
from dpgs.runner import run_training  # noqa: E402
from dpgs.tracking import RunTracker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"bags": ROOT / "configs" / "demo.yaml", "tiles": ROOT / "configs" / "tiles-demo.yaml"}
MARGIN = 0.01  # the target is the classic run's best validation AUC minus this
DPGS = ("train.mode=dpgs", "dpgs.workers=2", "train.batch_size=16")
RUNS: dict[str, tuple[str, ...]] = {
    "classic": ("train.mode=classic",),
    "packed": ("train.mode=packed", "train.batch_size=16"),
    "ddp": ("train.mode=packed", "train.batch_size=16"),  # trained by benchmarks/ddp_baseline.py
    "dpgs-keep100": (*DPGS, "dpgs.compression.keep_ratio=1.0"),
    "dpgs-keep1": (*DPGS, "dpgs.compression.keep_ratio=0.01"),
    "dpgs-keep0.1": (*DPGS, "dpgs.compression.keep_ratio=0.001"),
}


@dataclass
class Result:
    mode: str
    seed: int
    history: list[dict]
    test_auc: float
    load: float  # 1-minute load average when the run started
    best_val_auc: float = field(init=False)

    def __post_init__(self) -> None:
        self.best_val_auc = max((r.get("val_auc", -math.inf) for r in self.history), default=math.nan)

    def time_to(self, target: float) -> float:
        """``elapsed_seconds`` at the first epoch with ``val_auc >= target`` (NaN when never)."""
        return time_to(self.history, "val_auc", target)

    @property
    def time_to_best(self) -> float:
        return self.time_to(self.best_val_auc)


def prepare_data(kind: str, work: Path, size: int) -> list[str]:
    """Write the demo data (``size`` bags or slides) into ``work``; returns the overrides that point a
    config at it."""
    if kind == "bags":
        from dpgs.data import write_demo_data

        manifest = write_demo_data(work / "demo_data", bags=size, seed=0)
        return [f"data.manifest={manifest}", f"data.features_dir={manifest.parent / 'features'}"]
    from dpgs.wsi.synthetic import write_synthetic_slides
    from dpgs.wsi.tiling import TilingParams, tile_directory

    manifest = write_synthetic_slides(work / "demo_slides", n_slides=size, seed=0)
    tiles = manifest.parent / "tiles"
    tile_directory(manifest.parent / "slides", tiles, TilingParams(tile_size=32, level=1), progress=False)
    return [f"data.manifest={manifest}", f"data.slides_dir={manifest.parent / 'slides'}",
            f"data.tiles_dir={tiles}"]


def config_for(kind: str, mode: str, seed: int, common: list[str]):
    return load_config(CONFIGS[kind], [*common, *RUNS[mode], f"seed={seed}",
                                       f"tracking.run_name={mode}-seed{seed}"])


def wait_for_quiet(limit: float, max_wait: float = 240.0) -> float:
    """Wait (at most ``max_wait`` seconds) until the 1-minute load average is below ``limit`` (the previous
    run's processes fade out of it); returns the load average when the run starts."""
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def train(kind: str, mode: str, seed: int, common: list[str]) -> Result:
    load = os.getloadavg()[0]
    fold = run_training(config_for(kind, mode, seed, common)).folds[0]
    return Result(mode, seed, fold.history, fold.test_metrics.get("test_auc", math.nan), load)


def as_overrides(config) -> list[str]:
    """Every key of ``config`` as a dotted override (what ``run_ddp`` builds its config from)."""
    flat = flatten(config_to_dict(config))
    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in flat.items()]


def train_ddp(kind: str, seed: int, common: list[str]) -> Result:
    """The DDP baseline, logged to MLflow like a training run (``elapsed_seconds`` from after its setup)."""
    from ddp_baseline import run_ddp

    config = config_for(kind, "ddp", seed, common)
    load = os.getloadavg()[0]
    out = run_ddp(as_overrides(config), workers=2, style="packed")
    history = [{**row, "elapsed_seconds": row["elapsed_seconds"] - out["setup_seconds"]}
               for row in out["history"]]
    tags = {"dpgs.mode": "ddp", "dpgs.model": config.model.name}
    tracker = RunTracker.start(config.tracking.uri, config.experiment, f"ddp-seed{seed}", tags)
    params = flatten(config_to_dict(config))
    tracker.log_params({**params, "train.mode": "ddp (packed per rank)", "dpgs.workers": 2})
    for row in history:
        tracker.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=row["epoch"])
    test = out["test"].get("test_auc", math.nan)
    tracker.log_metrics({"test_auc": test, "test_acc": out["test"].get("test_acc", math.nan)})
    tracker.end()
    return Result("ddp", seed, history, test, load)


def median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else math.nan


def table(results: list[Result], modes: list[str]) -> str:
    classic = {r.seed: r for r in results if r.mode == "classic"}
    keep100 = {r.seed: r for r in results if r.mode == "dpgs-keep100"}
    rows = []
    for mode in modes:
        runs = [r for r in results if r.mode == mode]
        targets = [classic[r.seed].best_val_auc - MARGIN for r in runs]
        times = [r.time_to(target) for r, target in zip(runs, targets, strict=True)]
        ratios = [t / classic[r.seed].time_to_best for t, r in zip(times, runs, strict=True)]
        versus = [t / classic[r.seed].time_to(target)
                  for t, r, target in zip(times, runs, targets, strict=True)]
        test = mean([r.test_auc for r in runs])
        rows.append([
            mode,
            fmt(median(times), ".1f"),
            fmt(median(ratios), ".2f") + "x" if not math.isnan(median(ratios)) else "n/a",
            fmt(median(versus), ".2f") + "x" if not math.isnan(median(versus)) else "n/a",
            f"{sum(not math.isnan(t) for t in times)}/{len(runs)}",
            fmt(mean([r.best_val_auc for r in runs])),
            fmt(median([r.history[-1]["elapsed_seconds"] / len(r.history) for r in runs]), ".2f"),
            fmt(test, ".4f"),
            fmt(test - mean([classic[r.seed].test_auc for r in runs]), "+.4f"),
            fmt(test - mean([keep100[r.seed].test_auc for r in runs if r.seed in keep100]), "+.4f")
            if keep100 else "n/a",
            fmt(max(r.load for r in runs), ".2f"),
        ])
    header = ["run", "time to target (s, median)", "/ classic time to best (median)",
              "/ classic time to target (median)", "reached",
              "best val AUC (mean)", "s per epoch (median)", "test AUC (mean)", "test AUC - classic",
              "test AUC - keep 100%", "max load at start"]
    return markdown(header, rows)


def plot(results: list[Result], modes: list[str], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, mode in enumerate(modes):
        for j, r in enumerate(r for r in results if r.mode == mode):
            ax.plot([row["elapsed_seconds"] for row in r.history], [row["val_auc"] for row in r.history],
                    marker="o", markersize=3, color=f"C{i}", alpha=0.85, label=mode if j == 0 else None)
    targets = sorted({r.best_val_auc - MARGIN for r in results if r.mode == "classic"})
    for k, target in enumerate(targets):
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8,
                   label="classic best - 0.01 (per seed)" if k == 0 else None)
    ax.set_xlabel("wall time since training started, elapsed_seconds (s)")
    ax.set_ylabel("validation AUC")
    ax.set_ylim(bottom=max(0.4, ax.get_ylim()[0]))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=sorted(CONFIGS), default="bags")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, help="train.epochs (default: the demo config's)")
    p.add_argument("--size", type=int, help="bags (default 1000, as make demo) or slides (default 100, as "
                   "make demo-tiles)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--work", help="directory for data, runs and mlflow.db (default: a temporary one)")
    p.add_argument("--tracking-uri")
    p.add_argument("--out", help="Markdown table")
    p.add_argument("--png", help="the curves (also logged to MLflow)")
    p.add_argument("--json", help="raw per-run histories")
    p.add_argument("--quiet-load", type=float, default=1.3,
                   help="before each run, wait until the 1-minute load average is below this (max 4 min)")
    args = p.parse_args(argv)
    if "classic" not in args.runs:
        p.error("--runs must include classic (it sets the target)")
    if args.data == "tiles" and "ddp" in args.runs:
        p.error("the DDP baseline (benchmarks/ddp_baseline.py) trains feature bags only")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        uri = args.tracking_uri or f"sqlite:///{work / 'mlflow.db'}"
        experiment = f"convergence-{args.data}"
        size = args.size or (1000 if args.data == "bags" else 100)
        common = prepare_data(args.data, work, size) + [
            f"experiment={experiment}", f"tracking.uri={uri}", "eval.bootstrap=0",
        ]
        if args.epochs:
            common.append(f"train.epochs={args.epochs}")
        results: list[Result] = []
        started = time.strftime("%Y-%m-%d %H:%M")
        for seed in args.seeds:
            for mode in args.runs:
                wait_for_quiet(args.quiet_load)
                out = [*common, f"train.output_dir={work / 'runs' / f'{mode}-{seed}'}"]
                r = train_ddp(args.data, seed, out) if mode == "ddp" else train(args.data, mode, seed, out)
                results.append(r)
                print(f"[convergence] {mode} seed {seed}: best val AUC {r.best_val_auc:.4f} at "
                      f"{r.time_to_best:.1f} s, test AUC {r.test_auc:.4f} (load {r.load:.2f})", flush=True)
        png = Path(args.png) if args.png else work / "convergence.png"
        title = f"{args.data}: validation AUC vs wall time, seeds {args.seeds}"
        plot(results, args.runs, png, title)
        target = median([r.best_val_auc - MARGIN for r in results if r.mode == "classic"])
        rows = compare(uri, experiment, "val_auc", target)
        files = write_outputs(rows, "val_auc", work / "compare", target, title=experiment)
        run_id = log_comparison(uri, experiment, "val_auc", target, [*files, png], len(rows))
        if args.json:
            Path(args.json).write_text(json.dumps([r.__dict__ for r in results]))
    cfg = load_config(CONFIGS[args.data], [*common, *RUNS["classic"]])
    text = (
        f"{args.data} ({size} {'digits bags' if args.data == 'bags' else 'synthetic slides'}), "
        f"{cfg.model.name}, {cfg.train.epochs} epochs, seeds {args.seeds}, started {started}. "
        f"{machine_line()}. Target per seed: the classic run's best validation AUC - {MARGIN}.\n\n"
        f"{table(results, args.runs)}\n\nCurves: {png}; MLflow comparison run {run_id} ({uri})."
    )
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
