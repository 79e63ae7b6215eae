"""Tile bags: exact pixels for known coords, layouts of CLAM/TRIDENT/dpgs files, sampling, prefetch."""

from __future__ import annotations

from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from dpgs.data.errors import DataValidationError
from dpgs.wsi.augment import AugmentConfig, BagAugment, imagenet_normalize, to_float_tiles
from dpgs.wsi.synthetic import pyramid_levels, write_pyramid_tiff
from dpgs.wsi.tiles import TileBagDataset, TileLayout, TileReader, iterate_bags, sample_indices


@pytest.fixture(scope="module")
def image():
    return np.random.default_rng(5).integers(0, 256, size=(512, 512, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def slide(tmp_path_factory, image):
    return write_pyramid_tiff(tmp_path_factory.mktemp("tiles") / "s.tif", image, 3, 128, 20, 0.5)


def write_coords(path, coords, **attrs):
    with h5py.File(path, "w") as fh:
        fh.create_dataset("coords", data=np.asarray(coords, np.int64)).attrs.update(attrs)
    return path


def test_reader_returns_the_right_pixels(slide, image, tmp_path):
    levels = pyramid_levels(image, 3)
    coords = [[0, 0], [64, 32], [448, 480], [200, 100]]
    h5 = write_coords(tmp_path / "c0.h5", coords, patch_size=32, patch_level=0)  # CLAM, level 0
    with TileReader(slide, TileLayout.from_h5(h5), threads=3) as reader:
        tiles = reader.read()
        assert tiles.shape == (4, 32, 32, 3) and tiles.dtype == np.uint8
        for t, (x, y) in zip(tiles, coords, strict=True):
            np.testing.assert_array_equal(t, image[y : y + 32, x : x + 32])
        np.testing.assert_array_equal(reader.read([2, 0]), tiles[[2, 0]])
    h5 = write_coords(tmp_path / "c1.h5", coords, patch_size=16, patch_level=1)  # CLAM, level 1
    with TileReader(slide, TileLayout.from_h5(h5)) as reader:
        for t, (x, y) in zip(reader.read(), coords, strict=True):
            np.testing.assert_array_equal(t, levels[1][y // 2 : y // 2 + 16, x // 2 : x // 2 + 16])


@pytest.mark.parametrize(("level", "read", "resize"), [(0, 32, None), (1, 16, None), (0, 40, 20)])
def test_dense_region_read_equals_tile_by_tile(slide, tmp_path, level, read, resize):
    step = read * 2**level
    coords = [[x + 8, y + 24] for y in range(0, 384, step) for x in range(64, 448, step)][3:]
    h5 = write_coords(tmp_path / "g.h5", coords, patch_size=resize or read, patch_level=level, read_size=read)
    with TileReader(slide, TileLayout.from_h5(h5)) as reader:
        dense = reader.read()  # the tiles cover their bounding box: one region read
        single = np.stack([reader.read_one(i) for i in range(len(coords))])
        np.testing.assert_array_equal(dense, single)
        np.testing.assert_array_equal(reader.read([5, 1]), single[[5, 1]])
        assert reader.read([]).shape == (0, resize or read, resize or read, 3)


def test_resized_and_trident_layouts(slide, image, tmp_path):
    levels = pyramid_levels(image, 3)
    coords = [[128, 256]]
    # dpgs file: read 64 px at level 0, resize to 32
    h5 = write_coords(
        tmp_path / "d.h5", coords, patch_size=32, patch_level=0, read_size=64, patch_size_level0=64
    )
    with TileReader(slide, TileLayout.from_h5(h5)) as reader:
        ref = Image.fromarray(image[256:320, 128:192]).resize((32, 32), Image.Resampling.BILINEAR)
        np.testing.assert_array_equal(reader.read()[0], np.asarray(ref))
    # TRIDENT file: no level, 128 level-0 px per 32 px tile -> level 2 (downsample 4), 32 px, no resize
    h5 = write_coords(tmp_path / "t.h5", coords, patch_size=32, patch_size_level0=128)
    layout = TileLayout.from_h5(h5)
    with TileReader(slide, layout) as reader:
        assert (reader.level, reader.read_size) == (2, 32)
        np.testing.assert_array_equal(reader.read()[0], levels[2][64:96, 32:64])
    # explicit output size
    with TileReader(slide, layout, out_size=16) as reader:
        assert reader.read().shape == (1, 16, 16, 3)
    with pytest.raises(ValueError, match="coords attribute 'patch_size' is missing"):
        TileLayout.from_h5(write_coords(tmp_path / "bad.h5", coords, patch_level=0))


def test_sample_indices():
    a = sample_indices(100, 10, seed=1, epoch=0, index=3)
    assert len(set(a.tolist())) == 10 and (np.diff(a) > 0).all() and a.max() < 100
    np.testing.assert_array_equal(a, sample_indices(100, 10, 1, 0, 3))
    assert not np.array_equal(a, sample_indices(100, 10, 1, 1, 3))
    assert not np.array_equal(a, sample_indices(100, 10, 1, 0, 4))
    np.testing.assert_array_equal(sample_indices(7, 10, 1, 0, 0), np.arange(7))
    np.testing.assert_array_equal(sample_indices(7, None, 1, 0, 0), np.arange(7))


@pytest.fixture
def dataset_dirs(tmp_path, image):
    slides, tiles = tmp_path / "slides", tmp_path / "tiles" / "patches"
    slides.mkdir()
    tiles.mkdir(parents=True)
    grid = [[x, y] for y in range(0, 512, 64) for x in range(0, 512, 64)]  # 64 tiles of 64 px
    for k in range(3):
        write_pyramid_tiff(slides / f"s{k}.tif", np.roll(image, 17 * k, axis=1), 2, 128, 20, 0.5)
        write_coords(tiles / f"s{k}.h5", grid[: 20 + 10 * k], patch_size=64, patch_level=0, read_size=64)
    records = [SimpleNamespace(slide_id=f"s{k}", label=k % 2) for k in range(3)]
    return slides, tmp_path / "tiles", records


def test_dataset_bags_sampling_augmentation_and_prefetch(dataset_dirs, image):
    slides, tiles, records = dataset_dirs
    ds = TileBagDataset.from_records(records, slides, tiles, tiles_per_bag=8, tile_size=32, seed=3, threads=2)
    assert ds.tile_counts() == [20, 30, 40] and ds.lengths() == [8, 8, 8]
    bag = ds[1]
    assert bag.slide_id == "s1" and bag.label == 1 and bag.tiles.shape == (8, 3, 32, 32)
    np.testing.assert_array_equal(bag.indices, sample_indices(30, 8, 3, 0, 1))
    x, y = bag.coords[0]
    raw = np.roll(image, 17, axis=1)[y : y + 64, x : x + 64]
    ref = np.asarray(Image.fromarray(raw).resize((32, 32), Image.Resampling.BILINEAR))
    torch.testing.assert_close(bag.tiles[0], imagenet_normalize(to_float_tiles(ref[None]))[0])
    assert not np.array_equal(ds.get(1, 1).indices, bag.indices)

    aug = TileBagDataset.from_records(
        records, slides, tiles, tiles_per_bag=8, tile_size=32, seed=3, augment=BagAugment(AugmentConfig())
    )
    a1, a2 = aug[2], aug[2]
    torch.testing.assert_close(a1.tiles, a2.tiles, rtol=0, atol=0)  # same (seed, epoch, index)
    plain = TileBagDataset.from_records(records, slides, tiles, tiles_per_bag=8, tile_size=32, seed=3)[2]
    assert not torch.equal(a1.tiles, plain.tiles)

    streamed = list(iterate_bags(ds, [2, 0, 1], prefetch=1))
    assert [b.slide_id for b in streamed] == ["s2", "s0", "s1"]
    torch.testing.assert_close(streamed[2].tiles, ds[1].tiles, rtol=0, atol=0)

    everything = ds.read(0)  # evaluation on all tiles
    assert everything.tiles.shape == (20, 3, 32, 32)
    raw_ds = TileBagDataset.from_records(records, slides, tiles, tiles_per_bag=4, normalize=False)
    assert raw_ds[0].tiles.dtype == np.uint8 and raw_ds[0].tiles.shape == (4, 64, 64, 3)


def test_missing_files_are_listed(dataset_dirs):
    slides, tiles, records = dataset_dirs
    records = [*records, SimpleNamespace(slide_id="ghost", label=0)]
    with pytest.raises(DataValidationError) as info:
        TileBagDataset.from_records(records, slides, tiles)
    assert len(info.value.problems) == 2
    assert "no slide file ghost" in str(info.value) and "no coords file ghost.h5" in str(info.value)
    # TRIDENT names its coords files {slide_id}_patches.h5
    (tiles / "patches" / "s0.h5").rename(tiles / "patches" / "s0_patches.h5")
    ds = TileBagDataset.from_records(records[:1], slides, tiles)
    assert ds.items[0].coords_path.name == "s0_patches.h5"
