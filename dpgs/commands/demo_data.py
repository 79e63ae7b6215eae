"""``dpgs demo-data``: write the digits feature bags (MNIST-bags protocol) and their manifest."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo-data",
        help="write demo feature bags built from scikit-learn's 8x8 digits",
        description=(
            "Write MNIST-bags style demo data (Ilse et al. 2018) from scikit-learn's bundled 8x8 digits: "
            "OUT_DIR/features/{slide_id}.h5 and OUT_DIR/manifest.csv. A bag is positive when it holds a 9; "
            "with --classes 4 the label is the number of 9s clipped to 3."
        ),
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="new, empty, or previous demo directory (replaced)")
    p.add_argument("--bags", type=int, help="number of bags (default 200) or slides (default 8)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--classes", type=int, choices=(2, 4), default=2, help="2 (has a 9) or 4 (count of 9s)")
    p.add_argument(
        "--kind",
        choices=("bags", "slides"),
        default="bags",
        help="bags: digits feature bags (default); slides: small synthetic pyramidal TIFF slides",
    )
    p.add_argument(
        "--tumour-contrast",
        type=float,
        metavar="C",
        help="--kind slides: how far the tumour's nuclei texture is from normal tissue, in (0, 1] "
        "(default 1; smaller is a harder task)",
    )
    return p


def run(args) -> int:
    from dpgs.data.demo import read_summary, write_demo_data

    if args.kind == "slides":
        from dpgs.wsi.synthetic import write_synthetic_slides

        contrast = 1.0 if args.tumour_contrast is None else args.tumour_contrast
        try:
            manifest = write_synthetic_slides(
                args.out_dir, n_slides=args.bags or 8, seed=args.seed, tumour_contrast=contrast
            )
        except (ValueError, FileExistsError, OSError) as err:
            print(f"dpgs demo-data: error: {err}", file=sys.stderr)
            return 2
        print(f"wrote synthetic slides to {manifest.parent / 'slides'} and {manifest}")
        print(
            f"tile them with: dpgs tile {manifest.parent / 'slides'} {manifest.parent / 'tiles'} "
            "--tile-size 32"
        )
        return 0
    if args.tumour_contrast is not None:
        print("dpgs demo-data: error: --tumour-contrast applies to --kind slides only", file=sys.stderr)
        return 2
    try:
        manifest = write_demo_data(args.out_dir, bags=args.bags or 200, seed=args.seed, classes=args.classes)
    except (ValueError, FileExistsError, OSError) as err:
        print(f"dpgs demo-data: error: {err}", file=sys.stderr)
        return 2
    s = read_summary(manifest.parent)
    print(f"wrote {s['bags']} bags ({s['instances']} instances, 64 features each) to {manifest.parent}")
    print(f"  bag lengths: min {s['length_min']}, median {s['length_median']:g}, max {s['length_max']}")
    print(f"  labels: {s['label_counts']}  splits: {s['split_counts']}")
    print(f"  manifest: {manifest}")
    print(f"  features: {manifest.parent / 'features'}")
    return 0
