"""The gloo transport of a DPGS group: point-to-point sends of a ``torch.distributed`` gloo group formed
inside the Ray actors (TCP between the processes; neither Ray nor the driver is on the path).

A gloo send completes only once the receiver has posted its receive, so the master always takes what
live workers send (it never leaves one blocked in a send); see ``dpgs.distributed.transport`` for the
contract and its faults.

Wire protocol of one gather (every tag is its own ordered stream between two ranks):

* worker -> master: the message's size (int64, ``_SIZE_TAG``), then its bytes in ``CHUNK``-byte pieces
  (``_BODY_TAG``);
* master -> worker, as soon as every size is in: the route (``_ROUTE_TAG``), ``world - 1`` int64: how many
  leading bytes of each worker's message the master forwards to this one (0 for its own), or ``NO_RELAY``
  in every entry;
* master -> worker, while the messages arrive: each forwarded head in ``CHUNK``-byte pieces, piece i sent
  as soon as piece i of its message arrived (``_RELAY_TAG + origin``): cut-through, so the master's link
  carries a relayed step's bytes up and down at the same time instead of one after the other. When an
  origin's message breaks off, the rest of its pieces go out as zeros, so that every receiver's posted
  receives complete and it reaches the abort that follows.

A worker's :meth:`GlooChannel.send_up` takes its route; :meth:`GlooChannel.recv_relayed` the heads.

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

from dpgs.distributed.transport import JOIN_TIMEOUT_S, MASTER_RANK, ChannelBroken, Forward, worker_of

_SIZE_TAG, _BODY_TAG, _ROUTE_TAG, _RELAY_TAG = 0, 1, 2, 3  # _RELAY_TAG + worker: that worker's head
ABORT_SIZE = -1  # sent down instead of a message size: give up this exchange
NO_RELAY = -1  # every entry of a route that forwards nothing
CHUNK = 128 << 10  # bytes per piece of a message up and of a forwarded head


def pieces(n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of the ``CHUNK``-byte pieces of an ``n``-byte message (none when ``n`` is 0)."""
    return [(lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK)]


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
        self.arrivals: list[float] = []  # when each worker's message of the last gather arrived
        self._relayed: tuple | None = None  # worker: (heads, their receives) forwarded, not yet taken

    def _post(self, send: bool, tensor: torch.Tensor, peer: int, tag: int):
        """Post a send or a receive; a connection already broken raises ChannelBroken at once (gloo raises
        it from the post itself), the peer marked dead."""
        try:
            return (self._group.send if send else self._group.recv)([tensor], peer, tag)
        except RuntimeError as err:
            self.dead.add(peer)
            raise ChannelBroken(f"rank {self.rank}: posting to rank {peer} failed: {err}") from err

    def _post_each(self, posts: list[tuple[bool, torch.Tensor, int, int]], failed: list[str]) -> list:
        """Master: :meth:`_post` each ``(send, tensor, peer, tag)`` to a live peer; ``(peer, work)`` of those
        posted, the failures' messages appended to ``failed``."""
        works = []
        for send, tensor, peer, tag in posts:
            if peer in self.dead:
                continue
            try:
                works.append((peer, self._post(send, tensor, peer, tag)))
            except ChannelBroken as err:
                failed.append(str(err))
        return works

    def _wait(self, work, peer: int, what: str) -> None:
        try:
            work.wait(self.timeout)  # the group's own deadline is the join's
        except RuntimeError as err:
            self.dead.add(peer)
            raise ChannelBroken(f"rank {self.rank}: {what} with rank {peer} failed: {err}") from err

    # ---------------------------------------------------------------- worker
    def send_up(self, body: torch.Tensor) -> None:
        """Send ``body`` to the master. The route comes back as soon as every worker's size is in, and the
        receives of what it forwards are posted before this worker waits for its own sends to complete."""
        self._settle()
        size = torch.tensor([body.numel()], dtype=torch.int64)
        sends = [self._post(True, size, MASTER_RANK, _SIZE_TAG)]
        sends += [self._post(True, body[lo:hi], MASTER_RANK, _BODY_TAG) for lo, hi in pieces(body.numel())]
        route = torch.zeros(self.world - 1, dtype=torch.int64)
        self._wait(self._post(False, route, MASTER_RANK, _ROUTE_TAG), MASTER_RANK, "receiving the route")
        counts = route.tolist()
        if counts[0] != NO_RELAY:
            origins = [w for w in range(self.world - 1) if w != worker_of(self.rank)]
            heads = [torch.empty(counts[w], dtype=torch.uint8) for w in origins]
            works = [self._post(False, head[lo:hi], MASTER_RANK, _RELAY_TAG + w)
                     for w, head in zip(origins, heads, strict=True) for lo, hi in pieces(head.numel())]
            self._relayed = (heads, works)
        for work in sends:
            self._wait(work, MASTER_RANK, "sending up")

    def recv_relayed(self) -> list[torch.Tensor]:
        if self._relayed is None:
            return []
        (heads, works), self._relayed = self._relayed, None
        for work in works:
            self._wait(work, MASTER_RANK, "receiving a relayed message")
        return heads

    def _settle(self) -> None:
        """A route that forwarded heads nobody took is a protocol error."""
        if self._relayed is not None:
            raise RuntimeError(f"rank {self.rank}: the master forwarded other workers' messages; "
                               "recv_relayed must take them")

    def recv_down(self) -> torch.Tensor:
        self._settle()
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(self._post(False, size, MASTER_RANK, _SIZE_TAG), MASTER_RANK, "receiving the size")
        if int(size) == ABORT_SIZE:
            raise ChannelBroken(f"rank {self.rank}: the master aborted the exchange")
        body = torch.empty(int(size), dtype=torch.uint8)
        if body.numel():
            self._wait(self._post(False, body, MASTER_RANK, _BODY_TAG), MASTER_RANK, "receiving a message")
        return body

    # ---------------------------------------------------------------- master
    def _wait_all(self, works: list[tuple[int, Any]], what: str) -> list[str]:
        """Wait for every ``(peer, work)``; the failures' messages (their peers are marked dead)."""
        failed = []
        for peer, work in works:
            try:
                self._wait(work, peer, what)
            except ChannelBroken as err:
                failed.append(str(err))
        return failed

    def gather_up(self, timed: bool = False, forward: Forward | None = None) -> list[torch.Tensor]:
        """Every live worker's message is taken, even when another worker's failed (the live ones must not
        stay blocked in their send); then a failure raises ChannelBroken. ``timed``: record each
        message's arrival in ``self.arrivals`` (``time.perf_counter``). ``forward``: see the module
        docstring; each worker's message is waited for in a thread of its own (a gloo receive completes
        only inside ``wait``), which forwards its pieces as they arrive."""
        workers = [r for r in range(1, self.world) if r not in self.dead]
        sizes = {r: torch.zeros(1, dtype=torch.int64) for r in workers}
        failed: list[str] = []
        size_recvs = self._post_each([(False, sizes[r], r, _SIZE_TAG) for r in workers], failed)
        failed += self._wait_all(size_recvs, "receiving the size")
        counts = None
        if forward is not None and not failed and len(workers) == self.world - 1:
            counts = forward([int(sizes[r]) for r in workers])
        sends = self._post_each([(True, self._route_for(r, counts), r, _ROUTE_TAG) for r in workers], failed)
        bodies = {r: torch.empty(int(sizes[r]), dtype=torch.uint8) for r in workers if r not in self.dead}
        self.arrivals = [time.perf_counter()] * (self.world - 1)  # empty messages: arrived with their size
        with ThreadPoolExecutor(max_workers=max(len(bodies), 1)) as pool:
            results = list(pool.map(lambda r: self._take_message(r, bodies[r], counts, sends, failed),
                                    list(bodies)))
        failed += [r for r in results if r is not None]
        failed += self._wait_all(sends, "relaying")
        if failed or len(workers) < self.world - 1:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")
        return [bodies[r] for r in workers]

    def _route_for(self, rank: int, counts: list[int] | None) -> torch.Tensor:
        if counts is None:
            return torch.full((self.world - 1,), NO_RELAY, dtype=torch.int64)
        own = worker_of(rank)
        return torch.tensor([0 if w == own else n for w, n in enumerate(counts)], dtype=torch.int64)

    def _take_message(self, rank: int, body: torch.Tensor, counts: list[int] | None,
                      sends: list[tuple[int, Any]], failed: list[str]) -> str | None:
        """Receive ``rank``'s message piece by piece, forwarding each piece's share of its head to every other
        live worker as it arrives (zeros once the message broke off; a forward that cannot be posted goes to
        ``failed``); the failure's message, or None."""
        head = 0 if counts is None else counts[worker_of(rank)]
        others = [(r, _RELAY_TAG + worker_of(rank)) for r in range(1, self.world) if r != rank]
        works, failure = [], None
        try:  # every piece's receive at once, so the worker's sends never wait for one
            works = [self._post(False, body[lo:hi], rank, _BODY_TAG) for lo, hi in pieces(body.numel())]
        except ChannelBroken as err:
            failure = str(err)
        for index, (lo, hi) in enumerate(pieces(body.numel())):
            if failure is None:
                try:
                    self._wait(works[index], rank, "receiving a message")
                except ChannelBroken as err:
                    failure = str(err)
            if lo < head:
                end = min(hi, head)
                piece = body[lo:end] if failure is None else torch.zeros(end - lo, dtype=torch.uint8)
                sends += self._post_each([(True, piece, r, tag) for r, tag in others], failed)
        self.arrivals[worker_of(rank)] = time.perf_counter()
        return failure

    def send_down(self, body: torch.Tensor) -> None:
        """Every live worker gets ``body`` even when another worker's connection failed."""
        size = torch.tensor([body.numel()], dtype=torch.int64)
        posts = [(True, part, r, tag) for r in range(1, self.world)
                 for part, tag in ((size, _SIZE_TAG), (body, _BODY_TAG)) if part.numel()]
        failed: list[str] = []
        sends = self._post_each(posts, failed)
        failed += self._wait_all(sends, "sending down")
        if failed or self.dead:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")

    def abort(self, drain: bool) -> None:
        if drain:
            try:
                self.gather_up()
            except ChannelBroken:
                pass  # the failed ones are now marked dead
        size = torch.tensor([ABORT_SIZE], dtype=torch.int64)
        self._wait_all(self._post_each([(True, size, r, _SIZE_TAG) for r in range(1, self.world)], []),
                       "sending an abort")

    def close(self) -> None:
        self._group = None
        self._store = None
