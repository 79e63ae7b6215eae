"""Per-patch scores of a trained model over a whole slide, saved as h5 and drawn on the thumbnail.

Two kinds of runs:

* **Tile runs** (:func:`make_heatmap`): the run's :class:`~dpgs.models.tilemil.TileMIL` is put in eval
  mode; every tile of the slide is read in coords order (resized to ``tile_size`` when given),
  ImageNet-normalised and embedded ``batch_size`` tiles at a time under ``no_grad``. Eval-mode
  embeddings do not depend on how the tiles are batched, so the scores are
  ``model.instance_scores(tiles)`` and the probabilities ``softmax(model(tiles))`` of the whole bag,
  with bounded memory.
* **Feature-bag runs** (:func:`make_feature_heatmap`): the head scores the bag's features, read from a
  CLAM / TRIDENT / ``dpgs extract`` h5 file that carries the patches' ``coords``. The picture is drawn on
  the slide's thumbnail when the slide is given, else on a blank (white) canvas spanning the patches
  from the level-0 origin. A patch's side in level-0 pixels (:func:`footprint_level0`) is, in this
  order: the one given, the coords' ``patch_size_level0`` attribute, ``patch_size x downsample``
  (CLAM's attributes), ``patch_size x`` the slide's downsample at ``patch_level``, ``patch_size`` at
  level 0, else the grid step of the coords (the smallest positive gap between distinct x or y values).

In both cases the per-patch scores are ``head.instance_scores(features)`` (attention weights or
positive-class probabilities, depending on the head) and the bag's probabilities
``softmax(head(features))`` over all patches at once.

Files (written atomically):

* ``{slide_id}_heatmap.h5``: ``coords`` int64 [N, 2] (level-0 top-lefts, with the coords' attributes),
  ``scores`` float32 [N]; file attributes ``patch_size_level0`` (patch footprint in level-0 pixels),
  ``patch_size``, ``patch_level``, ``downsample`` (when the coords have them), ``classes`` (JSON),
  ``probabilities`` [C], ``predicted_class``, ``slide_id``, ``slide_path`` ("" without a slide),
  ``canvas`` (``thumbnail`` or ``blank``), ``model``, ``encoder``, ``run_dir``, ``run_id`` ("" when
  unknown), ``score_min``, ``score_max``, ``cmap``; tile runs add ``tile_size``, feature-bag runs
  ``features_path``;
* ``{slide_id}_heatmap.png``: the canvas with each patch's footprint filled with its score's colour,
  alpha-blended; colours map ``[score_min, score_max]`` of the slide linearly onto the colormap, and a
  colour bar labelled with both ends sits in the top-right corner.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpgs.outputs import write_atomically
from dpgs.wsi.augment import imagenet_normalize, to_float_tiles
from dpgs.wsi.features import read_batches
from dpgs.wsi.reader import open_slide
from dpgs.wsi.tiles import TileLayout, TileReader
from dpgs.wsi.tiling import read_coords_h5, slide_id_of

COPIED_ATTRS = ("patch_size", "patch_level", "downsample")
BLANK = 255  # canvas colour without a slide


@dataclass
class SlideScores:
    """Scores of one slide: ``scores`` [N] in coords order, ``probabilities`` [C] of the bag."""

    coords: np.ndarray
    scores: np.ndarray
    probabilities: np.ndarray
    patch_size_level0: int


@torch.no_grad()
def bag_scores(head: torch.nn.Module, feats: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(per-instance scores float32 [N], bag probabilities float64 [C]) of ``head`` on ``feats`` [N, D]."""
    head.eval()
    scores = head.instance_scores(feats).reshape(-1).float().cpu().numpy()
    probs = torch.softmax(head(feats).reshape(-1).double(), dim=0).cpu().numpy()
    return scores.astype(np.float32), probs


@torch.no_grad()
def score_tiles(model: torch.nn.Module, reader: TileReader, batch_size: int) -> SlideScores:
    """Per-tile scores and bag probabilities of all the reader's tiles (see module docstring)."""
    model.eval()
    feats = torch.cat([model.embed(imagenet_normalize(to_float_tiles(tiles)))
                       for tiles in read_batches(reader, batch_size)])
    scores, probs = bag_scores(model.head, feats)
    footprint = round(reader.read_size * reader.slide.level_downsamples[reader.level])
    return SlideScores(reader.layout.coords, scores, probs, int(footprint))


