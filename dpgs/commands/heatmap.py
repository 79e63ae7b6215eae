"""``dpgs heatmap``: per-patch scores of a trained model over one slide, as h5 and PNG.

Tile runs score every tile of ``--slide`` (coords from ``--coords`` or the run's ``data.tiles_dir``);
feature-bag runs score the patches of the slide's feature file (``--features``, or the file of the slide
id in the run's ``data.features_dir``) and draw them on the slide's thumbnail when ``--slide`` is given,
else on a blank canvas (see :mod:`dpgs.wsi.heatmap`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ARTIFACT_DIR = "heatmaps"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "heatmap",
        help="per-patch scores of a trained model over a slide (h5 + PNG on the thumbnail)",
        description=(
            "Score every patch of one slide with the run's model (best.pt, eval mode) and write "
            "OUT/{slide_id}_heatmap.h5 (coords, scores, class probabilities) and OUT/{slide_id}_heatmap.png "
            "(patches coloured by score on the slide thumbnail, or on a blank canvas for a feature-bag run "
            "without --slide). Both are logged to the run's MLflow run under heatmaps/ when it is known."
        ),
    )
    p.add_argument("--run", required=True, metavar="RUN_DIR_OR_RUN_ID",
                   help="a dpgs run directory (config.yaml, classes.json, best.pt) or an MLflow run id")
    p.add_argument("--slide", metavar="PATH",
                   help="the slide file (required for tile runs; feature-bag runs: the thumbnail to draw on)")
    p.add_argument("--coords", metavar="H5",
                   help="tile runs: its coords file (default: located under the run's data.tiles_dir)")
    p.add_argument("--features", metavar="H5",
                   help="feature-bag runs: the slide's feature file with 'features' and 'coords' (default: "
                        "located in the run's data.features_dir by slide id)")
    p.add_argument("--slide-id", help="feature-bag runs without --slide or --features: the slide id")
    p.add_argument("--patch-size-level0", type=int, metavar="PX",
                   help="feature-bag runs: patch side in level-0 pixels when the feature file does not say")
    p.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/heatmaps)")
    p.add_argument("--tracking-uri",
                   help="MLflow tracking URI (default: the run's tracking.uri; for a run id "
                        "sqlite:///mlflow.db)")
    p.add_argument("--tile-size", type=int, default=None,
                   help="resize tiles to this side (default: the run's data.tile_size, else patch_size)")
    p.add_argument("--batch-size", type=int, default=256, help="tiles per encoder pass (default 256)")
    p.add_argument("--thumbnail-size", type=int, default=1024, help="longer side of the PNG (default 1024)")
    p.add_argument("--cmap", default="jet", help="matplotlib colormap (default jet)")
    p.add_argument("--alpha", type=float, default=0.5, help="opacity of the patch colours (default 0.5)")
    return p


def locate_inputs(args, config) -> tuple[Path, Path]:
    """Tile runs: (slide, coords file): ``--coords``, else the slide's file under ``data.tiles_dir``."""
    from dpgs.wsi.tiles import locate_coords
    from dpgs.wsi.tiling import slide_id_of

    if args.slide is None:
        raise ValueError("--slide is required for a run trained on tile bags")
    if args.features is not None:
        raise ValueError("--features: the run was trained on tile bags; its heatmap reads --slide's tiles")
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


def locate_features(args, config) -> tuple[Path, Path | None, str]:
    """Feature-bag runs: (feature file, slide or None, slide id)."""
    from dpgs.data.errors import DataValidationError
    from dpgs.data.layout import resolve_layout
    from dpgs.wsi.tiling import slide_id_of

    if args.coords is not None:
        raise ValueError("--coords: the run was trained on feature bags; coords come from the feature file")
    slide = None if args.slide is None else Path(args.slide)
    if slide is not None and not slide.is_file():
        raise ValueError(f"--slide {slide}: slide file not found")
    if args.features is not None:
        features = Path(args.features)
        if not features.is_file():
            raise ValueError(f"--features {features}: feature file not found")
        sid = args.slide_id or (slide_id_of(slide) if slide is not None else features.stem)
        return features, slide, sid
    sid = args.slide_id or (slide_id_of(slide) if slide is not None else None)
    if sid is None:
        raise ValueError("a feature-bag run needs --features H5, --slide PATH or --slide-id ID")
    if config.data.features_dir is None:
        raise ValueError(f"slide '{sid}': no --features given and the run's config has no data.features_dir")
    try:
        features = resolve_layout(config.data.features_dir, config.data.encoder).locate(sid)
    except DataValidationError as err:
        raise ValueError("; ".join(err.problems)) from None
    if not features.is_file():
        raise ValueError(f"slide '{sid}': no feature file {features} (give --features H5)")
    return features, slide, sid


def log_artifacts(run_id: str, uri: str, paths: list[Path]) -> None:
    """Log ``paths`` under ``heatmaps/`` of the MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    for path in paths:
        client.log_artifact(run_id, str(path), ARTIFACT_DIR)


def run(args) -> int:
    from dpgs.modeling import resolve_device
    from dpgs.runs import resolve_run
    from dpgs.wsi.heatmap import FeatureBag, HeatmapOptions, make_feature_heatmap, make_heatmap

    try:
        ref = resolve_run(args.run, args.tracking_uri)
        config, classes = ref.config, ref.classes()
        options = HeatmapOptions(args.tile_size or config.data.tile_size, args.batch_size,
                                 args.thumbnail_size, args.cmap, args.alpha)
        out_dir = Path(args.out) if args.out else ref.run_dir / "heatmaps"
        meta = {"model": config.model.name, "encoder": config.model.encoder or "",
                "run_dir": str(ref.run_dir.resolve()), "run_id": ref.run_id or ""}
        device = resolve_device(config.train.device)
        if config.model.encoder is not None:
            slide, coords = locate_inputs(args, config)
            model = ref.load_model(None).to(device)
            files = make_heatmap(model, classes, slide, coords, out_dir, options, meta)
            what = f"{slide}: {len(files.result.scores)} tiles"
        else:
            features, slide, sid = locate_features(args, config)
            bag = FeatureBag.read(features)
            head = ref.load_model(bag.features.shape[1]).to(device)
            files = make_feature_heatmap(head, classes, bag, slide, sid, out_dir, options, meta,
                                         args.patch_size_level0)
            what = f"{sid} ({features}): {len(files.result.scores)} patches"
    except (ValueError, OSError) as err:  # RunError and SlideReadError included
        print(f"dpgs heatmap: error: {err}", file=sys.stderr)
        return 2
    probs = ", ".join(f"{c}={p:.4f}" for c, p in zip(classes, files.result.probabilities, strict=True))
    print(f"{what}; predicted probabilities {probs}")
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
