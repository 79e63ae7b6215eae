"""Measure the scaling model's inputs (``benchmarks/scaling_model.py``) on this machine, into a dict.

For each workload it measures, with the 1-minute load average beside every timed sample:

* **compute**: forward and backward of one packed pass over n bags, for a few n, fitted as a straight
  line in the pass's instances ``pass + instances * per_instance``; one bag costs ``per_instance`` times
  the mean bag length of the data (tile bags: one encoder pass per bag, so one bag is timed);
* **dense costs** on the real parameter vector: the worker's message up built (``contribution``), one
  dense gradient added on the master, weights loaded on a worker, one Adam step (``Replica.step``);
* **compression**, from a short DPGS run in one process on real bags (``P_max`` workers with one bag
  each per step, each with its own ``Uplink``, error feedback on; the master steps Adam on the
  mean gradient and encodes a ``downlink=delta`` weight delta): payload bytes, encode and decode+add
  seconds, and the union of the workers' top-k index sets for P = 1..P_max, fitted as
  ``k * P ** beta``; the sum of the first P payloads is encoded with the real codec (fp16 values over
  the union, dense small tensors) to measure what a merged downlink payload would weigh;
* **PowerSGD** (rank 4, torch's rules for which tensors it compresses): bytes of the P and Q factors
  and of the uncompressed tensors, and the hook's arithmetic replayed on the real shapes.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpgs.compression import KIND_GRADIENT, ParamLayout, decode
from dpgs.compression import wire as dmgc_wire
from dpgs.compression.dtypes import get_value_dtype, to_bits
from dpgs.config.schema import CompressionConfig, TrainConfig
from dpgs.distributed.codec import DeltaDownlink, Uplink
from dpgs.distributed.flat import flat_grads
from dpgs.distributed.frames import as_part
from dpgs.distributed.replica import Replica
from dpgs.distributed.sync import contribution
from dpgs.models import build_head
from dpgs.train.steps import batch_loss

KEEPS = (0.01, 0.001)
POWERSGD_RANK = 4
POWERSGD_MIN_COMPRESSION_RATE = 2.0  # torch's PowerSGDState default


def load1() -> float:
    return os.getloadavg()[0]


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[dict]:
    """``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones: [{"s", "load1"}]."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append({"s": time.perf_counter() - start, "load1": load1()})
    return samples


def median(samples: list[dict]) -> float:
    return statistics.median(s["s"] for s in samples)


@dataclass
class Bag:
    x: torch.Tensor
    label: int


@dataclass
class Source:
    """A workload to measure: its model, bags to time compute with, and distinct real bags."""

    name: str
    description: str
    build: Callable[[], torch.nn.Module]
    timing_bags: Callable[[int], list[Bag]]  # n bags for a packed timing pass
    real_bags: Callable[[int], list[Bag]]  # n distinct real bags
    pass_sizes: tuple[int, ...]  # bags per timed packed pass
    mean_instances: float  # mean bag length of the data the model is predicted for


