"""The gloo transport of a DPGS group: point-to-point sends of a ``torch.distributed`` gloo group formed
inside the Ray actors (TCP between the processes; neither Ray nor the driver is on the path).

A gloo send completes only once the receiver has posted its receive, so the master always takes what
live workers send (it never leaves one blocked in a send); see ``dpgs.distributed.transport`` for the
contract and its faults.

Wire protocol (every tag is its own ordered stream between two ranks). A message of n bytes travels in
pieces: the first carries n (int64, ``PREFIX`` bytes) and the body's first ``CHUNK - PREFIX`` bytes, each
later piece ``CHUNK`` bytes (:func:`pieces`). The receiver posts the first piece into a ``CHUNK``-byte
buffer (a gloo receive takes a shorter message), reads n, and posts the rest. A message that fits one piece
is therefore one gloo message: gloo adds two notifications and a 48-byte header to each, and on the small
payloads of a feature-bag model these, not the payloads, were most of a step's traffic.

* worker -> master: its message (``_BODY_TAG``);
* master -> worker, as soon as every first piece is in: the route (``_ROUTE_TAG``), ``world - 1`` int64 (how
  many leading bytes of each worker's message the master forwards to this one: 0 for its own, or
  ``NO_RELAY`` in every entry) and one int64 ``merged``, followed by the part of each forwarded head that
  came in its origin's first piece (origins in worker order). When every message came whole in its first
  piece, nothing is left to forward piece by piece: the route waits for the message down and carries its
  first piece at its end (``merged`` = 1), so a small step is one gloo message each way instead of a route
  and a message down (each gloo message costs a wait for the receiver's notification, a header and their
  TCP segments; on the lab, a feature-bag model's keep-1 % step 8 % shorter at 100 Mbit/s);
* master -> worker, while the messages arrive: the rest of each forwarded head, each piece sent as soon as
  the same piece of its message arrived (``_RELAY_TAG + origin``): cut-through, so the master's link
  carries a relayed step's bytes up and down at the same time instead of one after the other. When an
  origin's message breaks off, the rest of its pieces go out as zeros, so that every receiver's posted
  receives complete and it reaches the abort that follows;
* master -> worker: its message (``_BODY_TAG``; its first piece in the route when ``merged``), or a first
  piece whose size is ``ABORT_SIZE``.

A worker's :meth:`GlooChannel.send_up` takes its route; :meth:`GlooChannel.recv_relayed` the heads.

A bounded exchange (``bound``, see ``dpgs.distributed.transport``) has no route and no later pieces: the
receiver posts one receive of ``PREFIX + bound`` bytes before the message is sent (the master at the start of
its gather, a worker when it waits for the message down), and the message travels as one first piece of
``PREFIX + n`` bytes. Each message of an unbounded exchange waits for the other side at least twice (its
first piece, then the rest; a message up also for the route, which comes once every worker's first piece
is in); on two cores, three processes and an 0.8 MB dense step, the unbounded exchange took ~7 ms a step
where one preposted gloo message each way takes ~0.7 ms.

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

from dpgs.distributed.transport import (
    JOIN_TIMEOUT_S,
    MASTER_RANK,
    ChannelBroken,
    Forward,
    check_bound,
    worker_of,
)

_BODY_TAG, _ROUTE_TAG, _RELAY_TAG = 1, 2, 3  # _RELAY_TAG + worker: the rest of that worker's forwarded head
ABORT_SIZE = -1  # sent down instead of a message size: give up this exchange
NO_RELAY = -1  # every entry of a route that forwards nothing
CHUNK = 128 << 10  # bytes per piece of a message
PREFIX = 8  # the int64 size at the start of a message's first piece
FIRST = CHUNK - PREFIX  # body bytes in a message's first piece


def pieces(n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of the body bytes in each piece of an ``n``-byte message: the first piece (always one, the
    size's) holds ``[0, min(n, FIRST))``, every later one ``CHUNK`` bytes."""
    first = min(n, FIRST)
    return [(0, first)] + [(lo, min(lo + CHUNK, n)) for lo in range(first, n, CHUNK)]


def first_piece(size: int, head: torch.Tensor) -> torch.Tensor:
    """A message's first piece: ``size`` as int64, then ``head`` (at most ``FIRST`` bytes)."""
    return torch.cat([torch.tensor([size], dtype=torch.int64).view(torch.uint8), head])


def message_pieces(body: torch.Tensor) -> list[torch.Tensor]:
    """What is sent of ``body``: its first piece (:func:`first_piece`), then views of its later pieces."""
    spans = pieces(body.numel())
    return [first_piece(body.numel(), body[: spans[0][1]])] + [body[lo:hi] for lo, hi in spans[1:]]


