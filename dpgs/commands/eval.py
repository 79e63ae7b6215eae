"""``dpgs eval``: evaluate a trained run (every fold of a k-fold run) on its test split or another cohort.

For each fold (one for a single run): the run's ``config.yaml`` with the data options of the command
applied, the run's class order (``classes.json``) and its ``best.pt`` (or ``--checkpoint``). Tile runs
read every tile of the evaluated slides with no augmentation. The bags are

* the run's own manifest: the fold's ``--split`` part (``test`` by default; ``train``, ``val``, ``all``)
  with the splits rebuilt exactly as training built them (split column, CLAM split file or k-fold);
* an external cohort (``--manifest``): every row, or those whose ``split`` column equals ``--split``.

They are scored by :func:`dpgs.train.evaluate.score_bags` under the test protocols of
:class:`~dpgs.train.evaluate.EvalPlan` (all instances with bootstrap intervals, and K x R when
``--sample-k`` or the run's ``eval.sample_k`` is set), with the run's seed, so on the run's own test
split the metrics are the ones training logged. Outputs per fold: the printed metrics and confusion
matrix, ``predictions_<split>.csv`` (``predictions_<manifest stem>_<split>.csv`` for an external cohort)
in the fold's run directory or ``--out``, and, when the training run is known to MLflow, a new run in
its experiment tagged ``dpgs.kind=evaluation`` and ``dpgs.evaluates=<training run id>`` holding the
metrics and the CSV. A k-fold parent gets an evaluation parent run (``cv_mean_test_*``,
``cv_std_test_*``) with one nested evaluation run per fold. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

from dpgs.records import KIND_EVALUATION, TAG_EVALUATES, TAG_FOLD, TAG_KFOLD_PARENT, TAG_KIND, TAG_MODEL

OWN_SPLITS = ("train", "val", "test", "all")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained run (all folds) on its test split or an external cohort",
        description="Evaluate a run's best.pt (every fold of a k-fold run) with the run's config and class "
        "order: metrics with bootstrap intervals, the sampled K x R protocol, a predictions CSV, and a "
        "new MLflow run linked to the training run.",
    )
    p.add_argument("run", metavar="RUN_DIR_OR_RUN_ID",
                   help="a train.output_dir (a k-fold output_dir evaluates every fold), or an MLflow run id")
    p.add_argument("--tracking-uri", help="MLflow store (default: the run's tracking.uri; for a run id "
                                          "sqlite:///mlflow.db)")
    p.add_argument("--checkpoint", help="state_dict to evaluate (default RUN_DIR/best.pt; single runs only)")
    p.add_argument("--manifest", help="an external cohort: manifest CSV slide_id,label[,case_id][,split]")
    p.add_argument("--features-dir", help="feature bags of the evaluated slides (feature-bag runs)")
    p.add_argument("--slides-dir", help="slides of the evaluated cohort (tile runs)")
    p.add_argument("--tiles-dir", help="tile coords of the evaluated cohort (tile runs)")
    p.add_argument("--split", help="train, val, test (default) or all of the run's splits; with --manifest: "
                                   "rows whose split column equals this (default all)")
    p.add_argument("--sample-k", type=int, help="also evaluate K sampled instances per bag (default: the "
                                                "run's eval.sample_k; 0: off)")
    p.add_argument("--repeats", type=int, help="repeats of the sampled protocol (default: eval.repeats)")
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the intervals (default: "
                                                 "eval.bootstrap; 0: none)")
    p.add_argument("--ci-level", type=float, help="confidence level (default: eval.ci_level)")
    p.add_argument("--out", help="directory for the predictions CSV (default: each fold's run directory; "
                                 "k-fold: OUT/<fold>/)")
    return p


@dataclass(frozen=True)
class Cohort:
    """The evaluated bags: ``overrides`` of the run's ``data`` section, an ``external`` manifest or the
    run's own, and the ``split``."""

    overrides: tuple[str, ...]
    external: bool
    split: str

    @classmethod
    def from_args(cls, args, kind: str) -> Cohort:
        tiles = {"--slides-dir": args.slides_dir, "--tiles-dir": args.tiles_dir}
        if kind == "tiles" and args.features_dir:
            raise ValueError("--features-dir: the run was trained on tile bags (data.kind=tiles); give "
                             "--slides-dir and --tiles-dir")
        if kind == "features" and any(tiles.values()):
            given = ", ".join(k for k, v in tiles.items() if v)
            raise ValueError(f"{given}: the run was trained on feature bags (data.kind=features); give "
                             "--features-dir")
        named = {"manifest": args.manifest, "features_dir": args.features_dir, "slides_dir": args.slides_dir,
                 "tiles_dir": args.tiles_dir}
        overrides = tuple(f"data.{k}={v}" for k, v in named.items() if v)
        external = args.manifest is not None
        split = args.split or ("all" if external else "test")
        if not external and split not in OWN_SPLITS:
            raise ValueError(f"--split {split}: expected one of {', '.join(OWN_SPLITS)} for the run's own "
                             "manifest (other values select rows of a --manifest's split column)")
        return cls(overrides, external, split)

    def csv_name(self, config) -> str:
        stem = f"{Path(config.data.manifest).stem}_" if self.external else ""
        return f"predictions_{stem}{self.split}.csv"