def tile_source(work: Path, tiles: int, px: int, union_tiles: int, seed: int = 0) -> Source:
    """ResNet-18 (dense encoder) + ABMIL on tile bags. Compute is timed on random tiles of ``tiles``
    tiles per bag (the time does not depend on pixel values); real bags of ``union_tiles`` tiles come
    from synthetic slides (``dpgs.wsi``), tiled at ``px`` pixels, with the training augmentation."""
    from dpgs.models.tilemil import TileMIL, build_encoder

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        encoder = build_encoder("resnet18", big_stages=-1)
        return TileMIL(encoder, build_head("abmil", in_dim=encoder.feature_dim, num_classes=2))

    def timing_bags(n: int) -> list[Bag]:
        g = torch.Generator().manual_seed(seed)
        return [Bag(torch.randn(tiles, 3, px, px, generator=g), i % 2) for i in range(n)]

    def real_bags(n: int) -> list[Bag]:
        from dpgs.wsi.augment import AugmentConfig, BagAugment
        from dpgs.wsi.synthetic import write_synthetic_slides
        from dpgs.wsi.tiles import TileBagDataset, TileBagItem
        from dpgs.wsi.tiling import TilingParams, tile_directory

        side = px * max(8, math.ceil(2.2 * math.sqrt(union_tiles)))  # enough tissue tiles
        root = work / "slides"
        manifest = write_synthetic_slides(root, n_slides=max(2, n), seed=seed, size=(side, side), levels=2)
        tile_directory(manifest.parent / "slides", work / "tiles", TilingParams(tile_size=px, level=0),
                       progress=False)
        items = [TileBagItem(f"slide_{i:03d}", root / "slides" / f"slide_{i:03d}.tif",
                             work / "tiles" / "patches" / f"slide_{i:03d}.h5", i % 2) for i in range(n)]
        dataset = TileBagDataset(items, tiles_per_bag=union_tiles, seed=seed,
                                 augment=BagAugment(AugmentConfig()), threads=2)
        short = [c for c in dataset.tile_counts() if c < union_tiles]
        if short:
            raise RuntimeError(f"synthetic slides hold too few {px}-px tiles for {union_tiles} per bag: "
                               f"{short}")
        return [Bag(dataset.get(i, 1).features, items[i].label) for i in range(n)]

    return Source("tiles-resnet18",
                  f"ResNet-18 (dense) + ABMIL end to end, {tiles} tiles of {px}x{px} per bag (compression "
                  f"overlap on real {union_tiles}-tile bags of synthetic slides)",
                  build, timing_bags, real_bags, (1,), float(tiles))


def feature_source(work: Path, bags: int = 200, seed: int = 0) -> Source:
    """ABMIL head (64-d digit features, the demo data: log-normal bag lengths, median 24)."""
    import h5py

    from dpgs.data import write_demo_data

    manifest = write_demo_data(work / "demo", bags=bags, seed=seed)
    features = manifest.parent / "features"
    rows = [line.split(",") for line in manifest.read_text().splitlines()[1:]]

    def read(i: int) -> Bag:
        slide, label = rows[i % len(rows)][0], int(rows[i % len(rows)][1])
        with h5py.File(features / f"{slide}.h5") as h5:
            return Bag(torch.from_numpy(h5["features"][:]), label)

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_head("abmil", in_dim=64, num_classes=2)

    lengths = []
    for row in rows:
        with h5py.File(features / f"{row[0]}.h5") as h5:
            lengths.append(h5["features"].shape[0])
    return Source("features-abmil", "ABMIL head on the demo feature bags (64-d, median 24 instances)", build,
                  lambda n: [read(i) for i in range(n)], lambda n: [read(i) for i in range(n)],
                  (1, 4, 16, 64), float(np.mean(lengths)))


def loss_of(model: torch.nn.Module, bags: list[Bag]) -> torch.Tensor:
    """The sum of the bags' losses in one packed pass, as a DPGS worker computes it (``BagWorker``)."""
    out = batch_loss(model, [b.x for b in bags], torch.tensor([b.label for b in bags]), "packed")
    return out["per_bag"].sum()


