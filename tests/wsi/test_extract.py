"""``dpgs extract``: features equal the encoder on independently read tiles, coords and attributes
round-trip, the output trains as feature bags, resume, failures, interruption, ``--run`` weights."""

from __future__ import annotations

import csv
import json
import shutil
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from dpgs.cli import main
from dpgs.config import load_config, save_config
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.models import build_head
from dpgs.models.tilemil import TileMIL
from dpgs.wsi.features import (
    ExtractSettings,
    build_extraction_encoder,
    encoder_digest,
    extract_directory,
    is_finished,
)
from dpgs.wsi.tiles import TileBagDataset, TileLayout
from dpgs.wsi.tiling import read_coords_h5
from tests.tile_helpers import write_tiled_slides

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    """Two synthetic slides tiled at 32 px of level 1, and a trained-looking run directory."""
    root = tmp_path_factory.mktemp("extract")
    manifest, slides, tiles = write_tiled_slides(root, n_slides=2, size=(768, 512), level=1, levels=3)
    return SimpleNamespace(root=root, manifest=manifest, slides=slides, tiles=tiles,
                           run_dir=write_run(root / "run", manifest, slides, tiles))


def write_run(run_dir, manifest, slides, tiles):
    """A run directory (config.yaml, classes.json, best.pt) whose encoder differs from the random init."""
    config = load_config(None, ["data.kind=tiles", f"data.manifest={manifest}", f"data.slides_dir={slides}",
                                f"data.tiles_dir={tiles}", "model.encoder=resnet18", "model.name=abmil",
                                f"train.output_dir={run_dir}"])
    run_dir.mkdir()
    save_config(config, run_dir / "config.yaml")
    (run_dir / "classes.json").write_text(json.dumps(["0", "1"]))
    torch.manual_seed(7)
    model = ModelSpec(config.model, None, 2).build()
    for m in model.encoder.modules():
        if isinstance(m, torch.nn.BatchNorm2d):  # "trained" running statistics
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    torch.save(model.state_dict(), run_dir / "best.pt")
    return run_dir


def extract(*args) -> int:
    return main(["extract", *map(str, args), "--no-progress"])


def read_features(path):
    with h5py.File(path, "r") as fh:
        return (fh["features"][()], fh["coords"][()], dict(fh["coords"].attrs), dict(fh.attrs))


def all_tiles(tiled):
    """Normalised tiles [N, 3, 32, 32] of every slide, read by the tile-bag dataset (not by extract)."""
    with open(tiled.manifest, newline="") as fh:
        records = [SimpleNamespace(slide_id=r["slide_id"], label=int(r["label"])) for r in csv.DictReader(fh)]
    ds = TileBagDataset.from_records(records, tiled.slides, tiled.tiles, tiles_per_bag=None)
    return {ds.items[i].slide_id: ds.read(i).tiles for i in range(len(ds))}


@pytest.fixture(scope="module")
def random_features(tiled):
    """Features of the random-init ResNet-18 (batches of 7 tiles) and the independently read tiles."""
    out = tiled.root / "random"
    assert extract("--encoder", "resnet18", "--batch-size", 7, tiled.slides, tiled.tiles, out) == 0
    return out, all_tiles(tiled)


def test_features_equal_the_encoder_on_the_same_tiles(tiled, random_features):
    out, tiles = random_features
    head = build_head("abmil", in_dim=512, num_classes=2)
    model = TileMIL(build_extraction_encoder("resnet18"), head).eval()
    assert sorted(p.name for p in out.iterdir()) == [f"{sid}.h5" for sid in sorted(tiles)]
    for sid, x in tiles.items():
        feats, coords, coords_attrs, attrs = read_features(out / f"{sid}.h5")
        assert feats.dtype == np.float32 and feats.shape == (len(x), 512)
        assert coords.dtype == np.int64
        with torch.no_grad():
            np.testing.assert_allclose(feats, model.embed(x).numpy(), rtol=ATOL, atol=ATOL)
        source, source_attrs = read_coords_h5(tiled.tiles / "patches" / f"{sid}.h5")
        np.testing.assert_array_equal(coords, source)
        for key in ("patch_size", "patch_level", "downsample", "patch_size_level0"):
            assert coords_attrs[key] == source_attrs[key]
        assert attrs["encoder"] == "resnet18" and attrs["tile_size"] == 32


def test_output_is_a_features_dir_for_training(tiled, random_features):
    out, _ = random_features
    config = load_config(None, ["data.kind=features", f"data.manifest={tiled.manifest}",
                                f"data.features_dir={out}", "model.name=abmil"])
    data = load_experiment_data(config.data, with_splits=False)
    assert data.dataset.feature_dim == 512 and len(data.dataset) == 2
    head = ModelSpec(config.model, data.dataset.feature_dim, 2).build()
    bag = data.dataset[0]
    head.loss(bag.features, torch.tensor(bag.label))["loss"].backward()
    assert bag.coords is not None and bag.coords.shape == (bag.features.shape[0], 2)


