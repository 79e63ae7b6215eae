"""The contract of a DPGS step's exchange, both sides of it: :class:`StepSync`.

One ``StepSync`` object is built per fold from the config (``dpgs.distributed.sync.build_sync``) and
shipped to the master and to every worker inside the fold's start message; each rank keeps its own copy
with its own codec state (a worker's error-feedback residual, the master's delta residual). The ranks call
it and never ask which scheme it is.

In every scheme the step's gradient is ``(1 / B) sum_w g_w`` with ``g_w`` worker w's sum of per-bag loss
gradients, the gradient of the mean per-bag loss over the B bags. Floating-point buffers (BatchNorm
running statistics) are merged as the bag-weighted mean ``sum_w n_w s_w / B`` (summed in float64): each
worker's message up ends with its ``n_w s_w`` as float64 (8 bytes per value). The keep ratio of a step is
``StepPlan.keep_ratio`` (``dpgs.distributed.schedule``): 1 sends raw float32, below 1 top-k payloads.

A dense step's messages have sizes every rank knows before the step (:func:`step_bounds`): its exchange
is bounded (``dpgs.distributed.transport``), so a transport posts each receive before the message is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dpgs.compression import PayloadError
from dpgs.distributed.frames import frame_bytes
from dpgs.distributed.messages import MasterStep, StepPlan
from dpgs.distributed.replica import Replica
from dpgs.distributed.transport import Channel, as_bytes


@dataclass
class Contribution:
    """A worker's part of one step, kept until the step's exchange completes (re-sent after a failure,
    never recomputed, so every bag counts exactly once and the error-feedback residual stays right).

    ``body``: the message up (the gradient: raw float32 at keep ratio 1, else the compressed payload; then
    the float64 buffers times ``n_bags`` when the model has floating-point buffers).
    """

    step: int
    n_bags: int
    body: torch.Tensor
    payload_bytes: int  # the gradient's share of ``body``

    @property
    def up_bytes(self) -> int:
        return self.body.numel()


def contribution(
    step: int, n_bags: int, gradient: bytes | torch.Tensor, buffers: torch.Tensor | None
) -> Contribution:
    """The message up of a worker: ``gradient`` (payload bytes or raw float32 tensor) and ``buffers``. A
    tensor ``gradient`` is handed over: without buffers the message is a view of it (no copy), so the
    caller must not change it afterwards (the uplink codec returns a vector it keeps no hold of)."""
    grad = (
        as_bytes(gradient)
        if isinstance(gradient, torch.Tensor)
        else torch.frombuffer(bytearray(gradient), dtype=torch.uint8)
        if gradient
        else torch.empty(0, dtype=torch.uint8)
    )
    parts = [grad] if buffers is None else [grad, as_bytes(buffers.to(torch.float64) * n_bags)]
    return Contribution(step, n_bags, torch.cat(parts) if len(parts) > 1 else grad, grad.numel())


def split_up(bodies: list[torch.Tensor], replica: Replica) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Master: each worker's gradient part, and the sum of their buffer parts (float64, None without
    buffers)."""
    tail = 8 * replica.n_buffers
    grads, buffers = [], None
    for worker, body in enumerate(bodies):
        if body.numel() < tail:
            raise PayloadError(f"worker {worker} sent {body.numel()} bytes; expected at least {tail} bytes "
                               "of buffers")
        grads.append(body[: body.numel() - tail])
        if tail:
            part = body[body.numel() - tail :].clone().view(torch.float64)  # (any byte alignment)
            buffers = part.clone() if buffers is None else buffers.add_(part)
    return grads, buffers


@dataclass(frozen=True)
class Bounds:
    """The most bytes of a step's messages, each worker's up and the master's down (the ``bound`` of every
    ``Channel`` call of the step's exchange); None: unbounded."""

    up: int | None
    down: int | None


def step_bounds(step: StepPlan, replica: Replica) -> Bounds:
    """The same in every scheme. A dense step's: up, the raw float32 gradient (none from a worker without
    bags) and the float64 buffers; down, a frame of the float32 sum or weights and the float32 buffers. A
    compressed step is unbounded (a payload's size is known only once it is encoded, and the relay streams
    its pieces)."""
    if step.keep_ratio < 1.0:
        return Bounds(None, None)
    return Bounds(up=4 * replica.numel + 8 * replica.n_buffers,
                  down=frame_bytes([4 * replica.numel, 4 * replica.n_buffers]))


@dataclass(frozen=True)
class Received:
    """What the worker side of an exchange reports."""

    down_bytes: int
    exchange_seconds: float
    apply_seconds: float


class StepSync(Protocol):
    """How the ranks synchronise after each step (see the module docstring)."""

    scheme: str  # dpgs.compression.downlink
    worker_optimizer: bool  # workers step a replica of the master's optimizer
    exact_replicas: bool  # after each step every in-sync worker holds exactly the master's weights

    def contribute(
        self, step: StepPlan, n_bags: int, grad: torch.Tensor | None, buffers: torch.Tensor | None,
        replica: Replica,
    ) -> Contribution:
        """Worker: the message up of its gradient sum ``grad`` over ``n_bags`` bags (None without bags),
        from ``replica`` at the step's version (whose optimizer may precondition it)."""

    def codec_seconds(self, grad: torch.Tensor, keep_ratio: float, workers: int) -> float:
        """Worker: seconds its codec would spend in one step at ``keep_ratio`` < 1 with ``workers`` workers
        (encoding ``grad``, decoding and summing the step's payloads), this rank's codec state left as it
        was (``keep_ratio=auto``'s first decision)."""

    def worker(self, channel: Channel, step: StepPlan, part: Contribution, replica: Replica) -> Received:
        """Worker: send ``part``, receive the step's update, apply it to ``replica`` (version
        ``step.index + 1``)."""

    def master(self, channel: Channel, step: StepPlan, replica: Replica) -> MasterStep:
        """Master: receive the workers' parts, step ``replica``, send the update."""

    def restart(self, replica: Replica) -> None:
        """Master: every worker now holds ``replica``'s weights at its version (a new fold)."""

    def held(self, replica: Replica) -> torch.Tensor:
        """Master: the flat parameters in-sync workers hold (what a resynchronised worker gets)."""

    def state_dict(self) -> dict:
        """This rank's codec state (a worker's residual; the master's delta residual)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (resume)."""