def write_heatmap_h5(path: Path, result: SlideScores, coords_attrs: dict, meta: dict) -> Path:
    """``coords`` (coords file's attributes) and ``scores`` with the file attributes of the docstring."""
    import h5py

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as fh:
            ds = fh.create_dataset("coords", data=result.coords.astype(np.int64).reshape(-1, 2))
            ds.attrs.update(coords_attrs)
            fh.create_dataset("scores", data=result.scores)
            fh.attrs.update({k: coords_attrs[k] for k in COPIED_ATTRS if k in coords_attrs})
            fh.attrs["patch_size_level0"] = result.patch_size_level0
            fh.attrs["probabilities"] = result.probabilities
            fh.attrs["score_min"] = float(result.scores.min())
            fh.attrs["score_max"] = float(result.scores.max())
            fh.attrs.update(meta)

    return write_atomically(path, write)


def colormap(name: str):
    """The matplotlib colormap ``name``; ValueError naming it when unknown."""
    import matplotlib

    try:
        return matplotlib.colormaps[name]
    except KeyError:
        raise ValueError(f"unknown colormap '{name}' (e.g. jet, viridis, inferno, coolwarm)") from None


def score_colors(scores: np.ndarray, cmap) -> np.ndarray:
    """uint8 RGB [N, 3]: ``[min, max]`` of the scores mapped linearly onto ``cmap`` (mid colour if flat)."""
    lo, hi = float(scores.min()), float(scores.max())
    t = (scores - lo) / (hi - lo) if hi > lo else np.full_like(scores, 0.5)
    return np.rint(cmap(t.astype(np.float64))[:, :3] * 255).astype(np.uint8)


