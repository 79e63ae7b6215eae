"""``dpgs eval``: evaluate a saved model (``best.pt`` of a run directory) on a manifest."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval",
        help="evaluate a saved model on a manifest",
        description="Evaluate RUN_DIR/best.pt (or --checkpoint) with the run's config and class order.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a train.output_dir (holds config.yaml, classes.json)")
    p.add_argument("--checkpoint", help="state_dict to evaluate (default RUN_DIR/best.pt)")
    p.add_argument("--manifest", help="manifest CSV (default: the run's data.manifest)")
    p.add_argument("--features-dir", help="feature bags (default: the run's data.features_dir)")
    p.add_argument("--split", default="all", help="evaluate only rows whose split column equals this")
    p.add_argument("--sample-k", type=int, help="also run the sampled protocol with K instances per bag")
    p.add_argument("--repeats", type=int, default=5, help="repetitions of the sampled protocol")
    p.add_argument("--out", help="predictions CSV (default RUN_DIR/predictions_<split>.csv)")
    return p


def run(args) -> int:
    import torch

    from dpgs.config import ConfigError, load_config
    from dpgs.data import DataValidationError, load_experiment_data
    from dpgs.metrics import confusion
    from dpgs.modeling import ModelSpec, resolve_device
    from dpgs.train.evaluate import predict, sampled_protocol
    from dpgs.train.trainer import iterate_bags

    run_dir = Path(args.run_dir)
    try:
        for name in ("config.yaml", "classes.json"):
            if not (run_dir / name).is_file():
                raise ConfigError(f"{run_dir / name} not found: RUN_DIR must be a train.output_dir")
        overrides = []
        if args.manifest:
            overrides.append(f"data.manifest={args.manifest}")
        if args.features_dir:
            overrides.append(f"data.features_dir={args.features_dir}")
        config = load_config(run_dir / "config.yaml", overrides + ["data.folds=1", "data.split_file=null"])
        classes = json.loads((run_dir / "classes.json").read_text())
        data = load_experiment_data(config.data, seed=config.seed, classes=classes, with_splits=False)
        checkpoint = Path(args.checkpoint) if args.checkpoint else run_dir / "best.pt"
        if not checkpoint.is_file():
            raise ConfigError(f"checkpoint not found: {checkpoint}")
        model = ModelSpec(config.model, data.dataset.feature_dim, len(classes)).build()
        try:
            model.load_state_dict(torch.load(checkpoint, weights_only=True))
        except (RuntimeError, KeyError) as err:
            raise ConfigError(f"{checkpoint}: does not match the run's model ({err})") from None
    except (ConfigError, DataValidationError, ValueError) as err:
        print(f"dpgs eval: error: {err}", file=sys.stderr)
        return 2
    records = data.manifest.records
    indices = [i for i, r in enumerate(records) if args.split == "all" or r.split == args.split]
    if not indices:
        print(f"dpgs eval: error: no manifest rows with split '{args.split}'", file=sys.stderr)
        return 2
    device = resolve_device(config.train.device)
    model.to(device)
    preds = predict(model, iterate_bags(data.dataset, indices, 2), device, len(classes))
    metrics = preds.metrics("")
    if args.sample_k:
        metrics.update(
            sampled_protocol(
                model,
                lambda: iterate_bags(data.dataset, indices, 2),
                device,
                len(classes),
                args.sample_k,
                args.repeats,
                config.seed,
                "",
            )
        )
    out = Path(args.out) if args.out else run_dir / f"predictions_{args.split}.csv"
    with out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["slide_id", "label", "prediction", *[f"p_{c}" for c in classes]])
        for sid, y, p in zip(preds.slide_ids, preds.labels, preds.probs, strict=True):
            writer.writerow([sid, classes[y], classes[int(p.argmax())], *[f"{v:.6f}" for v in p]])
    print(f"evaluated {len(indices)} bags from {config.data.manifest}")
    for key, value in metrics.items():
        print(f"  {key:24s} {value:.4f}")
    print("confusion matrix (rows: true, columns: predicted; order " + ", ".join(classes) + "):")
    print(confusion(preds.labels, preds.probs))
    print(f"predictions: {out}")
    return 0
