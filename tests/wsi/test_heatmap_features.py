"""``dpgs heatmap`` for runs trained on feature bags: scores equal the head's on the file's features, the
patch footprint from the coords' attributes (or the slide, or the grid), thumbnail and blank canvases,
MLflow artifacts, and usage errors."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image

from dpgs.cli import main
from dpgs.config import load_config, save_config
from dpgs.models import build_head
from dpgs.tracking import RunTracker
from dpgs.wsi.heatmap import FeatureBag, footprint_level0
from dpgs.wsi.reader import open_slide
from dpgs.wsi.tiling import read_coords_h5
from tests.tile_helpers import write_tiled_slides

EXPERIMENT = "feature-heatmaps"
DIM = 16


def write_feature_file(path, coords, attrs, seed):
    features = np.random.default_rng(seed).standard_normal((len(coords), DIM)).astype(np.float32)
    with h5py.File(path, "w") as fh:
        fh.create_dataset("features", data=features)
        fh.create_dataset("coords", data=coords).attrs.update(attrs)
    return features


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Two tiled synthetic slides, TRIDENT-style feature files of their tiles (coords attributes kept), a
    run directory with a saved ABMIL head over them and its MLflow run."""
    root = tmp_path_factory.mktemp("feature-heatmap")
    _, slides, tiles = write_tiled_slides(root, n_slides=2, size=(768, 512), level=1, levels=3)
    features_dir = root / "features"
    features_dir.mkdir()
    feats = {}
    for i, sid in enumerate(("slide_000", "slide_001")):
        coords, attrs = read_coords_h5(tiles / "patches" / f"{sid}.h5")
        feats[sid] = write_feature_file(features_dir / f"{sid}.h5", coords, attrs, seed=i)
        feats[f"{sid}-coords"] = coords
    manifest = root / "manifest.csv"
    with manifest.open("w", newline="") as fh:
        csv.writer(fh).writerows([["slide_id", "label", "split"], ["slide_000", "a", "train"],
                                  ["slide_001", "b", "test"]])
    uri = f"sqlite:///{root / 'mlflow.db'}"
    run_dir = root / "run"
    config = load_config(None, [f"experiment={EXPERIMENT}", f"data.manifest={manifest}",
                                f"data.features_dir={features_dir}", "model.name=abmil",
                                f"train.output_dir={run_dir}", f"tracking.uri={uri}", "train.device=cpu"])
    run_dir.mkdir()
    save_config(config, run_dir / "config.yaml")
    (run_dir / "classes.json").write_text(json.dumps(["a", "b"]))
    torch.manual_seed(4)
    head = build_head("abmil", in_dim=DIM, num_classes=2).eval()
    torch.save(head.state_dict(), run_dir / "best.pt")
    MlflowClient(uri).create_experiment(EXPERIMENT, artifact_location=(root / "artifacts").as_uri())
    tracker = RunTracker.start(uri, EXPERIMENT, "fake-training")
    tracker.log_params({"train.output_dir": str(run_dir)})
    tracker.end()
    return SimpleNamespace(root=root, slides=slides, features_dir=features_dir, feats=feats, uri=uri,
                           run_dir=run_dir, run_id=tracker.run_id, head=head)


def heatmap(*args) -> int:
    return main(["heatmap", *map(str, args)])


def read_heatmap(path):
    with h5py.File(path, "r") as fh:
        return fh["coords"][()], fh["scores"][()], dict(fh.attrs)


def expected_scores(env, sid):
    x = torch.from_numpy(env.feats[sid])
    with torch.no_grad():
        return env.head.instance_scores(x).numpy(), torch.softmax(env.head(x).double(), -1).numpy()


