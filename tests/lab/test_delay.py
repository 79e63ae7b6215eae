"""The delay line (``tests/lab/delay.py``) between two network namespaces of this test's own: a TCP round
trip takes the two directions' delays more, and stops doing so when the delay line is stopped. Needs root,
iproute2, iptables and a C compiler (skipped otherwise); sends traffic only between its namespaces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.lab import delay

A, B = "dpgsdelaytest-a", "dpgsdelaytest-b"
ADDRESS = {A: "10.250.77.1", B: "10.250.77.2"}

ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5555)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(64)):
    c.sendall(d)
"""

PING = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 5555)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(64); times.append(time.perf_counter() - t)
print(1e3 * statistics.median(times))
"""

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0
    or not all(shutil.which(t) for t in ("ip", "iptables"))
    or not (shutil.which("cc") or shutil.which("gcc")),
    reason="needs Linux, root, iproute2, iptables and a C compiler",
)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    for ns in (A, B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        sh("ip", "netns", "add", A)
        sh("ip", "netns", "add", B)
        sh("ip", "-n", A, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", B)
        for ns in (A, B):
            sh("ip", "-n", ns, "addr", "add", f"{ADDRESS[ns]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (A, B):
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in listed.stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def round_trip_ms(count: int = 40) -> float:
    server = subprocess.Popen(["ip", "netns", "exec", B, sys.executable, "-c", ECHO, ADDRESS[B]],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        out = subprocess.run(["ip", "netns", "exec", A, sys.executable, "-c", PING, ADDRESS[B], str(count)],
                             check=True, capture_output=True, text=True, timeout=60).stdout
        return float(out)
    finally:
        server.kill()
        server.wait()


def test_the_delay_line_adds_each_directions_delay_to_a_round_trip(two_hosts, tmp_path):
    before = round_trip_ms()
    binary = delay.build(tmp_path)
    pids = {}
    for here, there, ms in ((A, B, 1.0), (B, A, 2.0)):  # B -> A waits 1 ms in A, A -> B 2 ms in B
        queue = delay.Queue(3, ADDRESS[there], ms)
        pids[here] = tmp_path / f"{here}.pid"
        delay.start(binary, here, [queue], pids[here])
        for rule in delay.rules("eth0", [queue]):
            sh("ip", "netns", "exec", here, "iptables", "-w", *rule)
    delayed = round_trip_ms()
    for pid_file in pids.values():
        delay.stop(pid_file)
    for ns in (A, B):  # the rules stay; --queue-bypass passes packets with no delay line listening
        assert not (tmp_path / f"{ns}.pid").exists()
    after = round_trip_ms()
    assert before < 1.0 and after < 1.0
    print(f"round trip: {before:.3f} ms, delayed {delayed:.3f} ms, after {after:.3f} ms")
    assert 3.0 <= delayed < 3.0 + 1.5, (before, delayed, after)


def test_a_delay_line_that_cannot_bind_its_queue_says_so(two_hosts, tmp_path):
    binary = delay.build(tmp_path)
    first = delay.start(binary, A, [delay.Queue(5, ADDRESS[B], 1.0)], tmp_path / "first.pid")
    try:
        with pytest.raises(delay.DelayError, match="did not start"):
            delay.start(binary, A, [delay.Queue(5, ADDRESS[B], 1.0)], tmp_path / "second.pid")
    finally:
        delay.stop(tmp_path / "first.pid")
    assert first > 0
