"""Throughput of tile-bag training: frozen encoder on the fly vs end to end with big layers vs dense.

    python benchmarks/tiles.py [--source slides|memory] [--tile-size 64] [--tiles-per-bag 64] [--bags 6]
                               [--encoder resnet18] [--big-stages 1] [--device cpu|cuda] [--amp]
                               [--out docs/benchmarks/tiles.md]

One optimizer step per bag (classic), the same TileMIL (encoder + ABMIL) in three configurations:

* ``frozen``: ``freeze_encoder=True``, the baseline of almost every MIL tool, except that embeddings
  are computed on the fly (no feature extraction pass): encoder forward under ``no_grad``, head trained;
* ``e2e-big``: encoder and head trained end to end, stages 0..``big_stages`` as big layers;
* ``e2e-dense``: the same with the plain (dense) encoder, where it fits.

``--source slides`` writes synthetic slides, tiles them and reads every bag from the slide files with
the per-slide augmentation (thread-pool reads, the next bag prefetched while the current one trains),
as ``dpgs train data.kind=tiles`` does. ``--source memory`` trains on random tiles held in memory
(compute only; runs where no slide reader is installed). Printed per configuration: seconds per bag,
tiles per second, the ratio to ``frozen``, and on CUDA the peak device memory. The first bag of each
configuration is a warm-up and is not timed.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from dpgs.models import build_head
from dpgs.models.tilemil import TileMIL, build_encoder


class MemoryBags:
    """``bags`` random normalised tile bags of ``tiles`` tiles each, labels alternating."""

    def __init__(self, bags: int, tiles: int, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randn(tiles, 3, size, size, generator=g) for _ in range(bags)]

    def __len__(self) -> int:
        return len(self.items)

    def get(self, i: int, epoch: int):
        return self.items[i], i % 2


class SlideBags:
    """Bags read from synthetic slides by a :class:`~dpgs.wsi.tiles.TileBagDataset` (augmentation on)."""

    def __init__(self, work: Path, bags: int, tiles: int, size: int, seed: int = 0):
        from dpgs.wsi.augment import AugmentConfig, BagAugment
        from dpgs.wsi.synthetic import write_synthetic_slides
        from dpgs.wsi.tiles import TileBagDataset, TileBagItem
        from dpgs.wsi.tiling import TilingParams, tile_directory

        side = max(512, int((8 * tiles) ** 0.5 + 2) * size)  # enough tissue tiles at level 0
        manifest = write_synthetic_slides(work / "slides", n_slides=bags, seed=seed, size=(side, side),
                                          levels=2)
        tile_directory(manifest.parent / "slides", work / "tiles", TilingParams(tile_size=size, level=0),
                       progress=False)
        items = [TileBagItem(f"slide_{i:03d}", manifest.parent / "slides" / f"slide_{i:03d}.tif",
                             work / "tiles" / "patches" / f"slide_{i:03d}.h5", i % 2) for i in range(bags)]
        self.dataset = TileBagDataset(items, tiles_per_bag=tiles, seed=seed,
                                      augment=BagAugment(AugmentConfig()), threads=4)
        short = [n for n in self.dataset.tile_counts() if n < tiles]
        if short:
            raise RuntimeError(f"synthetic slides hold too few tiles for {tiles} per bag: {short}")

    def __len__(self) -> int:
        return len(self.dataset)

    def get(self, i: int, epoch: int):
        bag = self.dataset.get(i, epoch)
        return bag.features, bag.label


def prefetched(source, order: list[int]):
    """Bags of ``order``, the next one read in a background thread while the caller trains."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(source.get, order[0], 1)
        for k in range(len(order)):
            item = pending.result()
            if k + 1 < len(order):
                pending = pool.submit(source.get, order[k + 1], 1)
            yield item


def build(encoder: str, big_stages: int, frozen: bool, device: torch.device) -> TileMIL:
    torch.manual_seed(0)
    enc = build_encoder(encoder, big_stages=big_stages, max_elements=1 << 22)
    return TileMIL(enc, build_head("abmil", enc.feature_dim, 2), freeze_encoder=frozen).to(device)


def measure(source, name: str, encoder: str, big_stages: int, frozen: bool, device: torch.device,
            amp: bool) -> dict:
    """Seconds per bag over ``len(source) - 1`` timed bags (one optimizer step each) and peak memory."""
    model = build(encoder, big_stages, frozen, device).train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    order = list(range(len(source)))
    tiles = 0
    start = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for k, (x, label) in enumerate(prefetched(source, order)):
        if k == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = model.loss(x, torch.tensor(label))
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        optimizer.step()
        if k >= 1:
            tiles += x.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    timed = len(order) - 1
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"name": name, "s_per_bag": seconds / timed, "tiles_per_s": tiles / seconds, "peak": peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=("slides", "memory"), default="slides")
    p.add_argument("--tile-size", type=int, default=64)
    p.add_argument("--tiles-per-bag", type=int, default=64)
    p.add_argument("--bags", type=int, default=6, help="bags per configuration (the first is a warm-up)")
    p.add_argument("--encoder", choices=("resnet18", "resnet50"), default="resnet18")
    p.add_argument("--big-stages", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--skip-dense", action="store_true", help="leave out e2e-dense (when it does not fit)")
    p.add_argument("--out", help="also write the Markdown table here")
    args = p.parse_args(argv)
    if args.bags < 2:
        p.error("--bags must be >= 2 (the first bag is a warm-up)")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.source == "slides":
            source = SlideBags(Path(tmp), args.bags, args.tiles_per_bag, args.tile_size)
        else:
            source = MemoryBags(args.bags, args.tiles_per_bag, args.tile_size)
        configs = [("frozen (on the fly)", -1, True), (f"e2e-big (big_stages={args.big_stages})",
                                                       args.big_stages, False)]
        if not args.skip_dense:
            configs.append(("e2e-dense", -1, False))
        rows = [measure(source, name, args.encoder, stages, frozen, device, args.amp)
                for name, stages, frozen in configs]
    base = rows[0]["s_per_bag"]
    where = (f"{torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    lines = [
        f"{args.encoder}, {args.tiles_per_bag} tiles of {args.tile_size} px per bag, one step per bag, "
        f"source={args.source}, {where}, torch {torch.__version__}{', bf16 autocast' if args.amp else ''}",
        "",
        "| configuration | s / bag | tiles / s | time vs frozen | peak device memory |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak'] / 2**20:.0f} MiB" if r["peak"] is not None else "n/a (CPU)"
        lines.append(f"| {r['name']} | {r['s_per_bag']:.3f} | {r['tiles_per_s']:.1f} | "
                     f"{r['s_per_bag'] / base:.2f}x | {peak} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
