"""How the master (rank 0) and the workers (ranks 1..P) exchange a step's data: the :class:`Channel`
contract and its one error, :class:`ChannelBroken`.

A step is one round trip through the master: every worker sends one message up (:meth:`Channel.send_up`,
received by the master's :meth:`Channel.gather_up`), the master sends one message down to every worker
(:meth:`Channel.send_down`, received by :meth:`Channel.recv_down`). While it gathers, the master may also
forward the head of each worker's message to every other worker (a ``forward`` rule given to
``gather_up``; the workers take them with :meth:`Channel.recv_relayed`): the relay of compressed gradients
(``dpgs.distributed.sync.relay``), which the gloo transport forwards piece by piece as they arrive.
Messages are 1-D ``uint8`` tensors (a float tensor travels as ``as_bytes(t)``, without a copy). Two
transports implement the contract: ``dpgs.distributed.gloo`` (point-to-point sends of a
``torch.distributed`` gloo group formed inside the Ray actors) and ``dpgs.distributed.mailbox`` (object
references through a small Ray actor, where the processes cannot connect to each other);
``dpgs.distributed.rendezvous`` opens one or the other.

A step's exchange may be *bounded*: when every rank knows before the step the most bytes each message can
hold (a dense step's, :func:`dpgs.distributed.sync.step_bounds`), every call of that exchange gets
the same ``bound`` (``up`` on the worker's ``send_up`` and the master's ``gather_up``, ``down`` on
``send_down`` and ``recv_down``). A bounded message is never relayed, and a transport may use the bound to
post its receive for the whole message before the message is sent (gloo: one piece instead of a first
piece, a route and the rest, each waiting for the other side). A message longer than its bound is refused
(``ValueError``: a bug in the caller, not a fault).

Faults: a peer that dies surfaces at once (its connection closes), an operation that waits longer than
the timeout fails, and both raise :class:`ChannelBroken`. The master is in every exchange, so when it
cannot complete one it tells every live worker (:meth:`Channel.abort`); everyone then reports where they
stopped and the driver re-forms the group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

MASTER_RANK = 0
JOIN_TIMEOUT_S = 60.0  # how long joining a group waits for the other ranks


def worker_rank(worker: int) -> int:
    """Group rank of worker ``worker`` (0-based): the master is rank 0."""
    return worker + 1


def worker_of(rank: int) -> int:
    """The worker (0-based) of group rank ``rank`` >= 1 (the inverse of :func:`worker_rank`)."""
    if rank < 1:
        raise ValueError(f"rank {rank} is the master's, not a worker's")
    return rank - 1


class ChannelBroken(RuntimeError):
    """An exchange could not complete (a peer died or hung, or the master aborted the step)."""


Forward = Callable[[list[int]], "list[int] | None"]
"""The master's relay rule: from the sizes of the workers' messages (worker order), how many leading bytes
of each to forward to every other worker, or None to forward nothing."""


def check_bound(body: torch.Tensor, bound: int | None) -> None:
    """Refuse a message longer than its exchange's ``bound`` (None: unbounded)."""
    if bound is not None and body.numel() > bound:
        raise ValueError(f"a message of {body.numel()} bytes in an exchange bounded to {bound} bytes")


class Channel(Protocol):
    rank: int
    world: int
    arrivals: list[float]  # master: when each worker's message of the last timed gather_up arrived
    def send_up(self, body: torch.Tensor, bound: int | None = None) -> None:
        """Worker: send ``body`` (1-D uint8) to the master (the send may complete in the next call);
        ``bound``: a bounded exchange (the module docstring)."""

    def recv_relayed(self) -> list[torch.Tensor]:
        """Worker: the heads of the other workers' messages that the master forwarded in the gather of this
        worker's last message up (worker order, without its own; empty when it forwarded none). Optional:
        the next :meth:`recv_down` or :meth:`send_up` settles an exchange that forwarded nothing. A
        transport may deliver the heads with the message down (gloo does when every message came whole in
        one piece), so a worker must not wait for them before it is ready to wait for that."""

    def gather_up(
        self, timed: bool = False, forward: Forward | None = None, bound: int | None = None
    ) -> list[torch.Tensor]:
        """Master: every worker's message, in worker order (``timed``: their arrival times in
        ``arrivals``, ``time.perf_counter`` seconds); ``forward``: relay their heads (:data:`Forward`);
        ``bound``: a bounded exchange, which is neither relayed nor timed (ValueError with either)."""

    def send_down(self, body: torch.Tensor, bound: int | None = None) -> None:
        """Master: send ``body`` to every worker (``bound``: a bounded exchange)."""

    def recv_down(self, bound: int | None = None) -> torch.Tensor:
        """Worker: the master's message (ChannelBroken when the master aborted the exchange; ``bound``: a
        bounded exchange)."""

    def abort(self, drain: bool, bound: int | None = None) -> None:
        """Master: make every live worker's next :meth:`recv_down` raise ChannelBroken. ``drain``: the
        workers are about to send their next message up (they received the last one down); take it first
        (``bound``: that exchange's bound up, if it is bounded)."""

    def close(self) -> None:
        """Leave the group."""


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a flat uint8 view."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class EmulatedLink:
    """A worker's channel that also waits, for each message up and down, its transfer time over a link of
    ``mbps`` megabits per second (``dpgs.emulate_bandwidth_mbps``: bandwidth experiments on one machine)."""

    def __init__(self, channel: Channel, mbps: float):
        self.channel, self.mbps = channel, mbps
        self.rank, self.world = channel.rank, channel.world

    def _wait(self, n_bytes: int) -> None:
        time.sleep(n_bytes * 8 / (self.mbps * 1e6))

    def send_up(self, body: torch.Tensor, bound: int | None = None) -> None:
        self._wait(body.numel())
        self.channel.send_up(body, bound)

    def recv_relayed(self) -> list[torch.Tensor]:
        heads = self.channel.recv_relayed()
        self._wait(sum(h.numel() for h in heads))
        return heads

    def gather_up(
        self, timed: bool = False, forward: Forward | None = None, bound: int | None = None
    ) -> list[torch.Tensor]:
        return self.channel.gather_up(timed, forward, bound)

    @property
    def arrivals(self) -> list[float]:
        return self.channel.arrivals

    def send_down(self, body: torch.Tensor, bound: int | None = None) -> None:
        self.channel.send_down(body, bound)

    def recv_down(self, bound: int | None = None) -> torch.Tensor:
        body = self.channel.recv_down(bound)
        self._wait(body.numel())
        return body

    def abort(self, drain: bool, bound: int | None = None) -> None:
        self.channel.abort(drain, bound)

    def close(self) -> None:
        self.channel.close()
