"""Measuring the links between the master and its workers: a probe exchange between two chunks.

For each probe size S the master sends S bytes to every worker at once (``send_down``), every worker
answers with S bytes as soon as it has them (``send_up``), and the master records when each answer
arrived (``Channel.gather_up(timed=True)``). The small size goes first; the second is chosen from its
round (:func:`second_probe_size`) so that no round takes much over ``ROUND_BUDGET_S``: the large size (the
dense message, up to 1 MiB) on a fast link, a size in between on a slow one, and one eighth of the small
size where even 4x the small one would take longer (a 1 MiB round took 34 s at 0.5 Mbit/s; the line
through 8 and 64 KiB measures such a link in 2.4 s). A size's round is repeated (up to ``REPEATS`` rounds, the
fastest kept) only while its rounds have taken less than ``REPEAT_BELOW_S`` in all: a round that short is
mostly fixed costs, where one delayed packet or wake-up weighs; a longer one is mostly transfer, which a
second round would only measure again at the same cost (at 100 Mbit/s the second round of a 0.65 MB probe
was 0.18 s of a 5 s run). An empty message down ends the probe. Worker w's round trip is modelled as

    round_trip_w(S) = latency_w + 2 S / rate_w

(S bytes down and S up through that worker's link, the master's link shared as in a real step). Two sizes
give both unknowns of every worker; the exchange of a step that moves ``up`` bytes up and ``down`` bytes
down per worker is then predicted as ``max_w latency_w + (up + down) / rate_w`` (the step waits for the
slowest worker), or ``max_w latency_w + max(up, down) / rate_w`` where the bytes down flow while the bytes
up arrive (the relay's cut-through: every link is full duplex).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpgs.distributed.transport import Channel

SMALL_PROBE = 64 << 10
LARGE_PROBE_MAX = 1 << 20  # 16x the small one; at 100 Mbit/s a probe of two rounds took 2.8 s at 4 MiB
REPEATS = 2
REPEAT_BELOW_S = 0.05  # a size's rounds are repeated while they took less than this in all
ROUND_BUDGET_S = 1.0  # the second probe's round, extrapolated from the small one's, takes at most this
PROBE_SHARE = 0.05  # re-probing the links takes at most this share of a run's wall time


def probe_sizes(dense_bytes: int) -> tuple[int, int]:
    """A small and a large probe: 64 KiB, and the dense message up to 1 MiB (at least 4x the small)."""
    return SMALL_PROBE, max(4 * SMALL_PROBE, min(LARGE_PROBE_MAX, dense_bytes))


def second_probe_size(small: int, large: int, small_round_s: float) -> int:
    """The size of the second probe, given the slowest worker's round trip of the ``small`` one.

    A round of S bytes is taken to last ``small_round_s * S / small`` (an upper bound: the latency is
    counted as if it grew with S). The second size is the largest of ``large`` and below whose round fits
    ``ROUND_BUDGET_S``, but at least ``4 * small`` so that the two sizes are far enough apart for the
    fit; where even ``4 * small`` would not fit, ``small // 8``: on such a link the small round is
    nearly all transfer, and a smaller size resolves the latency as well as a larger one would."""
    if 4 * small_round_s > ROUND_BUDGET_S:
        return small // 8
    fitting = int(small * ROUND_BUDGET_S / max(small_round_s, 1e-9))
    return max(4 * small, min(large, fitting))


@dataclass(frozen=True)
class LinkProbe:
    """Round trips ``seconds[i][w]`` of worker w for probe ``sizes[i]`` (bytes each way)."""

    sizes: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    @property
    def workers(self) -> int:
        return len(self.seconds[0])

    def fit(self, worker: int) -> tuple[float, float]:
        """(latency in seconds, rate in bytes/s) of ``worker``, the line through the smallest and the largest
        probe (a rate that cannot be resolved, a flat line, is infinite)."""
        s0, t0 = self.sizes[0], self.seconds[0][worker]
        s1, t1 = self.sizes[-1], self.seconds[-1][worker]
        slope = (t1 - t0) / (2 * (s1 - s0))  # seconds per byte of one direction
        if slope <= 0:
            return max(t1, 0.0), math.inf
        return max(t0 - 2 * s0 * slope, 0.0), 1.0 / slope

    def exchange_seconds(self, up_bytes: float, down_bytes: float, overlapped: bool = False) -> float:
        """Predicted wall time of moving ``up_bytes`` up and ``down_bytes`` down per worker (slowest), one
        after the other or, ``overlapped``, at the same time."""
        moved = max(up_bytes, down_bytes) if overlapped else up_bytes + down_bytes
        return max(lat + moved / rate for lat, rate in map(self.fit, range(self.workers)))

    def metrics(self) -> dict[str, float]:
        """Per-worker latency (ms) and rate (Mbit/s) for MLflow."""
        out = {}
        for w in range(self.workers):
            latency, rate = self.fit(w)
            out[f"link_latency_ms_worker_{w}"] = 1e3 * latency
            if math.isfinite(rate):
                out[f"link_mbps_worker_{w}"] = 8 * rate / 1e6
        return out


def _rounds(channel: Channel, size: int) -> tuple[float, ...]:
    """Rounds of ``size`` bytes, every worker at once, repeated while short (module docstring): each
    worker's fastest round trip."""
    rounds: list[list[float]] = []
    spent = 0.0
    while len(rounds) < REPEATS and (not rounds or spent < REPEAT_BELOW_S):
        start = time.perf_counter()
        channel.send_down(torch.zeros(size, dtype=torch.uint8))
        replies = channel.gather_up(timed=True)
        spent += time.perf_counter() - start
        if any(r.numel() != size for r in replies):
            got = [r.numel() for r in replies]
            raise RuntimeError(f"link probe: workers answered {got} bytes, not {size}")
        rounds.append([arrived - start for arrived in channel.arrivals])
    return tuple(min(times) for times in zip(*rounds, strict=True))


