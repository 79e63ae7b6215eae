"""The messages that cross actor boundaries in DPGS (driver, master, workers), as dataclasses.

Ranks: the master is rank 0 of the DPGS group, worker ``w`` (0-based) is rank ``w + 1``
(``dpgs.distributed.transport``). A step's *version* is the number of optimizer steps the model has
taken: step ``index`` takes every replica from version ``index`` to ``index + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dpgs.records import DriverProgress
    from dpgs.train.evaluate import EvalProtocol, Predictions


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: which bags each worker reads, in micro-batches, and the step's settings.

    ``bags[w][m]`` are the bag indices of micro-batch ``m`` for worker ``w`` (one packed forward/backward
    each; ``train.accumulation_steps`` micro-batches per step). The gradient of the step is the mean over
    all ``n_bags`` bags of the per-bag loss gradients. ``frozen_second_moment``: Adam's second moment is
    frozen from this step on if it is compressed (every rank freezes at the same step;
    ``dpgs.distributed.schedule.KeepSchedule.second_moment_frozen``).
    """

    index: int
    epoch: int
    step_in_epoch: int
    bags: tuple[tuple[tuple[int, ...], ...], ...]
    lr: float
    keep_ratio: float
    frozen_second_moment: bool = False

    @property
    def n_bags(self) -> int:
        return sum(len(micro) for worker in self.bags for micro in worker)

    def worker_bags(self, worker: int) -> list[int]:
        """Every bag of ``worker`` in this step, in micro-batch order."""
        return [i for micro in self.bags[worker] for i in micro]

    def counts(self) -> list[int]:
        """Bags per worker."""
        return [sum(len(m) for m in worker) for worker in self.bags]


@dataclass(frozen=True)
class EpochCheckpoint:
    """The checkpoint that a single-split run's epoch end writes beside its weights files
    (``Master.save_epoch``): where, and the driver's progress (``dpgs.records``)."""

    path: str
    driver: DriverProgress


@dataclass(frozen=True)
class ChunkPlan:
    """Consecutive steps that the ranks run without the driver; ``after`` is the step that follows the
    chunk in the same epoch (its bags are read ahead), or None; ``score``: bags the workers score once the
    chunk's steps are done."""

    steps: tuple[StepPlan, ...]
    after: StepPlan | None = None
    score: ShardedScoring | None = None

    def from_index(self, index: int) -> ChunkPlan:
        """The same chunk without the steps before ``index`` (after a failure)."""
        return ChunkPlan(tuple(s for s in self.steps if s.index >= index), self.after, self.score)


@dataclass(frozen=True)
class ShardedScoring:
    """Bags scored by the workers with the weights a chunk leaves, in the same call (the epoch's validation,
    one round trip less per epoch): worker w scores ``shards[w]`` under ``protocol`` with its replica, which
    must be exactly the master's model."""

    shards: tuple[tuple[int, ...], ...]
    protocol: EvalProtocol


@dataclass(frozen=True)
class ReplicaState:
    """What every in-sync worker holds at ``version`` (sent after a failure, a resume or a new fold).

    ``params``: flat float32 trainable parameters; ``buffers``: flat float32 floating-point buffers (None
    without BatchNorm); ``optimizer``: the optimizer state for workers that step a replica optimizer
    (``dpgs.compression.downlink=gradients``), else None.
    """

    version: int
    params: torch.Tensor
    buffers: torch.Tensor | None
    optimizer: dict | None


@dataclass
class WorkerStep:
    """What worker ``worker`` did in step ``index`` (seconds are wall time in the worker). The step's loss,
    bags and bytes in all are the master's report (:class:`MasterStep`), which a worker's failure does not
    lose; the bytes here are this worker's."""

    index: int
    worker: int
    n_bags: int
    instances: int
    read_wait_seconds: float  # waiting for bags that the read-ahead had not finished
    compute_seconds: float  # forward + backward
    encode_seconds: float
    exchange_seconds: float  # sending the gradient and waiting for the step's update
    apply_seconds: float  # decoding the update, optimizer step or delta, loading weights
    up_bytes: int
    down_bytes: int
    halo_bytes: int = 0  # sample-parallel groups: traffic among the group's ranks
    group_restarts: int = 0
    peak_device_bytes: int = 0  # the most CUDA memory allocated during the step's compute (0 on CPU)


@dataclass
class MasterStep:
    """What the master did in step ``index``."""

    index: int
    n_bags: int
    loss_sum: float  # the step's bags' losses (each worker sends its sum with its gradient)
    grad_norm: float
    wait_seconds: float  # waiting for the workers' gradients
    decode_seconds: float
    optimizer_seconds: float
    encode_seconds: float  # downlink frame (and weight delta) encoding
    up_bytes: int  # every worker's message up
    down_bytes: int  # to every worker: the frame, and the other workers' payloads where they were relayed
    dense_bytes: int  # the same messages, up and down, were they dense (``sync.contract.dense_step_bytes``)
    step_seconds: float  # wall time since the previous step ended (or the chunk started)


@dataclass(frozen=True)
class Rehearsal:
    """Worker ``worker``'s answer to ``keep_ratio=auto``'s first decision (``Worker.rehearse``): the compute
    seconds of its part of the run's next step (computed and kept for that step) and what its codec spent at
    each compressed ratio tried on that gradient (``codec_seconds[k]``: the encode and a step's decodes)."""

    worker: int
    compute_seconds: float
    codec_seconds: dict[float, float]


@dataclass
class ChunkResult:
    """A rank's answer to a chunk: the steps it completed, and where it stopped when it could not go on
    (``interrupted_at``: the step whose exchange failed; None when the chunk completed)."""

    rank: int
    steps: list = field(default_factory=list)  # WorkerStep (workers) or MasterStep (master)
    interrupted_at: int | None = None
    reason: str = ""
    scored: Predictions | None = None  # a worker's shard of ``ChunkPlan.score``, once every step completed
