"""The Ray actor ``GroupWorker``: a thin wrapper around
:class:`dpgs.distributed.group_worker_state.GroupWorkerState` (one logical DPGS worker = G ranks)."""

from __future__ import annotations

import os
import sys

import ray
import torch

from dpgs.distributed.group_worker_state import GroupWorkerState
from dpgs.spatial.group import GroupFailure


@ray.remote(num_cpus=0, max_task_retries=0)
class GroupWorker:
    """Coordinator of a sample-parallel group: weight version, uplink encoder, dataset and the group.

    The actor itself only moves tensors (it needs no CPU bundle); its G ranks reserve their own
    placement group. Same ``compute`` contract as ``BagWorker``.
    """

    def __init__(self, rank: int, threads: int = 1, **state_kwargs):
        torch.set_num_threads(threads)
        self.state = GroupWorkerState(rank=rank, **state_kwargs)

    def ping(self) -> int:
        """The coordinator's process id (used to detect restarts, and by fault-injection tests)."""
        return os.getpid()

    def where(self) -> dict:
        """Node id, process id and device of the coordinator, and where each of its ranks runs."""
        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "pid": os.getpid(), "device": self.state.device,
                "ranks": self.state.where(), "leftovers_released": self.state.leftovers}

    @ray.method(num_returns=3)
    def compute(self, update: bytes | None, buffers, indices: list[int], step: int, keep_ratio: float,
                epoch: int = 0, prefetch: list[int] | tuple[int, ...] = ()):
        try:
            return self.state.compute(update, buffers, indices, step, keep_ratio, epoch, prefetch)
        except GroupFailure as err:
            # The group ran out of rebuilds and released its ranks: die, so that the engine restarts this
            # worker (a fresh group) and re-runs its bags, counting it against dpgs.max_worker_restarts.
            print(f"[dpgs] group worker {self.state.rank}: {err}; exiting for a restart", file=sys.stderr,
                  flush=True)
            os._exit(1)

    def close(self) -> None:
        """Release the ranks and their placement group (call before killing the actor)."""
        self.state.close()