def gradient(model: torch.nn.Module, bags: list[Bag]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss_of(model, bags).backward()
    return flat_grads(model)


def measure_compute(source: Source, model: torch.nn.Module, repeats: int) -> dict:
    """Forward and backward seconds per packed pass of n bags, the fit ``pass + instances *
    per_instance`` of each, and one mean bag's share (``bag_forward_s``, ``bag_backward_s``)."""
    model.train()
    passes = []
    for n in source.pass_sizes:
        bags = source.timing_bags(n)
        fwd, bwd = [], []
        loss_of(model, bags).backward()  # warm-up
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = loss_of(model, bags)
            mid = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            fwd.append({"s": mid - start, "load1": load1()})
            bwd.append({"s": end - mid, "load1": load1()})
        passes.append({"bags": n, "instances": sum(int(b.x.shape[0]) for b in bags), "forward": fwd,
                       "backward": bwd, "forward_s": median(fwd), "backward_s": median(bwd)})
    fit = {}
    for part in ("forward", "backward"):
        xs = [p["instances"] for p in passes]
        ys = [p[f"{part}_s"] for p in passes]
        if len(xs) == 1:
            fit[part] = (0.0, ys[0] / xs[0])
        else:
            slope, intercept = np.polyfit(xs, ys, 1)
            if intercept < 0:  # a line through the origin instead
                slope, intercept = float(np.dot(xs, ys) / np.dot(xs, xs)), 0.0
            fit[part] = (float(intercept), float(slope))
    return {"passes": passes, "mean_instances": source.mean_instances,
            "pass_s": fit["forward"][0] + fit["backward"][0],
            "per_instance_forward_s": fit["forward"][1], "per_instance_backward_s": fit["backward"][1],
            "bag_forward_s": fit["forward"][1] * source.mean_instances,
            "bag_backward_s": fit["backward"][1] * source.mean_instances}


def measure_dense(model: torch.nn.Module, grad: torch.Tensor, repeats: int) -> dict:
    """Dense-path costs on the real parameter vector and the Adam step (``dpgs.distributed``)."""
    replica = Replica(model, TrainConfig(optimizer="adam"))
    replica.restart(model.state_dict(), with_optimizer=True)
    buffers = replica.flat_buffers()
    total = grad.clone()
    state = torch.cat([replica.flat_params()] + ([] if buffers is None else [buffers.float()]))
    add = timed(lambda: total.add_(grad), repeats)
    pack = timed(lambda: contribution(0, 1, 0.0, grad, buffers), repeats)

    def load() -> None:
        replica.load_params(state[: replica.numel])
        replica.load_buffers(state[replica.numel :] if replica.n_buffers else None)

    loads = timed(load, repeats)
    steps = timed(lambda: replica.step(grad * 1e-3, 1e-4, 1.0), repeats)
    return {"numel": replica.numel, "buffer_numel": replica.n_buffers,
            "dense_add": add, "dense_pack": pack, "dense_load": loads, "optimizer": steps,
            "dense_add_s": median(add), "dense_pack_s": median(pack), "dense_load_s": median(loads),
            "optimizer_s": median(steps)}


def union_exponent(workers: list[int], union: list[int]) -> float:
    """Least-squares ``beta`` of ``union[P] = union[1] * P ** beta`` in log-log, through P = 1."""
    xs = np.log(np.asarray(workers[1:], dtype=float))
    ys = np.log(np.asarray(union[1:], dtype=float) / union[0])
    return float((xs * ys).sum() / (xs * xs).sum()) if xs.size else 1.0


def merged_payload(payloads: list[bytes], layout_ranges: np.ndarray, numel: int) -> tuple[bytes, int, float]:
    """The sum of ``payloads`` as one DMGC payload (fp16 values on the union of their sparse positions,
    the dense ranges dense): (payload, union entries, encode seconds)."""
    total = torch.zeros(numel)
    positions = []
    for p in payloads:
        decoded = decode(p, expected_numel=numel)
        decoded.add_to(total)
        dense = decoded.header.dense_count
        positions.append(decoded.positions[: decoded.positions.numel() - dense])
    start = time.perf_counter()
    union = torch.unique(torch.cat(positions))  # sorted
    dense_pos = torch.cat([torch.arange(int(o), int(o + n)) for o, n in layout_ranges]) \
        if len(layout_ranges) else torch.empty(0, dtype=torch.int64)
    fp16 = get_value_dtype("fp16")
    values = torch.cat([total[union], total[dense_pos]])
    payload = dmgc_wire.encode(kind=KIND_GRADIENT, numel=numel, indices=union.numpy(),
                               value_bits=to_bits(values, fp16), dtype=fp16, ranges=layout_ranges)
    return payload, int(union.numel()), time.perf_counter() - start


def measure_compression(source: Source, model: torch.nn.Module, workers: int, steps: int,
                        progress: Callable[[str], None]) -> dict:
    """The short one-process DPGS run of the module docstring (``workers`` x ``steps`` distinct bags)."""
    bags = source.real_bags(workers * steps)
    replica = Replica(model, TrainConfig(optimizer="adam"))
    replica.restart(model.state_dict(), with_optimizer=True)
    numel = replica.numel
    cfg = CompressionConfig(keep_ratio=KEEPS[0], warmup_epochs=0)
    layout = ParamLayout.from_module(model, dense_min_numel=cfg.dense_min_numel)
    encoders = {keep: [Uplink(cfg, layout) for _ in range(workers)] for keep in KEEPS}
    decoders = {keep: Uplink(cfg, layout) for keep in KEEPS}
    deltas = {keep: DeltaDownlink(cfg) for keep in KEEPS}
    for encoder in deltas.values():
        encoder.restart(replica.flat_params(), 0)
    ranges = layout.with_dense_min_numel(cfg.dense_min_numel).dense_ranges()
    records = {keep: {"payload_bytes": [], "entries": [], "encode": [], "decode_add": [], "delta_bytes": [],
                      "delta_encode": [], "union": []} for keep in KEEPS}
    model.train()
    for step in range(steps):
        grads = []
        for w in range(workers):
            grads.append(gradient(model, [bags[step * workers + w]]))
        progress(f"  step {step + 1}/{steps}: {workers} bag gradients")
        for keep in KEEPS:
            rec = records[keep]
            payloads = []
            for w, g in enumerate(grads):
                start = time.perf_counter()
                payload = encoders[keep][w].encode(g, keep)
                rec["encode"].append({"s": time.perf_counter() - start, "load1": load1()})
                rec["payload_bytes"].append(len(payload))
                rec["entries"].append(encoders[keep][w].compressor.last_stats.count)
                payloads.append(payload)
                start = time.perf_counter()
                decoders[keep].sum_into(torch.zeros(numel), [as_part(payload)], [1], keep)
                rec["decode_add"].append({"s": time.perf_counter() - start, "load1": load1()})
            sparse = []
            for p in payloads:
                d = decode(p, expected_numel=numel)
                sparse.append(d.positions[: d.positions.numel() - d.header.dense_count])
            seen: set[int] = set()
            union = []
            for s in sparse:
                seen.update(s.tolist())
                union.append(len(seen))
            merged = []
            for p in sorted({1, workers, *[2**i for i in range(1, 7) if 2**i < workers]}):
                blob, entries, seconds = merged_payload(payloads[:p], ranges, numel)
                merged.append({"workers": p, "entries": entries, "bytes": len(blob), "encode_s": seconds})
            rec["union"].append({"step": step, "union_entries": union, "merged": merged})
        mean = torch.stack(grads).mean(0)
        replica.step(mean, 1e-4, 1.0)
        for keep in KEEPS:
            start = time.perf_counter()
            delta = deltas[keep].update(replica.flat_params(), keep)
            records[keep]["delta_encode"].append({"s": time.perf_counter() - start, "load1": load1()})
            records[keep]["delta_bytes"].append(len(delta))
    out = {}
    for keep, rec in records.items():
        last = rec["union"][-1]
        ps = list(range(1, workers + 1))
        merged = last["merged"]
        entries = np.array([m["entries"] for m in merged], dtype=float)
        sizes = np.array([m["bytes"] for m in merged], dtype=float)
        per_entry, intercept = (np.polyfit(entries, sizes, 1) if len(merged) > 1
                                else (sizes[0] / entries[0], 0.0))
        out[f"{keep:g}"] = {
            "keep": keep,
            "payload_bytes": float(statistics.median(rec["payload_bytes"])),
            "entries": float(statistics.median(rec["entries"])),
            "encode_s": median(rec["encode"]),
            "decode_add_s": median(rec["decode_add"]),
            "delta_bytes": float(statistics.median(rec["delta_bytes"])),
            "delta_encode_s": median(rec["delta_encode"]),
            "union_exponent": union_exponent(ps, last["union_entries"]),
            "union_exponent_first_step": union_exponent(ps, rec["union"][0]["union_entries"]),
            "merged_intercept": float(intercept),
            "merged_per_entry": float(per_entry),
            "merged_encode_per_entry_s": float(sum(m["encode_s"] for m in merged) / entries.sum()),
            "samples": rec,
        }
    return out


def powersgd_bytes(model: torch.nn.Module, rank: int) -> dict:
    """Bytes all-reduced per step by torch's PowerSGD hook: a tensor of ndim > 1 viewed as
    ``[shape[0], numel / shape[0]]`` is compressed when ``2 * rank * (n + m) < n * m``; P is n x rank,
    Q is m x rank; every other tensor goes uncompressed."""
    p_elems = q_elems = plain = 0
    shapes = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        n = param.shape[0] if param.dim() > 1 else 0
        m = param.numel() // n if n else 0
        if n and POWERSGD_MIN_COMPRESSION_RATE * rank * (n + m) < n * m:
            p_elems += n * rank
            q_elems += m * rank
            shapes.append((n, m))
        else:
            plain += param.numel()
    return {"rank": rank, "p_bytes": 4 * p_elems, "q_bytes": 4 * q_elems, "uncompressed_bytes": 4 * plain,
            "shapes": shapes}


def measure_powersgd(model: torch.nn.Module, repeats: int) -> dict:
    """The hook's arithmetic per step on the real shapes, replayed: error feedback added, P = M Q,
    P orthogonalised (QR, as the hook does for rank > 2), Q = M^T P, M ~ P Q^T, new error."""
    info = powersgd_bytes(model, POWERSGD_RANK)
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(n, m, generator=g) for n, m in info["shapes"]]
    errors = [torch.zeros_like(m) for m in mats]
    qs = [torch.randn(m.shape[1], POWERSGD_RANK, generator=g) for m in mats]

    def hook() -> None:
        for mat, err, q in zip(mats, errors, qs, strict=True):
            mat.add_(err)
            p = mat @ q
            p, _ = torch.linalg.qr(p)
            q.copy_(mat.t() @ p)
            err.copy_(mat - p @ q.t())

    samples = timed(hook, repeats)
    return {**{k: v for k, v in info.items() if k != "shapes"}, "compress": samples,
            "compress_s": median(samples)}


