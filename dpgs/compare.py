"""Side-by-side comparison of the runs of an MLflow experiment (``dpgs compare``).

For every top-level run (k-fold parents are summarised over their nested fold runs, shown as
mean ± std) the table holds: mode, model, B, workers, keep ratio, best value of the metric, epoch at
best, time to best (``elapsed_seconds`` at that epoch), time to target (first epoch whose metric
reaches ``--target``; for metrics named ``*loss`` "reaches" means <=), bytes per step and compression
ratio (DPGS runs), final test AUC and accuracy. Outputs: printed table, ``comparison.csv``,
``comparison.md`` and ``metric_vs_time.png``, also logged as artifacts of a new run tagged
``dpgs.kind=comparison`` (such runs are skipped by later comparisons).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

COLUMNS = [
    "run",
    "mode",
    "model",
    "B",
    "workers",
    "keep",
    "best",
    "epoch_at_best",
    "time_to_best_s",
    "time_to_target_s",
    "test_auc",
    "test_acc",
    "bytes_per_step",
    "compression_ratio",
]


class CompareError(ValueError):
    """The experiment does not exist or has nothing to compare."""


@dataclass
class Curve:
    steps: list[int]
    values: list[float]
    times: list[float]


def _curve(client: MlflowClient, run_id: str, metric: str) -> Curve:
    values = {m.step: m.value for m in client.get_metric_history(run_id, metric)}
    times = {m.step: m.value for m in client.get_metric_history(run_id, "elapsed_seconds")}
    steps = sorted(s for s in values if s in times)
    return Curve(steps, [values[s] for s in steps], [times[s] for s in steps])


def _better(metric: str):
    return (lambda a, b: a < b) if metric.endswith("loss") else (lambda a, b: a > b)


def summarise_curve(curve: Curve, metric: str, target: float | None) -> dict:
    """best, epoch at best, time to best, time to target of one run's per-epoch curve."""
    if not curve.steps:
        return {
            "best": math.nan,
            "epoch_at_best": math.nan,
            "time_to_best_s": math.nan,
            "time_to_target_s": math.nan,
        }
    better = _better(metric)
    best_i = 0
    for i, v in enumerate(curve.values):
        if better(v, curve.values[best_i]):
            best_i = i
    reached = math.nan
    if target is not None:
        for v, t in zip(curve.values, curve.times, strict=True):
            if (v <= target) if metric.endswith("loss") else (v >= target):
                reached = t
                break
    return {
        "best": curve.values[best_i],
        "epoch_at_best": curve.steps[best_i],
        "time_to_best_s": curve.times[best_i],
        "time_to_target_s": reached,
    }


def _comm(client: MlflowClient, run) -> tuple[float, float]:
    per_step = [m.value for m in client.get_metric_history(run.info.run_id, "comm_bytes_per_step")]
    ratio = [m.value for m in client.get_metric_history(run.info.run_id, "compression_ratio")]
    return (float(np.mean(per_step)) if per_step else math.nan, float(np.mean(ratio)) if ratio else math.nan)


def compare(
    tracking_uri: str, experiment: str, metric: str = "val_auc", target: float | None = None
) -> list[dict]:
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        names = ", ".join(e.name for e in client.search_experiments()) or "none"
        raise CompareError(f"experiment '{experiment}' not found at {tracking_uri} (experiments: {names})")
    runs = client.search_runs(
        [found.experiment_id], order_by=["attributes.start_time ASC"], max_results=10000
    )
    runs = [r for r in runs if r.data.tags.get("dpgs.kind") != "comparison"]
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not top:
        raise CompareError(f"experiment '{experiment}' has no runs to compare")
    rows = []
    for run in top:
        params = run.data.params
        row = {
            "run": run.info.run_name or run.info.run_id[:8],
            "run_id": run.info.run_id,
            "mode": params.get("train.mode", "?"),
            "model": params.get("model.name", "?"),
            "B": 1 if params.get("train.mode") == "classic" else params.get("train.batch_size", "?"),
            "workers": params.get("dpgs.workers", "-") if params.get("train.mode") == "dpgs" else "-",
            "keep": params.get("dpgs.compression.keep_ratio", "-")
            if params.get("train.mode") == "dpgs"
            else "-",
        }
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == run.info.run_id]
        members = children or [run]
        stats = [summarise_curve(_curve(client, m.info.run_id, metric), metric, target) for m in members]
        comm = [_comm(client, m) for m in members]
        for key in ("best", "epoch_at_best", "time_to_best_s", "time_to_target_s"):
            values = np.array([s[key] for s in stats], dtype=float)
            row[key] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
            if children:
                row[key + "_std"] = float(np.nanstd(values)) if np.isfinite(values).any() else math.nan
        row["bytes_per_step"] = (
            float(np.nanmean([c[0] for c in comm])) if any(np.isfinite(c[0]) for c in comm) else math.nan
        )
        row["compression_ratio"] = (
            float(np.nanmean([c[1] for c in comm])) if any(np.isfinite(c[1]) for c in comm) else math.nan
        )
        for key in ("test_auc", "test_acc"):
            values = [m.data.metrics.get(key, math.nan) for m in members]
            row[key] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
            if children:
                row[key + "_std"] = float(np.nanstd(values)) if np.isfinite(values).any() else math.nan
        row["folds"] = len(children)
        row["curves"] = [_curve(client, m.info.run_id, metric) for m in members]
        rows.append(row)
    return rows


def _cell(row: dict, key: str) -> str:
    value = row[key]
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        text = f"{value:.4g}"
        if f"{key}_std" in row and not math.isnan(row[f"{key}_std"]):
            text += f" ± {row[key + '_std']:.2g}"
        return text
    return str(value)


def to_markdown(rows: list[dict], metric: str) -> str:
    header = [c if c != "best" else f"best {metric}" for c in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def write_outputs(rows: list[dict], metric: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = (
        out_dir / "comparison.csv",
        out_dir / "comparison.md",
        out_dir / "metric_vs_time.png",
    )
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run_id", *COLUMNS, "folds"])
        for r in rows:
            writer.writerow([r["run_id"], *[r[c] for c in COLUMNS], r["folds"]])
    md_path.write_text(to_markdown(rows, metric) + "\n")
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        for i, curve in enumerate(r["curves"]):
            if curve.steps:
                ax.plot(
                    curve.times,
                    curve.values,
                    marker="o",
                    markersize=3,
                    label=r["run"] if i == 0 else None,
                    color=f"C{rows.index(r) % 10}",
                )
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(metric)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return [csv_path, md_path, png_path]


def log_comparison(tracking_uri: str, experiment: str, metric: str, files: list[Path]) -> str:
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    run = client.create_run(
        exp.experiment_id,
        run_name=f"compare-{metric}",
        tags={"dpgs.kind": "comparison", "dpgs.metric": metric},
    )
    for path in files:
        client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id)
    return run.info.run_id
