"""Builders for the DPGS tests: variable-length feature bags on disk and configs over them."""

from __future__ import annotations

import csv
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import torch

from dpgs.config import load_config
from dpgs.experiment import load_experiment_data
from dpgs.train.engine import FoldSetup


def write_bags(root: Path, lengths: list[int], dim: int = 8, seed: int = 0) -> tuple[Path, Path]:
    """Bags whose label is whether their mean first feature is positive; split train/val/test."""
    rng = np.random.default_rng(seed)
    feats_dir = root / "features"
    feats_dir.mkdir(parents=True)
    rows = []
    for i, n in enumerate(lengths):
        label = i % 2
        x = rng.standard_normal((n, dim)).astype(np.float32)
        x[:, 0] += 1.5 if label else -1.5
        with h5py.File(feats_dir / f"s{i}.h5", "w") as fh:
            fh.create_dataset("features", data=x)
        split = "train" if i < 0.7 * len(lengths) else ("val" if i < 0.85 * len(lengths) else "test")
        rows.append([f"s{i}", label, split])
    manifest = root / "manifest.csv"
    with manifest.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["slide_id", "label", "split"])
        w.writerows(rows)
    return manifest, feats_dir


MIXED_LENGTHS = [3, 40, 7, 1, 90, 12, 5, 30, 2, 60, 8, 15, 4, 22, 9, 11, 6, 50, 13, 2]  # instances per bag


def base_overrides(manifest: Path, feats_dir: Path, out: Path) -> list[str]:
    """What every test config starts from: the bags, the output directory and an MLflow store beside it, a
    fixed learning rate, no read-ahead, no dropout."""
    return [
        f"data.manifest={manifest}",
        f"data.features_dir={feats_dir}",
        f"train.output_dir={out}",
        f"tracking.uri=sqlite:///{out.parent / 'mlflow.db'}",
        "train.scheduler=none",
        "train.lr=0.01",
        "data.prefetch=0",
        "model.params={dropout: 0.0}",
    ]


def make_config(manifest: Path, feats_dir: Path, out: Path, *overrides: str):
    return load_config(None, [*base_overrides(manifest, feats_dir, out), *overrides])


def train_argv(bags: tuple[Path, Path], out: Path, *overrides: str) -> list[str]:
    """``dpgs train`` arguments of the config :func:`make_config` builds over ``bags``."""
    return ["train", *base_overrides(*bags, out), *overrides]


def experiment_data(config):
    return load_experiment_data(config.data, seed=config.seed)


def fold_setup(config, spec, model, dataset, train_indices, class_weights=None, eval_dataset=None,
               validation=None, output_dir=None) -> FoldSetup:
    """One fold on the CPU, writing to ``output_dir`` (default: ``train.output_dir``)."""
    return FoldSetup(config, spec, model, class_weights, dataset, list(train_indices), torch.device("cpu"),
                     Path(output_dir or config.train.output_dir), eval_dataset, validation)


@contextmanager
def dpgs_engine(config, spec, model, dataset, train_indices, class_weights=None, eval_dataset=None,
                validation=None):
    """A DPGS engine for one fold on its own session (closed on exit)."""
    from dpgs.distributed.session import DpgsSession
    from dpgs.runner import dpgs_roles

    session = DpgsSession(config, dpgs_roles(config))
    setup = fold_setup(config, spec, model, dataset, train_indices, class_weights, eval_dataset, validation)
    try:
        yield session.engine(setup)
    finally:
        session.close()
