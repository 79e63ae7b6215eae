"""The keep ratio of each step (``dpgs.distributed.schedule``): fixed ratios with their warm-up, and
``keep_ratio=auto`` deciding from a measured link and compute, against hand-computed exchange times."""

from __future__ import annotations

import pytest

from dpgs.compression import ParamLayout
from dpgs.config.schema import CompressionConfig
from dpgs.distributed.link_probe import LinkProbe
from dpgs.distributed.messages import WorkerStep
from dpgs.distributed.schedule import HEADER_BYTES, ByteModel, KeepSchedule, step_compute_seconds

RESNET18 = 11_689_512  # about the trainable parameters of ResNet-18 + ABMIL


def link(mbps: float, latency_s: float = 0.001, workers: int = 2) -> LinkProbe:
    """The round trips a link of ``mbps`` and ``latency_s`` gives for 64 KiB and 4 MiB probes."""
    rate = mbps * 1e6 / 8
    sizes = (64 << 10, 4 << 20)
    return LinkProbe(sizes, tuple(tuple(latency_s + 2 * s / rate for _ in range(workers)) for s in sizes))


def model(numel: int = RESNET18, workers: int = 2, **cfg) -> ByteModel:
    layout = ParamLayout.from_shapes([("w", (numel,))])
    return ByteModel.of(CompressionConfig(**cfg), layout, 0, workers)


def test_the_probe_fit_recovers_latency_and_rate():
    probe = link(100.0, latency_s=0.002)
    latency, rate = probe.fit(0)
    assert latency == pytest.approx(0.002) and rate == pytest.approx(100e6 / 8)
    assert probe.exchange_seconds(1e6, 2e6) == pytest.approx(0.002 + 3e6 / (100e6 / 8))
    assert probe.metrics()["link_mbps_worker_1"] == pytest.approx(100.0)


def test_the_slowest_worker_sets_the_exchange():
    fast, slow = link(1000.0), link(100.0)
    seconds = tuple((f[0], s[1]) for f, s in zip(fast.seconds, slow.seconds, strict=True))
    probe = LinkProbe(fast.sizes, seconds)
    assert probe.exchange_seconds(1e6, 1e6) == pytest.approx(slow.exchange_seconds(1e6, 1e6))


def test_bytes_per_worker_at_each_keep_ratio():
    bytes_ = model(1_000_000, workers=4, value_dtype="fp16", dense_min_numel=0)
    assert bytes_.per_worker(1.0) == (4e6, 4e6 + HEADER_BYTES)  # raw up, the dense sum down
    up, down = bytes_.per_worker(0.01)
    assert up == HEADER_BYTES + 3.0 * 10_000  # fp16 value + 1 byte of index per sent entry
    assert down == 4 * up + HEADER_BYTES  # the four payloads relayed
    assert bytes_.per_worker(0.5)[1] == 4e6 + HEADER_BYTES  # four payloads would be larger: the dense sum
    delta = model(1_000_000, workers=4, downlink="delta", dense_min_numel=0)
    assert delta.per_worker(0.01)[1] == delta.payload(0.01) + HEADER_BYTES  # one delta down
    assert bytes_.calibrated(0.01, HEADER_BYTES + 2.2 * 10_000).payload(0.01) == pytest.approx(
        HEADER_BYTES + 2.2 * 10_000)


def test_auto_chooses_dense_on_a_fast_link_and_compresses_on_a_slow_one():
    cfg = CompressionConfig(keep_ratio="auto")
    compute = 3.0  # seconds of forward/backward of a tile bag on the CPU
    fast = KeepSchedule(cfg).decide(link(20_000.0, latency_s=1e-4), compute, model())
    assert fast.ratio == 1.0 and fast.dense_exchange_seconds <= 0.1 * compute
    slow_schedule = KeepSchedule(cfg)
    slow = slow_schedule.decide(link(100.0), compute, model())
    # 47 MB each way at 100 Mbit/s is 7.5 s; keep 10 % (3.5 MB up, 7 MB down) 0.84 s > 0.3 s; keep 1 %: 0.08 s
    assert slow.dense_exchange_seconds == pytest.approx(0.001 + 2 * 4 * RESNET18 * 8 / 100e6, rel=1e-3)
    assert slow.ratio == 0.01 and slow.exchange_seconds <= 0.1 * compute
    assert slow_schedule.ratio(1) == 0.25 and slow_schedule.ratio(3) == 0.01  # DGC warm-up, then steady
    hopeless = KeepSchedule(cfg).decide(link(1.0), compute, model())
    assert hopeless.ratio == 0.001  # nothing fits: the fastest exchange
    assert slow.metrics()["auto_keep_ratio"] == 0.01


def test_auto_stays_dense_where_latency_dominates():
    """A tiny model behind a slow-to-answer link: nothing fits in 10 % of a 1 ms step, and compressing
    would save nothing (the 50 ms latency is the exchange): dense."""
    cfg = CompressionConfig(keep_ratio="auto")
    decision = KeepSchedule(cfg).decide(link(1000.0, latency_s=0.05), 0.001, model(10_000))
    assert decision.ratio == 1.0 and decision.dense_exchange_seconds > 0.1 * 0.001


def test_a_fixed_ratio_overrides_auto():
    schedule = KeepSchedule(CompressionConfig(keep_ratio=1.0))
    assert not schedule.auto and schedule.ratio(1) == 1.0
    schedule = KeepSchedule(CompressionConfig(keep_ratio=0.01, warmup_epochs=2))
    assert [schedule.ratio(e) for e in (1, 2, 3)] == [0.25, 0.0625, 0.01]


def test_compute_is_the_median_of_the_slowest_worker_per_step():
    def report(index, worker, seconds):
        return WorkerStep(index, worker, 1, [0.0], 1, 0.0, seconds, 0.0, 0.0, 0.0, 0, 0, 0)

    reports = [report(0, 0, 1.0), report(0, 1, 3.0), report(1, 0, 2.0), report(1, 1, 1.0), report(2, 0, 9.0)]
    assert step_compute_seconds(reports) == 3.0  # per step 3, 2, 9
