"""Side-by-side comparison of the runs of an MLflow experiment (``dpgs compare``).

Input: the runs an experiment holds under the tracking contract of docs/architecture.md (per-epoch
metrics logged with ``step = epoch``, ``elapsed_seconds`` the wall time since the run started, params
from the flattened config). One row per top-level run; a k-fold parent (tag ``dpgs.kfold_parent``, or
any run with nested runs) is one row summarising its nested fold runs, which are not listed on their own.
Runs tagged ``dpgs.kind=comparison`` (earlier comparisons) or ``dpgs.kind=evaluation`` (``dpgs eval``
runs and their nested fold runs) are skipped.

Per run, for the compared metric ``m`` (``val_auc`` by default; lower is better when its name ends in
``loss``, higher otherwise):

* ``best``: the best per-epoch value of ``m``; ``epoch_at_best``: the first epoch reaching it;
  ``time_to_best_s``: ``elapsed_seconds`` at that epoch.
* ``time_to_target_s``: ``elapsed_seconds`` at the first epoch with ``m >= target`` (``<=`` for losses);
  ``reached``: how many of the row's runs got there ("1/1", "3/5").
* ``bytes_per_step``: bytes sent up and down over the whole run divided by its optimizer steps,
  ``sum_e (comm_bytes_up_e + comm_bytes_down_e) / sum_e steps_e``, with ``steps_e`` the per-epoch
  ``optimizer_steps`` metric, else the ``steps_per_epoch`` param; runs that only logged
  ``comm_bytes_per_step`` use its mean over epochs.
* ``compression_ratio``: dense bytes over bytes sent for the whole run,
  ``sum_e comm_dense_bytes_e / sum_e (comm_bytes_up_e + comm_bytes_down_e)``, else the mean of the
  per-epoch ``compression_ratio``.
* ``test_auc``, ``test_acc``: the final test metrics; ``test_auc_ci`` and ``test_acc_ci``: their
  bootstrap confidence intervals ``[test_<m>_ci_low, test_<m>_ci_high]`` (single runs that logged them);
  ``test_<m>_vs_best``: ``best`` for the run with the highest ``test_<m>`` among the rows with an
  interval, ``overlaps`` when a run's interval overlaps the best run's (their difference is within the
  sampling noise of the test set), ``separated`` when it does not, ``-`` without an interval.

K-fold rows hold the mean over the folds that have a value and, in ``<column>_std``, the population
standard deviation (``numpy.std``, as the trainer's ``cv_std_test_*``); ``time_to_target_s`` is the mean
over the folds that reached the target. Outputs: the printed Markdown table, ``comparison.csv``,
``comparison.md`` and ``metric_vs_time.png`` (the metric against wall time, one line per run, folds in
their parent's colour), all logged as artifacts of a new run tagged ``dpgs.kind=comparison``.
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
from mlflow.entities import Run, ViewType  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from dpgs.metrics import Interval  # noqa: E402
from dpgs.records import (  # noqa: E402
    KIND_COMPARISON,
    KIND_EVALUATION,
    PARAM_STEPS_PER_EPOCH,
    TAG_KFOLD_PARENT,
    TAG_KIND,
    TAG_METRIC,
    TAG_MODE,
    TAG_MODEL,
    TAG_PARENT,
)

SKIPPED_KINDS = (KIND_COMPARISON, KIND_EVALUATION)
CI_COLUMNS = ("test_auc", "test_acc")  # metrics shown with their bootstrap interval and overlap flag
CI_BOUNDS = tuple(f"{m}_ci_{end}" for m in CI_COLUMNS for end in ("low", "high"))
FILES = ("comparison.csv", "comparison.md", "metric_vs_time.png")

# Per-run numeric summaries; k-fold rows show each as mean ± std over the folds.
NUMERIC = (
    "best",
    "epoch_at_best",
    "time_to_best_s",
    "time_to_target_s",
    "bytes_per_step",
    "compression_ratio",
    "test_auc",
    "test_acc",
)
COLUMNS = (
    "run",
    "status",
    "mode",
    "model",
    "B",
    "workers",
    "keep",
    "folds",
    "best",
    "epoch_at_best",
    "time_to_best_s",
    "time_to_target_s",
    "reached",
    "bytes_per_step",
    "compression_ratio",
    "test_auc",
    "test_auc_ci",
    "test_auc_vs_best",
    "test_acc",
    "test_acc_ci",
    "test_acc_vs_best",
)
HEADERS = {
    "best": "best {metric}",
    "epoch_at_best": "epoch at best",
    "time_to_best_s": "time to best (s)",
    "time_to_target_s": "time to target (s)",
    "bytes_per_step": "bytes/step",
    "compression_ratio": "compression",
    "test_auc_ci": "test_auc CI",
    "test_auc_vs_best": "test_auc vs best",
    "test_acc_ci": "test_acc CI",
    "test_acc_vs_best": "test_acc vs best",
}
NOTE = ("CI: bootstrap confidence interval of the test metric; vs best: `overlaps` when the run's interval "
        "overlaps the best run's (the difference is within the sampling noise), `separated` when not.")


class CompareError(ValueError):
    """The experiment does not exist, has no runs, or none of its runs logged the metric."""


@dataclass
class Curve:
    """One run's per-epoch values of a metric with the wall time (``elapsed_seconds``) of each epoch."""

    epochs: list[int]
    values: list[float]
    times: list[float]


