"""``dpgs tile``: tile a directory of slides into CLAM/TRIDENT-style coords files."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tile",
        help="tile whole-slide images into coords h5 files (tissue detection, thumbnails)",
        description=(
            "Tile every slide of SLIDES_DIR into non-overlapping tiles with tissue. Writes "
            "OUT_DIR/patches/{slide_id}.h5 (coords [N, 2] level-0 top-left, CLAM/TRIDENT attributes), "
            "OUT_DIR/thumbnails/{slide_id}.png (kept tiles outlined) and OUT_DIR/tiling_report.csv. "
            "Slides already tiled with the same settings are skipped; unreadable slides are reported and "
            "the others are tiled."
        ),
    )
    p.add_argument("slides_dir", metavar="SLIDES_DIR", help="directory of slides (.svs, .tif, .ndpi, ...)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (created; reused to resume)")
    p.add_argument("--tile-size", type=int, default=256, help="tile side in output pixels (default 256)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--magnification", type=float, default=None, help="tile at this magnification, e.g. 20 (default 20)"
    )
    where.add_argument("--level", type=int, default=None, help="tile at this pyramid level instead")
    p.add_argument(
        "--tissue", choices=("grey", "otsu"), default="grey", help="tissue detection (default grey)"
    )
    p.add_argument(
        "--min-tissue", type=float, default=0.6, help="keep tiles with at least this tissue fraction (0.6)"
    )
    p.add_argument("--workers", type=int, default=1, help="slides tiled in parallel processes (default 1)")
    p.add_argument("--thumbnail-size", type=int, default=1024, help="longer side of thumbnails (1024)")
    p.add_argument(
        "--backend", choices=("auto", "tiffslide", "openslide"), default="auto", help="slide reader (auto)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    from dpgs.wsi.tiling import TilingParams, tile_directory

    magnification = None if args.level is not None else (args.magnification or 20.0)
    try:
        params = TilingParams(
            tile_size=args.tile_size,
            magnification=magnification,
            level=args.level,
            tissue=args.tissue,
            min_tissue=args.min_tissue,
            thumbnail_size=args.thumbnail_size,
            backend=args.backend,
        )
        report = tile_directory(
            args.slides_dir, args.out_dir, params, workers=args.workers, progress=not args.no_progress
        )
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"dpgs tile: error: {err}", file=sys.stderr)
        return 2
    if not report.outcomes:
        print(f"dpgs tile: error: no slides found in {args.slides_dir}", file=sys.stderr)
        return 2
    c = report.counts
    total = sum(o.tiles for o in report.outcomes if o.status != "failed")
    print(
        f"{len(report.outcomes)} slides: {c['tiled']} tiled, {c['skipped']} already done, "
        f"{c['failed']} failed; {total} tiles"
    )
    for o in report.failed:
        print(f"  FAILED {o.slide_id}: {o.error}")
    print(f"  report: {report.report_path}")
    return 1 if report.failed else 0
