"""The DPGS master role (rank 0 of the group): the parameters, the optimizer and the step count.

The pool (``dpgs.distributed.pool``) runs it as a Ray actor (``ray.remote(Master)``) on the driver's
node. Per step it receives every worker's gradient message, forms the mini-batch gradient

    g = (1 / B) * sum_w g_w,    B = number of bags in the step,

(``g_w``: worker w's sum of per-bag loss gradients), which is the gradient of the mean per-bag loss over
the B bags whatever their lengths and however they were spread, steps its optimizer and sends the update
(``dpgs.distributed.sync``). It is the authority the workers are resynchronised from after a failure,
and what checkpoints save and evaluation reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dpgs.config import Config
from dpgs.distributed.channel import Channel, ChannelBroken, Rendezvous, free_address
from dpgs.distributed.messages import MASTER_RANK, ChunkPlan, ChunkResult, FoldStart, ReplicaState
from dpgs.distributed.replica import Replica
from dpgs.distributed.sync import DeltaSync, step_sync
from dpgs.outputs import save_torch_atomically

CHECKPOINT_FORMAT = 2


class Master:
    def __init__(self, model_spec, config: Config, threads: int = 1):
        torch.set_num_threads(threads)  # the workers' count: replica optimizer steps are then bit-identical
        self.replica = Replica(model_spec.build(), config.train)
        self.sync = step_sync(config.dpgs.compression, config.train, self.replica.numel)
        self.channel: Channel | None = None

    # ---------------------------------------------------------------- the group
    def address(self) -> tuple[str, int]:
        """Where this process will host the next gloo group's rendezvous store."""
        return free_address()

    def join(self, rendezvous: Rendezvous) -> int:
        if self.channel is not None:
            self.channel.close()
        self.channel = None
        self.channel = rendezvous.open(MASTER_RANK)
        return os.getpid()

    # ---------------------------------------------------------------- folds and state
    def start_fold(self, fold: FoldStart) -> int:
        self.replica.restart(fold.model_state)
        self._restart_broadcast()
        return self.replica.version

    def _restart_broadcast(self) -> None:
        if isinstance(self.sync, DeltaSync):
            self.sync.encoder.start(self.replica.flat_params(), self.replica.version)

    def replica_state(self) -> ReplicaState:
        """What every in-sync worker holds now (``downlink=delta``: the broadcast's ``held``)."""
        held = self.sync.encoder.held if isinstance(self.sync, DeltaSync) else None
        return self.replica.state(held)

    def version(self) -> int:
        return self.replica.version

    def model_state(self) -> dict:
        return self.replica.model.state_dict()

    # ---------------------------------------------------------------- steps
    def run_chunk(self, plan: ChunkPlan) -> ChunkResult:
        """Run the chunk's steps; on a broken exchange, release the live workers and report where it
        stopped (the step that did not complete; None when every step of the chunk completed)."""
        result = ChunkResult(MASTER_RANK)
        for position, step in enumerate(plan.steps):
            if step.index != self.replica.version:
                raise RuntimeError(
                    f"master holds version {self.replica.version}, asked to run step {step.index}"
                )
            try:
                result.steps.append(self.sync.master(self.channel, step, self.replica))
            except ChannelBroken as err:
                # Not stepped: the live workers wait for this step's update. Stepped (sending failed): the
                # live workers took the step and, unless it was the chunk's last, send their next part.
                stepped = self.replica.version > step.index
                more = position + 1 < len(plan.steps)
                if not stepped or more:
                    self.channel.abort(drain=stepped)
                result.interrupted_at = self.replica.version if not stepped or more else None
                result.reason = str(err)
                return result
        return result

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything a resume needs from the master (the learning rate is a function of the step)."""
        state = {
            "format": CHECKPOINT_FORMAT,
            "model": self.replica.model.state_dict(),
            "optimizer": self.replica.optimizer.state_dict(),
            "step": self.replica.version,
        }
        if isinstance(self.sync, DeltaSync):
            state["held"] = self.sync.encoder.held.clone()
        return state

    def load_state_dict(self, state: dict) -> int:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"checkpoint format {state.get('format')} (this dpgs writes {CHECKPOINT_FORMAT})"
            )
        self.replica.model.load_state_dict(state["model"])
        self.replica.optimizer.load_state_dict(state["optimizer"])
        self.replica.version = int(state["step"])
        if isinstance(self.sync, DeltaSync):
            self.sync.encoder.start(state.get("held", self.replica.flat_params()), self.replica.version)
        return self.replica.version

    def save_checkpoint(self, path: str, driver: dict, workers: list) -> str:
        """Write ``{"master", "driver", "workers"}`` to ``path`` atomically (``dpgs.outputs``);
        ``workers``: each worker's error-feedback state (None in dense mode)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return str(save_torch_atomically({"master": self.state_dict(), "driver": driver, "workers": workers},
                                         path))

    def ping(self) -> int:
        return os.getpid()
