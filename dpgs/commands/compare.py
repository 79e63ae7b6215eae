"""``dpgs compare``: a side-by-side table of an experiment's runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "compare",
        help="compare the runs of an MLflow experiment side by side",
        description="Table (printed, CSV, Markdown) and metric-vs-time plot of an experiment's runs.",
    )
    p.add_argument("--experiment", required=True, help="MLflow experiment name")
    p.add_argument("--metric", default="val_auc", help="per-epoch metric to compare (default val_auc)")
    p.add_argument(
        "--target", type=float, help="report the wall time at which each run first reaches this value"
    )
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow tracking URI")
    p.add_argument("--out", default="runs/compare", help="directory for comparison.csv/.md and the PNG")
    return p


def run(args) -> int:
    from dpgs.compare import CompareError, compare, log_comparison, to_markdown, write_outputs

    try:
        rows = compare(args.tracking_uri, args.experiment, args.metric, args.target)
    except CompareError as err:
        print(f"dpgs compare: error: {err}", file=sys.stderr)
        return 2
    print(to_markdown(rows, args.metric))
    files = write_outputs(rows, args.metric, Path(args.out))
    run_id = log_comparison(args.tracking_uri, args.experiment, args.metric, files)
    print(f"\nwrote {', '.join(str(f) for f in files)}")
    print(f"logged as artifacts of MLflow run {run_id} (experiment {args.experiment})")
    return 0
