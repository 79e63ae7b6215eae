"""The bandwidth benchmark's tile manifests: splits reassigned per label, as asked, or a clear error."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth_workloads import (  # noqa: E402
    QUICK_STEPS,
    TILE_SPLITS,
    TILE_TUMOUR_CONTRAST,
    quick_splits,
    workload,
    write_split_manifest,
)


def _manifest(path: Path, per_label: int) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["slide_id", "label", "case_id", "split"])
        for i in range(2 * per_label):
            writer.writerow([f"slide_{i:03d}", i % 2, f"case_{i:03d}", "train"])
    return path


def test_splits_are_reassigned_in_order_within_each_label(tmp_path):
    source = _manifest(tmp_path / "manifest.csv", per_label=7)
    out = tmp_path / "bench.csv"
    write_split_manifest(source, out, {"train": 4, "val": 4, "test": 2})
    with out.open() as f:
        rows = list(csv.DictReader(f))
    split_of = {r["slide_id"]: r["split"] for r in rows}
    # label 0 is slides 0, 2, 4, ...: two to train, two to val, one to test, the last two left out
    assert [split_of.get(f"slide_{i:03d}") for i in range(0, 14, 2)] == [
        "train", "train", "val", "val", "test", None, None]
    assert [split_of.get(f"slide_{i:03d}") for i in range(1, 14, 2)] == [
        "train", "train", "val", "val", "test", None, None]
    assert {r["case_id"] for r in rows} == {f"case_{int(s[6:]):03d}" for s in split_of}


def test_too_few_slides_of_a_label_is_an_error_naming_the_file(tmp_path):
    source = _manifest(tmp_path / "manifest.csv", per_label=3)
    with pytest.raises(ValueError, match=r"manifest\.csv: only 3 slides of label 0, need 5"):
        write_split_manifest(source, tmp_path / "bench.csv", {"train": 4, "val": 4, "test": 2})
    assert not (tmp_path / "bench.csv").exists()


def test_whole_tile_runs_have_the_bench_splits_and_enough_slides():
    w = workload("tiles")
    assert w.manifest_name == "manifest-bench.csv"
    # a cache folder written with another slide count or contrast is never reused
    assert w.data_dir == f"tiles-{w.bags}-contrast{TILE_TUMOUR_CONTRAST:g}"
    assert w.bags >= sum(TILE_SPLITS.values())
    assert TILE_SPLITS["train"] // w.batch == 12  # steps an epoch


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_quick_tile_runs_take_the_same_steps_at_every_p_from_their_own_manifest(workers):
    w = workload("tiles", quick=True, workers=workers)
    splits = quick_splits(w.batch)
    assert splits["train"] // w.batch == QUICK_STEPS  # one bag per worker per step, at any P
    assert w.manifest_name == f"manifest-quick-B{workers}.csv"  # another P's manifest is never reused
    assert w.bags >= sum(splits.values())
