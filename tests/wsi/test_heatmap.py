"""``dpgs heatmap``: scores equal ``instance_scores`` on independently read tiles, files and picture,
MLflow artifacts (run id and run directory), and usage errors naming the path."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image

from dpgs.cli import main
from dpgs.config import load_config, save_config
from dpgs.modeling import ModelSpec
from dpgs.tracking import RunTracker
from dpgs.wsi.reader import open_slide
from dpgs.wsi.tiles import TileBagDataset, TileBagItem
from dpgs.wsi.tiling import read_coords_h5
from tests.tile_helpers import write_tiled_slides

EXPERIMENT = "heatmaps-test"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Two tiled synthetic slides, a run directory with a saved TileMIL and its MLflow run."""
    root = tmp_path_factory.mktemp("heatmap")
    manifest, slides, tiles = write_tiled_slides(root, n_slides=2, size=(768, 512), level=1, levels=3)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    run_dir = root / "run"
    config = load_config(None, [
        f"experiment={EXPERIMENT}", "data.kind=tiles", f"data.manifest={manifest}",
        f"data.slides_dir={slides}", f"data.tiles_dir={tiles}", "model.encoder=resnet18", "model.name=abmil",
        f"train.output_dir={run_dir}", f"tracking.uri={uri}", "train.device=cpu",
    ])
    run_dir.mkdir()
    save_config(config, run_dir / "config.yaml")
    (run_dir / "classes.json").write_text(json.dumps(["benign", "tumour"]))
    torch.manual_seed(3)
    model = ModelSpec(config.model, None, 2).build()
    torch.save(model.state_dict(), run_dir / "best.pt")
    MlflowClient(uri).create_experiment(EXPERIMENT, artifact_location=(root / "artifacts").as_uri())
    tracker = RunTracker.start(uri, EXPERIMENT, "fake-training")
    tracker.log_params({"train.output_dir": str(run_dir)})
    tracker.end()
    return SimpleNamespace(root=root, slides=slides, tiles=tiles, uri=uri, run_dir=run_dir,
                           run_id=tracker.run_id, model=model.eval())


def heatmap(*args) -> int:
    return main(["heatmap", *map(str, args)])


def read_heatmap(path):
    with h5py.File(path, "r") as fh:
        return fh["coords"][()], fh["scores"][()], dict(fh.attrs)


def artifacts(env) -> set[str]:
    return {a.path for a in MlflowClient(env.uri).list_artifacts(env.run_id, "heatmaps")}


def test_scores_files_picture_and_artifacts_by_run_id(env, capsys):
    slide = env.slides / "slide_001.tif"
    assert heatmap("--run", env.run_id, "--tracking-uri", env.uri, "--slide", slide, "--batch-size", 5) == 0
    assert f"logged to MLflow run {env.run_id}" in capsys.readouterr().out
    out = env.run_dir / "heatmaps"
    coords, scores, attrs = read_heatmap(out / "slide_001_heatmap.h5")
    coords_path = env.tiles / "patches" / "slide_001.h5"
    source, source_attrs = read_coords_h5(coords_path)
    np.testing.assert_array_equal(coords, source)
    bag = TileBagDataset([TileBagItem("slide_001", slide, coords_path, 1)], tiles_per_bag=None).read(0)
    with torch.no_grad():
        expected = env.model.instance_scores(bag.tiles).numpy()
        probs = torch.softmax(env.model(bag.tiles), -1).numpy()
    assert scores.shape == (len(source),) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(attrs["probabilities"], probs, rtol=1e-5, atol=1e-6)
    assert attrs["predicted_class"] == ["benign", "tumour"][int(np.argmax(probs))]
    assert json.loads(attrs["classes"]) == ["benign", "tumour"] and attrs["run_id"] == env.run_id
    for key in ("patch_size_level0", "patch_size", "patch_level", "downsample"):
        assert attrs[key] == source_attrs[key]
    with open_slide(slide) as s:
        thumb = s.thumbnail(1024)
    png = Image.open(out / "slide_001_heatmap.png")
    assert png.size == (thumb.shape[1], thumb.shape[0]) and png.mode == "RGB"
    picture = np.asarray(png)
    x, y = (coords[np.argmax(scores)] + attrs["patch_size_level0"] // 2) * thumb.shape[1] // 768
    assert not np.array_equal(picture[y, x], thumb[y, x])  # the tile is coloured
    assert np.array_equal(picture[2, 2], thumb[2, 2])  # the background is not
    assert artifacts(env) >= {"heatmaps/slide_001_heatmap.h5", "heatmaps/slide_001_heatmap.png"}


def test_run_dir_finds_its_mlflow_run(env, tmp_path, capsys):
    out = tmp_path / "maps"
    coords = env.tiles / "patches" / "slide_000.h5"
    slide = env.slides / "slide_000.tif"
    args = ("--slide", slide, "--coords", coords, "--out", out, "--thumbnail-size", 200)
    assert heatmap("--run", env.run_dir, *args) == 0  # tracking URI from the run's config
    assert f"logged to MLflow run {env.run_id}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["slide_000_heatmap.h5", "slide_000_heatmap.png"]
    assert max(Image.open(out / "slide_000_heatmap.png").size) == 200
    assert artifacts(env) >= {"heatmaps/slide_000_heatmap.h5", "heatmaps/slide_000_heatmap.png"}
    elsewhere = tmp_path / "copied_run"
    shutil.copytree(env.run_dir, elsewhere, ignore=shutil.ignore_patterns("heatmaps"))
    assert heatmap("--run", elsewhere, *args) == 0
    assert f"no MLflow run found for {elsewhere}" in capsys.readouterr().out


def test_usage_errors_name_the_path(env, tmp_path, capsys):
    slide = env.slides / "slide_000.tif"
    missing = tmp_path / "no_such_run"
    assert heatmap("--run", missing, "--slide", slide) == 2
    assert f"run directory {missing} not found" in capsys.readouterr().err
    assert heatmap("--run", "0" * 32, "--tracking-uri", env.uri, "--slide", slide) == 2
    assert f"--run {'0' * 32}: neither a run directory nor an MLflow run id" in capsys.readouterr().err
    untiled = tmp_path / "untiled.tif"
    shutil.copy(slide, untiled)
    assert heatmap("--run", env.run_dir, "--slide", untiled) == 2
    assert f"{untiled}: no coords file for slide 'untiled' in {env.tiles}" in capsys.readouterr().err
    assert heatmap("--run", env.run_dir, "--slide", tmp_path / "nope.tif") == 2
    assert f"--slide {tmp_path / 'nope.tif'}: slide file not found" in capsys.readouterr().err
    wrong = tmp_path / "wrong_run"
    shutil.copytree(env.run_dir, wrong, ignore=shutil.ignore_patterns("heatmaps"))
    state = torch.load(wrong / "best.pt", weights_only=True)
    del state["head.classifier.weight"]
    torch.save(state, wrong / "best.pt")
    assert heatmap("--run", wrong, "--slide", slide) == 2
    assert f"{wrong / 'best.pt'}: does not match the run's model" in capsys.readouterr().err
