"""``dpgs compare``: a side-by-side table of an experiment's runs (see dpgs/compare.py for the columns)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "compare",
        help="compare the runs of an MLflow experiment side by side",
        description="Table (printed, CSV, Markdown) and metric-vs-wall-time plot of an experiment's runs, "
        "logged as artifacts of a new MLflow run tagged dpgs.kind=comparison.",
    )
    p.add_argument("--experiment", required=True, help="MLflow experiment name")
    p.add_argument(
        "--metric",
        default="val_auc",
        help="per-epoch metric to compare (default val_auc; names ending in 'loss': lower is better)",
    )
    p.add_argument(
        "--target",
        type=float,
        help="also report the wall time at which each run first reaches this metric value",
    )
    p.add_argument(
        "--tracking-uri",
        default="sqlite:///mlflow.db",
        help="MLflow tracking URI: sqlite:///PATH or http://HOST:PORT (default sqlite:///mlflow.db)",
    )
    p.add_argument("--out", default="runs/compare", help="directory for comparison.csv/.md and the PNG")
    p.add_argument(
        "--latest",
        action="store_true",
        help="only the newest run of each run name (a command run again replaces its earlier run)",
    )
    return p


def run(args) -> int:
    from mlflow.exceptions import MlflowException

    from dpgs.compare import CompareError, compare, log_comparison, to_markdown, write_outputs

    try:
        rows = compare(args.tracking_uri, args.experiment, args.metric, args.target, args.latest)
        print(to_markdown(rows, args.metric))
        files = write_outputs(
            rows,
            args.metric,
            Path(args.out),
            args.target,
            title=f"{args.experiment}: {args.metric} vs wall time",
        )
        run_id = log_comparison(
            args.tracking_uri, args.experiment, args.metric, args.target, files, len(rows)
        )
    except CompareError as err:
        print(f"dpgs compare: error: {err}", file=sys.stderr)
        return 2
    except MlflowException as err:
        print(f"dpgs compare: error: tracking store {args.tracking_uri}: {err.message}", file=sys.stderr)
        return 2
    print(f"\nwrote {', '.join(str(f) for f in files)}")
    print(
        f"logged as artifacts of MLflow run {run_id} "
        f"(experiment '{args.experiment}', tag dpgs.kind=comparison)"
    )
    return 0