def lower_is_better(metric: str) -> bool:
    return metric.endswith("loss")


def _history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    """step -> value; when a step was logged twice (a resumed run) the later value wins."""
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {m.step: m.value for m in points}


def load_curve(client: MlflowClient, run_id: str, metric: str) -> Curve:
    values = _history(client, run_id, metric)
    times = _history(client, run_id, "elapsed_seconds")
    epochs = sorted(e for e in values if e in times)
    return Curve(epochs, [values[e] for e in epochs], [times[e] for e in epochs])


def summarise_curve(curve: Curve, metric: str, target: float | None) -> dict[str, float]:
    """best, epoch at best (first epoch reaching it), time to best and time to target of one curve."""
    out = {
        "best": math.nan,
        "epoch_at_best": math.nan,
        "time_to_best_s": math.nan,
        "time_to_target_s": math.nan,
        "reached": math.nan,
    }
    if not curve.epochs:
        return out
    values = np.asarray(curve.values, dtype=float)
    i = int(np.argmin(values) if lower_is_better(metric) else np.argmax(values))
    out.update(best=float(values[i]), epoch_at_best=float(curve.epochs[i]), time_to_best_s=curve.times[i])
    if target is not None:
        hits = values <= target if lower_is_better(metric) else values >= target
        out["reached"] = float(hits.any())
        if hits.any():
            out["time_to_target_s"] = curve.times[int(np.argmax(hits))]
    return out


def communication(client: MlflowClient, run: Run) -> dict[str, float]:
    """Whole-run bytes per optimizer step and compression ratio (NaN for runs without DPGS traffic)."""
    run_id = run.info.run_id
    up, down = _history(client, run_id, "comm_bytes_up"), _history(client, run_id, "comm_bytes_down")
    epochs = sorted(set(up) & set(down))
    sent = sum(up[e] + down[e] for e in epochs)
    steps_logged = _history(client, run_id, "optimizer_steps")
    steps_param = run.data.params.get(PARAM_STEPS_PER_EPOCH)
    if epochs and all(e in steps_logged for e in epochs):
        steps = sum(steps_logged[e] for e in epochs)
    elif epochs and steps_param is not None:
        steps = int(steps_param) * len(epochs)
    else:
        steps = 0
    if steps > 0:
        per_step = sent / steps
    else:
        logged = list(_history(client, run_id, "comm_bytes_per_step").values())
        per_step = float(np.mean(logged)) if logged else math.nan
    dense = _history(client, run_id, "comm_dense_bytes")
    if epochs and sent > 0 and all(e in dense for e in epochs):
        ratio = sum(dense[e] for e in epochs) / sent
    else:
        logged = list(_history(client, run_id, "compression_ratio").values())
        ratio = float(np.mean(logged)) if logged else math.nan
    return {"bytes_per_step": per_step, "compression_ratio": ratio}


