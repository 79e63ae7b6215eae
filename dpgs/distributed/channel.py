"""How the master (rank 0) and the workers (ranks 1..P) exchange a step's data.

A step is one round trip through the master: every worker sends one message up (:meth:`Channel.send_up`,
received by the master's :meth:`Channel.gather_up`), the master sends one message down to every worker
(:meth:`Channel.send_down` / :meth:`Channel.recv_down`). Messages are 1-D ``uint8`` tensors (a float
tensor travels as ``t.view(torch.uint8)``, without a copy). Two transports implement the protocol:

* :class:`GlooChannel`: point-to-point sends of a ``torch.distributed`` gloo group formed inside the Ray
  actors (TCP between the processes; neither Ray nor the driver is on the path);
* ``dpgs.distributed.mailbox.MailboxChannel``: object references through a small Ray actor, where the
  processes cannot connect to each other.

Faults: a peer that dies surfaces at once (its connection closes), an operation that waits longer than
the timeout fails, and both raise :class:`ChannelBroken`. The master is in every exchange, so when it
cannot complete one it tells every live worker (:meth:`Channel.abort`); everyone then reports where they
stopped and the driver re-forms the group. A gloo send completes only once the receiver has posted its
receive, so the master always takes what live workers send (it never leaves one blocked in a send).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dpgs.distributed.messages import MASTER_RANK

ABORT = -1  # size sent down instead of a message: give up this exchange
JOIN_TIMEOUT_S = 60.0
_SIZE_TAG, _BODY_TAG = 0, 1


class ChannelBroken(RuntimeError):
    """An exchange could not complete (a peer died or hung, or the master aborted the step)."""


class Channel(Protocol):
    rank: int
    world: int

    def send_up(self, body: torch.Tensor) -> None:
        """Worker: send ``body`` (1-D uint8) to the master."""

    def gather_up(self) -> list[torch.Tensor]:
        """Master: every worker's message, in worker order."""

    def send_down(self, body: torch.Tensor) -> None:
        """Master: send ``body`` to every worker."""

    def recv_down(self) -> torch.Tensor:
        """Worker: the master's message (ChannelBroken when the master aborted the exchange)."""

    def abort(self, drain: bool) -> None:
        """Master: make every live worker's next :meth:`recv_down` raise ChannelBroken. ``drain``: the
        workers are about to send their next message up (they received the last one down); take it first."""

    def close(self) -> None:
        """Leave the group."""


@dataclass(frozen=True)
class Rendezvous:
    """How the ranks of one generation of the group find each other.

    ``transport`` is ``gloo`` (``address`` = the master's store) or ``ray`` (``mailbox`` = actor handle).
    Joining waits at most ``JOIN_TIMEOUT_S`` for the other ranks; every later operation ``timeout_s``.
    """

    transport: str
    generation: int
    world: int
    timeout_s: float
    address: tuple[str, int] | None = None
    mailbox: Any = None

    def open(self, rank: int) -> Channel:
        if self.transport == "gloo":
            return GlooChannel(rank, self.world, self.address, self.timeout_s)
        from dpgs.distributed.mailbox import MailboxChannel

        return MailboxChannel(rank, self.world, self.mailbox, self.generation, self.timeout_s)


def free_address() -> tuple[str, int]:
    """This node's IP address and a port that is free now (for the group's rendezvous store)."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a flat uint8 view."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class GlooChannel:
    """A gloo process group; the master's process hosts the rendezvous store.

    Each message is an int64 size (``ABORT`` for an abort) followed by the body. Every wait is bounded by
    ``timeout_s`` (gloo's deadline).
    """

    def __init__(self, rank: int, world: int, address: tuple[str, int], timeout_s: float):
        self.rank, self.world = rank, world
        host, port = address
        try:
            self._store = dist.TCPStore(
                host, port, world, rank == MASTER_RANK, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S)
            )
            self._group = dist.ProcessGroupGloo(
                self._store, rank, world, datetime.timedelta(seconds=timeout_s)
            )
        except (RuntimeError, ValueError, OSError) as err:
            raise ChannelBroken(f"rank {rank}: cannot join the gloo group at {host}:{port}: {err}") from err
        self.dead: set[int] = set()  # ranks whose connection failed (the master sends them nothing more)

    def _wait(self, work, peer: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            self.dead.add(peer)
            raise ChannelBroken(f"rank {self.rank}: {what} with rank {peer} failed: {err}") from err

    def send_up(self, body: torch.Tensor) -> None:
        size = torch.tensor([body.numel()], dtype=torch.int64)
        works = [self._group.send([size], MASTER_RANK, _SIZE_TAG)]
        if body.numel():
            works.append(self._group.send([body], MASTER_RANK, _BODY_TAG))
        for work in works:
            self._wait(work, MASTER_RANK, "sending up")

    def _wait_all(self, works: list[tuple[int, Any]], what: str) -> list[str]:
        """Wait for every ``(peer, work)``; the failures' messages (their peers are marked dead)."""
        failed = []
        for peer, work in works:
            try:
                self._wait(work, peer, what)
            except ChannelBroken as err:
                failed.append(str(err))
        return failed

    def gather_up(self) -> list[torch.Tensor]:
        """Every live worker's message is taken, even when another worker's failed (the live ones must not
        stay blocked in their send); then a failure raises ChannelBroken."""
        workers = [r for r in range(1, self.world) if r not in self.dead]
        sizes = {r: torch.zeros(1, dtype=torch.int64) for r in workers}
        failed = self._wait_all(
            [(r, self._group.recv([sizes[r]], r, _SIZE_TAG)) for r in workers], "receiving the size"
        )
        bodies = {r: torch.empty(int(sizes[r]), dtype=torch.uint8) for r in workers if r not in self.dead}
        failed += self._wait_all(
            [(r, self._group.recv([b], r, _BODY_TAG)) for r, b in bodies.items() if b.numel()],
            "receiving a message",
        )
        if failed or len(workers) < self.world - 1:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")
        return [bodies[r] for r in workers]

    def send_down(self, body: torch.Tensor) -> None:
        """Every live worker gets ``body`` even when another worker's connection failed."""
        size = torch.tensor([body.numel()], dtype=torch.int64)
        works = []
        for r in range(1, self.world):
            if r in self.dead:
                continue
            works.append((r, self._group.send([size], r, _SIZE_TAG)))
            if body.numel():
                works.append((r, self._group.send([body], r, _BODY_TAG)))
        failed = self._wait_all(works, "sending down")
        if failed or self.dead:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")

    def recv_down(self) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(self._group.recv([size], MASTER_RANK, _SIZE_TAG), MASTER_RANK, "receiving the size")
        if int(size) == ABORT:
            raise ChannelBroken(f"rank {self.rank}: the master aborted the exchange")
        body = torch.empty(int(size), dtype=torch.uint8)
        if body.numel():
            self._wait(self._group.recv([body], MASTER_RANK, _BODY_TAG), MASTER_RANK, "receiving a message")
        return body

    def abort(self, drain: bool) -> None:
        if drain:
            try:
                self.gather_up()
            except ChannelBroken:
                pass  # the failed ones are now marked dead
        size = torch.tensor([ABORT], dtype=torch.int64)
        self._wait_all(
            [(r, self._group.send([size], r, _SIZE_TAG)) for r in range(1, self.world) if r not in self.dead],
            "sending an abort",
        )

    def close(self) -> None:
        self._group = None
        self._store = None