def test_scores_on_the_slide_thumbnail_and_artifacts(env, capsys):
    slide = env.slides / "slide_000.tif"
    assert heatmap("--run", env.run_id, "--tracking-uri", env.uri, "--slide", slide) == 0
    assert f"logged to MLflow run {env.run_id}" in capsys.readouterr().out
    out = env.run_dir / "heatmaps"
    coords, scores, attrs = read_heatmap(out / "slide_000_heatmap.h5")
    np.testing.assert_array_equal(coords, env.feats["slide_000-coords"])
    expected, probs = expected_scores(env, "slide_000")
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(attrs["probabilities"], probs, rtol=1e-6)
    assert attrs["canvas"] == "thumbnail" and attrs["patch_size_level0"] == 64
    assert attrs["features_path"] == str(env.features_dir / "slide_000.h5") and attrs["encoder"] == ""
    with open_slide(slide) as s:
        thumb = s.thumbnail(1024)
    picture = np.asarray(Image.open(out / "slide_000_heatmap.png"))
    assert picture.shape == thumb.shape
    x, y = coords[np.argmax(scores)] + 32  # centre of the top-scoring patch (thumbnail = level 0 here)
    assert not np.array_equal(picture[y, x], thumb[y, x]) and np.array_equal(picture[2, 2], thumb[2, 2])
    logged = {a.path for a in MlflowClient(env.uri).list_artifacts(env.run_id, "heatmaps")}
    assert logged >= {"heatmaps/slide_000_heatmap.h5", "heatmaps/slide_000_heatmap.png"}


def test_blank_canvas_without_a_slide(env, tmp_path):
    out = tmp_path / "maps"
    assert heatmap("--run", env.run_dir, "--features", env.features_dir / "slide_001.h5", "--out", out,
                   "--thumbnail-size", 320) == 0
    coords, scores, attrs = read_heatmap(out / "slide_001_heatmap.h5")
    assert attrs["canvas"] == "blank" and attrs["slide_path"] == ""
    np.testing.assert_allclose(scores, expected_scores(env, "slide_001")[0], rtol=1e-5, atol=1e-7)
    picture = np.asarray(Image.open(out / "slide_001_heatmap.png"))
    w0, h0 = coords.max(axis=0) + 64  # the patches' extent from the origin
    scale = 320 / max(w0, h0)
    assert picture.shape == (round(h0 * scale), round(w0 * scale), 3)
    x, y = ((coords[0] + 32) * scale).astype(int)
    assert not np.array_equal(picture[y, x], [255, 255, 255])  # a patch is coloured
    assert np.array_equal(picture[picture.shape[0] - 1, 0], [255, 255, 255])  # outside the patches: blank


def test_patch_footprint_from_attributes_slide_or_grid(tmp_path):
    coords = np.array([[0, 0], [96, 0], [48, 144]], dtype=np.int64)

    def bag(**attrs):
        return FeatureBag(tmp_path / "x.h5", torch.zeros(3, 2), coords, attrs)

    assert footprint_level0(bag(patch_size_level0=100, patch_size=50, downsample=4.0), None) == 100
    assert footprint_level0(bag(patch_size=50, downsample=[4.0, 4.0]), None) == 200  # CLAM attributes
    assert footprint_level0(bag(patch_size=50, patch_level=1), (1.0, 2.0)) == 100  # the slide's downsample
    assert footprint_level0(bag(patch_size=50, patch_level=0), None) == 50
    assert footprint_level0(bag(), None) == 48  # grid step: gaps 48 (x) and 144 (y)
    assert footprint_level0(bag(patch_size_level0=100), None, given=30) == 30
    with pytest.raises(ValueError, match="patches at level 2, the slide has 2"):
        footprint_level0(bag(patch_size=50, patch_level=2), (1.0, 2.0))


def test_usage_errors_name_the_problem(env, tmp_path, capsys):
    assert heatmap("--run", env.run_dir, "--slide-id", "slide_000", "--coords", tmp_path / "c.h5") == 2
    assert "--coords: the run was trained on feature bags" in capsys.readouterr().err
    assert heatmap("--run", env.run_dir) == 2
    assert "needs --features H5, --slide PATH or --slide-id ID" in capsys.readouterr().err
    assert heatmap("--run", env.run_dir, "--slide-id", "nope") == 2
    assert "slide 'nope': no feature file" in capsys.readouterr().err
    no_coords = tmp_path / "plain.h5"
    with h5py.File(no_coords, "w") as fh:
        fh.create_dataset("features", data=np.zeros((3, DIM), np.float32))
    assert heatmap("--run", env.run_dir, "--features", no_coords) == 2
    assert f"{no_coords}: no 'coords' dataset" in capsys.readouterr().err
    torch.save(torch.zeros(3, DIM), tmp_path / "bag.pt")
    assert heatmap("--run", env.run_dir, "--features", tmp_path / "bag.pt") == 2
    assert "carry no patch coordinates" in capsys.readouterr().err