def probe_as_master(channel: Channel, sizes: tuple[int, int]) -> LinkProbe:
    """The master's side of a probe of ``sizes = (small, large)`` (:func:`probe_sizes`): the small size,
    then the second chosen from it (:func:`second_probe_size`). Ends the probe with an empty message."""
    small, large = sizes
    measured = {small: _rounds(channel, small)}
    second = second_probe_size(small, large, max(measured[small]))
    measured[second] = _rounds(channel, second)
    channel.send_down(torch.empty(0, dtype=torch.uint8))
    ordered = sorted(measured)
    return LinkProbe(tuple(ordered), tuple(measured[size] for size in ordered))


def probe_as_worker(channel: Channel) -> None:
    """A worker's side: answer each probe message with as many bytes as it received, until an empty one."""
    while (body := channel.recv_down()).numel():
        channel.send_up(body)


@dataclass
class LinkWatch:
    """The last probe of the links: what it measured, when (``time.monotonic``) and what it cost.

    ``keep_ratio=auto`` re-decides every epoch; it probes the links again only when the time since the
    last probe is at least ``cost / PROBE_SHARE``, so that probing takes at most ``PROBE_SHARE`` of the
    run's wall time (a probe moves the dense gradient, up to 1 MiB, both ways to every worker: on a
    slow link that is as long as a whole epoch of a small model). Until then the last probe stands; the
    steps' own exchange times, measured every epoch, still move the choice."""

    link: LinkProbe | None = None
    taken_at: float = 0.0
    cost_s: float = 0.0

    def due(self, now: float) -> bool:
        return self.link is None or (now - self.taken_at) * PROBE_SHARE >= self.cost_s

    def record(self, link: LinkProbe, taken_at: float, cost_s: float) -> None:
        self.link, self.taken_at, self.cost_s = link, taken_at, cost_s

    def latest(self, probe: Callable[[], LinkProbe]) -> tuple[LinkProbe, bool]:
        """The links to decide on, and whether they were probed now: a new ``probe()`` when one is
        :meth:`due`, else the last one."""
        now = time.monotonic()
        if not self.due(now):
            return self.link, False
        self.record(probe(), now, time.monotonic() - now)
        return self.link, True

    def standing(self) -> str:
        """How old the last probe is and what it took, for a decision taken on it."""
        age = time.monotonic() - self.taken_at
        return f"the links' probe of {age:.0f} s ago stands: it took {self.cost_s:.2f} s"
