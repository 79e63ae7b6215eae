"""GPU benchmark of big-layer ResNets against the dense model (results: docs/benchmarks/biglayers_gpu.md).

One process measures everything, so every ratio is against a baseline taken in the same run:

* ``machine``: GPU, host, library versions, pinned host<->device copy bandwidth;
* ``sweep`` (a): ResNet-18/50, dense and ``big_stages`` 0..4, on one 1024^2, 2048^2, 4096^2 image and on a
  bag of 256 tiles of 224^2: time per training step (forward + backward, float32, the input starting in
  host RAM), ``torch.cuda.max_memory_allocated``, bytes staged by the big layers and their rate;
* ``overlap`` (b): double-buffered staging (``overlap=True``) against synchronous copies;
* ``amp`` (c): ``torch.autocast(bfloat16)`` against float32, with float32 or bfloat16 host storage;
* ``memory`` (d): dense peak memory against image area (linear fit, extrapolated to the whole GPU), and,
  under a device-memory cap, the largest dense image against a big model on a larger one.

Each section has a time budget; a configuration whose predicted time (from the same configuration at
a smaller input) does not fit in what is left is reported as skipped, as is one whose host activations
would not fit in the available host RAM.

    python3 benchmarks/biglayers_gpu.py                                  # every section, on CUDA
    python3 benchmarks/biglayers_gpu.py --sections sweep --budget 600
    python3 benchmarks/biglayers_gpu.py --device cpu --scale 0.0625      # smoke test of the script
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from dpgs.biglayers import DEFAULT_MAX_ELEMENTS, BigBatchNorm2d, BigConv2d, BigMaxPool2d, resnet18, resnet50
from dpgs.biglayers.transfer import channel_for

BUILD = {"resnet18": resnet18, "resnet50": resnet50}
SECTIONS = ("machine", "sweep", "overlap", "amp", "memory")
# share of --budget per timed section
SHARES = {"sweep": 0.62, "overlap": 0.12, "amp": 0.12, "memory": 0.14}
ARCH_SHARES = {"resnet18": 0.6, "resnet50": 0.4}  # of the sweep's share
GIB = 2**30
SLOW_S = 2.0  # a configuration whose warm-up step takes longer is timed once


@dataclass(frozen=True)
class Input:
    """``batch`` images of ``side`` x ``side`` pixels."""

    batch: int
    side: int

    @property
    def pixels(self) -> int:
        return self.batch * self.side * self.side

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.side}^2"


@dataclass
class Budget:
    """Seconds left to one section."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


@dataclass
class Result:
    mean: float
    std: float
    repeats: int
    peak_gib: float
    staged_gb: float  # bytes staged by big layers per step, both directions


def cfg_name(stages: int) -> str:
    return "dense" if stages < 0 else f"big_stages={stages}"


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else a large number."""
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 1 << 50


_HOST_PER_PIXEL: dict[tuple[str, int], float] = {}


def host_elements_per_pixel(arch: str, stages: int) -> float:
    """Elements of the host activations the big layers keep per input pixel (measured at 128^2 on CPU)."""
    key = (arch, stages)
    if stages < 0:
        return 0.0
    if key not in _HOST_PER_PIXEL:
        model = BUILD[arch](big_stages=stages, num_classes=0, device="cpu")
        total = [0]
        hooks = [m.register_forward_hook(lambda m, i, o: total.__setitem__(0, total[0] + o.numel()))
                 for m in model.modules() if isinstance(m, (BigConv2d, BigBatchNorm2d, BigMaxPool2d))]
        with torch.no_grad():
            model(torch.randn(2, 3, 128, 128))
        for h in hooks:
            h.remove()
        _HOST_PER_PIXEL[key] = total[0] / (2 * 128 * 128)
    return _HOST_PER_PIXEL[key]


def host_bytes_needed(arch: str, stages: int, inp: Input, storage: torch.dtype | None) -> float:
    """Host activations plus the gradients that live beside them in backward (a 1.6x allowance)."""
    size = torch.tensor([], dtype=storage or torch.float32).element_size()
    return 1.6 * host_elements_per_pixel(arch, stages) * inp.pixels * size


def step(model: torch.nn.Module, x: torch.Tensor, amp: torch.dtype | None, device: torch.device) -> None:
    """One training step without the optimiser: forward, a scalar loss, backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        y = model(x)
    y.float().square().mean().backward()