def measure_workload(source: Source, repeats: int, union_workers: int, union_steps: int,
                     progress: Callable[[str], None]) -> dict:
    progress(f"{source.name}: compute")
    model = source.build()
    compute = measure_compute(source, model, repeats)
    progress(f"{source.name}: dense costs")
    grad = flat_grads(model)  # the last timed backward's
    dense = measure_dense(source.build(), grad, max(3, repeats))
    progress(f"{source.name}: compression ({union_workers} workers x {union_steps} steps of real bags)")
    compressed = measure_compression(source, source.build(), union_workers, union_steps, progress)
    progress(f"{source.name}: PowerSGD")
    powersgd = measure_powersgd(source.build(), max(3, repeats))
    return {"name": source.name, "description": source.description, "compute": compute, "dense": dense,
            "compressed": compressed, "powersgd": powersgd}


def measure_all(quick: bool, tiles: int, px: int, threads: int, progress: Callable[[str], None]) -> dict:
    """Every workload's inputs with ``threads`` torch threads; ``quick``: fewer repeats, workers, steps.

    One thread is the default: dpgs gives each of P >= 2 workers (and the master) ``floor(CPUs / P)``
    threads on a 2-core machine, and on a shared machine two threads make small operations wait for
    each other (measured: a head's top-k encode took 60x longer with 2 threads than with 1 at load 14).
    """
    import platform

    torch.set_num_threads(threads)
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="dpgs-scaling-") as tmp:
        work = Path(tmp)
        union_tiles = 8
        tile = tile_source(work / "tiles", tiles, px, union_tiles)
        feats = feature_source(work / "features")
        workloads = [
            measure_workload(tile, repeats, 4 if quick else 8, 2, progress),
            measure_workload(feats, 3 if quick else 5, 16 if quick else 64, 2 if quick else 3, progress),
        ]
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} torch thread(s)",
        "threads": threads,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "quick": quick,
        "load1_at_end": load1(),
        "workloads": {w["name"]: w for w in workloads},
    }
