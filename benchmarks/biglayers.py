"""Runtime sweep of big-layer ResNets (Big-Layers paper, Figure 2 / Appendix A.2).

For the dense model and big_stages 0..3 it times training iterations (forward + backward + Adam step) on
one [1, 3, side, side] image, after warm-up, and fits t(A) = a * A^b + c (A = side^2, a, b, c >= 0) per
configuration with a grid over b and non-negative least squares for a and c; it prints b, R^2 and the
doubling factor F = t(2 A_med) / t(A_med). Ratios are against the dense model at the same side.

On CUDA it also prints the transfer-bound time (bytes staged by big layers / measured pinned
host-to-device bandwidth) and the peak allocated GPU memory. Sides the dense model cannot run (out of
memory) are reported as OOM.

    python benchmarks/biglayers.py                      # CPU: sides 256 .. 2048
    python benchmarks/biglayers.py --arch resnet50 --sides 256 512 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dpgs.biglayers import resnet18, resnet50
from dpgs.biglayers.transfer import channel_for

CPU_SIDES = [256, 362, 512, 724, 1024, 1448, 2048]
GPU_SIDES = [4096, 5793, 8192, 11585, 16384, 23170, 32768]


def fit_power_law(area: np.ndarray, t: np.ndarray) -> tuple[float, float, float, float]:
    """Least-squares fit of t = a * A^b + c with a, b, c >= 0; returns (a, b, c, R^2)."""
    best = None
    scaled = area / area.max()  # numerically safe basis; a is rescaled at the end
    for b in np.arange(0.1, 3.0005, 0.001):  # b = 0 would make a and c collinear
        basis = scaled ** b
        design = np.stack([basis, np.ones_like(basis)], axis=1)
        (a, c), *_ = np.linalg.lstsq(design, t, rcond=None)
        if c < 0:  # constrained: c = 0
            a, c = float(basis @ t / (basis @ basis)), 0.0
        if a < 0:
            a, c = 0.0, float(t.mean())
        sse = float(((a * basis + c - t) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, a / area.max() ** b, float(b), c)
    sse, a, b, c = best
    r2 = 1.0 - sse / float(((t - t.mean()) ** 2).sum())
    return a, b, c, r2


def doubling_factor(a: float, b: float, c: float, area_med: float) -> float:
    return (a * (2 * area_med) ** b + c) / (a * area_med ** b + c)


def time_config(arch: str, big_stages: int, side: int, max_elements: int, device: torch.device,
                warmup: int, repeats: int) -> dict:
    torch.manual_seed(0)
    build = resnet18 if arch == "resnet18" else resnet50
    model = build(big_stages=big_stages, max_elements=max_elements, num_classes=2, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(1, 3, side, side)
    target = torch.tensor([1])
    channel = channel_for(device, True) if device.type == "cuda" else None
    times, moved = [], 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + repeats):
        before = (channel.bytes_to_device + channel.bytes_to_host) if channel else 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x if big_stages >= 0 else x.to(device)),
                                                 target.to(device))
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            moved = ((channel.bytes_to_device + channel.bytes_to_host) - before) if channel else 0
    result = {"mean": statistics.mean(times), "std": statistics.pstdev(times), "bytes": moved}
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def host_to_device_bandwidth(device: torch.device) -> float:
    """Measured pinned host -> device copy bandwidth in bytes/s (256 MiB copies)."""
    src = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    src.to(device, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        src.to(device, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * src.numel() / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["resnet18", "resnet50"], default="resnet18")
    parser.add_argument("--sides", type=int, nargs="+")
    parser.add_argument("--stages", type=int, nargs="+", default=[-1, 0, 1, 2, 3])
    parser.add_argument("--max-elements", type=int, default=1 << 22)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sides = args.sides or (GPU_SIDES if device.type == "cuda" else CPU_SIDES)
    bandwidth = host_to_device_bandwidth(device) if device.type == "cuda" else None

    print(f"# {args.arch}, device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"max_elements {args.max_elements}, warm-up {args.warmup}, repeats {args.repeats}")
    if bandwidth:
        print(f"# pinned host->device bandwidth {bandwidth / 1e9:.1f} GB/s")
    name = lambda k: "dense" if k < 0 else f"big_stages={k}"  # noqa: E731
    header = "| side | config | time (s) | std (s) | vs dense |"
    if device.type == "cuda":
        header += " transfer-bound (s) | peak GPU (GiB) |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    results: dict[int, dict[int, dict]] = {k: {} for k in args.stages}
    for side in sides:
        dense_time = None
        for k in args.stages:
            try:
                r = time_config(args.arch, k, side, args.max_elements, device, args.warmup, args.repeats)
            except torch.OutOfMemoryError:
                print(f"| {side} | {name(k)} | OOM | | |")
                torch.cuda.empty_cache()
                continue
            results[k][side] = r
            dense_time = r["mean"] if k < 0 else dense_time
            ratio = f"{r['mean'] / dense_time:.2f}x" if dense_time else "n/a"
            row = f"| {side} | {name(k)} | {r['mean']:.3f} | {r['std']:.3f} | {ratio} |"
            if device.type == "cuda":
                bound = r["bytes"] / bandwidth if k >= 0 else 0.0
                row += f" {bound:.3f} | {r['peak_gib']:.2f} |"
            print(row, flush=True)

    print("\n| config | n | a | b | c | R^2 | doubling factor |")
    print("|---|---|---|---|---|---|---|")
    for k in args.stages:
        pts = sorted(results[k].items())
        if len(pts) < 3:
            continue
        area = np.array([s * s for s, _ in pts], dtype=np.float64)
        t = np.array([r["mean"] for _, r in pts])
        a, b, c, r2 = fit_power_law(area, t)
        f = doubling_factor(a, b, c, float(np.median(area)))
        print(f"| {name(k)} | {len(pts)} | {a:.3e} | {b:.2f} | {c:.3e} | {r2:.3f} | {f:.2f} |")
    print(f"\nmax_elements = {args.max_elements} ({args.max_elements * 4 / 2**20:.0f} MiB in float32)")


if __name__ == "__main__":
    main()
