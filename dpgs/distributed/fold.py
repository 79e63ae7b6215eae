"""What every rank of a DPGS group receives at the start of a fold."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpgs.distributed.sync import StepSync


@dataclass(frozen=True)
class FoldStart:
    """The fold's initial weights and class weights, and its step synchronisation: each rank keeps its own
    copy of ``sync`` with its own codec state (a new fold starts with empty residuals)."""

    name: str
    model_state: dict[str, torch.Tensor]
    class_weights: torch.Tensor | None
    sync: StepSync
