import tracemalloc

import h5py
import numpy as np
import pytest
import torch

from dpgs.config.schema import DataConfig
from dpgs.data import (
    DataValidationError,
    bag_info,
    check_inputs,
    load_manifest,
    read_bag,
    validate_inputs,
)
from dpgs.data.readers import iter_feature_chunks
from dpgs.experiment import load_experiment_data
from tests.data_helpers import write_csv, write_h5, write_pt


def manifest_for(tmp_path, slides, header=("slide_id", "label"), **kw):
    rows = [
        [s, i % 2] if len(header) == 2 else [s, i % 2, *kw.get("extra", [])] for i, s in enumerate(slides)
    ]
    csv = write_csv(tmp_path / "m.csv", list(header), rows)
    return csv, load_manifest(csv, tmp_path / "f", strict=False)


def problems_of(manifest, **kw):
    with pytest.raises(DataValidationError) as err:
        validate_inputs(manifest, **kw)
    return err.value.problems


def test_good_inputs_return_metadata(tmp_path):
    write_h5(tmp_path / "f" / "a.h5", n=7, d=3, dtype=np.float16)
    write_pt(tmp_path / "f" / "b.pt", n=2, d=3, dtype=torch.float16)
    _, m = manifest_for(tmp_path, ["a", "b"])
    infos = validate_inputs(m)
    assert infos["a"].length == 7 and infos["a"].dim == 3 and infos["a"].dtype == "float16"
    assert infos["a"].coords_shape == (7, 2)
    assert (infos["b"].length, infos["b"].dim, infos["b"].coords_shape) == (2, 3, None)


def test_missing_file_named_with_row(tmp_path):
    write_h5(tmp_path / "f" / "a.h5")
    _, m = manifest_for(tmp_path, ["a", "gone"])
    assert problems_of(m) == [f"slide 'gone' (row 3, {tmp_path / 'f' / 'gone.h5'}): feature file not found"]


def test_all_files_missing_points_at_the_layout(tmp_path):
    write_h5(tmp_path / "f" / "h5_files" / "other.h5")
    _, m = manifest_for(tmp_path, ["a", "b"])
    problems = problems_of(m)
    assert len(problems) == 3
    where = tmp_path / "f" / "h5_files"
    assert problems[2] == f"none of the 2 feature files exists in the clam layout ({where})"


def test_corrupt_files_named(tmp_path):
    write_h5(tmp_path / "f" / "a.h5")
    (tmp_path / "f" / "b.h5").write_bytes(b"not hdf5" * 20)
    (tmp_path / "f" / "c.pt").write_bytes(b"not a pickle" * 20)
    torch.save({"features": torch.zeros(2, 2)}, tmp_path / "f" / "d.pt")
    with h5py.File(tmp_path / "f" / "e.h5", "w") as fh:
        fh.create_dataset("feats", data=np.zeros((2, 4)))
    _, m = manifest_for(tmp_path, ["a", "b", "c", "d", "e"])
    problems = problems_of(m)
    assert len(problems) == 4
    assert problems[0].startswith(f"slide 'b' (row 3): unreadable or corrupt file: {tmp_path / 'f' / 'b.h5'}")
    assert problems[1].startswith(f"slide 'c' (row 4): unreadable or corrupt file: {tmp_path / 'f' / 'c.pt'}")
    assert problems[2].endswith("d.pt: .pt file holds a dict, expected a [N, D] tensor")
    assert problems[3].endswith("e.h5: no 'features' dataset (found: feats)")


