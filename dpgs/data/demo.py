"""Demo feature bags: the MNIST-bags protocol of Ilse et al. (2018) on scikit-learn's 8x8 digits.

Each instance is one digit image; its 64 features are the pixel intensities scaled to [0, 1]. Labels
are drawn first (balanced: each class gets ``bags // classes`` bags, the remainder spread over the
first classes) and each bag is then built to match:

* ``classes=2``: a bag is positive iff it contains at least one 9; positive bags get 1 to 3 nines,
  negative bags none;
* ``classes=4``: the label is the number of 9s clipped to 3 (an ordinal grade), grade 3 bags get 3 to
  5 nines.

Bag lengths are heavy-tailed like tile counts of slides: log-normal with median 24 and sigma 1,
rounded and clipped to [1, 500] (raised to the number of 9s the bag needs). Instances are otherwise
drawn uniformly from the non-9 digits. Cases (patients) hold one slide, about one in five holds two;
cases are split 60/20/20 into train/val/test, stratified by label, and the digit images are
partitioned the same way (stratified by digit), so no image appears in two splits (as Ilse et al.
drew train and test bags from the MNIST train and test sets).

Output, written to a temporary directory next to ``out_dir`` and renamed into place at the end::

    out_dir/manifest.csv          slide_id,label,case_id,split
    out_dir/features/{id}.h5      features float32 [N, 64], coords int64 [N, 2], images uint8 [N, 8, 8],
                                  digits int64 [N] (the instance labels, ground truth for heatmaps)
    out_dir/demo.json             the generator's parameters and summary counts

``images`` hold the pixels scaled to 0..255, and ``features == images / 255`` exactly.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import h5py
import numpy as np

from dpgs.staging import staged_directory

NINE = 9
MEDIAN_LENGTH = 24
LENGTH_SIGMA = 1.0
MAX_LENGTH = 500
TWO_SLIDE_CASE_FRACTION = 0.2
SPLIT_FRACTIONS = (("train", 0.6), ("val", 0.2), ("test", 0.2))
SPLIT_PATTERN = ("train", "val", "test", "train", "train")
TILE = 256  # spacing of the fake coordinate grid (pixels at level 0)
MARKER = "demo.json"
MIN_BAGS_PER_CLASS = 5


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 8, 8] scaled to 0..255, digit labels [n]) from scikit-learn's bundled set."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    return images, digits.target.astype(np.int64)


def nines_for_label(label: int, classes: int, rng: np.random.Generator) -> int:
    """How many 9s a bag of class ``label`` holds."""
    if classes == 2:
        return int(rng.integers(1, 4)) if label == 1 else 0
    return label if label < 3 else int(rng.integers(3, 6))


def bag_length(rng: np.random.Generator) -> int:
    """Heavy-tailed instance count: log-normal(median 24, sigma 1) clipped to [1, 500]."""
    value = rng.lognormal(mean=math.log(MEDIAN_LENGTH), sigma=LENGTH_SIGMA)
    return int(min(MAX_LENGTH, max(1, round(value))))


def balanced_labels(n: int, classes: int, rng: np.random.Generator) -> np.ndarray:
    labels = np.arange(n) % classes
    return rng.permutation(labels)


def assign_cases(n_bags: int, rng: np.random.Generator) -> list[int]:
    """Case index of every bag; about TWO_SLIDE_CASE_FRACTION of the cases hold two slides."""
    cases, case = [], 0
    while len(cases) < n_bags:
        slides = 2 if rng.random() < TWO_SLIDE_CASE_FRACTION and n_bags - len(cases) >= 2 else 1
        cases.extend([case] * slides)
        case += 1
    return cases


def split_of_cases(case_labels: list[int], rng: np.random.Generator) -> list[str]:
    """train/val/test for every case, stratified by the label of the case's first slide.

    Within each label the cases are shuffled and assigned in the repeating pattern SPLIT_PATTERN
    (60/20/20; a label with only three cases still reaches every split).
    """
    out = [""] * len(case_labels)
    for label in sorted(set(case_labels)):
        members = rng.permutation([c for c, y in enumerate(case_labels) if y == label])
        for k, case in enumerate(members):
            out[case] = SPLIT_PATTERN[k % len(SPLIT_PATTERN)]
    return out


def partition_digits(digits: np.ndarray, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    """Disjoint image pools per split (60/20/20 of every digit), each split into nines and others."""
    pools: dict[str, list[np.ndarray]] = {name: [] for name, _ in SPLIT_FRACTIONS}
    for d in range(10):
        idx = rng.permutation(np.flatnonzero(digits == d))
        cut1 = round(SPLIT_FRACTIONS[0][1] * len(idx))
        cut2 = cut1 + round(SPLIT_FRACTIONS[1][1] * len(idx))
        for name, part in zip(pools, (idx[:cut1], idx[cut1:cut2], idx[cut2:]), strict=True):
            pools[name].append(part)
    out = {}
    for name, parts in pools.items():
        idx = np.concatenate(parts)
        out[name] = {"nine": idx[digits[idx] == NINE], "other": idx[digits[idx] != NINE]}
    return out


def grid_coords(n: int) -> np.ndarray:
    """A fake tile grid: instance i at (column, row) * TILE on a roughly square grid."""
    width = max(1, math.ceil(math.sqrt(n)))
    i = np.arange(n)
    return np.stack([(i % width) * TILE, (i // width) * TILE], axis=1).astype(np.int64)


def build_bag(label: int, classes: int, pool: dict[str, np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Image indices of one bag of class ``label`` in random order."""
    nines = nines_for_label(label, classes, rng)
    n = max(bag_length(rng), nines)
    chosen = np.concatenate([rng.choice(pool["nine"], size=nines), rng.choice(pool["other"], size=n - nines)])
    return rng.permutation(chosen)


