"""DMGC codec benchmark: payload size, compression ratio and timings of TopKCompressor.

For a 1M- and an 11.7M-element (ResNet-18-sized) gradient with heavy-tailed values (Student-t, 3 degrees of
freedom, times a log-normal scale per tensor, tensor sizes taken from ResNet-18), and for the real gradient
of a ResNet-18 (random 224x224 images, batch 8, random labels), at keep 10 %, 1 %, 0.1 %, 0.01 % with fp16
values it prints: payload bytes, ratio vs dense fp32, ratio of a plain COO encoding (int32 index + fp16
value, 6 bytes per entry) as a baseline, encode / decode / selection milliseconds. Each configuration runs
``--steps`` calls on a fresh compressor with changing gradients (error feedback on) and reports the median of
all calls but the first. Selection time is also given as a percentage of a ResNet-18 backward pass measured
in the same run. A second table compares value dtypes at 1 % keep.

    python benchmarks/compression.py
    python benchmarks/compression.py --sizes 1000000 --steps 3 --no-resnet
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from dpgs.biglayers import resnet18
from dpgs.compression import ParamLayout, TopKCompressor, decompress

KEEPS = [0.1, 0.01, 0.001, 0.0001]
RESNET18_NUMEL = 11_689_512


def heavy_tailed(numel: int, tensor_sizes: list[int], generator: torch.Generator) -> torch.Tensor:
    """Student-t(3) values times a log-normal scale per tensor (tensor sizes cycled until ``numel``)."""
    out = torch.empty(numel)
    student = torch.distributions.StudentT(torch.tensor(3.0))
    offset, i = 0, 0
    while offset < numel:
        size = min(tensor_sizes[i % len(tensor_sizes)], numel - offset)
        scale = float(torch.exp(torch.randn(1, generator=generator) - 7.0))
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        out[offset : offset + size] = student.sample((size,)) * scale
        offset, i = offset + size, i + 1
    return out


def run_codec(gradients: list[torch.Tensor], keep: float, steps: int, value_dtype: str = "fp16") -> dict:
    comp = TopKCompressor(value_dtype=value_dtype)
    rows = []
    for step in range(steps):
        flat = gradients[step % len(gradients)]
        payload = comp.compress(flat, keep)
        start = time.perf_counter()
        decompress(payload, expected_numel=flat.numel())
        decode_ms = (time.perf_counter() - start) * 1e3
        rows.append((comp.last_stats, decode_ms))
    kept = rows[1:] if len(rows) > 1 else rows
    stats = [s for s, _ in kept]
    numel = stats[0].numel
    count = statistics.median(s.count for s in stats)
    payload = statistics.median(s.payload_bytes for s in stats)
    return {
        "numel": numel, "keep": keep, "count": int(count), "payload": int(payload),
        "ratio": 4 * numel / payload, "coo_ratio": 4 * numel / (6 * count) if count else float("inf"),
        "bytes_per_entry": payload / count if count else float("nan"),
        "encode_ms": statistics.median(s.encode_ms for s in stats),
        "decode_ms": statistics.median(d for _, d in kept),
        "selection_ms": statistics.median(s.selection_ms for s in stats),
        "method": stats[-1].method,
    }


def resnet_backward(batch: int, side: int, repeats: int) -> tuple[float, list[torch.Tensor], list[int]]:
    """Median backward milliseconds of ResNet-18 (1000 classes) and the flat gradients of each pass."""
    torch.manual_seed(0)
    model = resnet18(num_classes=1000)
    times, grads = [], []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        x = torch.randn(batch, 3, side, side)
        y = torch.randint(0, 1000, (batch,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        start = time.perf_counter()
        loss.backward()
        if i:  # the first pass warms up the allocator
            times.append((time.perf_counter() - start) * 1e3)
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    sizes = [s.numel for s in ParamLayout.from_module(model)]
    return statistics.median(times), grads, sizes


def table(title: str, results: list[dict], backward_ms: float | None) -> None:
    print(f"\n### {title}\n")
    head = ("| numel | keep | sent | payload B | B/entry | ratio vs fp32 | COO int32+fp16 ratio "
            "| gain vs COO | encode ms | decode ms | selection ms | selection path |")
    if backward_ms is not None:
        head += " selection / backward |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        line = (f"| {r['numel']:,} | {r['keep'] * 100:g} % | {r['count']:,} | {r['payload']:,} | "
                f"{r['bytes_per_entry']:.2f} | {r['ratio']:,.1f}x | {r['coo_ratio']:,.1f}x | "
                f"{r['ratio'] / r['coo_ratio']:.2f}x | {r['encode_ms']:.1f} | {r['decode_ms']:.1f} | "
                f"{r['selection_ms']:.1f} | {r['method']} |")
        if backward_ms is not None:
            line += f" {100 * r['selection_ms'] / backward_ms:.2f} % |"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, RESNET18_NUMEL])
    parser.add_argument("--keeps", type=float, nargs="+", default=KEEPS)
    parser.add_argument("--steps", type=int, default=7,
                        help="calls per configuration (the first one is not counted)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--no-resnet", action="store_true", help="skip the ResNet-18 backward and gradient")
    args = parser.parse_args()

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}")
    backward_ms, real_grads, sizes = None, [], None
    if not args.no_resnet:
        backward_ms, real_grads, sizes = resnet_backward(args.batch, args.side, repeats=3)
        print(f"ResNet-18 backward, batch {args.batch} x 3 x {args.side} x {args.side}, CPU: "
              f"{backward_ms:.0f} ms (median of 3)")
    if sizes is None:
        sizes = [9408, 64, 64, 36864, 64, 64, 36864, 73728, 128, 147456, 294912, 589824, 1179648, 2359296]
    generator = torch.Generator().manual_seed(0)
    synthetic = {}
    for numel in args.sizes:
        synthetic[numel] = [heavy_tailed(numel, sizes, generator) for _ in range(3)]
        results = [run_codec(synthetic[numel], keep, args.steps) for keep in args.keeps]
        table(f"Synthetic heavy-tailed gradient, {numel:,} elements, fp16 values", results,
              backward_ms if numel == RESNET18_NUMEL else None)
    if real_grads:
        results = [run_codec(real_grads, keep, args.steps) for keep in args.keeps]
        table("Real ResNet-18 gradient (random images and labels), fp16 values", results, backward_ms)
    largest = synthetic[max(synthetic)]
    dtype_rows = []
    for dtype in ("fp32", "bf16", "fp16"):
        r = run_codec(largest, 0.01, args.steps, dtype)
        dtype_rows.append(r | {"method": f"{dtype} values"})
    table(f"Value dtypes at 1 % keep, synthetic {max(synthetic):,} elements", dtype_rows, None)


if __name__ == "__main__":
    main()
