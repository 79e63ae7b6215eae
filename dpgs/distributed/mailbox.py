"""The Ray transport of a DPGS group: a mailbox actor that holds each exchange's data as object refs.

Used where the ranks cannot form a gloo group (``dpgs.transport=ray``, or ``auto`` when forming one
fails). Each rank numbers its operations; because every rank performs the same operations in the same
order, operation ``seq`` of generation ``g`` names the same exchange on every rank. A value is posted
under ``(g, seq, src, dst)`` and removed once its readers took it (a message down is held under each
worker's own rank, once when every worker gets the same). A gather takes two numbers: the messages up, then
what the master forwards of them to each worker (None when nothing), posted once every message is in.
The driver aborts a generation when a rank dies, which wakes every waiting rank with ChannelBroken.
A bounded exchange (``dpgs.distributed.transport``) is the same here: a post needs no receive waiting for
it, so the bound only refuses longer messages.
"""

from __future__ import annotations

import asyncio
import time

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dpgs.distributed.transport import MASTER_RANK, ChannelBroken, Forward, check_bound, worker_of


@ray.remote(num_cpus=0, max_concurrency=1000)
class Mailbox:
    """Async actor: ``post`` a value for ``readers`` takers, ``take`` it (waiting until it is posted)."""

    def __init__(self) -> None:
        self.values: dict[tuple, list] = {}  # key -> [value, readers left]
        self.posted: dict[tuple, asyncio.Event] = {}
        self.aborted: set[int] = set()

    def _event(self, key: tuple) -> asyncio.Event:
        return self.posted.setdefault(key, asyncio.Event())

    async def post(self, key: tuple, value, readers: int) -> None:
        if key[0] in self.aborted:
            return
        self.values[key] = [value, readers]
        self._event(key).set()

    async def post_to_workers(self, key: tuple, value, workers: int) -> None:
        """``value`` (held once) for each of workers 1..``workers``, under ``(*key, worker)``."""
        for worker in range(1, workers + 1):
            await self.post((*key, worker), value, 1)

    async def take(self, key: tuple, timeout_s: float):
        if key[0] in self.aborted:
            raise ChannelBroken(f"exchange {key} aborted by the driver")
        try:
            await asyncio.wait_for(self._event(key).wait(), timeout_s)
        except asyncio.TimeoutError:
            self.posted.pop(key, None)
            raise ChannelBroken(f"exchange {key}: nothing arrived within {timeout_s:.0f}s") from None
        if key[0] in self.aborted:
            raise ChannelBroken(f"exchange {key} aborted by the driver")
        entry = self.values[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.values[key], self.posted[key]
        return entry[0]

    async def abort(self, generation: int) -> None:
        """Wake every rank waiting in ``generation`` with ChannelBroken and drop its values."""
        self.aborted.add(generation)
        for key in [k for k in self.posted if k[0] == generation]:
            self.posted.pop(key).set()
            self.values.pop(key, None)


class MailboxChannel:
    """:class:`~dpgs.distributed.transport.Channel` over a :class:`Mailbox` actor."""

    def __init__(self, rank: int, world: int, mailbox, generation: int, timeout_s: float):
        self.rank, self.world = rank, world
        self.mailbox, self.generation, self.timeout_s = mailbox, generation, timeout_s
        self.seq = 0
        self.arrivals: list[float] = []  # when each worker's message of the last timed gather arrived
        self._relayed: int | None = None  # worker: the number of what is forwarded of its last message up

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _post(self, seq: int, dst: int, value, readers: int) -> None:
        self.mailbox.post.remote((self.generation, seq, self.rank, dst), value, readers)

    def _take(self, seq: int, src: int, dst: int):
        try:
            return ray.get(
                self.mailbox.take.remote((self.generation, seq, src, dst), self.timeout_s),
                timeout=self.timeout_s + 30,
            )
        except RayTaskError as err:
            raise ChannelBroken(f"rank {self.rank}: {err.cause if err.cause else err}") from err
        except (RayActorError, GetTimeoutError) as err:
            raise ChannelBroken(f"rank {self.rank}: the mailbox is unreachable: {err}") from err

    def send_up(self, body: torch.Tensor, bound: int | None = None) -> None:
        check_bound(body, bound)  # a posted object needs no receive: the bound changes nothing else
        self._settle()
        self._post(self._next(), MASTER_RANK, body, 1)
        self._relayed = self._next()

    def recv_relayed(self) -> list[torch.Tensor]:
        if self._relayed is None:
            return []
        seq, self._relayed = self._relayed, None
        return self._take(seq, MASTER_RANK, self.rank) or []

    def _settle(self) -> None:
        if self.recv_relayed():
            raise RuntimeError(f"rank {self.rank}: the master forwarded other workers' messages; "
                               "recv_relayed must take them")

    def gather_up(
        self, timed: bool = False, forward: Forward | None = None, bound: int | None = None
    ) -> list[torch.Tensor]:
        if bound is not None and (timed or forward is not None):
            raise ValueError("a bounded gather is neither timed nor relayed")
        seq, relayed = self._next(), self._next()
        try:
            bodies = self._gather(seq, timed)
        except ChannelBroken:
            self._post_relayed(relayed, None)  # the live workers go on to the abort
            raise
        counts = None if forward is None else forward([b.numel() for b in bodies])
        heads = None if counts is None else [
            [b[:n] for o, (b, n) in enumerate(zip(bodies, counts, strict=True)) if o != worker_of(rank)]
            for rank in range(1, self.world)
        ]
        self._post_relayed(relayed, heads)
        return bodies

    def _post_relayed(self, seq: int, heads: list[list[torch.Tensor]] | None) -> None:
        if heads is None:
            self.mailbox.post_to_workers.remote((self.generation, seq, self.rank), None, self.world - 1)
        else:
            for rank, own in enumerate(heads, start=1):
                self._post(seq, rank, own, 1)

    def _gather(self, seq: int, timed: bool) -> list[torch.Tensor]:
        if not timed:
            return [self._take(seq, src, MASTER_RANK) for src in range(1, self.world)]
        refs = {self.mailbox.take.remote((self.generation, seq, src, MASTER_RANK), self.timeout_s): src
                for src in range(1, self.world)}
        self.arrivals = [0.0] * (self.world - 1)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s + 30)
            if not ready:
                raise ChannelBroken(f"rank {self.rank}: the mailbox is unreachable")
            self.arrivals[refs[ready[0]] - 1] = time.perf_counter()
        try:
            return ray.get(list(refs))
        except RayTaskError as err:
            raise ChannelBroken(f"rank {self.rank}: {err.cause if err.cause else err}") from err

    def send_down(self, body: torch.Tensor, bound: int | None = None) -> None:
        """One post, which the mailbox holds once for every worker."""
        check_bound(body, bound)
        self.mailbox.post_to_workers.remote((self.generation, self._next(), self.rank), body, self.world - 1)

    def recv_down(self, bound: int | None = None) -> torch.Tensor:
        self._settle()
        body = self._take(self._next(), MASTER_RANK, self.rank)
        if body is None:
            raise ChannelBroken(f"rank {self.rank}: the master aborted the exchange")
        if bound is not None and body.numel() > bound:
            raise ChannelBroken(f"rank {self.rank}: the master sent a message of {body.numel()} bytes in an "
                                f"exchange bounded to {bound}")
        return body

    def abort(self, drain: bool, bound: int | None = None) -> None:
        """Posts never block here, so nothing needs draining: the workers' next message down is the abort
        (None); the driver also aborts the whole generation when a rank dies. ``drain``: the workers first
        send up (seq + 1) and take what is forwarded of it (seq + 2, nothing), then receive (seq + 3)."""
        if drain:
            self._post_relayed(self.seq + 2, None)
        self.seq += 3 if drain else 1
        self.mailbox.post_to_workers.remote((self.generation, self.seq, self.rank), None, self.world - 1)

    def close(self) -> None:
        """Nothing to release: the mailbox belongs to the pool."""
