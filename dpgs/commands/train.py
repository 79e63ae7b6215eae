"""``dpgs train``: train a model from a YAML config plus dotted overrides.

Exit codes (docs/reliability.md): 0 trained; 2 refused before training or stopped by something the user
can fix (config, inputs, resume, output directory, disk), with ``dpgs train: error: ...``; 3 the cluster,
a worker or the master failed (``RunFailure``); 130 / 143 interrupted by SIGINT / SIGTERM. Every run that
does not finish is marked KILLED (interrupted) or FAILED in MLflow and keeps its checkpoints.
"""

from __future__ import annotations

import argparse
import signal
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
    p.add_argument("--resume", help="resume a run, in any mode: a single-split run from its last epoch's "
                   "checkpoint, a k-fold command from its finished folds (the output directory, the file or "
                   "the MLflow run id)")
    p.add_overrides("overrides", help="dotted config overrides, before, between or after the options")
    return p


def run(args) -> int:
    from dpgs.config import ConfigError, load_config
    from dpgs.data import DataValidationError
    from dpgs.errors import RunFailure
    from dpgs.interrupts import Interrupted, signals_interrupt

    overrides = list(args.overrides)
    if args.tracking_uri:
        overrides.append(f"tracking.uri={args.tracking_uri}")
    if args.address:
        overrides.append(f"dpgs.address={args.address}")
    config = None
    try:
        with signals_interrupt():
            config = load_config(args.config, overrides)
            if args.resume:  # checked against the checkpoint by run_training, before anything is written
                from dpgs.records import find_resume_target

                target = find_resume_target(args.resume, config.tracking.uri)
                config = config.model_copy(update={"dpgs": config.dpgs.model_copy(update={"resume": target})})
            if config.data.manifest is None:
                raise ConfigError("data.manifest is required (set it in the config or as data.manifest=PATH)")
            from dpgs.runner import run_training

            result = run_training(config)
    except KeyboardInterrupt as err:
        stopped = err if isinstance(err, Interrupted) else Interrupted(signal.SIGINT)
        kept = ""
        if config is not None:
            out = config.train.output_dir
            kept = (f"; --resume {out} keeps the folds that finished" if config.data.folds > 1
                    else f"; --resume {out} continues from its last checkpoint")
        print(f"dpgs train: {stopped} (a started MLflow run is marked KILLED{kept})", file=sys.stderr)
        return stopped.exit_code
    except (ConfigError, DataValidationError, ValueError, OSError) as err:
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