def load_data(ref, cohort: Cohort):
    """(config with the cohort's data options, experiment data in the run's class order)."""
    from dpgs.config import load_config
    from dpgs.experiment import load_experiment_data

    config = load_config(ref.run_dir / "config.yaml", list(cohort.overrides))
    data = load_experiment_data(config.data, seed=config.seed, classes=ref.classes(),
                                with_splits=not cohort.external)
    return config, data


def bag_indices(data, ref, cohort: Cohort) -> list[int]:
    """The fold's evaluated bag indices (see the module docstring); ValueError when there are none."""
    records = data.manifest.records
    if cohort.external or cohort.split == "all":
        chosen = [i for i, r in enumerate(records) if cohort.split == "all" or r.split == cohort.split]
    else:
        name = ref.run_dir.name
        splits = data.splits if len(data.splits) == 1 else [s for s in data.splits if s.name == name]
        if not splits:
            names = ", ".join(s.name for s in data.splits)
            raise ValueError(f"{ref.run_dir}: no split named '{name}' among the run's splits ({names})")
        split = splits[0]
        chosen = list({"train": split.train, "val": split.val, "test": split.test}[cohort.split])
    if not chosen:
        raise ValueError(f"{ref.run_dir.name}: no bags in split '{cohort.split}' of {data.manifest.source}")
    return chosen


@dataclass
class FoldEvaluation:
    """One fold's result; ``test_metrics`` is the attribute :func:`dpgs.train.trainer.cv_summary` reads."""

    ref: object  # dpgs.runs.RunRef
    classes: list[str]
    predictions: list  # dpgs.train.evaluate.Predictions, one per protocol (all instances first)
    test_metrics: dict[str, float]
    csv_path: Path
    n_bags: int


def plan_of(args, config):
    """The test plan of the run's ``eval`` section with the command's options applied."""
    from pydantic import ValidationError

    from dpgs.config.schema import EvalConfig
    from dpgs.train.evaluate import EvalPlan

    section = config.eval.model_dump()
    given = {"sample_k": args.sample_k, "repeats": args.repeats, "bootstrap": args.bootstrap,
             "ci_level": args.ci_level}
    section.update({k: v for k, v in given.items() if v is not None})
    if section["sample_k"] == 0:
        section["sample_k"] = None
    try:
        eval_cfg = EvalConfig.model_validate(section)
    except ValidationError as err:  # only the command's values can be out of range
        first = err.errors()[0]
        raise ValueError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
    return EvalPlan.from_config(eval_cfg, config.seed)


def write_predictions(path: Path, classes: list[str], predictions: list) -> Path:
    """One row per bag: slide_id, label, prediction, p_<class>, loss; a sampled protocol adds
    k<K>_prediction, k<K>_p_<class> and k<K>_loss (means over its repeats)."""
    from dpgs.outputs import write_atomically

    full, *sampled = predictions
    header = ["slide_id", "label", "prediction", *[f"p_{c}" for c in classes], "loss"]
    columns = []
    for p in [full, *sampled]:
        tag = "" if not p.protocol.is_sampled else f"k{p.protocol.sample_k}_"
        if tag:
            header += [f"{tag}prediction", *[f"{tag}p_{c}" for c in classes], f"{tag}loss"]
        columns.append((p.mean_probs, p.losses.mean(axis=0)))

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            for b, (sid, y) in enumerate(zip(full.slide_ids, full.labels, strict=True)):
                row = [sid, classes[int(y)]]
                for probs, losses in columns:
                    predicted = classes[int(probs[b].argmax())]
                    row += [predicted, *[f"{v:.6f}" for v in probs[b]], f"{losses[b]:.6f}"]
                writer.writerow(row)

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, write)


