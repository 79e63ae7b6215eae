"""DPGS virtual nodes on one GPU: P = 1, 2, 4 workers sharing one CUDA device (DPGS paper, Table 4).

    python benchmarks/virtual_nodes_gpu.py [--bags 1000] [--epochs 3] [--models abmil,transmil] [--out FILE]

Each worker gets 1/P of the GPU through Ray's fractional GPUs, and its CUDA allocator is capped at 1/P of
the device's memory (``dpgs.distributed.gpu_share``). Feature bags of ``make demo``'s data (digits, 64-d),
B=16, dense exchange (keep 100 %: the table is about sharing the GPU, not the link), Adam; one process
packed on the same GPU (``train.mode=packed``) is the baseline. The DPGS engine is driven directly, without
MLflow, so that the script runs where only torch, Ray and dpgs's own requirements are installed.

Per row: seconds per epoch (median over the epochs after the first), seconds per step, the slowest
worker's compute per step, the share of a step outside compute, bags per second, the largest CUDA memory
a worker allocated in a step (``worker_peak_device_mib``), the GPU's busy fraction (NVML, sampled every
50 ms over the measured epochs), and bytes per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from _common import demo_manifest, emit, fmt, markdown

from dpgs.config import load_config
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.train.engine import FoldSetup
from dpgs.train.local_engine import LocalEngine


class GpuBusy:
    """The GPU's busy fraction (NVML utilisation, percent) sampled every 50 ms while running."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: list[int] = []
        self.running = False

    def __enter__(self):
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @property
    def percent(self) -> float:
        return statistics.mean(self.samples) if self.samples else float("nan")


def batches_of(indices: list[int], batch: int, epoch: int) -> list[list[int]]:
    order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(epoch)).tolist()
    return [[indices[i] for i in order[s : s + batch]] for s in range(0, len(order), batch)]


def measure(config, data, epochs: int, workers: int | None, busy: GpuBusy) -> dict:
    """Train ``epochs`` epochs (DPGS with ``workers`` workers, or packed when None); the row's figures."""
    spec = ModelSpec(config.model, data.dataset.feature_dim, len(data.manifest.classes))
    torch.manual_seed(config.seed)
    model = spec.build()
    train = list(data.splits[0].train)
    times, stats, busy.samples = [], [], []
    if workers is None:
        engine = LocalEngine(model, config.train, torch.device("cuda"), None, config.seed, data.dataset, 2)
        for epoch in range(1, epochs + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with busy if epoch > 1 else nullcontext():
                engine.run_epoch(batches_of(train, config.train.batch_size, epoch), epoch)
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        steps = len(batches_of(train, config.train.batch_size, 1))
        epoch_s = statistics.median(times[1:])
        return {"epoch_s": epoch_s, "step_s": epoch_s / steps, "compute_s": None, "overhead": None,
                "bags_per_s": len(train) / epoch_s, "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
                "busy": busy.percent, "bytes": None}
    from dpgs.distributed.session import DpgsSession
    from dpgs.runner import dpgs_roles

    session = DpgsSession(config, dpgs_roles(config))
    try:
        engine = session.engine(FoldSetup(config, spec, model, None, data.dataset, train, torch.device("cpu"),
                                          Path(config.train.output_dir)))
        for epoch in range(1, epochs + 1):
            start = time.perf_counter()
            with busy if epoch > 1 else nullcontext():
                stats.append(engine.run_epoch(batches_of(train, config.train.batch_size, epoch), epoch, []))
            times.append(time.perf_counter() - start)
    finally:
        session.close()
    later = stats[1:]
    mean = lambda key: statistics.mean(s[key] for s in later)  # noqa: E731
    epoch_s = statistics.median(times[1:])
    return {"epoch_s": epoch_s, "step_s": mean("step_seconds"), "compute_s": mean("time_compute_seconds"),
            "overhead": mean("step_overhead_seconds") / mean("step_seconds"),
            "bags_per_s": len(train) / epoch_s,
            "peak_mib": max(s.get("worker_peak_device_mib", 0.0) for s in later), "busy": busy.percent,
            "bytes": mean("comm_bytes_per_step")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=3, help="the first is not measured")
    p.add_argument("--models", default="abmil,transmil")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("virtual_nodes_gpu.py needs a CUDA device")
    busy = GpuBusy()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, args.bags)
        for model in args.models.split(","):
            for workers in (None, 1, 2, 4):
                name = "packed" if workers is None else f"dpgs P={workers}"
                config = load_config(None, [
                    f"data.manifest={manifest}", f"data.features_dir={manifest.parent / 'features'}",
                    f"train.output_dir={work / 'runs' / model / name.replace(' ', '')}",
                    f"tracking.uri=sqlite:///{work / 'mlflow.db'}", f"model.name={model}",
                    "train.device=cuda", "train.batch_size=16", "train.lr=5e-4", "train.scheduler=none",
                    f"train.mode={'packed' if workers is None else 'dpgs'}", f"dpgs.workers={workers or 1}",
                    "dpgs.compression.keep_ratio=1.0", "seed=0",
                ])
                data = load_experiment_data(config.data, seed=config.seed)
                r = measure(config, data, args.epochs, workers, busy)
                print(model, name, r, flush=True)
                rows.append([model, name, fmt(r["epoch_s"]), fmt(r["step_s"], ".4f"),
                             "-" if r["compute_s"] is None else fmt(r["compute_s"], ".4f"),
                             "-" if r["overhead"] is None else fmt(100 * r["overhead"], ".0f") + "%",
                             fmt(r["bags_per_s"], ".0f"), fmt(r["peak_mib"], ".1f"),
                             fmt(r["busy"], ".0f") + "%",
                             "-" if r["bytes"] is None else fmt(r["bytes"] / 1024, ".0f")])
    gpu = torch.cuda.get_device_name(0)
    text = (f"Demo bags {args.bags}, B=16, dense, {args.epochs} epochs (the first not measured). {gpu}, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, {os.cpu_count()} CPU cores.\n\n"
            + markdown(["model", "run", "s/epoch", "s/step", "compute s/step", "outside compute", "bags/s",
                        "peak MiB per worker", "GPU busy", "KiB/step"], rows))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