def staged_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return sum(channel_for(device, o).bytes_to_device + channel_for(device, o).bytes_to_host
               for o in (True, False))


def measure(arch: str, stages: int, inp: Input, device: torch.device, *, amp=None, storage=None,
            overlap: bool = True, max_elements: int = DEFAULT_MAX_ELEMENTS, warmup: int = 1,
            repeats: int = 2, slow_s: float = SLOW_S) -> Result | None:
    """Time ``repeats`` steps after ``warmup`` ones (one repeat when a warm-up step takes over ``slow_s``);
    ``None`` when the device runs out of memory."""
    free_device()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = x = None
    try:
        model = BUILD[arch](big_stages=stages, max_elements=max_elements, num_classes=0, device=device,
                            storage_dtype=storage, overlap=overlap)
        x = torch.randn(inp.batch, 3, inp.side, inp.side)
        times, moved = [], 0
        for i in range(warmup + repeats):
            before = staged_bytes(device)
            sync(device)
            start = time.perf_counter()
            step(model, x, amp, device)
            sync(device)
            elapsed = time.perf_counter() - start
            if i < warmup:
                if elapsed > slow_s:
                    repeats = 1
                continue
            times.append(elapsed)
            moved = staged_bytes(device) - before
            if len(times) >= repeats:
                break
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
        return Result(statistics.mean(times), statistics.pstdev(times), len(times), peak, moved / 1e9)
    except torch.OutOfMemoryError:
        return None
    finally:
        del model, x
        free_device()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """Runs configurations under a section budget, predicting their time from smaller inputs."""

    def __init__(self, device: torch.device, budget: Budget, host_fraction: float = 0.6) -> None:
        self.device, self.budget, self.host_fraction = device, budget, host_fraction
        self.seen: dict[tuple, tuple[int, float]] = {}  # config key -> (pixels, seconds per step)

    def run(self, arch: str, stages: int, inp: Input, **options) -> Result | str:
        key = (arch, stages, tuple(sorted((k, str(v)) for k, v in options.items())))
        need = host_bytes_needed(arch, stages, inp, options.get("storage"))
        if need > self.host_fraction * available_host_bytes():
            return f"skipped: needs ~{need / GIB:.0f} GiB host RAM"
        if key in self.seen:
            pixels, seconds = self.seen[key]
            step_s = seconds * inp.pixels / pixels
            predicted = step_s * (1 + (1 if step_s > SLOW_S else options.get("repeats", 2)))
            if predicted > self.budget.left():
                return f"skipped: predicted {predicted:.0f} s > {max(self.budget.left(), 0):.0f} s left"
        elif self.budget.left() <= 0:
            return "skipped: section budget spent"
        try:
            result = measure(arch, stages, inp, self.device, **options)
        except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
            traceback.print_exc()
            return f"error: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        if result is None:
            return "OOM"
        self.seen[key] = (inp.pixels, result.mean)
        return result


def print_table(header: list[str]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)


def row(cells: list) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def result_cells(r: Result | str, base: Result | str | None) -> list[str]:
    if isinstance(r, str):
        return [r, "", "", "", "", ""]
    ratio = f"{r.mean / base.mean:.2f}x" if isinstance(base, Result) else "n/a"
    rate = f"{r.staged_gb / r.mean:.1f}" if r.staged_gb else ""
    staged = f"{r.staged_gb:.1f}" if r.staged_gb else ""
    return [f"{r.mean:.3f} ± {r.std:.3f} (n={r.repeats})", ratio, f"{r.peak_gib:.2f}", staged, rate, ""]


# --- sections ------------------------------------------------------------------------------------------


def copy_rate(dst: torch.Tensor, src: torch.Tensor, device: torch.device, non_blocking: bool) -> float:
    """GB/s of ``dst.copy_(src)`` (one warm-up copy, then three timed)."""
    dst.copy_(src, non_blocking=non_blocking)
    sync(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=non_blocking)
    sync(device)
    return 3 * src.numel() * src.element_size() / (time.perf_counter() - start) / 1e9


