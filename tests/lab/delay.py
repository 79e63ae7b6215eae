"""Link delay without netem: a user-space delay line (``tests/lab/delayline.c``) behind netfilter queues.

Kernels built without ``CONFIG_NET_SCH_NETEM`` (this development machine's among them) cannot delay a link
with ``tc``. They can still queue packets to a program (``NFQUEUE``) that gives each its verdict later:
the delay line holds every packet of a queue for that queue's delay, then lets it through.

Each host delays what it *receives* (iptables ``INPUT``), one queue per sending host: a packet from host X
to host Y waits ``delay(X) + delay(Y)`` in Y, which is what netem on both ends of every link would add (a
host's link delayed by d each way). Delaying on receipt, not on sending, keeps a held packet off the
sender's books: TCP counts a packet held below its socket against the socket's small-queue limit, which
would cap a delayed link's throughput.

Measured between two namespaces joined by a veth (2026-11-27): 1 ms each way gave a TCP round trip of
2.25-2.28 ms (0.014 ms undelayed; the delay line's wake-ups add about 0.1 ms a direction), and bulk
TCP through tbf at 1 Gbit/s and 100 Mbit/s ran at 956 and 96 Mbit/s, as without the delay.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("delayline.c")
READY = "delayline: ready"


class DelayError(RuntimeError):
    pass


def build(out_dir: Path) -> Path:
    """Compile the delay line into ``out_dir`` (once; needs a C compiler)."""
    binary = out_dir / "delayline"
    if binary.exists() and binary.stat().st_mtime >= SOURCE.stat().st_mtime:
        return binary
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise DelayError(f"a link delay on a kernel without netem needs a C compiler to build {SOURCE}")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([compiler, "-O2", "-o", str(binary), str(SOURCE)], capture_output=True, text=True)
    if result.returncode != 0:
        raise DelayError(f"building {SOURCE} failed: {result.stderr.strip()[-2000:]}")
    return binary


@dataclass(frozen=True)
class Queue:
    """Packets from ``source`` (an address) wait ``delay_ms`` in netfilter queue ``number``."""

    number: int
    source: str
    delay_ms: float


def rules(device: str, queues: list[Queue]) -> list[list[str]]:
    """The iptables arguments that send what ``device`` receives from each queue's source to its queue
    (``--queue-bypass``: with no delay line listening, packets pass)."""
    return [["-A", "INPUT", "-i", device, "-s", q.source, "-j", "NFQUEUE", "--queue-num", str(q.number),
             "--queue-bypass"] for q in queues]


def start(binary: Path, netns: str, queues: list[Queue], pid_file: Path, timeout_s: float = 10) -> int:
    """Run the delay line for ``queues`` in network namespace ``netns`` (any earlier one of ``pid_file``
    stopped first); returns its pid once it has bound its queues."""
    stop(pid_file)
    args = [f"{q.number}:{1000 * q.delay_ms:g}" for q in queues]
    proc = subprocess.Popen(["ip", "netns", "exec", netns, str(binary), *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else ""
    if line != READY:
        proc.kill()
        rest = proc.stdout.read() if proc.poll() is not None else ""
        raise DelayError(f"the delay line in {netns} did not start: {(line + rest).strip() or 'no answer'}")
    proc.stdout.close()
    pid_file.write_text(str(proc.pid))
    return proc.pid


def stop(pid_file: Path, timeout_s: float = 5) -> None:
    """Stop the delay line of ``pid_file``, if one runs."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    pid_file.unlink()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:  # not our child: it ends when /proc says so
            if not Path(f"/proc/{pid}").exists():
                return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
