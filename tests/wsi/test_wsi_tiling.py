"""Tiling: geometry, tissue rules on a hand-made slide, coords files, reports, resuming, the CLI."""

from __future__ import annotations

import argparse
import csv
import json

import h5py
import numpy as np
import pytest

from dpgs.wsi import tissue as T
from dpgs.wsi.reader import Slide
from dpgs.wsi.synthetic import write_pyramid_tiff
from dpgs.wsi.tiling import (
    TilingParams,
    choose_geometry,
    grid_coords,
    read_coords_h5,
    tile_directory,
    tile_slide,
)

TILE = 128
PINK = (200, 120, 170)  # grey 149.6, saturated
WHITE = (245, 245, 245)


def handmade_image() -> np.ndarray:
    """1024 x 1024, 8 x 8 tiles of 128 px; tissue is placed tile by tile (see the expected sets)."""
    img = np.empty((1024, 1024, 3), np.uint8)
    img[:] = WHITE

    def tile(col, row):
        return img[row * TILE : (row + 1) * TILE, col * TILE : (col + 1) * TILE]

    img[128:384, 128:512] = PINK  # tiles (1..3, 1..2): full tissue
    tile(6, 1)[:, :96] = PINK  # 75% tissue: kept at 0.6
    tile(6, 3)[:, :64] = PINK  # 50% tissue: dropped
    tile(1, 5)[:] = 0  # black: grey 0 < 3
    tile(2, 5)[:] = 229  # grey 229 <= 230: foreground for the grey rule, unsaturated for Otsu
    tile(3, 5)[:] = 231  # grey 231 > 230
    tile(4, 5)[:] = 4  # grey 4 >= 3
    tile(5, 5)[:] = 2  # grey 2 < 3
    return img


FULL = {(c, r) for c in (1, 2, 3) for r in (1, 2)}
GREY_KEPT = FULL | {(6, 1), (2, 5), (4, 5)}
OTSU_KEPT = FULL | {(6, 1)}


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    root = tmp_path_factory.mktemp("slides")
    write_pyramid_tiff(root / "hand.tif", handmade_image(), levels=3, tile=256, objective_power=20, mpp=0.5)
    rng = np.random.default_rng(1)
    other = np.full((512, 768, 3), 245, np.uint8)
    other[:, 256:512] = rng.integers(60, 200, size=(512, 256, 3), dtype=np.uint8)  # tiles (1, 0), (1, 1)
    write_pyramid_tiff(root / "other.svs", other, levels=2, tile=256, objective_power=40, mpp=0.25)
    (root / "broken.tif").write_bytes(np.random.default_rng(2).bytes(4096))
    (root / "notes.txt").write_text("not a slide")
    return root


