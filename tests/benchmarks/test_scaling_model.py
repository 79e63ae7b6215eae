"""The scaling model's arithmetic (benchmarks/scaling_model.py) against hand-computed steps."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dpgs.distributed.frames import HEADER, frame_bytes
from dpgs.distributed.sync.contract import tail_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from scaling_lab import link_delay, link_rate  # noqa: E402
from scaling_model import (  # noqa: E402
    DPGS_FRAME_HEADER,
    DPGS_FRAME_PART,
    DPGS_LOSS_SUM,
    Compressed,
    Link,
    PowerSgd,
    Scenario,
    Workload,
    ddp_buckets,
    exchange_limit_workers,
    fastest_workers,
    predict,
)

GBPS = Link("1 Gbps", 1e9, 1e-3, goodput=1.0)


def workload(**changes) -> Workload:
    """1M parameters (4 MB dense), no buffers, one bag = 0.99 s forward + 0.01 s backward."""
    base = dict(
        name="toy", numel=1_000_000, buffer_numel=0, bag_forward_s=0.99, bag_backward_s=0.01,
        optimizer_s=0.05, dense_add_s=0.01, dense_pack_s=0.02, dense_load_s=0.03,
        compressed={0.01: Compressed(keep=0.01, payload_bytes=10_000, encode_s=0.004, decode_add_s=0.002,
                                     entries=10_000, union_exponent=0.5, merged_intercept=1_000,
                                     merged_per_entry=1.0, merged_encode_per_entry_s=1e-7,
                                     delta_bytes=12_000, delta_encode_s=0.006)},
        powersgd=PowerSgd(rank=4, p_bytes=40_000, q_bytes=60_000, uncompressed_bytes=100_000,
                          compress_s=0.03),
    )
    base.update(changes)
    return Workload(**base)


def test_dense_star_step_by_hand():
    # P = 4 workers, B = 8 bags: 2 bags each -> compute 2 s. Up and down 4 MB per worker; the master's
    # link carries 4 x 4 MB each way: 2 x 0.128 s. Latency 2 x 1 ms (bounded: one gloo message each way).
    # CPU: pack 0.02 + 4 adds x 0.01 +
    # Adam 0.05 + load 0.03 = 0.14.
    step = predict(workload(), "dpgs-dense", Scenario(4, 8, GBPS))
    assert step.compute == pytest.approx(2.0)
    assert step.cpu == pytest.approx(0.14)
    assert step.comm == pytest.approx(0.256 + 0.002)
    assert step.total == pytest.approx(2.398)
    assert step.master_bytes == pytest.approx(32e6)
    assert step.exchange == pytest.approx(0.398)


def test_relay_step_by_hand():
    # Up: 10 kB and the 8-byte loss sum per worker (4 x 10 kB = 0.32 ms on the master's link, the sums
    # 0.26 us). Down, forwarded as it arrives: the three other payloads, 30 kB to each of 4 workers
    # (0.96 ms); one piece (the payload is one), so the forward starts once the upload is in. Then the
    # frame of 32 + 8 bytes to each of 4 workers (1.28 us). Each message is one piece: 2 latencies. CPU:
    # encode 0.004, every worker decodes 4 payloads (0.008) and steps Adam (0.05).
    step = predict(workload(), "dpgs-keep0.01", Scenario(4, 8, GBPS))
    assert step.cpu == pytest.approx(0.062)
    assert step.comm == pytest.approx(3.2e-4 + 2.56e-7 + 9.6e-4 + 1.28e-6 + 0.002)
    assert step.total == pytest.approx(2.062 + step.comm)
    assert step.master_bytes == pytest.approx(4 * (10_008 + 30_000 + 40))
    clipped = predict(workload(), "dpgs-keep0.01", Scenario(4, 8, GBPS, clipping=True))
    assert clipped.total - step.total == pytest.approx(0.008)  # the master decodes before its frame
    # 10 MB payloads at P = 2 (77 pieces of 128 KiB): up and down at once, plus one piece; 6 latencies
    big = workload(compressed={0.01: replace(workload().compressed[0.01], payload_bytes=10e6)})
    two = predict(big, "dpgs-keep0.01", Scenario(2, 4, GBPS))
    assert two.comm == pytest.approx(8 * 2 * (10e6 + 8 + (128 << 10)) / 1e9 + 8 * 2 * 40 / 1e9 + 0.006)
    # one queue for both directions (the loopback checks' namespace): up, then down
    shared = predict(big, "dpgs-keep0.01", Scenario(2, 4, GBPS, full_duplex=False))
    assert shared.comm == pytest.approx(8 * 2 * (2 * 10e6 + 8) / 1e9 + 8 * 2 * 40 / 1e9 + 0.006)


def test_merged_and_delta_by_hand():
    # Union of 4 top-k sets: 10 000 x 4 ** 0.5 = 20 000 entries -> 1 000 + 20 000 bytes + 48 of frame.
    merged = predict(workload(), "dpgs-keep0.01-merged", Scenario(4, 8, GBPS))
    down = 32 + 16 + 21_000
    assert merged.comm == pytest.approx(8 * 4 * 10_008 / 1e9 + 8 * 4 * down / 1e9 + 0.002)
    # encode 0.004 + master decodes 4 x 0.002 + merge encode 20 000 x 1e-7 + worker decodes 2 payloads'
    # worth (0.004) + Adam 0.05
    assert merged.cpu == pytest.approx(0.004 + 0.008 + 0.002 + 0.004 + 0.05)
    delta = predict(workload(), "dpgs-keep0.01-delta", Scenario(4, 8, GBPS))
    assert delta.comm == pytest.approx(8 * 4 * 10_008 / 1e9 + 8 * 4 * (32 + 16 + 12_000) / 1e9 + 0.002)
    assert delta.cpu == pytest.approx(0.004 + 0.008 + 0.05 + 0.006 + 0.002)


def test_slow_worker_links_bound_the_phase():
    # Master at 10 Gbps, workers at 100 Mbps: 4 MB takes 0.32 s on a worker link, 4 x 4 MB 0.0128 s on
    # the master's: the workers' links set both phases.
    fast = Link("10 Gbps", 10e9, 1e-3, goodput=1.0)
    slow = Link("100 Mbps", 100e6, 1e-3, goodput=1.0)
    step = predict(workload(), "dpgs-dense", Scenario(4, 8, fast, worker_link=slow))
    assert step.comm == pytest.approx(2 * 0.32 + 0.002)


def test_ddp_ring_by_hand():
    # 4 MB: a 1 MiB bucket and one more (2 rounds). Each link carries 2 x 3/4 x 4 MB = 6 MB: 0.048 s;
    # 2 rounds x 2 x 3 steps x 1 ms = 0.012 s; 0.01 s of it hides behind the last bag's backward.
    assert ddp_buckets(4e6) == 2
    step = predict(workload(), "ddp", Scenario(4, 8, GBPS))
    assert step.comm == pytest.approx(0.05)
    assert step.total == pytest.approx(2.0 + 0.05 + 0.05)
    assert step.master_bytes == 0.0
    # A 0.5 s backward could hide all 0.06 s, but not the last bucket's share (4e6 - 2**20) / 4e6.
    hidden = predict(workload(bag_forward_s=0.5, bag_backward_s=0.5), "ddp", Scenario(4, 8, GBPS))
    assert hidden.comm == pytest.approx(0.06 * 0.737856)
    # 100 MB: buckets 1 MiB + 3 x 25 MiB + the rest; 2 x 3/4 x 100 MB = 1.2 s, 5 rounds x 6 steps x 1 ms
    # = 0.03 s, of which 0.01 s hides.
    assert ddp_buckets(100e6) == 5
    assert predict(workload(numel=25_000_000), "ddp", Scenario(4, 8, GBPS)).comm == pytest.approx(1.22)
    # PowerSGD: 200 kB all-reduced (each link carries 2 x 3/4 x 200 kB = 300 kB: 2.4 ms), 3 all-reduces
    # per bucket (2 x 3 x 2 x 3 steps x 1 ms = 0.036 s), 0.01 s hidden.
    ps = predict(workload(), "ddp-powersgd", Scenario(4, 8, GBPS))
    assert ps.comm == pytest.approx(2.4e-3 + 0.036 - 0.01)
    assert ps.cpu == pytest.approx(0.03 + 0.05)
    one = predict(workload(), "ddp", Scenario(1, 8, GBPS))
    assert one.comm == 0.0 and one.compute == pytest.approx(8.0)


def test_saturation_and_fastest_workers_by_hand():
    # B = 64. Dense exchange(P) = 0.102 + P x 0.064 (link, both phases) + 0.01 P (adds) = 0.102 + 0.074 P;
    # compute(P) = ceil(64 / P). P = 9: 0.768 <= 0.8; P = 10: 0.842 > 0.7.
    s = Scenario(1, 64, GBPS)
    assert exchange_limit_workers(workload(), "dpgs-dense", s, list(range(1, 65))) == 10
    # total(P) = ceil(64 / P) + 0.102 + 0.074 P: P = 16 gives 4 + 1.286 = 5.286, P = 32 gives 2 + 2.47 =
    # 4.47, P = 22 gives 3 + 1.73 = 4.73, P = 64 gives 1 + 4.838; the minimum is P = 32.
    assert fastest_workers(workload(), "dpgs-dense", s, list(range(1, 65))) == 32
    assert exchange_limit_workers(workload(), "dpgs-dense", s, [1, 2], share=10.0) is None
    # The network alone, 0.002 + 0.064 P against 0.1 ceil(64 / P): P = 10 gives 0.642 <= 0.7, P = 11
    # gives 0.706 > 0.6.
    assert exchange_limit_workers(workload(), "dpgs-dense", s, list(range(1, 65)), part="comm") == 11


def test_unknown_method_and_keep_are_refused():
    with pytest.raises(ValueError, match="keep ratio 0.001 not measured"):
        predict(workload(), "dpgs-keep0.001", Scenario(2, 8, GBPS))
    with pytest.raises(ValueError, match="unknown method"):
        predict(workload(), "allgather", Scenario(2, 8, GBPS))


def test_lab_link_names():
    assert link_rate("100mbit") == 100e6
    assert link_rate("1 Gbps") == 1e9
    assert link_rate("loopback") is None
    assert link_rate("1gbit+1ms") == 1e9
    assert link_delay("100mbit+2.5ms") == pytest.approx(2.5e-3)
    assert link_delay("100mbit") is None and link_delay("loopback") is None
    with pytest.raises(ValueError, match="expected loopback or a rate"):
        link_rate("fast")


def test_lab_rows_predicted_from_their_own_compute_or_loopback(tmp_path):
    import json

    from scaling_lab import compare_lab

    rows = [
        # With compute_s: 1.5 + cpu 0.12 (0.02 + 2 x 0.01 + 0.05 + 0.03) + comm (2 phases of 2 x 4 MB at
        # 100 Mbit/s x 1448/1514, 2 x 1 ms).
        {"workload": "toy", "link": "100mbit", "method": "dpgs-dense", "workers": 2, "step_s": 2.0,
         "compute_s": 1.5, "wire_bytes_per_step": None},
        # Without: the loopback row's 1.25 s plus the same comm.
        {"workload": "toy", "link": "loopback", "method": "dpgs-dense", "workers": 2, "step_s": 1.25},
        {"workload": "toy", "link": "100 Mbps", "method": "dpgs-dense", "workers": 2, "step_s": 2.5},
    ]
    path = tmp_path / "bandwidth.json"
    path.write_text(json.dumps(rows))
    comm = 2 * 8 * 2 * 4e6 / (100e6 * 1448 / 1514) + 0.002
    table = compare_lab(path, [workload()], default_workers=2)
    lines = table.splitlines()[2:]
    own = 1.5 + 0.12 + comm
    assert f"| {own:.3f} | {100 * (own / 2.0 - 1):+.0f} % | lab compute" in lines[0]
    assert f"| {1.25 + comm:.3f} | {100 * ((1.25 + comm) / 2.5 - 1):+.0f} % | lab loopback" in lines[2]
    # A delayed link's row takes its own delay (the default latency is 1 ms): 2 x 5 ms.
    path.write_text(json.dumps([{**rows[0], "link": "100mbit+5ms"}]))
    delayed = compare_lab(path, [workload()], default_workers=2).splitlines()[2]
    assert f"| {own + 0.008:.3f} |" in delayed
    path.write_text(json.dumps([{"workload": "toy", "link": "100mbit"}]))
    with pytest.raises(SystemExit, match="row 0 lacks method, step_s"):
        compare_lab(path, [workload()], default_workers=2)


def test_a_loopback_row_with_its_compute_adds_the_runtime_loop_cost(tmp_path):
    """A loopback row's step less its compute and the model's terms there is the runtime's own cost per
    step; a lab row of the same workload, method and P adds the median over such rows to its compute and
    the model's terms."""
    import json

    from scaling_lab import LOOPBACK_LATENCY_S, compare_lab

    rows = [
        {"workload": "toy", "link": "loopback", "method": "dpgs-dense", "workers": 2, "step_s": 1.8,
         "compute_s": 1.5},
        {"workload": "toy", "link": "100mbit", "method": "dpgs-dense", "workers": 2, "step_s": 2.0,
         "compute_s": 1.5},
        {"workload": "toy", "link": "loopback", "method": "dpgs-dense", "workers": 2, "step_s": 1.9,
         "compute_s": 1.7},  # step - compute: 0.3, 0.2 and 0.4 over the three; the median 0.3
        {"workload": "toy", "link": "loopback", "method": "dpgs-dense", "workers": 2, "step_s": 2.3,
         "compute_s": 1.9},
    ]
    path = tmp_path / "bandwidth.json"
    path.write_text(json.dumps(rows))
    loop = 0.3 - 0.12 - (2 * 8 * 2 * 4e6 / 1e15 + 2 * LOOPBACK_LATENCY_S)
    comm = 2 * 8 * 2 * 4e6 / (100e6 * 1448 / 1514) + 0.002
    lines = compare_lab(path, [workload()], default_workers=2).splitlines()[2:]
    assert f"| {1.5 + 0.12 + comm + loop:.3f} |" in lines[1] and "lab compute + model + loop" in lines[1]
    # a loopback row: its own compute and the model (the loop's cost is what it measures)
    assert "| lab compute + model |" in lines[0]


def test_the_models_message_sizes_are_dpgs_own():
    """The constants the model prices dpgs's messages with are those of the code that builds them."""
    assert DPGS_FRAME_HEADER == HEADER.size
    assert frame_bytes([0]) == DPGS_FRAME_HEADER + DPGS_FRAME_PART
    assert tail_bytes(7) == DPGS_LOSS_SUM + 8 * 7
