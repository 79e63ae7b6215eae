"""``dpgs heatmap``: per-tile scores of a trained tile model over one slide, as h5 and PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ARTIFACT_DIR = "heatmaps"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "heatmap",
        help="per-tile scores of a trained tile model over a slide (h5 + PNG on the thumbnail)",
        description=(
            "Score every tile of SLIDE with the run's model (best.pt, eval mode) and write "
            "OUT/{slide_id}_heatmap.h5 (coords, scores, class probabilities) and OUT/{slide_id}_heatmap.png "
            "(the thumbnail with tiles coloured by score). Both are logged to the run's MLflow run under "
            "heatmaps/ when it is known."
        ),
    )
    p.add_argument("--run", required=True, metavar="RUN_DIR_OR_RUN_ID",
                   help="a dpgs run directory (config.yaml, classes.json, best.pt) or an MLflow run id")
    p.add_argument("--slide", required=True, metavar="PATH", help="the slide file")
    p.add_argument("--coords", metavar="H5",
                   help="its coords file (default: located under the run's data.tiles_dir)")
    p.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/heatmaps)")
    p.add_argument("--tracking-uri",
                   help="MLflow tracking URI (default: the run's tracking.uri; for a run id "
                        "sqlite:///mlflow.db)")
    p.add_argument("--tile-size", type=int, default=None,
                   help="resize tiles to this side (default: the run's data.tile_size, else patch_size)")
    p.add_argument("--batch-size", type=int, default=256, help="tiles per encoder pass (default 256)")
    p.add_argument("--thumbnail-size", type=int, default=1024, help="longer side of the PNG (default 1024)")
    p.add_argument("--cmap", default="jet", help="matplotlib colormap (default jet)")
    p.add_argument("--alpha", type=float, default=0.5, help="opacity of the tile colours (default 0.5)")
    return p


def locate_inputs(args, config) -> tuple[Path, Path]:
    """(slide, coords file): ``--coords`` or the slide's file under the run's ``data.tiles_dir``."""
    from dpgs.wsi.tiles import locate_coords
    from dpgs.wsi.tiling import slide_id_of

    slide = Path(args.slide)
    if not slide.is_file():
        raise ValueError(f"--slide {slide}: slide file not found")
    if args.coords is not None:
        if not Path(args.coords).is_file():
            raise ValueError(f"--coords {args.coords}: coords file not found")
        return slide, Path(args.coords)
    tiles_dir = config.data.tiles_dir
    if tiles_dir is None:
        raise ValueError(f"{slide}: no --coords given and the run's config has no data.tiles_dir")
    sid = slide_id_of(slide)
    coords = locate_coords(tiles_dir, sid)
    if coords is None:
        raise ValueError(f"{slide}: no coords file for slide '{sid}' in {tiles_dir}/patches or {tiles_dir} "
                         f"(give --coords H5, or run `dpgs tile`)")
    return slide, coords


def log_artifacts(run_id: str, uri: str, paths: list[Path]) -> None:
    """Log ``paths`` under ``heatmaps/`` of the MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    for path in paths:
        client.log_artifact(run_id, str(path), ARTIFACT_DIR)


def run(args) -> int:
    from dpgs.modeling import resolve_device
    from dpgs.wsi.heatmap import HeatmapOptions, load_tile_model, make_heatmap
    from dpgs.wsi.runref import resolve_run

    try:
        ref = resolve_run(args.run, args.tracking_uri)
        classes = ref.classes()
        model = load_tile_model(ref.run_dir, ref.config, classes)
        slide, coords = locate_inputs(args, ref.config)
        options = HeatmapOptions(args.tile_size or ref.config.data.tile_size, args.batch_size,
                                 args.thumbnail_size, args.cmap, args.alpha)
        model.to(resolve_device(ref.config.train.device))
        out_dir = Path(args.out) if args.out else ref.run_dir / "heatmaps"
        meta = {"model": ref.config.model.name, "encoder": ref.config.model.encoder,
                "run_dir": str(ref.run_dir.resolve()), "run_id": ref.run_id or ""}
        files = make_heatmap(model, classes, slide, coords, out_dir, options, meta)
    except (ValueError, OSError) as err:  # RunError and SlideReadError included
        print(f"dpgs heatmap: error: {err}", file=sys.stderr)
        return 2
    probs = ", ".join(f"{c}={p:.4f}" for c, p in zip(classes, files.result.probabilities, strict=True))
    print(f"{slide}: {len(files.result.scores)} tiles; predicted probabilities {probs}")
    print(f"  scores:  {files.h5}\n  picture: {files.png}")
    return report_mlflow(ref, [files.h5, files.png])


def report_mlflow(ref, paths: list[Path]) -> int:
    """Log the files to the run's MLflow run when it is known; 1 when logging fails."""
    from mlflow.exceptions import MlflowException

    if ref.run_id is None:
        print(f"  no MLflow run found for {ref.run_dir} in {ref.tracking_uri}; files not logged")
        return 0
    try:
        log_artifacts(ref.run_id, ref.tracking_uri, paths)
    except (MlflowException, OSError) as err:
        print(f"dpgs heatmap: error: logging to MLflow run {ref.run_id} failed: {err}", file=sys.stderr)
        return 1
    print(f"  logged to MLflow run {ref.run_id} under {ARTIFACT_DIR}/")
    return 0
