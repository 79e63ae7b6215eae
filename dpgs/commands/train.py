"""``dpgs train``: train a model from a YAML config plus dotted overrides."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a MIL model (all folds when data.folds > 1)",
        description="Train from a YAML config; KEY=VALUE overrides use dotted keys (train.batch_size=16).",
    )
    p.add_argument("--config", "-c", help="YAML config file (see configs/)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: tracking.uri, sqlite:///mlflow.db)")
    p.add_argument("--address", help="Ray address for train.mode=dpgs: 'auto' or host:port (dpgs.address)")
    p.add_argument("--resume", help="resume a DPGS run from a checkpoint directory or MLflow run id")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return p


def run(args) -> int:
    from dpgs.config import ConfigError, load_config
    from dpgs.data import DataValidationError
    from dpgs.errors import RunFailure

    overrides = list(args.overrides)
    if args.tracking_uri:
        overrides.append(f"tracking.uri={args.tracking_uri}")
    if args.address:
        overrides.append(f"dpgs.address={args.address}")
    try:
        config = load_config(args.config, overrides)
        if args.resume:
            if config.train.mode != "dpgs":
                raise ConfigError("--resume needs train.mode=dpgs (single-process runs restart from best.pt)")
            from dpgs.distributed.resume import attach_resume

            config = attach_resume(config, args.resume)
        if config.data.manifest is None:
            raise ConfigError("data.manifest is required (set it in the config or as data.manifest=PATH)")
        from dpgs.runner import run_training

        result = run_training(config)
    except (ConfigError, DataValidationError, FileNotFoundError, ValueError) as err:
        print(f"dpgs train: error: {err}", file=sys.stderr)
        return 2
    except RunFailure as err:
        print(f"dpgs train: error: {err}", file=sys.stderr)
        return err.exit_code
    print("\nfinal metrics:")
    for key, value in sorted(result.summary.items()):
        print(f"  {key:28s} {value:.4f}" if isinstance(value, float) else f"  {key:28s} {value}")
    print(f"MLflow run id: {result.run_id}")
    print(f"tracking URI:  {config.tracking.uri}")
    print(f"open it with:  mlflow ui --backend-store-uri {config.tracking.uri}")
    print(f"outputs in:    {config.train.output_dir}")
    return 0
