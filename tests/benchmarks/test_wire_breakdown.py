"""The wire breakdown (benchmarks/wire_breakdown.py) on a pcap file written here: each packet is read with its
frame length and TCP payload, goes to its connection's class, and counts only inside the windows."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from wire_breakdown import breakdown, connection_class, last_epoch, parse_owners, read_pcap  # noqa: E402

HEAD, WORKER = "10.213.0.10", "10.213.0.11"
OWNERS = [  # ss -tnpH's local, peer and users columns, as the capture keeps them
    f"[::ffff:{HEAD}]:33899 [::ffff:{WORKER}]:59264 users:((\"ray::Master.run\",pid=7,fd=59))",
    f"[::ffff:{WORKER}]:59264 [::ffff:{HEAD}]:33899 users:((\"ray::IDLE\",pid=8,fd=30))",
    f"[::ffff:{WORKER}]:59264 [::ffff:{HEAD}]:33899 users:((\"ray::BagWorker.\",pid=8,fd=30))",
    f"[::ffff:{WORKER}]:59264 [::ffff:{HEAD}]:33899 users:((\"ray::IDLE\",pid=8,fd=30))",
    f"[::ffff:{HEAD}]:12149 [::ffff:{WORKER}]:54076 users:((\"python\",pid=5,fd=38))",
    f"[::ffff:{WORKER}]:54076 [::ffff:{HEAD}]:12149 users:((\"ray::BagWorker\",pid=8,fd=31))",
    f"[::ffff:{HEAD}]:35525 [::ffff:{WORKER}]:49138 users:((\"raylet\",pid=3,fd=63))",
]


def tcp_frame(src: str, sport: int, dst: str, dport: int, payload: int) -> tuple[bytes, int]:
    """The first 96 bytes of an Ethernet / IPv4 / TCP (32-byte header: timestamps) frame, and its length."""
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + 32 + payload, 0, 0, 64, 6, 0,
                     bytes(map(int, src.split("."))), bytes(map(int, dst.split("."))))
    tcp = struct.pack(">HHIIBBHHH", sport, dport, 0, 0, 8 << 4, 0x10, 0, 0, 0) + bytes(12)
    frame = bytes(12) + b"\x08\x00" + ip + tcp + bytes(payload)
    return frame[:96], len(frame)


def write_pcap(path: Path, packets: list[tuple[float, bytes, int]]) -> None:
    out = bytearray(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 96, 1))
    for t, frame, wire in packets:
        out += struct.pack("<IIII", int(t), round((t - int(t)) * 1e6), len(frame), wire) + frame
    path.write_bytes(bytes(out))


@pytest.fixture
def capture(tmp_path):
    arp = (bytes(12) + b"\x08\x06" + bytes(28), 42)
    packets = [
        (100.1, *tcp_frame(WORKER, 59264, HEAD, 33899, 3600)),  # the exchange: a message up
        (100.2, *tcp_frame(HEAD, 33899, WORKER, 59264, 0)),  # its ACK
        (100.3, *tcp_frame(HEAD, 12149, WORKER, 54076, 500)),  # a Ray call from the driver
        (100.4, *tcp_frame(WORKER, 49138, HEAD, 35525, 100)),  # the raylets
        (100.5, *arp),
        (101.5, *tcp_frame(WORKER, 59264, HEAD, 33899, 9000)),  # outside the windows
    ]
    write_pcap(tmp_path / "w.pcap", packets)
    return tmp_path / "w.pcap"


def test_packets_are_read_with_their_frame_length_and_tcp_payload(capture):
    packets = read_pcap(capture)
    assert [(p.wire, p.payload) for p in packets] == [(3666, 3600), (66, 0), (566, 500), (166, 100), (42, 0),
                                                      (9066, 9000)]
    assert packets[0].flow == (f"{WORKER}:59264", f"{HEAD}:33899") and packets[4].flow is None
    assert packets[2].time == pytest.approx(100.3)


def test_an_endpoint_keeps_its_actors_name_and_each_connection_its_class():
    owners = parse_owners(OWNERS)
    assert owners[f"{WORKER}:59264"] == "ray::BagWorker" and owners[f"{HEAD}:33899"] == "ray::Master"
    assert connection_class((f"{WORKER}:59264", f"{HEAD}:33899"), owners) == "exchange"
    assert connection_class((f"{HEAD}:12149", f"{WORKER}:54076"), owners) == "calls"
    assert connection_class((f"{WORKER}:49138", f"{HEAD}:35525"), owners) == "ray"
    assert connection_class((f"{WORKER}:22", "10.213.0.2:5000"), owners) == "other"
    assert connection_class(None, owners) == "other"


def test_the_breakdown_counts_per_step_only_inside_the_windows(capture):
    result = breakdown(read_pcap(capture), parse_owners(OWNERS), [(100.0, 100.35), (100.35, 101.0)], steps=2)
    assert result["exchange"] == {"packets": 1.0, "wire": (3666 + 66) / 2, "payload": 1800.0,
                                  "headers": 132 / 2}
    assert result["calls"]["wire"] == 283 and result["ray"]["payload"] == 50 and result["other"]["wire"] == 21
    assert result["total"]["wire"] == (3666 + 66 + 566 + 166 + 42) / 2


def test_the_last_epoch_gives_its_windows_steps_and_the_workers_count():
    chunk = lambda epoch, start, workers: {"epoch": epoch, "start": start, "end": start + 1,
                                           "steps": [r["index"] for r in workers if r["worker"] == 0],
                                           "workers": workers}
    step = lambda i, w, up, down: {"index": i, "worker": w, "up_bytes": up, "down_bytes": down}
    record = {"chunks": [chunk(1, 10.0, [step(0, 0, 900, 900), step(0, 1, 900, 900)]),
                         chunk(2, 20.0, [step(1, 0, 10, 20), step(1, 1, 99, 99)]),
                         chunk(2, 30.0, [step(2, 0, 30, 40), step(2, 1, 99, 99)])]}
    assert last_epoch(record, worker=0) == ([(20.0, 21.0), (30.0, 31.0)], 2, 50.0)


def test_a_file_that_is_not_a_pcap_is_named_in_the_error(tmp_path):
    (tmp_path / "x.pcap").write_bytes(b"not a capture at all")
    with pytest.raises(ValueError, match="x.pcap: not a little-endian microsecond pcap"):
        read_pcap(tmp_path / "x.pcap")
