"""The link probe (``dpgs.distributed.link_probe``) over an in-memory channel whose workers' links are
emulated (``EmulatedLink``): the fitted rates are the emulated ones, and a slow worker is seen as slow."""

from __future__ import annotations

import threading
import time

import pytest

from dpgs.distributed.link_probe import (
    PROBE_SHARE,
    REPEAT_BELOW_S,
    ROUND_BUDGET_S,
    LinkProbe,
    LinkWatch,
    probe_as_master,
    probe_as_worker,
    probe_sizes,
    second_probe_size,
)
from dpgs.distributed.transport import EmulatedLink
from tests.distributed.wire import Wire


class SentDown:
    """The master's channel, recording the size of every message it sends down."""

    def __init__(self, channel):
        self.channel, self.sizes = channel, []

    def send_down(self, body):
        self.sizes.append(body.numel())
        self.channel.send_down(body)

    def gather_up(self, timed=False, forward=None):
        return self.channel.gather_up(timed, forward)

    @property
    def arrivals(self):
        return self.channel.arrivals


def probe_emulated(mbps: list[float]) -> tuple[LinkProbe, list[int], float, list[threading.Thread]]:
    """``probe_as_master`` of 64 KiB and 1 MiB over one worker thread per rate in ``mbps`` (Mbit/s,
    ``EmulatedLink``): the probe, the sizes sent down, the seconds it took, and the worker threads
    (joined, with a timeout)."""
    wire = Wire(len(mbps))
    links = [EmulatedLink(wire.worker(w), rate) for w, rate in enumerate(mbps)]
    threads = [threading.Thread(target=probe_as_worker, args=(link,)) for link in links]
    for t in threads:
        t.start()
    master = SentDown(wire.master())
    start = time.perf_counter()
    probe = probe_as_master(master, (64 << 10, 1 << 20))
    took = time.perf_counter() - start
    for t in threads:
        t.join(timeout=10)
    return probe, master.sizes, took, threads


def test_probe_measures_each_workers_emulated_link():
    probe, _, _, _ = probe_emulated([80.0, 20.0])
    rates = [8 * probe.fit(w)[1] / 1e6 for w in range(2)]
    assert rates[0] == pytest.approx(80.0, rel=0.3) and rates[1] == pytest.approx(20.0, rel=0.3)
    # the exchange of 1 MB each way waits for the slow worker: about 2 MB at 20 Mbit/s
    assert probe.exchange_seconds(1e6, 1e6) == pytest.approx(2e6 * 8 / 20e6, rel=0.3)


def test_a_probe_repeats_only_its_short_rounds_and_ends_with_an_empty_message():
    """At 100 Mbit/s a 64 KiB round takes about 10 ms (repeated: fixed costs weigh) and a 1 MiB round
    about 170 ms (taken once: a second would measure the same transfer again at the same cost); the
    workers stop answering at the empty message."""
    probe, sizes, _, threads = probe_emulated([100.0, 100.0])
    assert not any(t.is_alive() for t in threads)
    assert sizes == [64 << 10, 64 << 10, 1 << 20, 0]
    assert 2 * (1 << 20) * 8 / 100e6 > REPEAT_BELOW_S
    assert 8 * probe.fit(0)[1] / 1e6 == pytest.approx(100.0, rel=0.3)


def test_probe_sizes_a_small_and_at_most_a_mebibyte():
    """64 KiB and the dense message, at most 1 MiB (a ResNet-18's 47 MB would take 2.8 s a probe at
    100 Mbit/s at 4 MiB) and at least 4x the small one (a tiny model's)."""
    assert probe_sizes(47_000_000) == (64 << 10, 1 << 20)
    assert probe_sizes(535_000) == (64 << 10, 535_000)
    assert probe_sizes(10_000) == (64 << 10, 256 << 10)


def test_the_second_probe_fits_the_round_budget():
    """A fast link gets the large probe; a slower one the size whose round fits the budget (at least 4x
    the small one); a link where 4x the small one would not fit, one eighth of the small one."""
    small, large = 64 << 10, 1 << 20
    assert second_probe_size(small, large, 0.012) == large  # 100 Mbit/s: a 1 MiB round ~0.2 s
    between = second_probe_size(small, large, 0.105)  # 10 Mbit/s: 1 MiB would take ~1.7 s
    assert 4 * small <= between < large and between / small * 0.105 <= ROUND_BUDGET_S
    assert second_probe_size(small, large, 0.25) == 4 * small  # 4x the small round is the budget
    assert second_probe_size(small, large, 2.1) == small // 8  # 0.5 Mbit/s: 1 MiB would take 34 s


def test_a_slow_link_is_probed_with_a_smaller_second_size():
    """At 0.5 Mbit/s a 64 KiB round takes about 2.1 s: the second probe is 8 KiB (0.26 s), not 1 MiB
    (34 s), and the fitted rate is still the link's."""
    probe, sizes, took, _ = probe_emulated([0.5, 0.5])
    assert sizes == [64 << 10, 8 << 10, 0]
    assert probe.sizes == (8 << 10, 64 << 10)
    assert 8 * probe.fit(1)[1] / 1e6 == pytest.approx(0.5, rel=0.3)
    assert took < 5.0


def test_link_watch_reprobes_once_the_last_probe_is_a_small_share_of_the_time_since():
    watch = LinkWatch()
    assert watch.due(now=5.0)  # never probed
    probe = LinkProbe((1, 2), ((0.1,), (0.2,)))
    watch.record(probe, taken_at=10.0, cost_s=0.7)
    assert watch.link is probe
    assert not watch.due(now=10.0 + 0.7 / PROBE_SHARE - 0.1)  # 0.7 s of probing in 14 s is over 5 %
    assert watch.due(now=10.0 + 0.7 / PROBE_SHARE)
    watch.record(probe, taken_at=30.0, cost_s=0.001)  # a cheap probe (a fast link) is repeated every epoch
    assert watch.due(now=30.1)


def test_an_emulated_link_also_waits_for_the_heads_the_master_forwards():
    """``dpgs.emulate_bandwidth_mbps`` charges a worker the relayed payloads it receives, as the bytes
    they are: 100 kB forwarded at 8 Mbit/s take 0.1 s."""
    import torch

    wire = Wire(2)
    slow = EmulatedLink(wire.worker(0), 8.0)
    slow.send_up(torch.zeros(10, dtype=torch.uint8))
    wire.worker(1).send_up(torch.full((100_000,), 7, dtype=torch.uint8))
    wire.master().gather_up(forward=lambda sizes: sizes)
    start = time.perf_counter()
    (head,) = slow.recv_relayed()
    assert time.perf_counter() - start >= 0.1
    assert head.numel() == 100_000 and int(head[0]) == 7