def evaluate_fold(ref, data, cohort: Cohort, plan, config, args, out_dir: Path) -> FoldEvaluation:
    from dpgs.modeling import resolve_device
    from dpgs.train.evaluate import score_bags

    indices = bag_indices(data, ref, cohort)
    in_dim = None if config.model.encoder else data.dataset.feature_dim
    model = ref.load_model(in_dim, Path(args.checkpoint) if args.checkpoint else None)
    device = resolve_device(config.train.device)
    model.to(device)
    predictions = [score_bags(model, data.eval_dataset, indices, p, device) for p in plan.protocols]
    classes = ref.classes()
    path = write_predictions(out_dir / cohort.csv_name(config), classes, predictions)
    return FoldEvaluation(ref, classes, predictions, plan.metrics(predictions), path, len(indices))


def print_fold(name: str, result: FoldEvaluation, cohort: Cohort, plan, manifest) -> None:
    """The fold's metrics side by side (all instances, interval, sampled mean ± std), confusion matrix."""
    from dpgs.metrics import CI_METRICS, METRIC_NAMES, confusion

    m = result.test_metrics
    print(f"{name}: {result.n_bags} bags (split {cohort.split} of {manifest})")
    sampled = plan.sampled
    header = f"  {'metric':8s} {'all instances':>14s} {f'{plan.ci_level:.0%} CI':>18s}"
    if sampled is not None:
        header += f" {f'K={sampled.sample_k} x {sampled.repeats} (mean ± std)':>30s}"
    print(header)
    for key in ("loss", *METRIC_NAMES):
        ci = "-"
        if key in CI_METRICS and f"test_{key}_ci_low" in m:
            ci = f"[{m[f'test_{key}_ci_low']:.4f}, {m[f'test_{key}_ci_high']:.4f}]"
        line = f"  {key:8s} {m[f'test_{key}']:14.4f} {ci:>18s}"
        if sampled is not None:
            mean, std = m[f"{plan.sampled_prefix()}{key}"], m[f"{plan.sampled_prefix()}{key}_std"]
            line += f" {f'{mean:.4f} ± {std:.4f}':>30s}"
        print(line)
    full = result.predictions[0]
    print("  confusion matrix (rows: true, columns: predicted; order " + ", ".join(result.classes) + "):")
    print("  " + str(confusion(full.labels, full.mean_probs)).replace("\n", "\n  "))
    print(f"  predictions: {result.csv_path}")


def eval_params(args, cohort: Cohort, config, plan, ref, n_bags: int) -> dict:
    """Params of an evaluation run: what was evaluated, on which bags, with which protocols."""
    data = config.data
    where = data.features_dir if data.kind == "features" else f"{data.slides_dir} + {data.tiles_dir}"
    sampled = plan.sampled
    return {
        "eval.run": args.run,
        "eval.run_dir": str(ref.run_dir),
        "eval.checkpoint": args.checkpoint or str(ref.checkpoint),
        "eval.manifest": str(data.manifest),
        "eval.data": str(where),
        "eval.external": str(cohort.external).lower(),
        "eval.split": cohort.split,
        "eval.n_bags": n_bags,
        "eval.sample_k": sampled.sample_k if sampled else "none",
        "eval.repeats": sampled.repeats if sampled else "none",
        "eval.bootstrap": plan.bootstrap,
        "eval.ci_level": plan.ci_level,
        "eval.seed": plan.seed,
        "model.name": config.model.name,
        "model.encoder": config.model.encoder or "none",
        "data.kind": data.kind,
    }


