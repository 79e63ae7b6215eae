"""The contract of a DPGS step's exchange, both sides of it: :class:`StepSync`.

One ``StepSync`` object is built per fold from the config (``dpgs.distributed.sync.build_sync``) and
shipped to the master and to every worker inside the fold's start message; each rank keeps its own copy
with its own codec state (a worker's error-feedback residual, the master's delta residual). The ranks call
it and never ask which scheme it is.

In every scheme the step's gradient is ``(1 / B) sum_w g_w`` with ``g_w`` worker w's sum of per-bag loss
gradients, the gradient of the mean per-bag loss over the B bags. Floating-point buffers (BatchNorm
running statistics) are merged as the bag-weighted mean ``sum_w n_w s_w / B`` (summed in float64). Each
worker's message up is its gradient, then float64 values (:func:`tail_bytes`): the sum of its bags' losses
and its ``n_w s_w``. So the master holds every step's loss as well as its bags and bytes (:class:`Gathered`,
``MasterStep``): the epoch's metrics come from the master's reports, which survive a worker's failure. The
keep ratio of a step is ``StepPlan.keep_ratio`` (``dpgs.distributed.schedule``): 1 sends raw float32,
below 1 top-k payloads.

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
from dpgs.distributed.transport import Channel, ChannelBroken, as_bytes


@dataclass
class Contribution:
    """A worker's part of one step, kept until the step's exchange completes (re-sent after a failure,
    never recomputed, so every bag counts exactly once and the error-feedback residual stays right).

    ``body``: the message up (the gradient: raw float32 at keep ratio 1, else the compressed payload; then
    the float64 loss sum and buffers times ``n_bags``: :func:`contribution`).
    """

    step: int
    n_bags: int
    body: torch.Tensor
    payload_bytes: int  # the gradient's share of ``body``

    @property
    def up_bytes(self) -> int:
        return self.body.numel()


def tail_bytes(n_buffers: int) -> int:
    """Bytes after the gradient in every message up: the loss sum and ``n_buffers`` buffer values, float64."""
    return 8 * (1 + n_buffers)


def contribution(
    step: int, n_bags: int, loss_sum: float, gradient: bytes | torch.Tensor, buffers: torch.Tensor | None
) -> Contribution:
    """The message up of a worker: ``gradient`` (payload bytes or raw float32 tensor), then as float64 the
    sum of its ``n_bags`` bags' losses and ``buffers`` times ``n_bags``."""
    grad = (
        as_bytes(gradient)
        if isinstance(gradient, torch.Tensor)
        else torch.frombuffer(bytearray(gradient), dtype=torch.uint8)
        if gradient
        else torch.empty(0, dtype=torch.uint8)
    )
    tail = torch.tensor([loss_sum], dtype=torch.float64)
    if buffers is not None:
        tail = torch.cat([tail, buffers.to(torch.float64) * n_bags])
    return Contribution(step, n_bags, torch.cat([grad, as_bytes(tail)]), grad.numel())


@dataclass(frozen=True)
class Gathered:
    """The master's reading of a step's messages up (:func:`split_up`)."""

    grads: list[torch.Tensor]  # each worker's gradient part (views of its message)
    buffers: torch.Tensor | None  # sum_w n_w s_w (float64; None without buffers)
    loss_sum: float  # the step's bags' losses, summed in worker order
    up_bytes: int  # every worker's message

    def payload_sizes(self) -> list[int]:
        return [g.numel() for g in self.grads]


def split_up(bodies: list[torch.Tensor], replica: Replica) -> Gathered:
    """Master: the workers' messages up (worker order) read as :class:`Gathered`; PayloadError for one too
    short to hold its loss sum and buffers."""
    tail = tail_bytes(replica.n_buffers)
    grads, buffers, loss_sum = [], None, 0.0
    for worker, body in enumerate(bodies):
        if body.numel() < tail:
            raise PayloadError(f"worker {worker} sent {body.numel()} bytes; expected at least {tail} bytes "
                               "of loss sum and buffers")
        grads.append(body[: body.numel() - tail])
        values = body[body.numel() - tail :].clone().view(torch.float64)  # a copy: any byte alignment
        loss_sum += float(values[0])
        if replica.n_buffers:
            buffers = values[1:] if buffers is None else buffers.add_(values[1:])
    return Gathered(grads, buffers, loss_sum, sum(b.numel() for b in bodies))


def dense_step_bytes(replica: Replica, workers: int) -> int:
    """The bytes of a step's messages were they all dense: each worker's up (float32 gradient, then the
    tail: :func:`tail_bytes`) and down (float32 weights or sum, float32 buffers)."""
    up = 4 * replica.numel + tail_bytes(replica.n_buffers)
    return workers * (up + 4 * (replica.numel + replica.n_buffers))


class UpdateNotSent(ChannelBroken):
    """The master took the step (``taken``: its report; live workers may have its update) but could not
    send every worker the update."""

    def __init__(self, cause: ChannelBroken, taken: MasterStep):
        super().__init__(str(cause))
        self.taken = taken


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
    return Bounds(up=4 * replica.numel + tail_bytes(replica.n_buffers),
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
        self, step: StepPlan, n_bags: int, loss_sum: float, grad: torch.Tensor | None,
        buffers: torch.Tensor | None, replica: Replica,
    ) -> Contribution:
        """Worker: the message up of its gradient sum ``grad`` over ``n_bags`` bags (None without bags)
        whose losses sum to ``loss_sum``, from ``replica`` at the step's version (whose optimizer may
        precondition it)."""

    def codec_seconds(self, grad: torch.Tensor, keep_ratio: float, workers: int) -> float:
        """Worker: seconds its codec would spend in one step at ``keep_ratio`` < 1 with ``workers`` workers
        (encoding ``grad``, decoding and summing the step's payloads), this rank's codec state left as it
        was (``keep_ratio=auto``'s first decision)."""

    def worker(self, channel: Channel, step: StepPlan, part: Contribution, replica: Replica) -> Received:
        """Worker: send ``part``, receive the step's update, apply it to ``replica`` (version
        ``step.index + 1``)."""

    def master(self, channel: Channel, step: StepPlan, replica: Replica) -> MasterStep:
        """Master: receive the workers' parts, step ``replica``, send the update. ChannelBroken when the
        exchange breaks; :class:`UpdateNotSent` once the step is taken."""

    def restart(self, replica: Replica) -> None:
        """Master: every worker now holds ``replica``'s weights at its version (a new fold)."""

    def held(self, replica: Replica) -> torch.Tensor:
        """Master: the flat parameters in-sync workers hold (what a resynchronised worker gets)."""

    def state_dict(self) -> dict:
        """This rank's codec state (a worker's residual; the master's delta residual)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (resume)."""
