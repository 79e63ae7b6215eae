"""The bandwidth benchmark's interface-counter sampler (benchmarks/bandwidth_sites.py) on this process's
own loopback: windows ending now can be read once a later sample exists, and not before."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth_sites import CounterSampler  # noqa: E402


def test_a_window_ending_now_is_read_after_waiting_for_a_later_sample():
    with CounterSampler({"lo": (_pid(), "lo")}, period=0.05) as sampler:
        start = time.time()
        time.sleep(0.2)
        sent = _send_over_loopback(200_000)
        end = time.time() + 0.2  # counters are interpolated between samples: a margin past the send
        with pytest.raises(ValueError, match="outside the sampled span"):
            sampler.at(end)
        sampler.wait_past(end)
        rx, tx = sampler.between(start, end)["lo"]
    assert tx >= sent and rx >= sent  # every byte sent on lo is also received on lo


def test_waiting_on_a_stopped_sampler_fails_instead_of_hanging():
    sampler = CounterSampler({"lo": (_pid(), "lo")}, period=0.05)
    with sampler:
        pass
    with pytest.raises(RuntimeError, match="not running"):
        sampler.wait_past(time.time() + 60)


def test_the_gap_at_a_time_is_the_span_of_the_samples_around_it():
    sampler = CounterSampler({"lo": (_pid(), "lo")})
    sampler.times = [10.0, 10.05, 10.6, 10.65]  # a sample 0.5 s late, as on a loaded machine
    assert sampler.gap_at(10.3) == pytest.approx(0.55)
    assert sampler.gap_at(10.02) == pytest.approx(0.05)
    assert sampler.gap_at(10.05) == 0.0 and sampler.gap_at(9.0) == 0.0 and sampler.gap_at(11.0) == 0.0


def _pid() -> int:
    return os.getpid()


def _send_over_loopback(n: int) -> int:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            conn, _ = server.accept()
            with conn:
                client.sendall(b"x" * n)
                got = 0
                while got < n:
                    got += len(conn.recv(65536))
    return n