def log_evaluation(args, group, cohort: Cohort, config, plan, results: list[FoldEvaluation]) -> str | None:
    """The evaluation run(s) in the training run's experiment (see the module docstring); the id of the
    top evaluation run, or None when no training run is known to MLflow."""
    from dpgs.tracking import RunTracker
    from dpgs.train.trainer import cv_summary

    known = [r.ref.run_id for r in results if r.ref.run_id is not None]
    if not known and group.parent_run_id is None:
        return None
    uri, experiment = group.folds[0].tracking_uri, config.experiment
    base = {TAG_KIND: KIND_EVALUATION, TAG_MODEL: config.model.name}

    def one(result: FoldEvaluation, name: str, tags: dict, parent=None) -> RunTracker:
        if result.ref.run_id is not None:
            tags = {**tags, TAG_EVALUATES: result.ref.run_id}
        tracker = RunTracker.start(uri, experiment, name, {**base, **tags}, parent=parent)
        try:
            tracker.log_params(eval_params(args, cohort, config, plan, result.ref, result.n_bags))
            tracker.log_metrics(result.test_metrics)
            tracker.log_artifact(result.csv_path)
        except BaseException:
            tracker.end("FAILED")
            raise
        tracker.end()
        return tracker

    if not group.kfold:
        return one(results[0], f"eval-{results[0].ref.run_dir.name}", {}).run_id
    tags = {**base, TAG_KFOLD_PARENT: "true"}
    if group.parent_run_id is not None:
        tags[TAG_EVALUATES] = group.parent_run_id
    parent = RunTracker.start(uri, experiment, f"eval-{group.root.name}", tags)
    try:
        for result in results:
            name = result.ref.run_dir.name
            one(result, name, {TAG_FOLD: name}, parent=parent)
        parent.log_params({"eval.run": args.run, "eval.split": cohort.split, "eval.folds": len(results)})
        parent.log_metrics(cv_summary(results))
    except BaseException:
        parent.end("FAILED")
        raise
    parent.end()
    return parent.run_id


def run(args) -> int:
    from mlflow.exceptions import MlflowException

    from dpgs.config import ConfigError
    from dpgs.data import DataValidationError
    from dpgs.runs import resolve_run_group
    from dpgs.train.trainer import cv_summary

    try:
        group = resolve_run_group(args.run, args.tracking_uri)
        if args.checkpoint and group.kfold:
            raise ValueError(f"--checkpoint: {args.run} has {len(group.folds)} folds; evaluate one fold's "
                             "run directory with it")
        first = group.folds[0]
        cohort = Cohort.from_args(args, first.config.data.kind)
        config, data = load_data(first, cohort)
        plan = plan_of(args, config)
        results = []
        for ref in group.folds:
            if ref.classes() != first.classes():
                raise ValueError(f"{ref.run_dir / 'classes.json'}: classes differ from {first.run_dir}")
            out_dir = ref.run_dir if args.out is None else Path(args.out)
            if args.out is not None and group.kfold:
                out_dir = out_dir / ref.run_dir.name
            result = evaluate_fold(ref, data, cohort, plan, config, args, out_dir)
            print_fold(ref.run_dir.name, result, cohort, plan, config.data.manifest)
            results.append(result)
    except (ConfigError, DataValidationError, ValueError, OSError) as err:  # RunError is a ValueError
        print(f"dpgs eval: error: {err}", file=sys.stderr)
        return 2
    if group.kfold:
        summary = cv_summary(results)
        print(f"over {len(results)} folds (mean ± std): " + ", ".join(
            f"{k.removeprefix('cv_mean_test_')} {v:.4f} ± {summary[k.replace('mean', 'std')]:.4f}"
            for k, v in summary.items() if k.startswith("cv_mean_")))
    try:
        run_id = log_evaluation(args, group, cohort, config, plan, results)
    except (MlflowException, OSError) as err:
        print(f"dpgs eval: error: logging to MLflow at {first.tracking_uri} failed: {err}", file=sys.stderr)
        return 1
    if run_id is None:
        print(f"no MLflow run found for {group.root} in {first.tracking_uri}; metrics not logged")
    else:
        print(f"logged as MLflow run {run_id} (experiment '{config.experiment}', "
              f"tag {TAG_KIND}={KIND_EVALUATION})")
    return 0
