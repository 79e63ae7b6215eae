"""``dpgs extract``: embed the tiles of every tiled slide with a ResNet encoder into feature files."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

WEIGHTS_PREFIX = "model.encoder_weights: "


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "extract",
        help="tile features of tiled slides with a ResNet encoder (CLAM/TRIDENT feature h5 files)",
        description=(
            "Embed every tile of every slide of SLIDES_DIR that has a coords file under TILES_DIR "
            "(`dpgs tile` output) and write OUT_DIR/{slide_id}.h5 with features [N, D] float32 and coords "
            "[N, 2]; OUT_DIR can be used as data.features_dir. Finished slides are skipped; slides that "
            "cannot be read are reported and the others extracted (exit status 1)."
        ),
    )
    p.add_argument("slides_dir", metavar="SLIDES_DIR", help="directory of slides (.svs, .tif, .ndpi, ...)")
    p.add_argument("tiles_dir", metavar="TILES_DIR", help="output of `dpgs tile` (patches/{slide_id}.h5)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="feature files are written here (created; resumable)")
    p.add_argument("--encoder", choices=("resnet18", "resnet50"),
                   help="encoder architecture (required without --run; with --run it must match the run)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--weights", metavar="PATH",
                         help="torchvision-format ResNet state_dict (e.g. ImageNet weights)")
    weights.add_argument("--run", metavar="RUN_DIR_OR_RUN_ID",
                         help="take the trained encoder of a dpgs run (best.pt of a run directory, or an "
                              "MLflow run id resolved through its train.output_dir)")
    p.add_argument("--tile-size", type=int, default=None,
                   help="resize tiles to this side (default: the run's data.tile_size, else the coords "
                        "file's patch_size)")
    p.add_argument("--batch-size", type=int, default=256, help="tiles per encoder pass (default 256)")
    p.add_argument("--big-stages", type=int, default=None,
                   help="encoder stages run as big layers, -1..4 (default: the run's, else 1)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--tracking-uri", help="MLflow tracking URI to resolve a --run id (sqlite:///mlflow.db)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@dataclass(frozen=True)
class EncoderChoice:
    """Which encoder to build and where its weights come from."""

    name: str
    big_stages: int
    max_elements: int
    weights: Path | None
    source: str
    tile_size: int | None


def choose_from_run(args) -> EncoderChoice:
    """The encoder of ``--run``: the run's architecture and the ``encoder.*`` entries of its best.pt."""
    from dpgs.runs import RunError, resolve_run

    ref = resolve_run(args.run, args.tracking_uri, lookup_mlflow=False)
    model = ref.config.model
    if model.encoder is None:
        raise RunError(f"--run {args.run}: {ref.run_dir} was trained on feature bags (model.encoder is "
                       "null), so it has no tile encoder")
    if args.encoder is not None and args.encoder != model.encoder:
        raise RunError(f"--encoder {args.encoder} does not match the run's model.encoder "
                       f"{model.encoder} ({ref.run_dir / 'config.yaml'})")
    source = f"run {ref.run_dir.resolve()}" + (f" (MLflow run {ref.run_id})" if ref.run_id else "")
    return EncoderChoice(
        model.encoder,
        model.big_stages if args.big_stages is None else args.big_stages,
        model.max_elements,
        ref.checkpoint,
        source,
        args.tile_size or ref.config.data.tile_size,
    )


def choose_encoder(args) -> EncoderChoice:
    """The encoder asked for by ``--encoder`` / ``--weights`` / ``--run`` (ValueError when unclear)."""
    if args.run is not None:
        return choose_from_run(args)
    if args.encoder is None:
        raise ValueError("give --encoder resnet18|resnet50 (or --run to take a trained encoder)")
    weights = None if args.weights is None else Path(args.weights)
    source = "random initialisation (seed 0)" if weights is None else str(weights.resolve())
    big_stages = 1 if args.big_stages is None else args.big_stages
    return EncoderChoice(args.encoder, big_stages, 1 << 24, weights, source, args.tile_size)


def build_encoder_for(choice: EncoderChoice, flag: str):
    """The encoder of ``choice``; weight problems are re-worded for the command line flag ``flag``."""
    from dpgs.wsi.features import build_extraction_encoder

    try:
        return build_extraction_encoder(choice.name, choice.big_stages, choice.max_elements, choice.weights)
    except ValueError as err:
        raise ValueError(f"{flag}: {str(err).removeprefix(WEIGHTS_PREFIX)}") from None


def print_report(report, out_dir: str) -> None:
    c = report.counts
    tiles = sum(o.tiles for o in report.outcomes if o.status in ("extracted", "skipped"))
    print(f"{len(report.outcomes)} slides: {c['extracted']} extracted, {c['skipped']} already done, "
          f"{c['failed']} failed, {c['untiled']} without coords file; {tiles} tiles")
    for o in report.failed:
        print(f"  FAILED {o.slide_id}: {o.error}")
    print(f"  features: {out_dir}")


def run(args) -> int:
    from dpgs.modeling import resolve_device
    from dpgs.wsi.features import ExtractSettings, encoder_digest, extract_directory

    try:
        choice = choose_encoder(args)
        encoder = build_encoder_for(choice, "--run" if args.run else "--weights")
        settings = ExtractSettings(choice.name, encoder_digest(encoder), choice.source, choice.tile_size,
                                   args.batch_size)
        encoder.to(resolve_device(args.device))
        report = extract_directory(args.slides_dir, args.tiles_dir, args.out_dir, encoder, settings,
                                   progress=not args.no_progress)
    except (ValueError, OSError) as err:  # RunError and FileNotFoundError included
        print(f"dpgs extract: error: {err}", file=sys.stderr)
        return 2
    if not any(o.status != "untiled" for o in report.outcomes):
        print(f"dpgs extract: error: no slide of {args.slides_dir} has a coords file under {args.tiles_dir} "
              f"(run `dpgs tile {args.slides_dir} {args.tiles_dir}`)", file=sys.stderr)
        return 2
    print_report(report, args.out_dir)
    return 1 if report.failed else 0