def _search_all(client: MlflowClient, experiment_id: str) -> list[Run]:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1000,
            order_by=["attributes.start_time ASC"],
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _describe(run: Run, n_folds: int, kfold: bool) -> dict:
    params = run.data.params
    mode = params.get("train.mode", run.data.tags.get(TAG_MODE, "?"))
    dpgs = mode == "dpgs"
    return {
        "run": run.info.run_name or run.info.run_id[:8],
        "run_id": run.info.run_id,
        "status": run.info.status,
        "mode": mode,
        "model": params.get("model.name", run.data.tags.get(TAG_MODEL, "?")),
        "B": "1" if mode == "classic" else params.get("train.batch_size", "?"),
        "workers": params.get("dpgs.workers", "?") if dpgs else "-",
        "keep": params.get("dpgs.compression.keep_ratio", "?") if dpgs else "-",
        "folds": n_folds if kfold else "-",
    }


def _aggregate(row: dict, per_run: list[dict], kfold: bool, target: float | None) -> None:
    """Mean (and for k-fold rows the population std) of every numeric summary over the row's runs."""
    for key in NUMERIC:
        values = np.array([r[key] for r in per_run], dtype=float)
        values = values[np.isfinite(values)]
        row[key] = float(values.mean()) if values.size else math.nan
        if kfold:
            row[f"{key}_std"] = float(values.std()) if values.size else math.nan
    reached = [r["reached"] for r in per_run if not math.isnan(r["reached"])]
    row["reached"] = f"{int(sum(reached))}/{len(per_run)}" if target is not None and per_run else "-"


def _intervals(run: Run | None) -> dict[str, float]:
    """``<m>_ci_low`` / ``<m>_ci_high`` of a single run's logged intervals (NaN for k-fold rows or when
    not logged: the mean of fold intervals is not an interval)."""
    metrics = {} if run is None else run.data.metrics
    return {key: metrics.get(key, math.nan) for key in CI_BOUNDS}


def flag_overlaps(rows: list[dict], metric: str) -> None:
    """Set ``<metric>_ci`` (the interval as text) and ``<metric>_vs_best`` on every row (module docstring)."""

    def interval(row: dict) -> Interval | None:
        low, high = row[f"{metric}_ci_low"], row[f"{metric}_ci_high"]
        return None if math.isnan(low) or math.isnan(high) else Interval(low, high, math.nan)  # level unused

    with_ci = [r for r in rows if interval(r) is not None and not math.isnan(r[metric])]
    best = max(with_ci, key=lambda r: r[metric]) if with_ci else None
    for row in rows:
        ci = interval(row)
        row[f"{metric}_ci"] = "-" if ci is None else f"[{ci.low:.4g}, {ci.high:.4g}]"
        if ci is None or math.isnan(row[metric]):
            row[f"{metric}_vs_best"] = "-"
        elif row is best:
            row[f"{metric}_vs_best"] = "best"
        else:
            row[f"{metric}_vs_best"] = "overlaps" if ci.overlaps(interval(best)) else "separated"


def latest_of_each_name(runs: list[Run]) -> list[Run]:
    """The newest of the runs (ordered by start time) that share a run name, in start order: a command run
    again (``make demo`` twice) replaces its earlier run instead of adding a second curve of the same
    name."""
    newest = {r.info.run_name or r.info.run_id: r for r in runs}
    return [r for r in runs if newest[r.info.run_name or r.info.run_id] is r]


