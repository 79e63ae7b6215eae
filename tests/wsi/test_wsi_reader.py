"""Slide readers: levels, metadata, exact pixels, errors naming the file."""

from __future__ import annotations

import numpy as np
import pytest

from dpgs.wsi.reader import Slide, SlideReadError, open_slide, openslide_available
from dpgs.wsi.synthetic import pyramid_levels, write_pyramid_tiff


@pytest.fixture(scope="module")
def image():
    return np.random.default_rng(0).integers(0, 256, size=(512, 768, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def svs_like(tmp_path_factory, image):
    path = tmp_path_factory.mktemp("reader") / "a.tif"
    return write_pyramid_tiff(path, image, levels=3, tile=128, objective_power=40, mpp=0.25)


def test_levels_and_metadata(svs_like):
    with open_slide(svs_like) as s:
        assert s.backend == "tiffslide"
        assert s.level_count == 3
        assert s.level_dimensions == ((768, 512), (384, 256), (192, 128))
        assert s.level_downsamples == (1.0, 2.0, 4.0)
        assert s.objective_power == 40.0
        assert s.mpp == pytest.approx(0.25)
        assert s.magnification == 40.0


@pytest.mark.parametrize(
    ("power", "mpp", "expected"), [(None, 0.5, (None, 0.5, 20.0)), (None, None, (None,) * 3)]
)
def test_generic_tiff_metadata(tmp_path, power, mpp, expected):
    path = write_pyramid_tiff(tmp_path / "g.tif", np.zeros((256, 256, 3), np.uint8), 2, 128, power, mpp)
    with open_slide(path) as s:
        assert s.level_dimensions == ((256, 256), (128, 128))
        got = (s.objective_power, None if s.mpp is None else round(s.mpp, 6), s.magnification)
        assert got == expected


def test_read_region_exact_pixels(svs_like, image):
    levels = pyramid_levels(image, 3)
    with open_slide(svs_like) as s:
        np.testing.assert_array_equal(s.read_region((100, 37), 0, (50, 20)), image[37:57, 100:150])
        # level-0 (200, 120) is level-1 (100, 60) and level-2 (50, 30)
        np.testing.assert_array_equal(s.read_region((200, 120), 1, (64, 32)), levels[1][60:92, 100:164])
        np.testing.assert_array_equal(s.read_region((200, 120), 2, (16, 8)), levels[2][30:38, 50:66])
        out = s.read_region((760, 0), 0, (16, 4))  # past the right edge: padded with black
        np.testing.assert_array_equal(out[:, :8], image[0:4, 760:768])
        assert (out[:, 8:] == 0).all()
        assert out.dtype == np.uint8 and out.flags.c_contiguous


def test_thumbnail_size_and_content(svs_like, image):
    with open_slide(svs_like) as s:
        thumb = s.thumbnail(96)
        assert thumb.shape == (64, 96, 3) and thumb.dtype == np.uint8
        # a thumbnail larger than the slide is level 0 itself
        big = s.thumbnail(10_000)
        np.testing.assert_array_equal(big, image)


def test_bad_level_and_size(svs_like):
    with open_slide(svs_like) as s:
        with pytest.raises(SlideReadError, match=r"a\.tif.*level 3 does not exist"):
            s.read_region((0, 0), 3, (4, 4))
        with pytest.raises(ValueError, match="positive"):
            s.read_region((0, 0), 0, (0, 4))


def test_garbage_and_missing_files_name_the_file(tmp_path):
    bad = tmp_path / "garbage.tif"
    bad.write_bytes(b"this is not a tiff file at all" * 10)
    with pytest.raises(SlideReadError, match=r"cannot read slide .*garbage\.tif: tiffslide: .*") as info:
        open_slide(bad, backend="tiffslide")
    assert info.value.path == str(bad)
    with pytest.raises(SlideReadError, match=r"nothere\.svs: no such file"):
        open_slide(tmp_path / "nothere.svs")
    with pytest.raises(ValueError, match="backend must be one of"):
        open_slide(bad, backend="pillow")


@pytest.mark.skipif(openslide_available(), reason="OpenSlide is installed here")
def test_openslide_requested_but_missing(svs_like):
    with pytest.raises(SlideReadError, match=r"OpenSlide is not installed .*dpgs\[openslide\]"):
        open_slide(svs_like, backend="openslide")


@pytest.mark.skipif(not openslide_available(), reason="OpenSlide is not installed")
def test_openslide_matches_tiffslide(svs_like):
    with open_slide(svs_like, "openslide") as a, open_slide(svs_like, "tiffslide") as b:
        assert a.level_dimensions == b.level_dimensions
        np.testing.assert_array_equal(
            a.read_region((10, 20), 1, (40, 30)), b.read_region((10, 20), 1, (40, 30))
        )



class WhiteSlide(Slide):
    """A backend that returns white everywhere, as OpenSlide returns transparent pixels off the slide."""

    def __init__(self):
        super().__init__("white.svs", [(100, 60), (50, 30)], [1.0, 2.0], None, None)

    def _read(self, x, y, level, w, h):
        return np.full((h, w, 4), 255, dtype=np.uint8)


def test_outside_the_slide_is_black_whatever_the_backend_returns():
    slide = WhiteSlide()
    inside = slide.read_region((10, 10), 0, (20, 20))
    assert (inside == 255).all()
    right = slide.read_region((90, 50), 0, (16, 16))  # 10 columns and 10 rows inside
    assert (right[:10, :10] == 255).all() and (right[10:] == 0).all() and (right[:, 10:] == 0).all()
    left = slide.read_region((-6, -4), 1, (8, 8))  # level 1: level pixel floor(-6 / 2) = -3, -2
    assert (left[2:, 3:] == 255).all() and (left[:2] == 0).all() and (left[:, :3] == 0).all()
    assert (slide.read_region((200, 0), 0, (4, 4)) == 0).all()  # wholly outside