def test_truncated_h5_named(tmp_path):
    write_h5(tmp_path / "f" / "a.h5", n=2000, d=64)
    data = (tmp_path / "f" / "a.h5").read_bytes()
    (tmp_path / "f" / "a.h5").write_bytes(data[: len(data) // 2])
    _, m = manifest_for(tmp_path, ["a"])
    (problem,) = problems_of(m)
    assert problem.startswith("slide 'a' (row 2): unreadable or corrupt file:") and "a.h5" in problem


def test_empty_bag_and_bad_shapes(tmp_path):
    write_h5(tmp_path / "f" / "a.h5", n=0, d=4)
    with h5py.File(tmp_path / "f" / "b.h5", "w") as fh:
        fh.create_dataset("features", data=np.zeros((3, 4, 2), np.float32))
    with h5py.File(tmp_path / "f" / "c.h5", "w") as fh:
        fh.create_dataset("features", data=np.zeros((3, 4), np.float32))
        fh.create_dataset("coords", data=np.zeros((2, 2)))
    with h5py.File(tmp_path / "f" / "d.h5", "w") as fh:
        fh.create_dataset("features", data=np.zeros((3, 4), np.int32))
    _, m = manifest_for(tmp_path, ["a", "b", "c", "d"])
    problems = problems_of(m)
    assert problems[0] == f"slide 'a' (row 2, {tmp_path / 'f' / 'a.h5'}): empty bag (0 instances)"
    assert problems[1].endswith("b.h5: 'features' has shape (3, 4, 2), expected [N, D]")
    assert problems[2].endswith("c.h5): coords have shape (2, 2), expected (3, 2)")
    assert problems[3].endswith("d.h5): features have dtype int32, expected float16 or float32")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_found_in_a_late_chunk(tmp_path, bad):
    feats = np.zeros((1000, 8), np.float16)
    feats[997, 5] = bad
    feats[998, 1] = bad
    tmp = tmp_path / "f"
    tmp.mkdir()
    with h5py.File(tmp / "a.h5", "w") as fh:
        fh.create_dataset("features", data=feats)
    t = torch.zeros(1000, 8)
    t[999, 0] = float(bad)
    torch.save(t, tmp / "b.pt")
    write_h5(tmp / "c.h5", n=1000, d=8)
    _, m = manifest_for(tmp_path, ["a", "b", "c"])
    problems = problems_of(m, chunk_bytes=256)  # 16..8 rows per chunk: the values are in the last chunks
    assert problems == [
        f"slide 'a' (row 2, {tmp / 'a.h5'}): 2 NaN/inf feature values",
        f"slide 'b' (row 3, {tmp / 'b.pt'}): 1 NaN/inf feature values",
    ]
    assert validate_inputs(m, check_values=False).keys() == {"a", "b", "c"}


def test_feature_dims_must_agree(tmp_path):
    for sid in ("a", "b", "c"):
        write_h5(tmp_path / "f" / f"{sid}.h5", d=16)
    write_pt(tmp_path / "f" / "odd.pt", d=12)
    _, m = manifest_for(tmp_path, ["a", "b", "odd", "c"])
    assert problems_of(m) == [
        f"slide 'odd' (row 4, {tmp_path / 'f' / 'odd.pt'}): "
        "feature dim 12 differs from the 16 of 3 other bags"
    ]


def test_every_problem_reported_at_once(tmp_path):
    write_h5(tmp_path / "f" / "ok.h5")
    write_h5(tmp_path / "f" / "empty.h5", n=0)
    write_h5(tmp_path / "f" / "wide.h5", d=9)
    feats = np.ones((3, 4), np.float32)
    feats[0, 0] = np.nan
    with h5py.File(tmp_path / "f" / "nan.h5", "w") as fh:
        fh.create_dataset("features", data=feats)
    (tmp_path / "f" / "bad.h5").write_bytes(b"x" * 64)
    rows = [
        ["ok", "a"],
        ["empty", "a"],
        ["wide", "b"],
        ["nan", "a"],
        ["bad", "b"],
        ["gone", "a"],
        ["ok", "a"],
        ["ok2", "zz"],
    ]
    csv = write_csv(tmp_path / "m.csv", ["slide_id", "label"], rows)
    m = load_manifest(csv, tmp_path / "f", classes=["a", "b"], strict=False)
    problems = problems_of(m)
    expected_fragments = [
        "row 8: duplicate slide_id 'ok'",
        "row 9: unknown label 'zz'",
        "slide 'empty' (row 3",
        "slide 'nan' (row 5",
        "slide 'bad' (row 6)",
        "slide 'gone' (row 7",
        "slide 'ok2' (row 9",
        "slide 'wide' (row 4",
    ]
    assert len(problems) == len(expected_fragments)
    for fragment in expected_fragments:
        assert any(fragment in p for p in problems), fragment
    _, collected = check_inputs(m)
    assert collected == problems


def test_reader_dtypes_and_pt_metadata(tmp_path):
    f16 = write_h5(tmp_path / "a.h5", n=3, d=2, dtype=np.float16)
    features, coords = read_bag(tmp_path / "a.h5")
    assert features.dtype == torch.float16 and torch.equal(features, torch.from_numpy(f16))
    assert coords.shape == (3, 2)
    t = write_pt(tmp_path / "b.pt", n=4, d=2, dtype=torch.bfloat16)
    assert bag_info(tmp_path / "b.pt").dtype == "bfloat16"
    assert torch.equal(read_bag(tmp_path / "b.pt")[0], t)
    torch.save(torch.zeros(5, 3), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert bag_info(tmp_path / "legacy.pt").length == 5


def experiment_cfg(tmp_path, **kw):
    return DataConfig(manifest=tmp_path / "m.csv", features_dir=tmp_path / "f", **kw)


def test_experiment_reports_split_and_file_problems_together(tmp_path):
    write_h5(tmp_path / "f" / "a.h5")
    write_h5(tmp_path / "f" / "b.h5")
    write_csv(tmp_path / "m.csv", ["slide_id", "label"], [["a", 0], ["b", 1], ["c", 1]])
    write_csv(tmp_path / "splits_0.csv", ["", "train", "val", "test"], [[0, "a", "b", "x"]])
    with pytest.raises(DataValidationError) as err:
        load_experiment_data(experiment_cfg(tmp_path, split_file=tmp_path / "splits_0.csv"))
    problems = err.value.problems
    assert any("slide 'c' (row 4" in p and "not found" in p for p in problems)
    assert f"{tmp_path / 'splits_0.csv'}, row 2, column test: slide 'x' is not in the manifest" in problems
    assert len(problems) == 2


def test_experiment_split_selection(tmp_path):
    for i in range(8):
        write_h5(tmp_path / "f" / f"s{i}.h5", d=3)
    splits = ["train"] * 4 + ["val", "val", "test", "test"]
    write_csv(
        tmp_path / "m.csv", ["slide_id", "label", "split"], [[f"s{i}", i % 2, splits[i]] for i in range(8)]
    )
    data = load_experiment_data(experiment_cfg(tmp_path, cache_gb=0.001))
    assert [s.name for s in data.splits] == ["split"]
    assert data.splits[0].train == [0, 1, 2, 3] and data.splits[0].test == [6, 7]
    assert data.dataset.feature_dim == 3 and data.dataset.cache.max_bytes == int(0.001 * 2**30)
    folds = load_experiment_data(experiment_cfg(tmp_path, folds=2, val_fraction=0.0), seed=3).splits
    assert [s.name for s in folds] == ["fold_0", "fold_1"]
    with pytest.raises(DataValidationError, match="choose one"):
        load_experiment_data(experiment_cfg(tmp_path, folds=2, split_file=tmp_path / "s.csv"))
    write_csv(tmp_path / "m.csv", ["slide_id", "label"], [[f"s{i}", i % 2] for i in range(8)])
    with pytest.raises(DataValidationError, match="no 'split' column; add one, or set data.split_file"):
        load_experiment_data(experiment_cfg(tmp_path))
    assert load_experiment_data(experiment_cfg(tmp_path), with_splits=False).splits == []


def test_float64_values_beyond_float32_range_are_refused(tmp_path):
    feats = np.zeros((300, 4), np.float64)
    feats[250, 2] = 1e39  # finite in float64, inf once read as float32
    feats[251, 0] = -3.5e38
    feats[252, 1] = 3.0e38  # within range
    (tmp_path / "f").mkdir()
    with h5py.File(tmp_path / "f" / "a.h5", "w") as fh:
        fh.create_dataset("features", data=feats)
    write_h5(tmp_path / "f" / "b.h5", n=300, d=4)
    _, m = manifest_for(tmp_path, ["a", "b"])
    assert problems_of(m, chunk_bytes=512) == [
        f"slide 'a' (row 2, {tmp_path / 'f' / 'a.h5'}): 2 float64 feature values beyond the float32 range "
        "(|x| > 3.403e+38); they would become inf in training"
    ]


@pytest.mark.parametrize("suffix", [".h5", ".pt"])
def test_value_scan_blocks_never_exceed_chunk_bytes_even_for_wide_rows(tmp_path, suffix):
    path = tmp_path / f"wide{suffix}"
    if suffix == ".h5":
        data = write_h5(path, n=3, d=1000, coords=False)
    else:
        data = write_pt(path, n=3, d=1000).numpy()
    blocks = list(iter_feature_chunks(path, chunk_bytes=256))  # a row is 4000 bytes
    assert max(b.nbytes for b in blocks) <= 256
    assert np.array_equal(np.concatenate([b.reshape(-1) for b in blocks]), data.reshape(-1))


def test_a_file_declaring_a_huge_dimension_is_scanned_in_bounded_memory(tmp_path):
    (tmp_path / "f").mkdir()
    with h5py.File(tmp_path / "f" / "huge.h5", "w") as fh:  # 1 x 2^24 float32 (64 MiB), chunks never written
        fh.create_dataset("features", shape=(1, 1 << 24), dtype="f4", chunks=(1, 1 << 16))
    _, alone = manifest_for(tmp_path, ["huge"])
    tracemalloc.start()
    try:
        assert validate_inputs(alone, chunk_bytes=1 << 20)["huge"].dim == 1 << 24
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    for sid in ("a", "b"):
        write_h5(tmp_path / "f" / f"{sid}.h5", d=4)
    _, mixed = manifest_for(tmp_path, ["a", "huge", "b"])
    tracemalloc.start()
    try:  # with the default 64 MiB blocks: the bag of the odd dimension is not scanned at all
        assert problems_of(mixed) == [
            f"slide 'huge' (row 3, {tmp_path / 'f' / 'huge.h5'}): feature dim 16777216 differs from the 4 "
            "of 2 other bags"
        ]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