def overlay_tiles(thumbnail: np.ndarray, boxes: np.ndarray, colors: np.ndarray, alpha: float) -> np.ndarray:
    """``thumbnail`` with each box ``(y0, y1, x0, x1)`` blended with its colour at opacity ``alpha``."""
    color = np.zeros(thumbnail.shape, dtype=np.float32)
    mask = np.zeros(thumbnail.shape[:2], dtype=np.float32)
    for (y0, y1, x0, x1), c in zip(boxes, colors, strict=True):
        color[y0:y1, x0:x1] = c
        mask[y0:y1, x0:x1] = alpha
    out = thumbnail.astype(np.float32) * (1 - mask[..., None]) + color * mask[..., None]
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def draw_colorbar(image, cmap, lo: float, hi: float) -> None:
    """Draw a vertical colour bar labelled ``hi`` (top) and ``lo`` (bottom) in the top-right corner."""
    from PIL import Image, ImageDraw, ImageFont

    w, h = image.size
    pad = 3
    bar_h, bar_w = max(12, min(h // 3, 256)), max(6, min(w // 40, 20))
    font = ImageFont.load_default()
    draw = ImageDraw.Draw(image)
    labels = (f"{hi:.3g}", f"{lo:.3g}")
    text_w = max(int(draw.textlength(t, font=font)) for t in labels)
    text_h = draw.textbbox((0, 0), labels[0], font=font)[3]
    box_w, box_h = bar_w + text_w + 3 * pad, max(bar_h, 2 * text_h) + 2 * pad
    x0, y0 = max(0, w - box_w - pad), min(pad, max(0, h - box_h))
    draw.rectangle((x0, y0, x0 + box_w, y0 + box_h), fill=(255, 255, 255), outline=(0, 0, 0))
    ramp = np.rint(cmap(np.linspace(1.0, 0.0, bar_h))[:, :3] * 255).astype(np.uint8)
    image.paste(Image.fromarray(np.repeat(ramp[:, None, :], bar_w, axis=1)), (x0 + pad, y0 + pad))
    tx = x0 + bar_w + 2 * pad
    draw.text((tx, y0 + pad), labels[0], fill=(0, 0, 0), font=font)
    draw.text((tx, y0 + pad + max(bar_h, 2 * text_h) - text_h), labels[1], fill=(0, 0, 0), font=font)


def render_heatmap(thumbnail: np.ndarray, level0_dim: tuple[int, int], result: SlideScores, cmap,
                   alpha: float):
    """PIL image of the thumbnail's size: tile footprints coloured by score, with a colour bar."""
    from PIL import Image

    from dpgs.wsi.tissue import footprint_boxes, thumbnail_scale

    sx, sy = thumbnail_scale(level0_dim, thumbnail.shape[:2])
    boxes = footprint_boxes(result.coords, result.patch_size_level0, sx, sy, thumbnail.shape[:2])
    image = Image.fromarray(overlay_tiles(thumbnail, boxes, score_colors(result.scores, cmap), alpha))
    draw_colorbar(image, cmap, float(result.scores.min()), float(result.scores.max()))
    return image


@dataclass(frozen=True)
class HeatmapOptions:
    """How tiles are read (tile runs) and the picture drawn."""

    tile_size: int | None = None
    batch_size: int = 256
    thumbnail_size: int = 1024
    cmap: str = "jet"
    alpha: float = 0.5
    threads: int = 4

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.thumbnail_size < 16:
            raise ValueError(f"thumbnail size must be >= 16, got {self.thumbnail_size}")


@dataclass(frozen=True)
class HeatmapFiles:
    """What :func:`make_heatmap` or :func:`make_feature_heatmap` wrote, and the scores."""

    h5: Path
    png: Path
    result: SlideScores


def _write(out_dir: Path, sid: str, result: SlideScores, coords_attrs: dict, canvas: np.ndarray,
           level0_dim: tuple[int, int], attrs: dict, options: HeatmapOptions) -> HeatmapFiles:
    """``{sid}_heatmap.h5`` and ``.png`` (the scores drawn on ``canvas``, which spans ``level0_dim``)."""
    cmap = colormap(options.cmap)
    out_dir.mkdir(parents=True, exist_ok=True)
    h5 = write_heatmap_h5(out_dir / f"{sid}_heatmap.h5", result, coords_attrs, attrs)
    image = render_heatmap(canvas, level0_dim, result, cmap, options.alpha)
    png = write_atomically(out_dir / f"{sid}_heatmap.png", lambda tmp: image.save(tmp, format="PNG"))
    return HeatmapFiles(h5, png, result)


def _common_attrs(sid: str, slide_path: Path | None, classes: list[str], result: SlideScores,
                  canvas: str, options: HeatmapOptions, meta: dict | None) -> dict:
    return {
        "slide_id": sid, "slide_path": "" if slide_path is None else str(slide_path),
        "classes": json.dumps(classes), "predicted_class": classes[int(np.argmax(result.probabilities))],
        "canvas": canvas, "cmap": options.cmap, **(meta or {}),
    }


def make_heatmap(model: torch.nn.Module, classes: list[str], slide_path: Path, coords_path: Path,
                 out_dir: Path, options: HeatmapOptions, meta: dict | None = None) -> HeatmapFiles:
    """Score every tile of the slide with a tile model and write ``{slide_id}_heatmap.h5`` and ``.png``
    into ``out_dir``.

    ``meta`` adds file attributes (model, encoder, run directory, run id). Unreadable slides or coords
    files raise ValueError / OSError naming the file.
    """
    colormap(options.cmap)  # an unknown colormap fails before the slide is read
    sid = slide_id_of(slide_path)
    layout = TileLayout.from_h5(coords_path)
    if len(layout) == 0:
        raise ValueError(f"{coords_path}: no tiles (tissue detection kept none)")
    coords_attrs = read_coords_h5(coords_path)[1]
    with TileReader(slide_path, layout, options.tile_size, options.threads) as reader:
        result = score_tiles(model, reader, options.batch_size)
        thumbnail = reader.slide.thumbnail(options.thumbnail_size)
        level0 = reader.slide.dimensions
        tile_size = reader.out_size
    attrs = _common_attrs(sid, slide_path, classes, result, "thumbnail", options, meta)
    attrs["tile_size"] = tile_size
    return _write(out_dir, sid, result, coords_attrs, thumbnail, level0, attrs, options)


@dataclass(frozen=True)
class FeatureBag:
    """A feature file's ``features`` float32 [N, D], ``coords`` int64 [N, 2] and the coords' attributes."""

    path: Path
    features: torch.Tensor
    coords: np.ndarray
    coords_attrs: dict

    @classmethod
    def read(cls, path: str | Path) -> FeatureBag:
        """ValueError naming the file when it has no features, no coords, or they do not match."""
        import h5py

        path = Path(path)
        if path.suffix != ".h5":
            raise ValueError(f"{path}: a heatmap needs an h5 feature file with 'coords' ({path.suffix} files "
                             "carry no patch coordinates)")
        try:
            with h5py.File(path, "r") as fh:
                missing = [k for k in ("features", "coords") if k not in fh]
                if missing:
                    raise ValueError(f"{path}: no {' or '.join(repr(k) for k in missing)} dataset (a heatmap "
                                     "needs the features and the patch coordinates)")
                features = np.asarray(fh["features"][()], dtype=np.float32)
                coords = np.asarray(fh["coords"][()], dtype=np.int64)
                attrs = {k: (v.item() if isinstance(v, np.generic) else v)
                         for k, v in fh["coords"].attrs.items()}
        except OSError as err:
            raise ValueError(f"{path}: cannot read the feature file ({err})") from None
        if features.ndim != 2 or coords.shape != (features.shape[0], 2) or features.shape[0] == 0:
            raise ValueError(f"{path}: features {features.shape} and coords {coords.shape} do not describe "
                             "the same N >= 1 patches ([N, D] and [N, 2])")
        return cls(path, torch.from_numpy(features), coords, attrs)


def grid_step(coords: np.ndarray) -> int | None:
    """The smallest positive gap between two distinct x, or two distinct y, coordinates (None if none)."""
    gaps = [np.diff(np.unique(coords[:, axis])) for axis in (0, 1)]
    gaps = np.concatenate(gaps)
    return int(gaps.min()) if gaps.size else None


def footprint_level0(bag: FeatureBag, level_downsamples: tuple[float, ...] | None,
                     given: int | None = None) -> int:
    """A patch's side in level-0 pixels (the order of the module docstring); ValueError when unknown."""
    if given is not None:
        return int(given)
    attrs = bag.coords_attrs
    size, level = attrs.get("patch_size"), attrs.get("patch_level")
    if attrs.get("patch_size_level0") is not None:
        return int(attrs["patch_size_level0"])
    if size is not None and attrs.get("downsample") is not None:
        return int(round(float(size) * float(np.ravel(attrs["downsample"])[0])))
    if size is not None and level is not None and level_downsamples is not None:
        if int(level) >= len(level_downsamples):
            raise ValueError(f"{bag.path}: patches at level {level}, the slide has {len(level_downsamples)}")
        return int(round(float(size) * level_downsamples[int(level)]))
    if size is not None and level is not None and int(level) == 0:
        return int(size)
    step = grid_step(bag.coords)
    if step is None:
        raise ValueError(f"{bag.path}: cannot tell the patch size in level-0 pixels (no coords attributes, "
                         "one patch); give --patch-size-level0")
    return step


def blank_canvas(coords: np.ndarray, footprint: int, max_size: int) -> tuple[np.ndarray, tuple[int, int]]:
    """(white canvas uint8 [h, w, 3], the level-0 size it spans): the patches' extent from the origin,
    the longer side ``min(max_size, level-0 side)``, the scaling of :meth:`Slide.thumbnail`."""
    w0, h0 = int(coords[:, 0].max()) + footprint, int(coords[:, 1].max()) + footprint
    scale = min(1.0, max_size / max(w0, h0))
    shape = (max(1, round(h0 * scale)), max(1, round(w0 * scale)), 3)
    return np.full(shape, BLANK, dtype=np.uint8), (w0, h0)


def make_feature_heatmap(head: torch.nn.Module, classes: list[str], bag: FeatureBag, slide_path: Path | None,
                         sid: str, out_dir: Path, options: HeatmapOptions, meta: dict | None = None,
                         patch_size_level0: int | None = None) -> HeatmapFiles:
    """Score the patches of a feature bag with ``head`` and write ``{sid}_heatmap.h5`` and ``.png`` into
    ``out_dir``, on the slide's thumbnail when ``slide_path`` is given, else on a blank canvas."""
    colormap(options.cmap)
    scores, probs = bag_scores(head, bag.features.to(next(head.parameters()).device))
    if slide_path is None:
        footprint = footprint_level0(bag, None, patch_size_level0)
        canvas, level0 = blank_canvas(bag.coords, footprint, options.thumbnail_size)
    else:
        with open_slide(slide_path) as slide:
            footprint = footprint_level0(bag, slide.level_downsamples, patch_size_level0)
            canvas, level0 = slide.thumbnail(options.thumbnail_size), slide.dimensions
    result = SlideScores(bag.coords, scores, probs, footprint)
    kind = "blank" if slide_path is None else "thumbnail"
    attrs = {**_common_attrs(sid, slide_path, classes, result, kind, options, meta),
             "features_path": str(bag.path)}
    return _write(out_dir, sid, result, bag.coords_attrs, canvas, level0, attrs, options)
