"""Virtual nodes and emulated bandwidth (DPGS paper, Figures 3 and 5, Table 4).

    python benchmarks/virtual_nodes.py [--bags 400] [--epochs 3] [--out docs/benchmarks/virtual_nodes.md]

Part 1: P = 1, 2, 4 virtual nodes on this machine, B=16, no compression: epoch time, step time,
Ray overhead share, worker imbalance.
Part 2: P=2, B=16 with each payload delayed by its size over 10 / 100 / 1000 Mbps
(``dpgs.emulate_bandwidth_mbps``), for no compression (dense fp32 through the codec), DGC-style
top-0.1% (fp32 values, ``dpgs.compression.wire=dgc``: raw int32 indices, no entropy coding) and ours
(top-0.1%, fp16 values, delta-coded indices, zstd): epoch time and bytes per step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import ray
from _common import demo_manifest, emit, fmt, machine_line, markdown, run

SCHEMES = {
    "none": ["dpgs.compression.keep_ratio=1.0", "dpgs.compression.value_dtype=fp32"],
    "DGC-style": [
        "dpgs.compression.keep_ratio=0.001",
        "dpgs.compression.value_dtype=fp32",
        "dpgs.compression.wire=dgc",
    ],
    "ours": ["dpgs.compression.keep_ratio=0.001", "dpgs.compression.value_dtype=fp16"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    base = ["train.mode=dpgs", "train.batch_size=16", f"train.epochs={args.epochs}"]
    nodes, links = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, args.bags)
        for p_workers in (1, 2, 4):
            r = run(manifest, work, f"P-{p_workers}", *base, f"dpgs.workers={p_workers}", *SCHEMES["none"])
            step = r["mean"]("step_seconds")
            nodes.append(
                [
                    str(p_workers),
                    fmt(r["train_s"]),
                    fmt(step),
                    fmt(100 * r["mean"]("step_overhead_seconds") / step, ".0f") + "%",
                    fmt(r["mean"]("worker_imbalance"), ".2f"),
                ]
            )
        for mbps in (10, 100, 1000):
            for scheme, extra in SCHEMES.items():
                r = run(
                    manifest,
                    work,
                    f"{scheme}-{mbps}",
                    *base,
                    "dpgs.workers=2",
                    f"dpgs.emulate_bandwidth_mbps={mbps}",
                    *extra,
                )
                links.append(
                    [
                        f"{mbps} Mbps",
                        scheme,
                        fmt(r["train_s"]),
                        fmt(r["mean"]("step_seconds")),
                        fmt(r["mean"]("comm_bytes_per_step") / 1024, ".1f"),
                        fmt(r["mean"]("compression_ratio"), ".1f") + "x",
                        fmt(r["test"].get("test_auc")),
                    ]
                )
    ray.shutdown()
    text = (
        f"Demo bags {args.bags}, ABMIL, B=16, {args.epochs} epochs. {machine_line()}.\n\n"
        "Virtual nodes (no compression):\n\n"
        + markdown(["P", "train s/epoch", "s/step", "Ray overhead", "worker imbalance"], nodes)
        + "\n\nEmulated bandwidth (P=2, keep 0.1% for the compressed schemes):\n\n"
        + markdown(["link", "scheme", "train s/epoch", "s/step", "KiB/step", "ratio", "test AUC"], links)
    )
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
