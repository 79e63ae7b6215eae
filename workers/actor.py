"""The Ray actor ``BagWorker``: a thin wrapper around :class:`dpgs.distributed.worker_state.WorkerState`."""

from __future__ import annotations

import os

import ray
import torch

from dpgs.distributed.worker_state import WorkerState


@ray.remote(max_task_retries=0)
class BagWorker:
    """Holds a model replica, its error-feedback residual and its weight version."""

    def __init__(self, rank: int, threads: int, **state_kwargs):
        torch.set_num_threads(threads)
        self.state = WorkerState(rank=rank, **state_kwargs)

    def ping(self) -> int:
        """The worker's process id (used to detect restarts, and by fault-injection tests)."""
        return os.getpid()

    def where(self) -> dict:
        """Node id, process id and device of this worker (printed at start-up)."""
        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "pid": os.getpid(), "device": str(self.state.device)}

    def receive(self, update: bytes) -> int:
        self.state.receive(update)
        return self.state.version

    @ray.method(num_returns=3)
    def compute(self, update: bytes | None, buffers, indices: list[int], step: int, keep_ratio: float,
                epoch: int = 0, prefetch: list[int] | tuple[int, ...] = ()):
        return self.state.compute(update, buffers, indices, step, keep_ratio, epoch, prefetch)