def _check_target(out_dir: Path) -> None:
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MARKER).exists())
    ):
        raise FileExistsError(
            f"{out_dir} exists and is not a dpgs demo directory (no {MARKER}); "
            "choose an empty or new directory"
        )


def _write(tmp: Path, bags: int, seed: int, classes: int) -> dict:
    rng = np.random.default_rng(seed)
    images, digits = digit_images()
    features_all = images.reshape(len(images), -1).astype(np.float32) / np.float32(255.0)
    pools = partition_digits(digits, rng)
    labels = balanced_labels(bags, classes, rng)
    cases = assign_cases(bags, rng)
    first_label = {}
    for b, case in enumerate(cases):
        first_label.setdefault(case, int(labels[b]))
    case_split = split_of_cases([first_label[c] for c in range(len(first_label))], rng)
    (tmp / "features").mkdir()
    rows, lengths = [], []
    for b in range(bags):
        split = case_split[cases[b]]
        idx = build_bag(int(labels[b]), classes, pools[split], rng)
        slide_id = f"bag_{b:05d}"
        with h5py.File(tmp / "features" / f"{slide_id}.h5", "w") as fh:
            fh.create_dataset("features", data=features_all[idx])
            fh.create_dataset("coords", data=grid_coords(len(idx)))
            fh.create_dataset("images", data=images[idx])
            fh.create_dataset("digits", data=digits[idx])
        rows.append((slide_id, int(labels[b]), f"case_{cases[b]:05d}", split))
        lengths.append(len(idx))
    with (tmp / "manifest.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["slide_id", "label", "case_id", "split"])
        writer.writerows(rows)
    summary = {
        "bags": bags,
        "seed": seed,
        "classes": classes,
        "instances": int(sum(lengths)),
        "length_min": int(min(lengths)),
        "length_median": float(np.median(lengths)),
        "length_max": int(max(lengths)),
        "label_counts": {str(c): int((labels == c).sum()) for c in range(classes)},
        "split_counts": {name: sum(r[3] == name for r in rows) for name, _ in SPLIT_FRACTIONS},
    }
    (tmp / MARKER).write_text(json.dumps(summary, indent=2))
    return summary


def write_demo_data(out_dir: str | Path, bags: int = 200, seed: int = 0, classes: int = 2) -> Path:
    """Write the demo bags and manifest into ``out_dir``; returns the manifest path.

    ``out_dir`` must be new, empty or a previous demo directory (which is replaced). Nothing is left
    half-written: on any error the temporary directory is removed and ``out_dir`` is untouched.
    """
    if classes not in (2, 4):
        raise ValueError(f"classes must be 2 or 4, got {classes}")
    if bags < MIN_BAGS_PER_CLASS * classes:
        raise ValueError(
            f"need at least {MIN_BAGS_PER_CLASS * classes} bags for {classes} classes, got {bags}"
        )
    out_dir = Path(out_dir)
    _check_target(out_dir)
    with staged_directory(out_dir) as tmp:
        _write(tmp, bags, seed, classes)
    return out_dir / "manifest.csv"


def read_summary(out_dir: str | Path) -> dict:
    """The parameters and counts recorded in ``demo.json``."""
    return json.loads((Path(out_dir) / MARKER).read_text())
