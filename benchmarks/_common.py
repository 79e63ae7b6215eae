"""Shared helpers of the training benchmarks: demo data, one training run, table formatting."""

from __future__ import annotations

import math
import platform
from pathlib import Path

import torch

from dpgs.config import load_config
from dpgs.data import write_demo_data

MACHINE = "2-core CPU VM, 24 GiB RAM, no GPU"


def loopback_channel(rank: int, world: int, ports, timeout_s: float):
    """Rank ``rank``'s ``GlooChannel`` of a group of processes on 127.0.0.1: rank 0 (the master) serves the
    store (``serve_store``: no port to race for) and puts its port on the queue ``ports`` once for each
    other rank, which takes it from there."""
    from dpgs.distributed.gloo import GlooChannel
    from dpgs.distributed.rendezvous import serve_store

    if rank != 0:
        return GlooChannel(rank, world, ("127.0.0.1", ports.get(timeout=timeout_s)), timeout_s=timeout_s)
    store = serve_store("127.0.0.1", timeout_s)
    for _ in range(world - 1):
        ports.put(store.port)
    return GlooChannel(0, world, ("127.0.0.1", store.port), timeout_s=timeout_s, store=store)


def machine_line() -> str:
    return f"{MACHINE} ({platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads)"


def demo_manifest(work: Path, bags: int, seed: int = 0) -> Path:
    return write_demo_data(work / "demo", bags=bags, seed=seed)


def run(manifest: Path, work: Path, name: str, *overrides: str) -> dict:
    """Train once; return per-epoch history, test metrics and derived timings."""
    from dpgs.runner import run_training  # MLflow with it: the other helpers run where it is not installed

    out = work / name
    cfg = load_config(
        None,
        [
            "experiment=benchmarks",
            f"tracking.run_name={name}",
            f"data.manifest={manifest}",
            f"data.features_dir={manifest.parent / 'features'}",
            f"train.output_dir={out}",
            f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
            "train.lr=5e-4",
            *overrides,
        ],
    )
    result = run_training(cfg)
    fold = result.folds[0]
    hist = fold.history
    steady = hist[1:] if len(hist) > 1 else hist
    mean = lambda key: sum(row.get(key, 0.0) for row in steady) / len(steady)
    return {
        "name": name,
        "history": hist,
        "test": fold.test_metrics,
        "train_s": mean("train_seconds") if "train_seconds" in hist[0] else mean("epoch_seconds"),
        "epoch_s": mean("epoch_seconds"),
        "best_val_auc": max((row.get("val_auc", -1.0) for row in hist), default=math.nan),
        "row": steady,
        "mean": mean,
    }


def time_to(history: list[dict], metric: str, target: float) -> float:
    """Elapsed seconds at the first epoch whose ``metric`` reaches ``target`` (NaN when never)."""
    for row in history:
        value = row.get(metric)
        if value is not None and value >= target - 1e-12:
            return row["elapsed_seconds"]
    return math.nan


def fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def emit(text: str, out: str | None) -> None:
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