def machine(device: torch.device) -> None:
    print("## machine")
    print(f"- python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, host RAM available {available_host_bytes() / GIB:.0f} GiB")
    print(f"- cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
          f"matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, cudnn.benchmark="
          f"{torch.backends.cudnn.benchmark}, default max_elements={DEFAULT_MAX_ELEMENTS}")
    if device.type != "cuda":
        return
    props = torch.cuda.get_device_properties(device)
    print(f"- GPU {props.name}, {props.total_memory / GIB:.1f} GiB, {props.multi_processor_count} SMs")
    for size in (64 << 20, 512 << 20):
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(size, dtype=torch.uint8)
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        rates = {name: copy_rate(dst, src, device, non_blocking)
                 for name, dst, src, non_blocking in (("pinned H2D", dev, pinned, True),
                                                      ("pinned D2H", pinned, dev, True),
                                                      ("pageable H2D", dev, pageable, False),
                                                      ("pageable D2H", pageable, dev, False),
                                                      ("host memcpy", pinned, pageable, False))}
        print(f"- {size >> 20} MiB copies (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    free_device()


def sweep(device: torch.device, budget: Budget, inputs: list[Input], archs: list[str],
          stages: list[int]) -> dict:
    print("\n## (a) sweep: time per step (forward + backward, float32) and peak device memory")
    print_table(["arch", "input", "config", "time (s)", "vs dense", "peak GPU (GiB)", "staged (GB)",
                 "staged GB/s"])
    runner = Runner(device, budget)
    results: dict = {}
    weights = [ARCH_SHARES[a] for a in archs]
    for a, arch in enumerate(archs):
        allotted = budget.seconds * sum(weights[:a + 1]) / sum(weights)  # cumulative, unspent time rolls on
        runner.budget = Budget(allotted - (budget.seconds - budget.left()))
        for inp in inputs:
            base = None
            for k in stages:
                r = runner.run(arch, k, inp)
                base = r if k < 0 else base
                results[(arch, inp, k)] = r
                row([arch, inp.name, cfg_name(k), *result_cells(r, base)[:5]])
    return results


def overlap_section(device: torch.device, budget: Budget, inp: Input, small: int) -> None:
    print(f"\n## (b) double-buffered staging vs synchronous copies (ResNet-18, big_stages=4, {inp.name})")
    print_table(["max_elements", "overlap", "time (s)", "vs overlap=False", "peak GPU (GiB)"])
    runner = Runner(device, budget)
    for max_elements in (DEFAULT_MAX_ELEMENTS, small):
        base = None
        for overlap in (False, True):
            r = runner.run("resnet18", 4, inp, overlap=overlap, max_elements=max_elements)
            base = r if not overlap else base
            c = result_cells(r, base)
            row([max_elements, overlap, c[0], c[1], c[2]])


def amp_section(device: torch.device, budget: Budget, cases: list[tuple[str, Input, int]]) -> None:
    print("\n## (c) mixed precision: autocast(bfloat16) vs float32")
    print_table(["arch", "input", "config", "precision", "time (s)", "vs float32", "peak GPU (GiB)"])
    runner = Runner(device, budget)
    for arch, inp, big in cases:
        for k in (-1, big):
            base = None
            variants = [("float32", None, None), ("autocast bf16", torch.bfloat16, None)]
            if k >= 0:
                variants.append(("autocast bf16 + bf16 storage", torch.bfloat16, torch.bfloat16))
            for name, amp, storage in variants:
                r = runner.run(arch, k, inp, amp=amp, storage=storage)
                base = r if amp is None else base
                c = result_cells(r, base)
                row([arch, inp.name, cfg_name(k), name, c[0], c[1], c[2]])


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    slope, intercept = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)
    return float(slope), float(intercept)


