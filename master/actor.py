"""The Ray actor ``Master``: a thin wrapper around :class:`dpgs.distributed.master_state.MasterState`."""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch

from dpgs.distributed.master_state import MasterState


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class Master:
    """Owns the parameters, the optimizer, the LR schedule and the step counter."""

    def __init__(self, model_spec, train_cfg, compression_cfg, threads: int = 1):
        torch.set_num_threads(threads)
        self.state = MasterState(model_spec, train_cfg, compression_cfg)

    def load_model_state(self, state: dict) -> int:
        """Start from the driver's initial weights (same initialisation as a single-process run)."""
        self.state.model.load_state_dict(state)
        return self.state.step_count

    def snapshot(self) -> bytes:
        return self.state.snapshot()

    def buffers(self):
        return self.state.buffers()

    @ray.method(num_returns=3)
    def step(self, n_bags: int, counts: list[int], keep_ratio: float, *payloads_and_buffers):
        """``payloads_and_buffers``: the P' gradient payloads, then the P' workers' buffers."""
        k = len(counts)
        payloads, buffers = list(payloads_and_buffers[:k]), list(payloads_and_buffers[k:])
        return self.state.step(n_bags, payloads, buffers, counts, keep_ratio)

    def end_epoch(self) -> float:
        return self.state.end_epoch()

    def model_state(self) -> dict:
        return self.state.model_state()

    def save_checkpoint(self, path: str, extra: dict) -> str:
        """Write master state + ``extra`` (driver progress, RNG states) atomically to ``path``."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(target.suffix + ".tmp")
        torch.save({"master": self.state.state_dict(), "driver": extra}, tmp)
        os.replace(tmp, target)
        return str(target)

    def load_checkpoint(self, master_state: dict) -> int:
        self.state.load_state_dict(master_state)
        return self.state.step_count