def route_header(world: int) -> int:
    """Bytes of a route's header: ``world - 1`` counts and ``merged``, int64 each."""
    return PREFIX * world


def route_capacity(world: int) -> int:
    """The most bytes of a route: its header, a first piece of every other worker's head, and a first piece
    of the message down."""
    return route_header(world) + (world - 2) * FIRST + CHUNK


def whole_message(body: torch.Tensor, bound: int) -> torch.Tensor:
    """A bounded message: its one piece (:func:`first_piece` of the whole ``body``)."""
    check_bound(body, bound)
    return first_piece(body.numel(), body)


def size_of(piece: torch.Tensor) -> int:
    """The message size that a received first piece starts with (anywhere in a route: copied to align)."""
    return int(piece[:PREFIX].clone().view(torch.int64))


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

    Messages travel as the module docstring says (``ABORT_SIZE`` as a size: an abort). Joining (the store,
    then gloo's connections) ends within ``JOIN_TIMEOUT_S`` (then ChannelBroken: the rank is free to join
    another group), or when nothing answers at the store's address, within that plus the back-off of the
    store client's one retry (24 s seen at 60 s; torch's own); every later wait is bounded by ``timeout_s``.

    ``store``: the store at ``address`` when this process already serves it
    (``dpgs.distributed.rendezvous.host_store``); without it the master rank serves a new one there.
    """

    def __init__(self, rank: int, world: int, address: tuple[str, int], timeout_s: float,
                 store: dist.TCPStore | None = None):
        self.rank, self.world = rank, world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        host, port = address
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            here = local_address(host)
            self._store = store if store is not None else dist.TCPStore(
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
        self._down_first: torch.Tensor | None = None  # worker: the message down's first piece, from a route
        self._merged: dict[int, torch.Tensor] | None = None  # master: routes waiting for the message down

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

    def _post_rest(self, start: torch.Tensor, size: int, peer: int, tag: int) -> tuple[torch.Tensor, list]:
        """The body of a ``size``-byte message whose first piece brought ``start`` (its first bytes), with the
        receives of its later pieces posted into it."""
        body = torch.empty(size, dtype=torch.uint8)
        body[: start.numel()].copy_(start)
        return body, [self._post(False, body[lo:hi], peer, tag) for lo, hi in pieces(size)[1:]]

    # ---------------------------------------------------------------- worker
    def send_up(self, body: torch.Tensor, bound: int | None = None) -> None:
        """Send ``body`` to the master; bounded, in one piece. Unbounded, the route comes back as soon as
        every worker's first piece is in (the master takes no later piece before that), or with the message
        down when every message came whole in its first piece (``merged``), and the receives of
        what it forwards are posted before the rest of ``body``: their notifications then go up ahead of it,
        not behind megabytes of it in the same TCP stream (behind a 5.7 MB upload at 100 Mbit/s they waited
        0.46 s, and the master could not forward to this worker until they arrived).
        """
        self._settle()
        if bound is not None:
            self._wait(self._post(True, whole_message(body, bound), MASTER_RANK, _BODY_TAG), MASTER_RANK,
                       "sending up")
            return
        parts = message_pieces(body)
        sends = [self._post(True, parts[0], MASTER_RANK, _BODY_TAG)]
        header = route_header(self.world)
        route = torch.empty(route_capacity(self.world), dtype=torch.uint8)
        self._wait(self._post(False, route, MASTER_RANK, _ROUTE_TAG), MASTER_RANK, "receiving the route")
        *counts, merged = route[:header].view(torch.int64).tolist()
        offset = header
        if counts[0] != NO_RELAY:
            heads, works = [], []
            for w in (w for w in range(self.world - 1) if w != worker_of(self.rank)):
                start = route[offset : offset + min(counts[w], FIRST)]
                head, posted = self._post_rest(start, counts[w], MASTER_RANK, _RELAY_TAG + w)
                offset += start.numel()
                heads.append(head)
                works += posted
            self._relayed = (heads, works)
        if merged:
            self._down_first = route[offset : offset + CHUNK]
        sends += [self._post(True, part, MASTER_RANK, _BODY_TAG) for part in parts[1:]]
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
        """A route that forwarded heads, or carried the message down, that nobody took is a protocol
        error."""
        if self._relayed is not None:
            raise RuntimeError(f"rank {self.rank}: the master forwarded other workers' messages; "
                               "recv_relayed must take them")
        if self._down_first is not None:
            raise RuntimeError(f"rank {self.rank}: the route carried the message down; "
                               "recv_down must take it")

    def recv_down(self, bound: int | None = None) -> torch.Tensor:
        """The first piece came with the route when the route was ``merged`` (never in a bounded exchange,
        which has no route)."""
        first, self._down_first = self._down_first, None
        self._settle()
        if first is not None and bound is not None:
            raise RuntimeError(f"rank {self.rank}: a bounded receive after a route that carried the message")
        if first is None:
            first = torch.empty(CHUNK if bound is None else PREFIX + bound, dtype=torch.uint8)
            self._wait(self._post(False, first, MASTER_RANK, _BODY_TAG), MASTER_RANK, "receiving a message")
        size = size_of(first)
        if size == ABORT_SIZE:
            raise ChannelBroken(f"rank {self.rank}: the master aborted the exchange")
        if bound is not None:
            if not 0 <= size <= bound:
                raise ChannelBroken(f"rank {self.rank}: the master sent a message of {size} bytes in an "
                                    f"exchange bounded to {bound}")
            return first[PREFIX : PREFIX + size]
        body, works = self._post_rest(first[PREFIX : PREFIX + min(size, FIRST)], size, MASTER_RANK, _BODY_TAG)
        for work in works:
            self._wait(work, MASTER_RANK, "receiving a message")
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

    def gather_up(
        self, timed: bool = False, forward: Forward | None = None, bound: int | None = None
    ) -> list[torch.Tensor]:
        """Every live worker's message is taken, even when another worker's failed (the live ones must not
        stay blocked in their send); then a failure raises ChannelBroken. ``timed``: record each
        message's arrival in ``self.arrivals`` (``time.perf_counter``). ``forward``: see the module
        docstring. Unbounded, each worker's message is waited for in a thread of its own (a gloo receive
        completes only inside ``wait``), which forwards its pieces as they arrive."""
        if bound is not None:
            if timed or forward is not None:
                raise ValueError("a bounded gather is neither timed nor relayed")
            return self._gather_bounded(bound)
        workers = [r for r in range(1, self.world) if r not in self.dead]
        firsts = {r: torch.empty(CHUNK, dtype=torch.uint8) for r in workers}
        failed: list[str] = []
        posted = dict(self._post_each([(False, firsts[r], r, _BODY_TAG) for r in workers], failed))
        self.arrivals = [time.perf_counter()] * (self.world - 1)
        with ThreadPoolExecutor(max_workers=max(len(posted), 1)) as pool:
            failed += [f for f in pool.map(lambda r: self._take_first(r, posted[r], firsts[r]), list(posted))
                       if f is not None]
            sizes = {r: size_of(firsts[r]) for r in posted if r not in self.dead}
            counts = None
            complete = not failed and len(sizes) == self.world - 1  # every first piece is in
            if forward is not None and complete:
                counts = forward([sizes[r] for r in workers])
            live = [r for r in workers if r not in self.dead]
            merge = complete and max(sizes.values()) <= FIRST  # nothing to forward piece by piece
            routes = {r: self._route_for(r, counts, firsts, merge) for r in live}
            if merge:
                self._merged, sends = routes, []
            else:
                sends = self._post_each([(True, route, r, _ROUTE_TAG) for r, route in routes.items()], failed)
            taken = list(pool.map(lambda r: self._take_rest(r, firsts[r], sizes[r], counts, sends, failed),
                                  live))
        failed += [failure for _, failure in taken if failure is not None]
        failed += self._wait_all(sends, "relaying")
        if failed or len(workers) < self.world - 1:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")
        return [body for body, _ in taken]

    def _gather_bounded(self, bound: int) -> list[torch.Tensor]:
        """Every live worker's one-piece message, its receive posted at once."""
        workers = [r for r in range(1, self.world) if r not in self.dead]
        buffers = {r: torch.empty(PREFIX + bound, dtype=torch.uint8) for r in workers}
        failed: list[str] = []
        posted = self._post_each([(False, buffers[r], r, _BODY_TAG) for r in workers], failed)
        failed += self._wait_all(posted, "receiving a message")
        for rank, _ in posted:
            if rank not in self.dead and not 0 <= size_of(buffers[rank]) <= bound:
                self.dead.add(rank)
                failed.append(f"rank {self.rank}: rank {rank} sent a message of {size_of(buffers[rank])} "
                              f"bytes in an exchange bounded to {bound}")
        if failed or len(workers) < self.world - 1:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")
        return [buffers[r][PREFIX : PREFIX + size_of(buffers[r])] for r in workers]

    def _take_first(self, rank: int, work: Any, first: torch.Tensor) -> str | None:
        """Wait for ``rank``'s first piece (its arrival time, if it is the whole message); the failure's
        message, or None."""
        try:
            self._wait(work, rank, "receiving a message")
        except ChannelBroken as err:
            return str(err)
        size = size_of(first)
        if size < 0:
            self.dead.add(rank)
            return f"rank {self.rank}: rank {rank} sent a message of {size} bytes"
        self.arrivals[worker_of(rank)] = time.perf_counter()
        return None

    def _route_for(self, rank: int, counts: list[int] | None, firsts: dict[int, torch.Tensor],
                   merged: bool) -> torch.Tensor:
        """``rank``'s route, followed by the part of each head forwarded to it that its first piece held
        (``merged``: the first piece of the message down goes at its end, :meth:`send_down`)."""
        own = worker_of(rank)
        entries = ([NO_RELAY] * (self.world - 1) if counts is None
                   else [0 if w == own else n for w, n in enumerate(counts)])
        header = torch.tensor([*entries, int(merged)], dtype=torch.int64).view(torch.uint8)
        if counts is None:
            return header
        heads = [firsts[r][PREFIX : PREFIX + min(counts[worker_of(r)], FIRST)]
                 for r in range(1, self.world) if r != rank]
        return torch.cat([header, *heads])

    def _take_rest(self, rank: int, first: torch.Tensor, size: int, counts: list[int] | None,
                   sends: list[tuple[int, Any]], failed: list[str]) -> tuple[torch.Tensor, str | None]:
        """Receive the rest of ``rank``'s message (its first piece ``first`` is in) piece by piece, forwarding
        each piece's share of its head to every other live worker as it arrives (zeros once the message broke
        off; a forward that cannot be posted goes to ``failed``); the message, and the failure's message or
        None."""
        head = 0 if counts is None else counts[worker_of(rank)]
        others = [(r, _RELAY_TAG + worker_of(rank)) for r in range(1, self.world) if r != rank]
        spans = pieces(size)[1:]
        failure = None
        try:  # every piece's receive at once, so the worker's sends never wait for one
            body, works = self._post_rest(first[PREFIX : PREFIX + min(size, FIRST)], size, rank, _BODY_TAG)
        except ChannelBroken as err:
            body, works, failure = torch.zeros(size, dtype=torch.uint8), [], str(err)
        for index, (lo, hi) in enumerate(spans):
            if failure is None:
                try:
                    self._wait(works[index], rank, "receiving a message")
                except ChannelBroken as err:
                    failure = str(err)
            if lo < head:
                end = min(hi, head)
                piece = body[lo:end] if failure is None else torch.zeros(end - lo, dtype=torch.uint8)
                sends += self._post_each([(True, piece, r, tag) for r, tag in others], failed)
        if spans:
            self.arrivals[worker_of(rank)] = time.perf_counter()
        return body, failure

    def _down_posts(self, parts: list[torch.Tensor]) -> list[tuple[bool, torch.Tensor, int, int]]:
        """The sends of a message down in ``parts`` (its pieces) to every worker: its first piece at the end
        of the route that waits for it, if the last gather left them merged."""
        merged, self._merged = self._merged, None
        if merged is None:
            return [(True, part, r, _BODY_TAG) for r in range(1, self.world) for part in parts]
        return [(True, torch.cat([route, parts[0]]), r, _ROUTE_TAG) for r, route in merged.items()] + [
            (True, part, r, _BODY_TAG) for r in merged for part in parts[1:]]

    def send_down(self, body: torch.Tensor, bound: int | None = None) -> None:
        """Every live worker gets ``body`` even when another worker's connection failed."""
        if bound is not None and self._merged is not None:
            raise RuntimeError("a bounded message down after an unbounded gather")
        parts = message_pieces(body) if bound is None else [whole_message(body, bound)]
        failed: list[str] = []
        sends = self._post_each(self._down_posts(parts), failed)
        failed += self._wait_all(sends, "sending down")
        if failed or self.dead:
            raise ChannelBroken("; ".join(failed) or f"ranks {sorted(self.dead)} are gone")

    def abort(self, drain: bool, bound: int | None = None) -> None:
        """Workers whose route waits for the message down (they have not received the last one: no drain)
        get the abort at its end."""
        if drain and self._merged is None:
            try:
                self.gather_up(bound=bound)
            except ChannelBroken:
                pass  # the failed ones are now marked dead
        piece = first_piece(ABORT_SIZE, torch.empty(0, dtype=torch.uint8))
        self._wait_all(self._post_each(self._down_posts([piece]), []), "sending an abort")

    def close(self) -> None:
        self._group = None
        self._store = None
