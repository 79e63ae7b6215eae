"""Per-tile scores of a trained tile model over a whole slide, saved as h5 and drawn on the thumbnail.

Scores. The run's :class:`~dpgs.models.tilemil.TileMIL` is put in eval mode; every tile of the slide is
read in coords order (resized to ``tile_size`` when given), ImageNet-normalised and embedded
``batch_size`` tiles at a time under ``no_grad``; the head then gives the per-tile scores
(``head.instance_scores``: attention weights or positive-class probabilities, depending on the head) and
the bag's logits over all tiles at once. Eval-mode embeddings do not depend on how the tiles are
batched, so the scores are ``model.instance_scores(tiles)`` and the probabilities
``softmax(model(tiles))`` of the whole bag, with bounded memory.

Files (written under a temporary name, then renamed):

* ``{slide_id}_heatmap.h5``: ``coords`` int64 [N, 2] (level-0 top-lefts, the coords file's attributes),
  ``scores`` float32 [N]; file attributes ``patch_size_level0`` (tile footprint in level-0 pixels),
  ``patch_size``, ``patch_level``, ``downsample`` (when the coords file has them), ``classes`` (JSON),
  ``probabilities`` [C], ``predicted_class``, ``slide_id``, ``slide_path``, ``model``, ``encoder``,
  ``run_dir``, ``run_id`` ("" when unknown), ``score_min``, ``score_max``, ``cmap``;
* ``{slide_id}_heatmap.png``: the slide thumbnail (same size) with each tile's footprint filled with
  its score's colour, alpha-blended; colours map ``[score_min, score_max]`` of the slide linearly onto
  the colormap, and a colour bar labelled with both ends sits in the top-right corner.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpgs.wsi.augment import imagenet_normalize, to_float_tiles
from dpgs.wsi.features import read_batches
from dpgs.wsi.runref import RunError
from dpgs.wsi.tiles import TileLayout, TileReader
from dpgs.wsi.tiling import read_coords_h5, slide_id_of

COPIED_ATTRS = ("patch_size", "patch_level", "downsample")


def load_tile_model(run_dir: Path, config, classes: list[str]) -> torch.nn.Module:
    """The run's TileMIL with ``best.pt`` loaded, in eval mode on the CPU; RunError naming the file."""
    from dpgs.modeling import ModelSpec

    if config.model.encoder is None:
        raise RunError(f"{run_dir}: the run was trained on feature bags (model.encoder is null); a heatmap "
                       "needs a tile model (data.kind=tiles)")
    model = ModelSpec(config.model, None, len(classes)).build()
    checkpoint = run_dir / "best.pt"
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors, truncated files, non-tensor content
        raise RunError(f"{checkpoint}: not a readable state_dict ({err})") from None
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError) as err:
        first = str(err).strip().splitlines()[:3]
        raise RunError(f"{checkpoint}: does not match the run's model ({' '.join(first)})") from None
    return model.eval()


@dataclass
class SlideScores:
    """Scores of one slide: ``scores`` [N] in coords order, ``probabilities`` [C] of the bag."""

    coords: np.ndarray
    scores: np.ndarray
    probabilities: np.ndarray
    patch_size_level0: int


@torch.no_grad()
def score_tiles(model: torch.nn.Module, reader: TileReader, batch_size: int) -> SlideScores:
    """Per-tile scores and bag probabilities of all the reader's tiles (see module docstring)."""
    model.eval()
    feats = torch.cat([model.embed(imagenet_normalize(to_float_tiles(tiles)))
                       for tiles in read_batches(reader, batch_size)])
    scores = model.head.instance_scores(feats).reshape(-1).float().cpu().numpy()
    probs = torch.softmax(model.head(feats).reshape(-1).double(), dim=0).cpu().numpy()
    footprint = round(reader.read_size * reader.slide.level_downsamples[reader.level])
    return SlideScores(reader.layout.coords, scores.astype(np.float32), probs, int(footprint))


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _replace_atomically(path: Path, write) -> Path:
    tmp = _tmp_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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

    return _replace_atomically(path, write)


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
    """How tiles are read and the picture drawn."""

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
    """What :func:`make_heatmap` wrote, and the scores."""

    h5: Path
    png: Path
    result: SlideScores


def make_heatmap(model: torch.nn.Module, classes: list[str], slide_path: Path, coords_path: Path,
                 out_dir: Path, options: HeatmapOptions, meta: dict | None = None) -> HeatmapFiles:
    """Score every tile of the slide and write ``{slide_id}_heatmap.h5`` and ``.png`` into ``out_dir``.

    ``meta`` adds file attributes (model, encoder, run directory, run id). Unreadable slides or coords
    files raise ValueError / OSError naming the file.
    """
    cmap = colormap(options.cmap)
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
    out_dir.mkdir(parents=True, exist_ok=True)
    attrs = {
        "slide_id": sid, "slide_path": str(slide_path), "classes": json.dumps(classes),
        "predicted_class": classes[int(np.argmax(result.probabilities))], "tile_size": tile_size,
        "cmap": options.cmap, **(meta or {}),
    }
    h5 = write_heatmap_h5(out_dir / f"{sid}_heatmap.h5", result, coords_attrs, attrs)
    image = render_heatmap(thumbnail, level0, result, cmap, options.alpha)
    png = _replace_atomically(out_dir / f"{sid}_heatmap.png", lambda tmp: image.save(tmp, format="PNG"))
    return HeatmapFiles(h5, png, result)
