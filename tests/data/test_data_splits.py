from collections import Counter

import numpy as np
import pytest

from dpgs.config.schema import DataConfig
from dpgs.data import (
    DataValidationError,
    Manifest,
    SlideRecord,
    clam_splits,
    kfold_splits,
    manifest_split,
)
from dpgs.experiment import load_experiment_data
from tests.data_helpers import write_csv, write_h5


def make_manifest(n=120, classes=3, seed=0, splits=None):
    rng = np.random.default_rng(seed)
    records, case = [], 0
    while len(records) < n:
        slides = int(rng.integers(1, 4))  # cases with 1..3 slides
        label = int(rng.integers(classes))
        for _ in range(slides):
            i = len(records)
            split = splits[i] if splits else None
            records.append(SlideRecord(f"s{i}", label, str(label), f"c{case}", split, None, row=i + 2))
        case += 1
    return Manifest(records[:n], [str(c) for c in range(classes)], source="m.csv")


def cases(m, idx):
    return {m.records[i].case_id for i in idx}


def test_kfold_groups_cases_and_covers_everything_once():
    m = make_manifest()
    folds = kfold_splits(m, k=5, val_fraction=0.25, seed=1)
    assert [f.name for f in folds] == [f"fold_{i}" for i in range(5)]
    tests = [i for f in folds for i in f.test]
    assert sorted(tests) == list(range(len(m)))  # every slide tested exactly once
    for a in range(5):
        for b in range(a + 1, 5):
            assert not cases(m, folds[a].test) & cases(m, folds[b].test)
    for f in folds:
        parts = [f.train, f.val, f.test]
        assert sorted(i for p in parts for i in p) == list(range(len(m)))
        assert not cases(m, f.train) & cases(m, f.val)
        assert not cases(m, f.train) & cases(m, f.test)
        assert not cases(m, f.val) & cases(m, f.test)
        assert 0.15 < len(f.val) / (len(f.train) + len(f.val)) < 0.35


def test_kfold_is_stratified():
    m = make_manifest(n=300, classes=2, seed=4)
    overall = np.mean([r.label for r in m.records])
    for f in kfold_splits(m, k=4, val_fraction=0.2, seed=0):
        for part in (f.train, f.val, f.test):
            assert abs(np.mean([m.records[i].label for i in part]) - overall) < 0.1


def test_kfold_is_reproducible_and_seed_dependent():
    m = make_manifest()
    a = kfold_splits(m, 3, 0.2, seed=7)
    b = kfold_splits(m, 3, 0.2, seed=7)
    c = kfold_splits(m, 3, 0.2, seed=8)
    assert [(f.train, f.val, f.test) for f in a] == [(f.train, f.val, f.test) for f in b]
    assert [f.test for f in a] != [f.test for f in c]


def test_val_fraction_zero_gives_empty_val():
    m = make_manifest(n=40)
    for f in kfold_splits(m, 4, val_fraction=0.0, seed=0):
        assert f.val == [] and len(f.train) + len(f.test) == 40


def test_kfold_needs_enough_cases():
    m = make_manifest(n=3)
    with pytest.raises(DataValidationError, match="10 folds need at least 10 cases"):
        kfold_splits(m, 10)
    with pytest.raises(ValueError, match="folds must be >= 2"):
        kfold_splits(m, 1)


def test_manifest_split_column():
    m = make_manifest(n=6, splits=["train", "test", "val", "train", "test", "train"])
    s = manifest_split(m)
    assert (s.train, s.val, s.test) == ([0, 3, 5], [2], [1, 4])
    m.records[4].split = None
    with pytest.raises(DataValidationError, match="m.csv, row 6: slide 's4' has no split value"):
        manifest_split(m)


def test_clam_split_file_ragged_with_index_column(tmp_path):
    m = make_manifest(n=8)
    rows = [[0, "s0", "s4", "s6"], [1, "s1", "s5", ""], [2, "s2", "", ""], [3, "s3"]]
    path = write_csv(tmp_path / "splits_0.csv", ["", "train", "val", "test"], rows)
    (s,) = clam_splits(m, path)
    assert s.name == "splits_0"
    assert (s.train, s.val, s.test) == ([0, 1, 2, 3], [4, 5], [6])  # s7 is in no column: unused


