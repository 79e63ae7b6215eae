"""Where a bandwidth row's wire bytes go: dpgs's exchange, its Ray calls, Ray itself, and the headers of each.

    python benchmarks/wire_breakdown.py --workload features --link 100mbit+1ms \\
        --methods dpgs-keep0.1,dpgs-keep1,dpgs-auto [--out wire-breakdown.json]

The bandwidth benchmark compares the wire bytes of a step (the worker hosts' interface counters) with
dpgs's own count (the payloads of the gradient exchange). On a small model the two differ by more than
the payloads' size can explain away; this script measures where the difference goes. It runs each method
as one row of ``benchmarks/bandwidth.py`` on the lab (a whole run, as a user runs it) while, on the first
worker host, ``tcpdump`` records the headers of every packet of its interface and ``ss -tnp`` samples, in
that host and the head, which process owns each TCP endpoint. Then, over the windows of the row's last
epoch (its chunks of steps: the same windows as the row's ``wire_bytes_per_step``), each packet goes to
the class of its connection (:func:`connection_class`):

* ``exchange``: the gloo connection between the master and the worker's actor: the step's messages up and
  down, what dpgs counts (``up_bytes + down_bytes`` of the worker's steps in the row's record);
* ``calls``: the driver and the worker's actor: Ray's actor calls (each chunk's plan, the steps' reports,
  the scores of the validation bags that the last chunk of an epoch carries);
* ``ray``: Ray's own connections (raylets, the GCS, idle worker processes);
* ``other``: everything else (the lab's ssh, ARP).

Per step and class: packets, the bytes on the wire (Ethernet frames, which is what the interface counters
count), the TCP payload, and the difference (Ethernet, IP and TCP headers, and the pure ACKs). For the
exchange, its TCP payload less dpgs's count is gloo's own framing. Needs root, the lab
(``tests/lab/netlab.py``) and ``tcpdump`` (``apt-get install tcpdump``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.lab.netlab

from tests.lab.netlab import NAME, STATE_ROOT, host_address  # noqa: E402

WORKER_HOST = "worker1"  # the host whose interface is captured
WORKER_NS, HEAD_NS = f"{NAME}-{WORKER_HOST}", f"{NAME}-head"
LAB_RECORDS = STATE_ROOT / NAME / "data" / "bw" / "records"  # the lab's data folder, bandwidth_sites' rows
CLASSES = ("exchange", "calls", "ray", "other")
SNAPLEN = 96  # Ethernet + IPv4 + TCP headers with options, never a payload byte


@dataclass(frozen=True)
class Packet:
    time: float
    wire: int  # the frame's length on the interface
    flow: tuple[str, str] | None  # (source, destination) "ip:port" of a TCP segment; None otherwise
    payload: int  # TCP payload bytes (0: a pure ACK, or not TCP)


def read_pcap(path: Path) -> list[Packet]:
    """The packets of a little-endian, microsecond pcap file of Ethernet frames (tcpdump's default)."""
    data = path.read_bytes()
    if len(data) < 24 or data[:4] != b"\xd4\xc3\xb2\xa1":
        raise ValueError(f"{path}: not a little-endian microsecond pcap file")
    packets, off = [], 24
    while off + 16 <= len(data):
        seconds, micros, kept, wire = struct.unpack_from("<IIII", data, off)
        frame = data[off + 16: off + 16 + kept]
        off += 16 + kept
        packets.append(_packet(seconds + micros / 1e6, wire, frame))
    return packets


def _packet(t: float, wire: int, frame: bytes) -> Packet:
    if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4 / TCP
        return Packet(t, wire, None, 0)
    ihl = (frame[14] & 15) * 4
    total = struct.unpack_from(">H", frame, 16)[0]
    tcp = 14 + ihl
    sport, dport = struct.unpack_from(">HH", frame, tcp)
    header = (frame[tcp + 12] >> 4) * 4
    src, dst = ".".join(map(str, frame[26:30])), ".".join(map(str, frame[30:34]))
    return Packet(t, wire, (f"{src}:{sport}", f"{dst}:{dport}"), total - ihl - header)


def parse_owners(lines: list[str]) -> dict[str, str]:
    """``ss -tnpH`` lines (local, peer, users) -> {"ip:port" of a local endpoint: its process's name}.

    A Ray worker process is named ``ray::IDLE`` until it hosts an actor, then ``ray::<Actor>`` or
    ``ray::<Actor>.<method>``: an endpoint takes the actor's name (``ray::Master``) when one was seen."""
    names: dict[str, str] = {}
    for line in lines:
        fields = line.split(None, 2)
        if len(fields) < 3 or '"' not in fields[2]:
            continue
        endpoint = fields[0].replace("[::ffff:", "").replace("]", "")
        name = fields[2].split('"')[1].split(".")[0]
        if name != "ray::IDLE" or endpoint not in names:
            names[endpoint] = name
    return names


def connection_class(flow: tuple[str, str] | None, owners: dict[str, str]) -> str:
    """``exchange``, ``calls``, ``ray`` or ``other`` (module docstring) for a packet's connection."""
    if flow is None:
        return "other"
    ends = {owners.get(e, "?") for e in flow}
    actors = {e for e in ends if e.startswith("ray::") and e != "ray::IDLE"}
    if "ray::Master" in ends and len(actors) == 2:
        return "exchange"
    if "python" in ends and actors:
        return "calls"
    if ends & {"raylet", "gcs_server", "ray::IDLE"} or any(e.startswith("ray::") for e in ends):
        return "ray"
    return "other"


def breakdown(packets: list[Packet], owners: dict[str, str], windows: list[tuple[float, float]],
              steps: int) -> dict[str, dict[str, float]]:
    """Per step and class: packets, wire bytes, TCP payload and headers (wire - payload) of the packets
    inside ``windows`` (``[start, end)`` wall-clock seconds), over ``steps`` steps; plus ``total``."""
    sums = {c: defaultdict(float) for c in (*CLASSES, "total")}
    for p in packets:
        if not any(a <= p.time < b for a, b in windows):
            continue
        for c in (connection_class(p.flow, owners), "total"):
            sums[c]["packets"] += 1
            sums[c]["wire"] += p.wire
            sums[c]["payload"] += p.payload
    return {c: {k: s[k] / steps for k in ("packets", "wire", "payload")}
            | {"headers": (s["wire"] - s["payload"]) / steps} for c, s in sums.items()}


def last_epoch(record: dict, worker: int) -> tuple[list[tuple[float, float]], int, float]:
    """The row record's last epoch: its chunks' windows, its steps, and ``worker``'s bytes up and down per
    step (dpgs's count)."""
    epoch = max(c["epoch"] for c in record["chunks"])
    chunks = [c for c in record["chunks"] if c["epoch"] == epoch]
    steps = sum(len(c["steps"]) for c in chunks)
    own = sum(r["up_bytes"] + r["down_bytes"] for c in chunks for r in c["workers"] if r["worker"] == worker)
    return [(c["start"], c["end"]) for c in chunks], steps, own / steps


class Capture:
    """tcpdump on the first worker host's interface and ``ss`` samples of both hosts, from the moment the lab
    is up until it goes; the rows' records are copied out of the lab's data folder as they are written."""

    def __init__(self, folder: Path):
        self.folder, self.stop = folder, threading.Event()
        self.owners: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Capture:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)

    def _lab_up(self) -> bool:
        return WORKER_NS in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    def _run(self) -> None:
        while not self._lab_up():
            if self.stop.wait(0.5):
                return
        tcpdump = ["tcpdump", "-i", "eth0", "-s", str(SNAPLEN), "-Z", "root", "-U",
                   "-w", str(self.folder / "worker1.pcap")]
        dump = subprocess.Popen(["ip", "netns", "exec", WORKER_NS, *tcpdump],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not self.stop.is_set() and self._lab_up():
                for ns in (HEAD_NS, WORKER_NS):
                    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tnpH"],
                                         capture_output=True, text=True)
                    self.owners += [" ".join(line.split()[3:]) for line in out.stdout.splitlines()]
                for record in LAB_RECORDS.glob("*.json"):
                    shutil.copy(record, self.folder / record.name)
                self.stop.wait(0.5)
        finally:
            dump.terminate()
            dump.wait(timeout=10)


