"""Synthetic slides: readable pyramids with metadata, a manifest, tumour texture only on positives."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from dpgs.wsi.reader import open_slide
from dpgs.wsi.synthetic import (
    NUCLEUS_RGB,
    TUMOUR_NUCLEUS_SCALE,
    TUMOUR_NUCLEUS_THRESHOLD,
    read_summary,
    render_slide,
    tumour_nuclei_texture,
    write_synthetic_slides,
)
from dpgs.wsi.tiling import TilingParams, tile_directory


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "slides_demo"
    return write_synthetic_slides(out, n_slides=6, seed=1, size=(512, 384))


def test_manifest_and_files(demo):
    with open(demo) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["slide_id"] for r in rows] == [f"slide_{i:03d}" for i in range(6)]
    assert [r["label"] for r in rows] == ["0", "1"] * 3
    assert sorted(r["split"] for r in rows if r["label"] == "1") == ["test", "train", "val"]
    assert len({r["case_id"] for r in rows}) == 6
    summary = read_summary(demo.parent)
    assert summary == json.loads((demo.parent / "demo_slides.json").read_text())
    for s in summary["slides"]:
        assert s["tissue_fraction"] > 0.05
        assert (s["tumour_fraction"] > 0) == (s["label"] == 1)
    with open_slide(demo.parent / "slides" / "slide_001.tif") as s:
        assert s.level_dimensions == ((512, 384), (256, 192), (128, 96))
        assert (s.objective_power, s.mpp) == (20.0, 0.5)


def test_positive_slides_have_a_distinct_texture(demo, tmp_path):
    report = tile_directory(
        demo.parent / "slides", tmp_path, TilingParams(tile_size=32, level=1), progress=False
    )
    assert report.counts == {"tiled": 6, "skipped": 0, "failed": 0}
    assert all(o.tiles > 5 for o in report.outcomes)


def test_tumour_differs_by_nuclei_not_by_colour():
    """Tumour regions hold about twice the nuclear area of normal tissue, in the same colours: a texture
    to learn, not a colour shift."""
    image, masks = render_slide(768, 1024, True, np.random.default_rng(3))
    tumour, normal = masks["tumour"], masks["tissue"] & ~masks["tumour"]
    assert tumour.sum() > 2000
    px = image.astype(float)
    nucleus = np.abs(px - NUCLEUS_RGB).max(axis=-1) < 16  # nucleus colour (pixel noise has sigma 4)
    assert nucleus[tumour].mean() > 1.6 * nucleus[normal].mean()
    stroma_tumour = px[tumour & ~nucleus].mean(axis=0)
    stroma_normal = px[normal & ~nucleus].mean(axis=0)
    assert np.abs(stroma_tumour - stroma_normal).max() < 8  # the same stroma colour
    negative, masks = render_slide(768, 1024, False, np.random.default_rng(3))
    assert not masks["tumour"].any()


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "x.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a dpgs synthetic-slides directory"):
        write_synthetic_slides(tmp_path, n_slides=2, size=(256, 256))
    with pytest.raises(ValueError, match="n_slides must be >= 2"):
        write_synthetic_slides(tmp_path / "new", n_slides=1)


def _nuclear_area(image: np.ndarray, where: np.ndarray) -> float:
    return float((np.abs(image.astype(float) - NUCLEUS_RGB).max(axis=-1) < 16)[where].mean())


def test_tumour_contrast_moves_the_texture_towards_normal_tissue():
    """A lower contrast draws tumour nuclei closer to normal ones: the nuclear area of the tumour lies
    between normal tissue's and the full tumour's, on the same slide layout (same seed)."""
    full, masks = render_slide(768, 1024, True, np.random.default_rng(3))
    low, low_masks = render_slide(768, 1024, True, np.random.default_rng(3), tumour_contrast=0.3)
    tumour, normal = masks["tumour"], masks["tissue"] & ~masks["tumour"]
    assert np.array_equal(low_masks["tumour"], tumour)  # the contrast changes the texture, not the layout
    area_normal, area_low, area_full = (
        _nuclear_area(full, normal), _nuclear_area(low, tumour), _nuclear_area(full, tumour)
    )
    assert area_normal < area_low < area_full
    assert area_low - area_normal < 0.5 * (area_full - area_normal)
    assert tumour_nuclei_texture(1.0) == (TUMOUR_NUCLEUS_SCALE, TUMOUR_NUCLEUS_THRESHOLD)


@pytest.mark.parametrize("contrast", [0.0, -0.5, 1.5])
def test_refuses_a_contrast_outside_the_unit_interval_before_writing(tmp_path, contrast):
    out = tmp_path / "slides_demo"
    with pytest.raises(ValueError, match=r"tumour_contrast must be in \(0, 1\]"):
        write_synthetic_slides(out, n_slides=2, size=(256, 256), tumour_contrast=contrast)
    assert not out.exists()


def test_summary_records_the_contrast(tmp_path):
    manifest = write_synthetic_slides(tmp_path / "d", n_slides=2, size=(256, 256), tumour_contrast=0.4)
    assert read_summary(manifest.parent)["tumour_contrast"] == 0.4