def memory_section(device: torch.device, budget: Budget, sweep_results: dict, cap_gib: float,
                   sides: list[int], big_side_factors: tuple[float, ...]) -> None:
    print("\n## (d) memory: dense peak grows with the image, big peak stays flat")
    runner = Runner(device, budget)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    for arch in ("resnet18", "resnet50"):
        pts = {k: [(inp.pixels, r.peak_gib) for (a, inp, kk), r in sweep_results.items()
                   if a == arch and kk == k and inp.batch == 1 and isinstance(r, Result)]
               for k in (-1, 4)}
        if len(pts[-1]) >= 2 and total:
            slope, base = fit_line(*zip(*pts[-1], strict=True))
            side = ((total / GIB - base) / slope) ** 0.5 if slope > 0 else float("nan")
            print(f"- {arch} dense: peak = {base:.2f} GiB + {slope * 2**20:.3f} GiB per megapixel "
                  f"({len(pts[-1])} sizes); extrapolated largest square image on "
                  f"{total / GIB:.0f} GiB: ~{side:.0f}^2")
        if pts[4]:
            print(f"- {arch} big_stages=4: peak " + ", ".join(f"{p / 2**20:.0f} MP: {g:.2f} GiB"
                                                             for p, g in sorted(pts[4])))
    if device.type != "cuda":
        return
    print(f"\nUnder a {cap_gib:g} GiB cap (torch.cuda.set_per_process_memory_fraction), ResNet-18, float32:")
    print_table(["config", "input", "time (s)", "peak GPU (GiB)", ""])
    free_device()
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / total, index)
    try:
        largest = None
        for side in sides:
            r = runner.run("resnet18", -1, Input(1, side), repeats=1)
            row(["dense", Input(1, side).name, *result_cells(r, None)[:1], *result_cells(r, None)[2:3], ""])
            if not isinstance(r, Result):
                break
            largest = side
        if largest is not None:
            # the big model on a larger image: the largest of these sides whose predicted time (from the
            # sweep) fits in what is left of the budget
            key = ("resnet18", 4, (("repeats", "1"),))
            for (a, inp, k), r in sweep_results.items():
                if a == "resnet18" and k == 4 and inp.batch == 1 and isinstance(r, Result):
                    runner.seen.setdefault(key, (inp.pixels, r.mean))
            for factor in big_side_factors:
                side = int(largest * factor) // 32 * 32
                r = runner.run("resnet18", 4, Input(1, side), repeats=1)
                row(["big_stages=4", Input(1, side).name, *result_cells(r, None)[:1],
                     *result_cells(r, None)[2:3], f"{side * side / largest**2:.2f}x the dense maximum area"])
                if isinstance(r, Result) or r == "OOM":
                    break
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        free_device()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for all timed sections")
    parser.add_argument("--archs", nargs="+", choices=list(BUILD), default=list(BUILD))
    parser.add_argument("--stages", type=int, nargs="+", default=[-1, 0, 1, 2, 3, 4])
    parser.add_argument("--inputs", nargs="+", default=["1x1024", "1x2048", "1x4096", "256x224"],
                        help="sweep inputs as BATCHxSIDE, in the order they run")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every image side (smoke tests)")
    parser.add_argument("--cap-gib", type=float, default=4.0, help="device-memory cap of section (d)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    s = lambda side: max(32, int(side * args.scale) // 32 * 32)  # noqa: E731
    inputs = [Input(int(b), s(int(side))) for b, side in (i.split("x") for i in args.inputs)]
    if "machine" in args.sections:
        machine(device)
    sweep_results: dict = {}
    budget = lambda name: Budget(args.budget * SHARES[name])  # noqa: E731
    if "sweep" in args.sections:
        sweep_results = sweep(device, budget("sweep"), inputs, args.archs, args.stages)
    if "overlap" in args.sections:
        overlap_section(device, budget("overlap"), Input(1, s(2048)), 1 << 20)
    if "amp" in args.sections:
        cases = [("resnet18", Input(1, s(2048)), 4), ("resnet50", Input(1, s(1024)), 2)]
        amp_section(device, budget("amp"), cases)
    if "memory" in args.sections:
        sides = [s(side) for side in (2048, 2560, 2816, 3072, 3584, 4096, 5120, 6144)]
        memory_section(device, budget("memory"), sweep_results, args.cap_gib, sides, (2.0, 1.5, 1.25))


if __name__ == "__main__":
    main()
