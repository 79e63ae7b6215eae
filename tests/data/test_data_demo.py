import argparse
import csv

import h5py
import numpy as np
import pytest

import dpgs.data.demo as demo
from dpgs.commands import demo_data as demo_cmd
from dpgs.data import BagDataset, load_manifest, validate_inputs, write_demo_data


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "bags2"
    return write_demo_data(out, bags=200, seed=0, classes=2)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "bags4"
    return write_demo_data(out, bags=80, seed=1, classes=4)


def read_rows(manifest):
    with manifest.open() as fh:
        return list(csv.DictReader(fh))


def bag_file(manifest, slide_id):
    return h5py.File(manifest.parent / "features" / f"{slide_id}.h5", "r")


def test_binary_label_is_presence_of_a_nine(binary):
    rows = read_rows(binary)
    assert list(rows[0]) == ["slide_id", "label", "case_id", "split"]
    labels = [int(r["label"]) for r in rows]
    assert labels.count(0) == labels.count(1) == 100
    for r in rows:
        with bag_file(binary, r["slide_id"]) as fh:
            nines = int((fh["digits"][()] == 9).sum())
        assert int(r["label"]) == int(nines > 0)
        assert nines <= 3


def test_four_classes_count_nines_clipped_to_three(graded):
    rows = read_rows(graded)
    assert sorted({r["label"] for r in rows}) == ["0", "1", "2", "3"]
    assert all(sum(r["label"] == c for r in rows) == 20 for c in "0123")
    saw_more_than_three = False
    for r in rows:
        with bag_file(graded, r["slide_id"]) as fh:
            nines = int((fh["digits"][()] == 9).sum())
        assert int(r["label"]) == min(nines, 3)
        saw_more_than_three |= nines > 3
    assert saw_more_than_three  # grade 3 means "3 or more"


def test_images_match_features_and_the_digits_set(binary):
    images_all, digits_all = demo.digit_images()
    lookup = {}
    for img, d in zip(images_all, digits_all, strict=True):
        lookup.setdefault(img.tobytes(), set()).add(int(d))
    for r in read_rows(binary)[:40]:
        with bag_file(binary, r["slide_id"]) as fh:
            feats, images, coords, digits = (fh[k][()] for k in ("features", "images", "coords", "digits"))
        n = len(digits)
        assert feats.dtype == np.float32 and feats.shape == (n, 64)
        assert images.dtype == np.uint8 and images.shape == (n, 8, 8)
        assert np.array_equal(feats, images.reshape(n, 64).astype(np.float32) / np.float32(255))
        assert 0.0 <= feats.min() and feats.max() <= 1.0
        assert coords.shape == (n, 2) and len({tuple(c) for c in coords}) == n
        for img, d in zip(images, digits, strict=True):
            assert int(d) in lookup[img.tobytes()]


def test_lengths_are_heavy_tailed(binary):
    lengths = np.array(BagDataset(load_manifest(binary, binary.parent / "features").records).lengths())
    assert lengths.min() <= 3 and lengths.max() >= 10 * np.median(lengths)
    rng = np.random.default_rng(0)
    draws = np.array([demo.bag_length(rng) for _ in range(20_000)])
    assert draws.min() == 1 and draws.max() == demo.MAX_LENGTH
    assert 22 <= np.median(draws) <= 26
    assert draws.mean() > 1.4 * np.median(draws)  # right-skewed (log-normal: e^(sigma^2/2) = 1.65)


def test_cases_and_splits(binary):
    rows = read_rows(binary)
    per_case = {}
    for r in rows:
        per_case.setdefault(r["case_id"], set()).add(r["split"])
    sizes = [sum(r["case_id"] == c for r in rows) for c in per_case]
    assert set(sizes) == {1, 2} and 0.1 < sizes.count(2) / len(sizes) < 0.3
    assert all(len(s) == 1 for s in per_case.values())  # a case never straddles splits
    counts = {s: sum(r["split"] == s for r in rows) for s in ("train", "val", "test")}
    assert 0.5 < counts["train"] / len(rows) < 0.7 and counts["val"] > 20 and counts["test"] > 20
    for split in ("train", "val", "test"):  # stratified by label
        positives = [int(r["label"]) for r in rows if r["split"] == split]
        assert 0.4 < np.mean(positives) < 0.6


