"""The engine contract of the trainer: what one fold needs (:class:`FoldSetup`), what trains it
(:class:`Engine`) and what lives for a whole command (:class:`Session`).

An :class:`Engine` runs the optimizer steps of an epoch and exposes the current model for evaluation; a
:class:`Session` lives for a whole ``dpgs train`` command and builds one engine per fold (the DPGS session,
``dpgs.distributed.session``, keeps Ray and its actors across folds; ``dpgs.train.local_engine`` runs the
single-process modes). The trainer only knows these protocols, so ``dpgs.train`` never imports
``dpgs.distributed``; ``dpgs.runner`` picks the session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dpgs.config.schema import Config
from dpgs.records import Checkpoint, DriverProgress
from dpgs.train.evaluate import EvalProtocol, Predictions


@dataclass(frozen=True)
class EpochSoFar:
    """What an epoch's steps before a checkpoint within it added to the epoch's summed metrics: the loss
    summed over their bags (``loss_sum``, summed in the order the epoch sums it), the bags (``bags``), the
    optimizer steps (``steps``) and, in DPGS, the bytes sent up and down and their dense size (zero in a
    single process). A checkpoint carries it, so the epoch resumed from there ends with the uninterrupted
    epoch's ``train_loss``, ``optimizer_steps`` and byte counts (all zero at an epoch's start)."""

    loss_sum: float = 0.0
    bags: int = 0
    steps: int = 0
    up_bytes: int = 0
    down_bytes: int = 0
    dense_bytes: int = 0

    def to_file(self) -> dict:
        return {"sum": self.loss_sum, "bags": self.bags, "steps": self.steps, "up_bytes": self.up_bytes,
                "down_bytes": self.down_bytes, "dense_bytes": self.dense_bytes}

    @classmethod
    def from_file(cls, saved: dict | None) -> EpochSoFar:
        """The inverse of :meth:`to_file`; None (a checkpoint written before it was kept): nothing."""
        if saved is None:
            return cls()
        return cls(float(saved["sum"]), int(saved["bags"]), int(saved["steps"]), int(saved["up_bytes"]),
                   int(saved["down_bytes"]), int(saved["dense_bytes"]))


@dataclass(frozen=True)
class Validation:
    """The bags a fold is validated on after every epoch (``indices``), and how (``protocol``)."""

    indices: tuple[int, ...]
    protocol: EvalProtocol


@dataclass
class FoldSetup:
    """What an engine needs to train one fold: the model's recipe and initial weights, the training data."""

    config: Config
    spec: Any  # dpgs.modeling.ModelSpec
    model: torch.nn.Module  # initial weights; the engine trains it (or a copy of its state)
    class_weights: torch.Tensor | None
    dataset: Any
    train_indices: list[int]
    device: torch.device
    output_dir: Path
    eval_dataset: Any = None  # what validation and testing read (None: ``dataset``)
    validation: Validation | None = None  # an engine may score it ahead (DPGS: with the epoch's last chunk)

    def __post_init__(self) -> None:
        if self.eval_dataset is None:
            self.eval_dataset = self.dataset


@dataclass(frozen=True)
class EpochEnd:
    """What is saved when an epoch ends: the current weights to every file of ``weights_files`` (``last.pt``,
    and ``best.pt`` when the epoch improved the monitored metric), then, in a single-split run
    (``Config.writes_checkpoints``), the checkpoint that continues at the start of epoch ``epoch + 1`` with
    ``history`` (every epoch's row)."""

    epoch: int
    history: list[dict]
    weights_files: tuple[Path, ...]


class Engine(Protocol):
    """One fold's optimizer steps (single process or DPGS); the trainer relies on nothing else."""

    def run_epoch(self, batches: list[list[int]], epoch: int, history: list[dict]) -> dict:
        """Train on the epoch's batches of bag indices; returns at least ``train_loss``, ``train_seconds``
        and ``optimizer_steps`` (MLflow metrics of the epoch)."""

    def evaluate(self, indices: list[int], protocol: EvalProtocol, state: dict | None = None) -> Predictions:
        """Predictions of the evaluation bags ``indices`` under ``protocol``, with the current weights or
        ``state`` (the driver merges shards scored wherever the engine runs; see dpgs.train.evaluate)."""

    def state_dict(self) -> dict:
        """The current weights (what ``last.pt`` and ``best.pt`` hold)."""

    def save_epoch(self, end: EpochEnd) -> None:
        """Write ``end``'s weights files and checkpoint. It may return before they are on disk (DPGS: the
        master writes them while the next epoch starts); :meth:`wait_saved` waits for them."""

    def wait_saved(self) -> None:
        """Return once everything :meth:`save_epoch` was asked to write is written; raise what writing it
        raised (``OSError`` naming the file)."""

    def restore(self, checkpoint: Checkpoint) -> DriverProgress:
        """Continue from ``checkpoint`` (one that this kind of engine wrote: the resume check compares
        ``train.mode``); returns its driver part (``epoch``, ``history``)."""

    def final_metrics(self) -> dict:
        """Metrics logged once at the end of the fold (for example ``worker_restarts``)."""

    def close(self) -> None:
        """Release what the engine holds for this fold."""


class Session(Protocol):
    """What one ``dpgs train`` command holds while it trains all its folds."""

    def engine(self, setup: FoldSetup) -> Engine:
        """The engine of one fold."""

    def close(self) -> None:
        """Release everything (called once, after the last fold)."""
