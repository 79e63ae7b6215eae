"""The gloo transport of a DPGS group: point-to-point sends of a ``torch.distributed`` gloo group formed
inside the Ray actors (TCP between the processes; neither Ray nor the driver is on the path).

A gloo send completes only once the receiver has posted its receive, so the master always takes what
live workers send (it never leaves one blocked in a send); see ``dpgs.distributed.transport`` for the
contract and its faults.

Addresses: every rank binds its gloo device to its Ray node's address (:func:`local_address`), the
address the other nodes reach it at. (gloo's default resolves the host name, and where that name does not
resolve to the host's address, as with Ubuntu's ``127.0.1.1 <hostname>`` line, it binds to loopback and
the group cannot form across machines.)
"""

from __future__ import annotations

import datetime
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from dpgs.distributed.transport import JOIN_TIMEOUT_S, MASTER_RANK, ChannelBroken

_SIZE_TAG, _BODY_TAG = 0, 1
ABORT_SIZE = -1  # sent down instead of a message size: give up this exchange


def local_address(peer: str) -> str:
    """The address this process is reached at: its Ray node's address in a Ray process, else the source
    address of its route to ``peer``."""
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


class GlooChannel:
    """A gloo process group; the master's process hosts the rendezvous store.

    Each message is an int64 size (``ABORT_SIZE`` for an abort) followed by the body. Joining (the store,
    then gloo's connections) ends within ``JOIN_TIMEOUT_S`` (then ChannelBroken: the rank is free to join
    another group); every later wait is bounded by ``timeout_s``.
    """

    def __init__(self, rank: int, world: int, address: tuple[str, int], timeout_s: float):
        self.rank, self.world = rank, world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        host, port = address
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            here = local_address(host)
            self._store = dist.TCPStore(
                host, port, world, rank == MASTER_RANK, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S)
            )
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=here)]
            options._timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
            self._group = dist.ProcessGroupGloo(self._store, rank, world, options)
        except (RuntimeError, ValueError, OSError) as err:
            self._store = None  # the master's store goes now, not when the exception is collected
            raise ChannelBroken(f"rank {rank}: cannot join the gloo group at {host}:{port}: {err}") from err
        self.dead: set[int] = set()  # ranks whose connection failed (the master sends them nothing more)
        self.arrivals: list[float] = []  # when each worker's message of the last timed gather arrived

    def _wait(self, work, peer: int, what: str) -> None:
        try:
            work.wait(self.timeout)  # the group's own deadline is the join's
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

    def _wait_timed(self, works: list[tuple[int, Any]], what: str) -> list[str]:
        """:meth:`_wait_all`, recording in ``self.arrivals[peer - 1]`` when each work completed. A gloo
        receive completes only inside ``wait``, so each is waited for in a thread of its own."""

        def wait(peer: int, work) -> str | None:
            try:
                self._wait(work, peer, what)
                return None
            except ChannelBroken as err:
                return str(err)
            finally:
                self.arrivals[peer - 1] = time.perf_counter()

        with ThreadPoolExecutor(max_workers=max(len(works), 1)) as pool:
            results = list(pool.map(lambda pw: wait(*pw), works))
        return [r for r in results if r is not None]

    def gather_up(self, timed: bool = False) -> list[torch.Tensor]:
        """Every live worker's message is taken, even when another worker's failed (the live ones must not
        stay blocked in their send); then a failure raises ChannelBroken. ``timed``: record each
        message's arrival in ``self.arrivals`` (``time.perf_counter``)."""
        workers = [r for r in range(1, self.world) if r not in self.dead]
        sizes = {r: torch.zeros(1, dtype=torch.int64) for r in workers}
        failed = self._wait_all(
            [(r, self._group.recv([sizes[r]], r, _SIZE_TAG)) for r in workers], "receiving the size"
        )
        bodies = {r: torch.empty(int(sizes[r]), dtype=torch.uint8) for r in workers if r not in self.dead}
        works = [(r, self._group.recv([b], r, _BODY_TAG)) for r, b in bodies.items() if b.numel()]
        if timed:
            now = time.perf_counter()
            self.arrivals = [now] * (self.world - 1)  # empty messages: arrived with their size
            failed += self._wait_timed(works, "receiving a message")
        else:
            failed += self._wait_all(works, "receiving a message")
        if failed or len(workers) < self.world - 1:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")
        return [bodies[r] for r in workers]

    def send_down(self, body: torch.Tensor) -> None:
        """Every live worker gets ``body`` even when another worker's connection failed."""
        self.send_each([body] * (self.world - 1))

    def send_each(self, bodies: list[torch.Tensor]) -> None:
        """Every live worker ``w`` gets ``bodies[w]`` even when another worker's connection failed."""
        if len(bodies) != self.world - 1:
            raise ValueError(f"{len(bodies)} messages for {self.world - 1} workers")
        works = []
        for r, body in zip(range(1, self.world), bodies, strict=True):
            if r in self.dead:
                continue
            size = torch.tensor([body.numel()], dtype=torch.int64)
            works.append((r, self._group.send([size], r, _SIZE_TAG)))
            if body.numel():
                works.append((r, self._group.send([body], r, _BODY_TAG)))
        failed = self._wait_all(works, "sending down")
        if failed or self.dead:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")

    def recv_down(self) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(self._group.recv([size], MASTER_RANK, _SIZE_TAG), MASTER_RANK, "receiving the size")
        if int(size) == ABORT_SIZE:
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
        size = torch.tensor([ABORT_SIZE], dtype=torch.int64)
        self._wait_all(
            [(r, self._group.send([size], r, _SIZE_TAG)) for r in range(1, self.world) if r not in self.dead],
            "sending an abort",
        )

    def close(self) -> None:
        self._group = None
        self._store = None