def kept_tiles(coords: np.ndarray, size0: int) -> set[tuple[int, int]]:
    return {(int(x) // size0, int(y) // size0) for x, y in coords}


@pytest.mark.parametrize(("method", "expected"), [("grey", GREY_KEPT), ("otsu", OTSU_KEPT)])
def test_tissue_rules_keep_exactly_the_known_tiles(slides, method, expected):
    params = TilingParams(tile_size=TILE, magnification=20, tissue=method, thumbnail_size=256)
    result = tile_slide(slides / "hand.tif", params)
    assert result.grid_tiles == 64
    assert kept_tiles(result.coords, TILE) == expected
    if method == "grey":
        frac = dict(zip(map(tuple, result.coords // TILE), result.fractions, strict=True))
        assert frac[(6, 1)] == pytest.approx(0.75)
        assert frac[(1, 1)] == 1.0


def test_min_tissue_threshold_is_inclusive(slides):
    params = TilingParams(tile_size=TILE, level=0, min_tissue=0.5)
    assert (6, 3) in kept_tiles(tile_slide(slides / "hand.tif", params).coords, TILE)
    params = TilingParams(tile_size=TILE, level=0, min_tissue=0.0)
    assert len(tile_slide(slides / "hand.tif", params).coords) == 64


def test_tiling_at_a_coarser_level(slides):
    # level 1 (downsample 2): 64 px tiles of level 1 cover 128 px of level 0 -> same grid and tiles
    result = tile_slide(slides / "hand.tif", TilingParams(tile_size=64, level=1))
    assert result.geometry.patch_size_level0 == 128 and result.geometry.patch_level == 1
    assert kept_tiles(result.coords, 128) == GREY_KEPT


def test_grey_rule_and_otsu_threshold_units():
    rgb = np.array([[[2, 2, 2], [3, 3, 3], [229, 229, 229], [231, 231, 231], *[PINK] * 4]], np.uint8)
    assert T.grey_foreground(rgb).tolist() == [[False, True, True, False, True, True, True, True]]
    assert T.grey_tissue_fraction(rgb) == pytest.approx(6 / 8)
    values = np.array([10] * 30 + [11] * 10 + [200] * 50 + [201] * 10, np.uint8)
    t = T.otsu_threshold(values)
    assert 11 <= t < 200
    # brute force: the threshold maximises the between-class variance
    best = max(range(255), key=lambda s: _between(values, s))
    assert _between(values, t) == pytest.approx(_between(values, best))
    assert T.otsu_threshold(np.full(10, 7, np.uint8)) == 7


def _between(v, t):
    lo, hi = v[v <= t].astype(float), v[v > t].astype(float)
    if len(lo) == 0 or len(hi) == 0:
        return -1.0
    return len(lo) * len(hi) / len(v) ** 2 * (lo.mean() - hi.mean()) ** 2


def test_median_filter_matches_numpy_reference():
    img = np.random.default_rng(0).integers(0, 256, size=(9, 11), dtype=np.uint8)
    out = T.median_filter(img, 3)
    padded = np.pad(img, 1, mode="edge")
    ref = np.array([[np.median(padded[y : y + 3, x : x + 3]) for x in range(11)] for y in range(9)])
    np.testing.assert_array_equal(out, ref.astype(np.uint8))


def fake_slide(dims, downsamples, power=None, mpp=None):
    return Slide("fake.svs", dims, downsamples, power, mpp)


@pytest.mark.parametrize(
    ("mag", "level", "read", "size0"),
    [(40, 0, 256, 256), (20, 1, 256, 512), (10, 2, 256, 1024), (5, 2, 512, 2048), (30, 0, 341, 341)],
)
def test_magnification_selects_level(mag, level, read, size0):
    slide = fake_slide([(40000, 30000), (20000, 15000), (10000, 7500)], [1.0, 2.0, 4.0], power=40)
    g = choose_geometry(slide, 256, magnification=mag)
    assert (g.patch_level, g.read_size, g.patch_size_level0) == (level, read, size0)
    assert g.downsample == pytest.approx(40 / mag)


def test_magnification_tolerates_scanner_downsamples_and_uses_mpp():
    slide = fake_slide([(40000, 30000), (9999, 7499)], [1.0, 4.0003], mpp=0.25)  # 10 / 0.25 = 40x
    g = choose_geometry(slide, 256, magnification=10)
    assert (g.patch_level, g.read_size, g.patch_size_level0) == (1, 256, 1024)
    assert g.level0_magnification == 40


def test_magnification_errors_name_the_slide():
    slide = fake_slide([(1000, 1000)], [1.0], power=20)
    with pytest.raises(ValueError, match=r"fake\.svs: scanned at 20x, cannot tile at 40x"):
        choose_geometry(slide, 256, magnification=40)
    with pytest.raises(ValueError, match=r"fake\.svs: no objective power or mpp.*--level"):
        choose_geometry(fake_slide([(1000, 1000)], [1.0]), 256, magnification=20)
    with pytest.raises(ValueError, match=r"fake\.svs: level 2 does not exist"):
        choose_geometry(slide, 256, level=2)
    g = choose_geometry(fake_slide([(1000, 1000), (500, 500)], [1.0, 2.0]), 100, level=1)
    assert (g.patch_level, g.read_size, g.patch_size_level0, g.target_magnification) == (1, 100, 200, None)


def test_grid_coords_row_major_full_tiles():
    c = grid_coords((300, 250), 100)
    assert c.tolist() == [[0, 0], [100, 0], [200, 0], [0, 100], [100, 100], [200, 100]]


def test_directory_run_report_roundtrip_and_resume(slides, tmp_path):
    out = tmp_path / "tiles"
    params = TilingParams(tile_size=TILE, magnification=20)
    report = tile_directory(slides, out, params, progress=False)
    status = {o.slide_id: o.status for o in report.outcomes}
    assert status == {"hand": "tiled", "other": "tiled", "broken": "failed"}
    (bad,) = report.failed
    assert "broken.tif" in bad.error and "cannot read slide" in bad.error

    with open(report.report_path) as fh:
        rows = {r["slide_id"]: r for r in csv.DictReader(fh)}
    assert rows["broken"]["status"] == "failed" and "broken.tif" in rows["broken"]["error"]
    assert rows["hand"]["tiles"] == str(len(GREY_KEPT)) and rows["hand"]["grid_tiles"] == "64"

    coords, attrs = read_coords_h5(out / "patches" / "hand.h5")
    assert coords.dtype == np.int64 and kept_tiles(coords, TILE) == GREY_KEPT
    expected = {"patch_size": 128, "patch_level": 0, "downsample": 1.0, "patch_size_level0": 128}
    assert {k: attrs[k] for k in expected} == expected
    assert attrs["read_size"] == 128 and attrs["name"] == "hand" and attrs["level0_magnification"] == 20
    assert attrs["level0_dim"].tolist() == [1024, 1024]
    # the 40x slide at 20x: 128 px tiles of level 1 (downsample 2) cover 256 level-0 px
    c2, a2 = read_coords_h5(out / "patches" / "other.h5")
    assert (a2["patch_level"], a2["downsample"], a2["patch_size_level0"]) == (1, 2.0, 256)
    assert kept_tiles(c2, 256) == {(1, 0), (1, 1)}
    with h5py.File(out / "patches" / "hand.h5", "r") as fh:
        assert json.loads(fh.attrs["dpgs_settings"]) == params.settings()
        assert fh["tissue_fraction"].shape == (len(coords),)

    thumb = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(out / "thumbnails" / "hand.png"))
    assert thumb.shape == (1024, 1024, 3)
    assert tuple(thumb[128, 200]) == (0, 160, 0)  # top edge of the kept tile (1, 1)
    assert tuple(thumb[200, 200]) == PINK  # its inside is untouched
    assert not (thumb[900:1000, 900:1000] == (0, 160, 0)).all(axis=-1).any()  # no outline on background

    mtime = (out / "patches" / "hand.h5").stat().st_mtime_ns
    again = tile_directory(slides, out, params, progress=False)
    assert {o.slide_id: o.status for o in again.outcomes} == {
        "hand": "skipped",
        "other": "skipped",
        "broken": "failed",
    }
    assert (out / "patches" / "hand.h5").stat().st_mtime_ns == mtime
    assert {o.slide_id: o.tiles for o in again.outcomes}["hand"] == len(GREY_KEPT)

    changed = tile_directory(
        slides, out, TilingParams(tile_size=TILE, level=0, tissue="otsu"), progress=False
    )
    assert {o.slide_id: o.status for o in changed.outcomes}["hand"] == "tiled"
    assert kept_tiles(read_coords_h5(out / "patches" / "hand.h5")[0], TILE) == OTSU_KEPT


def test_parallel_workers_match_serial(slides, tmp_path):
    params = TilingParams(tile_size=TILE, magnification=20)
    serial = tile_directory(slides, tmp_path / "a", params, progress=False)
    parallel = tile_directory(slides, tmp_path / "b", params, workers=2, progress=False)
    assert [(o.slide_id, o.status, o.tiles) for o in serial.outcomes] == [
        (o.slide_id, o.status, o.tiles) for o in parallel.outcomes
    ]
    for sid in ("hand", "other"):
        a, _ = read_coords_h5(tmp_path / "a" / "patches" / f"{sid}.h5")
        b, _ = read_coords_h5(tmp_path / "b" / "patches" / f"{sid}.h5")
        np.testing.assert_array_equal(a, b)


def test_cli_tile(slides, tmp_path, capsys):
    from dpgs.commands import tile

    parser = argparse.ArgumentParser()
    tile.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["tile", str(slides), str(tmp_path / "o"), "--tile-size", "128", "--no-progress"]
    )
    assert tile.run(args) == 1  # one slide failed
    out = capsys.readouterr().out
    assert "3 slides: 2 tiled, 0 already done, 1 failed" in out and "FAILED broken" in out
    args = parser.parse_args(
        ["tile", str(slides), str(tmp_path / "o"), "--tile-size", "128", "--no-progress"]
    )
    assert tile.run(args) == 1
    assert "0 tiled, 2 already done, 1 failed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["tile", "a", "b", "--level", "1", "--magnification", "20"])
    args = parser.parse_args(["tile", str(tmp_path / "none"), str(tmp_path / "o2")])
    assert tile.run(args) == 2
    assert "does not exist" in capsys.readouterr().err


def test_params_validation():
    with pytest.raises(ValueError, match="magnification or level, not both"):
        TilingParams(magnification=20, level=1)
    assert TilingParams().magnification == 20.0 and TilingParams(level=2).magnification is None
    with pytest.raises(ValueError, match="tissue method"):
        TilingParams(tissue="li")
    with pytest.raises(ValueError, match="min_tissue"):
        TilingParams(min_tissue=1.5)