def compare(
    tracking_uri: str, experiment: str, metric: str = "val_auc", target: float | None = None,
    latest: bool = False,
) -> list[dict]:
    """The comparison rows of ``experiment`` (see the module docstring); each row keeps its curves.
    ``latest``: only the newest top-level run of each run name (:func:`latest_of_each_name`)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        names = ", ".join(sorted(e.name for e in client.search_experiments())) or "none"
        raise CompareError(
            f"experiment '{experiment}' not found at {tracking_uri} (experiments there: {names})"
        )
    runs = [
        r
        for r in _search_all(client, found.experiment_id)
        if r.data.tags.get(TAG_KIND) not in SKIPPED_KINDS
    ]
    ids = {r.info.run_id for r in runs}
    children: dict[str, list[Run]] = {}
    for r in runs:
        parent = r.data.tags.get(TAG_PARENT)
        if parent in ids:
            children.setdefault(parent, []).append(r)
    top = [r for r in runs if r.data.tags.get(TAG_PARENT) not in ids]
    if latest:
        top = latest_of_each_name(top)
    if not top:
        raise CompareError(f"experiment '{experiment}' at {tracking_uri} has no runs to compare")
    rows = []
    for run in top:
        kids = children.get(run.info.run_id, [])
        kfold = bool(kids) or run.data.tags.get(TAG_KFOLD_PARENT) == "true"
        members = kids if kfold else [run]
        row = _describe(run, len(kids), kfold)
        curves = [load_curve(client, m.info.run_id, metric) for m in members]
        per_run = [
            {
                **summarise_curve(c, metric, target),
                **communication(client, m),
                "test_auc": m.data.metrics.get("test_auc", math.nan),
                "test_acc": m.data.metrics.get("test_acc", math.nan),
            }
            for m, c in zip(members, curves, strict=True)
        ]
        _aggregate(row, per_run, kfold, target)
        row.update(_intervals(None if kfold else run))
        row["curves"] = [
            (m.info.run_name or m.info.run_id[:8], c) for m, c in zip(members, curves, strict=True)
        ]
        rows.append(row)
    for metric_name in CI_COLUMNS:
        flag_overlaps(rows, metric_name)
    if not any(c.epochs for row in rows for _, c in row["curves"]):
        logged = sorted({k for r in runs for k in r.data.metrics})
        raise CompareError(
            f"no run of experiment '{experiment}' logged the per-epoch metric '{metric}' together with "
            f"elapsed_seconds (metrics logged: {', '.join(logged) or 'none'})"
        )
    return rows


def format_cell(row: dict, key: str) -> str:
    """A table cell: 4 significant digits, '± std' on k-fold rows, '-' for missing values."""
    value = row[key]
    if not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "-"
    text = f"{value:.4g}"
    std = row.get(f"{key}_std", math.nan)
    if not math.isnan(std):
        text += f" ± {std:.2g}"
    return text


def to_markdown(rows: list[dict], metric: str) -> str:
    header = [HEADERS.get(c, c).format(metric=metric) for c in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(format_cell(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join([*lines, "", NOTE])


def write_csv(rows: list[dict], path: Path) -> None:
    """One line per row: raw numbers (empty when missing), for k-fold rows ``<column>_std``, and the
    interval bounds ``test_<m>_ci_low`` / ``_ci_high``."""
    fields = ["run_id", *COLUMNS, *(f"{k}_std" for k in NUMERIC), *CI_BOUNDS]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            values = {k: row.get(k, math.nan) for k in fields}
            writer.writerow(
                {k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}
            )


def plot_metric_vs_time(rows: list[dict], metric: str, target: float | None, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, row in enumerate(rows):
        for j, (_, curve) in enumerate(row["curves"]):
            if curve.epochs:
                ax.plot(
                    curve.times,
                    curve.values,
                    marker="o",
                    markersize=3,
                    color=f"C{i % 10}",
                    label=row["run"] if j == 0 else None,
                )
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("wall time, elapsed_seconds (s)")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(
    rows: list[dict], metric: str, out_dir: Path, target: float | None = None, title: str = ""
) -> list[Path]:
    """``comparison.csv``, ``comparison.md`` and ``metric_vs_time.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = (out_dir / name for name in FILES)
    write_csv(rows, csv_path)
    md_path.write_text(to_markdown(rows, metric) + "\n")
    plot_metric_vs_time(rows, metric, target, png_path, title)
    return [csv_path, md_path, png_path]


def log_comparison(
    tracking_uri: str, experiment: str, metric: str, target: float | None, files: list[Path], n_rows: int
) -> str:
    """A new run of ``experiment`` tagged ``dpgs.kind=comparison`` holding ``files`` as artifacts."""
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    run = client.create_run(
        exp.experiment_id,
        run_name=f"compare-{metric}",
        tags={TAG_KIND: KIND_COMPARISON, TAG_METRIC: metric},
    )
    run_id = run.info.run_id
    try:
        client.log_param(run_id, "compare.metric", metric)
        client.log_param(run_id, "compare.target", "none" if target is None else f"{target:g}")
        client.log_param(run_id, "compare.rows", n_rows)
        for path in files:
            client.log_artifact(run_id, str(path))
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id)
    return run_id
