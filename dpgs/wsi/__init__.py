"""Whole-slide images: readers, tissue detection, tiling, synthetic slides, tile bags, augmentation.

Modules import their heavy dependencies (tiffslide, h5py, PIL, torch) where they use them; import the
names from the submodules, for example ``from dpgs.wsi.tiling import tile_directory``.
"""