def test_small_demo_reaches_every_split_with_every_class(tmp_path):
    rows = read_rows(write_demo_data(tmp_path / "small", bags=10, seed=3))
    for split in ("train", "val", "test"):
        assert {r["label"] for r in rows if r["split"] == split} == {"0", "1"}
    with pytest.raises(ValueError, match="need at least 20 bags for 4 classes"):
        write_demo_data(tmp_path / "tiny", bags=19, classes=4)


def test_digit_pools_of_splits_are_disjoint():
    _, digits = demo.digit_images()
    pools = demo.partition_digits(digits, np.random.default_rng(0))
    seen = np.concatenate([p[k] for p in pools.values() for k in ("nine", "other")])
    assert len(seen) == len(set(seen.tolist())) == len(digits)
    assert all((digits[p["nine"]] == 9).all() and (digits[p["other"]] != 9).all() for p in pools.values())
    assert 0.55 < len(pools["train"]["nine"]) / (digits == 9).sum() < 0.65


def test_validates_and_is_reproducible(binary, tmp_path):
    m = load_manifest(binary, binary.parent / "features")
    assert m.classes == ["0", "1"] and len(validate_inputs(m)) == 200
    a = write_demo_data(tmp_path / "a", bags=20, seed=5)
    b = write_demo_data(tmp_path / "b", bags=20, seed=5)
    c = write_demo_data(tmp_path / "c", bags=20, seed=6)
    assert a.read_bytes() == b.read_bytes()
    with bag_file(a, "bag_00007") as fa, bag_file(b, "bag_00007") as fb:
        assert np.array_equal(fa["features"][()], fb["features"][()])
    assert a.read_bytes() != c.read_bytes()


def test_failure_leaves_nothing_half_done(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = demo.grid_coords

    def flaky(n):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full")
        return real(n)

    monkeypatch.setattr(demo, "grid_coords", flaky)
    with pytest.raises(OSError, match="disk full"):
        write_demo_data(tmp_path / "out", bags=10)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(demo, "grid_coords", real)
    first = write_demo_data(tmp_path / "out", bags=10, seed=1)
    before = first.read_bytes()
    calls["n"] = 0
    monkeypatch.setattr(demo, "grid_coords", flaky)
    with pytest.raises(OSError):
        write_demo_data(tmp_path / "out", bags=10, seed=2)
    assert first.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_foreign_directories_and_replaces_previous_demo(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a dpgs demo directory"):
        write_demo_data(tmp_path / "mine", bags=10)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    write_demo_data(tmp_path / "d", bags=30, seed=0)
    write_demo_data(tmp_path / "d", bags=10, seed=0)
    assert len(list((tmp_path / "d" / "features").iterdir())) == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "mine"]
    with pytest.raises(ValueError, match="classes must be 2 or 4"):
        write_demo_data(tmp_path / "e", classes=3)


def test_command(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    demo_cmd.add_parser(sub)
    args = parser.parse_args(
        ["demo-data", str(tmp_path / "x"), "--bags", "20", "--seed", "3", "--classes", "4"]
    )
    assert demo_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert "wrote 20 bags" in out and str(tmp_path / "x" / "manifest.csv") in out
    assert demo.read_summary(tmp_path / "x")["label_counts"] == {"0": 5, "1": 5, "2": 5, "3": 5}
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "z").write_text("")
    args = parser.parse_args(["demo-data", str(tmp_path / "y")])
    assert demo_cmd.run(args) == 2
    assert "not a dpgs demo directory" in capsys.readouterr().err


def test_command_tumour_contrast_is_for_slides(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    demo_cmd.add_parser(sub)
    args = parser.parse_args(["demo-data", str(tmp_path / "b"), "--tumour-contrast", "0.5"])
    assert demo_cmd.run(args) == 2
    assert "--tumour-contrast applies to --kind slides only" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    args = parser.parse_args(
        ["demo-data", str(tmp_path / "s"), "--kind", "slides", "--bags", "2", "--tumour-contrast", "1.5"]
    )
    assert demo_cmd.run(args) == 2
    assert "tumour_contrast must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