def measure(method: str, args: argparse.Namespace, folder: Path) -> dict:
    """Run ``method`` as one bandwidth row under a :class:`Capture`; its breakdown (module docstring)."""
    rows = folder / "rows.json"
    with Capture(folder) as capture:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bandwidth.py"),
                        "--workload", args.workload, "--links", args.link, "--methods", method,
                        "--repeats", "1", "--out", str(rows)], check=True)
    (row,) = [r for r in json.loads(rows.read_text()) if r["method"] == method]
    record = json.loads((folder / f"{row['row_id']}.json").read_text())
    worker = row["worker_ips"].index(host_address(WORKER_HOST))
    windows, steps, own = last_epoch(record, worker)
    classes = breakdown(read_pcap(folder / "worker1.pcap"), parse_owners(capture.owners), windows, steps)
    return {"workload": args.workload, "link": args.link, "method": method, "steps": steps,
            "dpgs_bytes_per_step": own,
            "row_wire_over_dpgs": row["wire_bytes_per_step"] / row["dpgs_bytes_per_step"],
            "classes": classes}


def table(results: list[dict]) -> str:
    """A markdown table: per method, per step of one worker, dpgs's count and each class's bytes."""
    lines = ["| method | dpgs's count | exchange: TCP payload (gloo's framing) | exchange: headers and ACKs "
             "| calls | ray | other | wire / dpgs's count |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, own = r["classes"], r["dpgs_bytes_per_step"]
        ex = c["exchange"]
        lines.append(
            f"| {r['method']} | {own:.0f} B | {ex['payload']:.0f} B (+{ex['payload'] - own:.0f}) "
            f"| {ex['headers']:.0f} B ({ex['packets']:.1f} packets) | {c['calls']['wire']:.0f} B "
            f"| {c['ray']['wire']:.0f} B | {c['other']['wire']:.0f} B | {c['total']['wire'] / own:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["tiles", "features"], default="features")
    p.add_argument("--link", default="100mbit+1ms", help="one link of benchmarks/bandwidth.py (not loopback)")
    p.add_argument("--methods", default="dpgs-keep0.1,dpgs-keep1,dpgs-auto",
                   help="comma-separated DPGS methods")
    p.add_argument("--out", type=Path, default=Path("wire-breakdown.json"))
    args = p.parse_args(argv)
    if shutil.which("tcpdump") is None:
        raise SystemExit("wire_breakdown: tcpdump is not installed (apt-get install tcpdump)")
    if args.link == "loopback" or not all(m.startswith("dpgs-") for m in args.methods.split(",")):
        raise SystemExit("wire_breakdown: --link must be a lab link and --methods DPGS methods")
    results = []
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory(prefix="dpgs-wire-") as tmp:
            results.append(measure(method, args, Path(tmp)))
        args.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