def test_second_run_skips_and_other_settings_redo(tiled, random_features, capsys):
    out, _ = random_features
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert extract("--encoder", "resnet18", tiled.slides, tiled.tiles, out) == 0
    assert "0 extracted, 2 already done, 0 failed" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    redo = tiled.root / "redo"
    shutil.copytree(out, redo)
    assert extract("--encoder", "resnet18", "--tile-size", 24, tiled.slides, tiled.tiles, redo) == 0
    assert "2 extracted, 0 already done" in capsys.readouterr().out
    assert read_features(redo / "slide_000.h5")[3]["tile_size"] == 24


def test_bad_slide_and_bad_coords_are_reported_and_others_written(tiled, tmp_path, capsys):
    slides, tiles = tmp_path / "slides", tmp_path / "tiles"
    (tiles / "patches").mkdir(parents=True)
    slides.mkdir()
    good = tiled.tiles / "patches" / "slide_000.h5"
    shutil.copy(tiled.slides / "slide_000.tif", slides)
    shutil.copy(good, tiles / "patches")
    (slides / "broken.tif").write_bytes(b"not a tiff at all")
    shutil.copy(good, tiles / "patches" / "broken.h5")
    shutil.copy(tiled.slides / "slide_001.tif", slides / "badcoords.tif")
    (tiles / "patches" / "badcoords.h5").write_bytes(b"garbage")
    shutil.copy(tiled.slides / "slide_001.tif", slides / "untiled.tif")
    out = tmp_path / "out"
    assert extract("--encoder", "resnet18", slides, tiles, out) == 1
    printed = capsys.readouterr().out
    assert "1 extracted, 0 already done, 2 failed, 1 without coords file" in printed
    assert f"FAILED broken: cannot read slide {slides / 'broken.tif'}" in printed
    assert f"FAILED badcoords: {tiles / 'patches' / 'badcoords.h5'}" in printed
    assert sorted(p.name for p in out.iterdir()) == ["slide_000.h5"]


def test_an_interrupted_run_leaves_no_file(tiled, tmp_path, monkeypatch):
    import dpgs.wsi.features as features

    encoder = build_extraction_encoder("resnet18")
    settings = ExtractSettings("resnet18", encoder_digest(encoder), "random", batch_size=4)
    real, calls = features.embed_tiles, []

    def stop_on_second_batch(enc, tiles):
        calls.append(len(tiles))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(enc, tiles)

    monkeypatch.setattr(features, "embed_tiles", stop_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        extract_directory(tiled.slides, tiled.tiles, tmp_path / "out", encoder, settings, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_run_weights_are_used(tiled, random_features, tmp_path):
    out = tmp_path / "trained"
    assert extract("--run", tiled.run_dir, "--batch-size", 64, tiled.slides, tiled.tiles, out) == 0
    encoder = build_extraction_encoder("resnet18", weights=tiled.run_dir / "best.pt")
    state = torch.load(tiled.run_dir / "best.pt", weights_only=True)
    torch.testing.assert_close(encoder.bn1.running_mean, state["encoder.bn1.running_mean"])
    tiles = random_features[1]
    for sid, x in tiles.items():
        feats, _, _, attrs = read_features(out / f"{sid}.h5")
        with torch.no_grad():
            np.testing.assert_allclose(feats, encoder(x).numpy(), rtol=ATOL, atol=ATOL)
        random = read_features(random_features[0] / f"{sid}.h5")[0]
        assert np.abs(feats - random).max() > 1e-2
        assert attrs["encoder_sha256"] == encoder_digest(encoder)
        assert str(tiled.run_dir.resolve()) in attrs["weights"]
    # files of another encoder are not taken for this one's: the weights' digest is in the resume key
    settings = ExtractSettings("resnet18", encoder_digest(encoder), "run")
    layout = TileLayout.from_h5(tiled.tiles / "patches" / "slide_000.h5")
    assert is_finished(out / "slide_000.h5", settings, layout)
    assert not is_finished(random_features[0] / "slide_000.h5", settings, layout)


def test_usage_errors_name_the_path(tiled, tmp_path, capsys):
    args = (tiled.slides, tiled.tiles, tmp_path / "out")
    missing = tmp_path / "no_such_run"
    assert extract("--run", missing, *args) == 2
    assert f"run directory {missing} not found" in capsys.readouterr().err
    assert extract(*args) == 2
    assert "give --encoder" in capsys.readouterr().err
    assert extract("--run", tiled.run_dir, "--encoder", "resnet50", *args) == 2
    assert "does not match the run's model.encoder resnet18" in capsys.readouterr().err
    weights = tmp_path / "wrong.pth"
    state = build_extraction_encoder("resnet18").state_dict()
    state["conv1.weight"] = torch.zeros(64, 3, 3, 3)
    torch.save(state, weights)
    assert extract("--encoder", "resnet18", "--weights", weights, *args) == 2
    assert f"--weights: {weights} does not fit the encoder" in capsys.readouterr().err
    assert extract("--encoder", "resnet50", "--weights", weights, *args) == 2
    assert f"{weights} does not fit the encoder: missing" in capsys.readouterr().err
    empty = tmp_path / "empty_tiles"
    empty.mkdir()
    assert extract("--encoder", "resnet18", tiled.slides, empty, tmp_path / "out") == 2
    assert f"has a coords file under {empty}" in capsys.readouterr().err
    assert extract("--encoder", "resnet18", tiled.slides, tmp_path / "nope", tmp_path / "out") == 2
    assert f"tiles directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
