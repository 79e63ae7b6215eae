"""Connecting to Ray, and the resources each worker gets.

* ``dpgs.address`` unset: always start a new local Ray instance sized to this machine
  (``address="local"``: another Ray on the machine, ``RAY_ADDRESS`` or a stale cluster file are ignored;
  dashboard off unless ``dpgs.dashboard``; object store ``dpgs.object_store_gb`` or 20% of RAM capped at
  8 GiB). ``auto`` or ``host:port``: join an existing cluster, with a clear error when there is none.
* On one machine, P virtual nodes share its CPUs (``cpus_per_worker`` = CPUs / P, so that the workers
  pack evenly onto the nodes) and GPU (``gpus_per_worker`` = 1 / P of a GPU); torch threads per worker are
  floor(cpus_per_worker), at least 1, so the workers together do not oversubscribe the cores.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import ray

from dpgs.config.schema import DpgsConfig
from dpgs.errors import RunFailure
from dpgs.interrupts import keep_signal_handlers
from dpgs.runwatch import WATCHER

RAY_NODE_ENV = {"RAY_object_manager_pull_timeout_ms": "60000"}
"""Settings every Ray node of a dpgs cluster is started with (``configs/cluster*.yaml`` export them in their
``ray start`` commands; docs/cluster.md). Ray's object manager asks again for an object it has not received
``object_manager_pull_timeout_ms`` after asking (Ray's default: 10 s), and the sender then sends it a
second time while the first copy is still arriving. An object that takes longer than that on a slow link
therefore crosses it twice: measured on the lab at 100 Mbit/s with 3 workers, each worker received the
fold's 46 MB of start weights (22 s through the head's link) twice, and again the test weights at the end.
60 s covers what dpgs sends through Ray (weights, evaluation weights, residuals for the checkpoint) up to
750 MB a link at 100 Mbit/s; a pull that really failed (its source gone) is retried after 60 s instead of
10 s, well within ``dpgs.call_timeout_s``."""


class ClusterError(RunFailure):
    """Ray cannot be reached or cannot host the requested workers."""

    exit_code = 2


def _default_object_store_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return int(min(total * 0.2, 8 << 30))


def _cluster_address(address: str) -> str | None:
    """``host:port`` of the cluster to join (``auto``: $RAY_ADDRESS, then Ray's current-cluster file)."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    return current.read_text().strip() if current.is_file() else None


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast (instead of Ray's long reconnect loop) when nothing listens at the cluster address."""
    target = _cluster_address(address)
    hint = "Start one with `ray start --head` or `ray up configs/cluster.yaml`, or unset dpgs.address."
    if not target:
        raise ClusterError(
            f"dpgs.address={address}: no Ray cluster found (no RAY_ADDRESS, no running cluster). {hint}"
        )
    host, _, port = target.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as err:
        raise ClusterError(
            f"dpgs.address={address}: no Ray cluster found at {target} ({err}). {hint}"
        ) from None


def connect(cfg: DpgsConfig) -> bool:
    """Start or join Ray; False when this process was already connected (nothing done). ``ray.init``
    installs its own SIGTERM handler; dpgs keeps its own (``dpgs.interrupts``), so a signal still ends the
    run cleanly."""
    if ray.is_initialized():
        return False
    if cfg.address:
        _probe(cfg.address)
        try:
            with keep_signal_handlers():
                ray.init(address=cfg.address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise ClusterError(
                f"dpgs.address={cfg.address}: no Ray cluster found ({err}). Start one with "
                "`ray start --head` or `ray up configs/cluster.yaml`, or unset dpgs.address to run locally."
            ) from None
        return True
    store = int(cfg.object_store_gb * (1 << 30)) if cfg.object_store_gb else _default_object_store_bytes()
    print("[dpgs] starting a local Ray instance for this run (dpgs.address unset; --address auto joins a "
          "running cluster)", flush=True)
    with keep_signal_handlers():
        context = ray.init(
            address="local",
            num_cpus=os.cpu_count(),
            include_dashboard=cfg.dashboard,
            object_store_memory=store,
            log_to_driver=True,
        )
    # stopped by the run watcher if Ray itself ends this process (raylet or GCS death)
    WATCHER.watch_ray_session(Path(context.address_info["session_dir"]).name)
    return True


@dataclass
class WorkerResources:
    """One worker's CPU and GPU share, its torch thread count and its device."""

    cpus: float
    gpus: float
    threads: int
    device: str


def worker_resources(cfg: DpgsConfig, train_device: str) -> WorkerResources:
    """Per-worker CPU/GPU share and torch thread count from the cluster's resources."""
    resources = ray.cluster_resources()
    total_cpus = float(resources.get("CPU", 1.0))
    total_gpus = float(resources.get("GPU", 0.0))
    # nodes without CPUs (a head started with --num-cpus=0) host no workers
    node_cpus = [c for n in ray.nodes() if n["Alive"] and (c := float(n["Resources"].get("CPU", 0.0))) > 0]
    node_cpus = node_cpus or [1.0]
    per_node = math.ceil(cfg.workers / len(node_cpus))  # workers spread evenly over the nodes
    cpus = cfg.cpus_per_worker or max(min(total_cpus / cfg.workers, min(node_cpus) / per_node), 0.01)
    use_gpu = train_device != "cpu" and total_gpus > 0
    if cfg.gpus_per_worker is not None:
        gpus = cfg.gpus_per_worker
    else:
        gpus = min(1.0, total_gpus / cfg.workers) if use_gpu else 0.0
    threads = max(1, int(cpus))
    return WorkerResources(cpus=cpus, gpus=gpus, threads=threads, device="cuda" if gpus > 0 else "cpu")