def test_clam_split_problems_named(tmp_path):
    m = make_manifest(n=4)
    rows = [["s0", "s1", "nope"], ["s1", "", ""]]
    path = write_csv(tmp_path / "splits_3.csv", ["train", "val", "test"], rows)
    with pytest.raises(DataValidationError) as err:
        clam_splits(m, path)
    assert err.value.problems == [
        f"{path}, row 2, column test: slide 'nope' is not in the manifest",
        f"{path}, row 3, column train: slide 's1' already listed (row 2, column val)",
    ]
    bad = write_csv(tmp_path / "x.csv", ["train", "validation"], [["s0", "s1"]])
    with pytest.raises(DataValidationError, match=r"x.csv: missing column\(s\) val, test"):
        clam_splits(m, bad)
    with pytest.raises(DataValidationError, match="split file not found"):
        clam_splits(m, tmp_path / "none.csv")


def test_clam_split_directory_in_numeric_order(tmp_path):
    m = make_manifest(n=4)
    for k in (0, 2, 10):
        write_csv(
            tmp_path / f"splits_{k}.csv", ["train", "val", "test"], [[f"s{k % 4}", "", f"s{(k + 1) % 4}"]]
        )
    splits = clam_splits(m, tmp_path)
    assert [s.name for s in splits] == ["splits_0", "splits_2", "splits_10"]
    assert Counter(len(s.train) for s in splits) == {1: 3}
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataValidationError, match="no splits_\\*.csv files"):
        clam_splits(m, tmp_path / "empty")


def experiment_with(tmp_path, rows, header=("slide_id", "label", "case_id", "split"), **data):
    """load_experiment_data over small h5 bags of ``rows`` (a manifest with ``header``)."""
    for row in rows:
        write_h5(tmp_path / "f" / f"{row[0]}.h5", n=3, d=2)
    write_csv(tmp_path / "m.csv", list(header), rows)
    return load_experiment_data(DataConfig(manifest=tmp_path / "m.csv", features_dir=tmp_path / "f", **data))


def test_a_case_in_two_manifest_splits_is_refused(tmp_path):
    rows = [["a", 0, "p1", "train"], ["b", 1, "p2", "train"], ["c", 0, "p1", "test"], ["d", 1, "p1", "val"],
            ["e", 1, "p3", "test"]]
    with pytest.raises(DataValidationError) as err:
        experiment_with(tmp_path, rows)
    assert err.value.problems == [
        f"{tmp_path / 'm.csv'}, split 'split': case 'p1' has slides in train (row 2) and val (row 5) and "
        "test (row 4); the slides of one case must all be in one part"
    ]


def test_a_class_without_training_slides_and_a_single_class_are_refused(tmp_path):
    rows = [["a", 0, "p1", "train"], ["b", 0, "p2", "train"], ["c", 1, "p3", "test"], ["d", 2, "p4", "val"]]
    with pytest.raises(DataValidationError) as err:
        experiment_with(tmp_path, rows)
    assert err.value.problems == [
        f"{tmp_path / 'm.csv'}, split 'split': class '1' has no slide in train",
        f"{tmp_path / 'm.csv'}, split 'split': class '2' has no slide in train",
    ]
    rows = [["a", 1, "p1", "train"], ["b", 1, "p2", "train"], ["c", 1, "p3", "test"]]
    with pytest.raises(DataValidationError, match="every slide has label '1'; training a classifier"):
        experiment_with(tmp_path, rows)


def test_kfold_refuses_a_class_with_fewer_cases_than_the_folds_need(tmp_path):
    rows = [[f"s{i}", int(i >= 10), f"p{i}"] for i in range(13)]  # class 1: 3 cases
    with pytest.raises(DataValidationError) as err:
        experiment_with(tmp_path, rows, header=("slide_id", "label", "case_id"), folds=4, val_fraction=0.0)
    assert err.value.problems == [
        f"{tmp_path / 'm.csv'}: class '1' has 3 case(s), fewer than the 4 folds of data.folds=4 (every test "
        "fold needs one); lower data.folds or add slides of that class"
    ]
    with pytest.raises(DataValidationError, match=r"class '1' has 2 training case\(s\), fewer than the 5"):
        experiment_with(tmp_path, rows, header=("slide_id", "label", "case_id"), folds=3, val_fraction=0.2)
    assert len(experiment_with(tmp_path, rows, header=("slide_id", "label", "case_id"), folds=3,
                               val_fraction=0.5).splits) == 3
