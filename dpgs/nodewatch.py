"""Stop a worker node's Ray when its head is gone (``python -m dpgs.nodewatch HEAD:PORT``).

Without Docker, ``ray down`` runs ``ray stop`` on the head only (Ray's ``local`` provider stops nothing on
the worker machines), and a worker's Ray does not end by itself: its raylet exits once the head's GCS has
been unreachable for a minute, but its log monitor and agents keep running. The worker start commands of
configs/cluster.yaml therefore start this watcher (before ``ray start``, so that it also cleans up after a
start that fails half-way): it connects to the head's GCS port
every ``poll_s`` seconds and, once the port has been unreachable for ``grace_s`` seconds (a stopped or
killed head, or a partition that long; Ray without GCS fault tolerance cannot rejoin a restarted head
anyway), runs ``ray stop --force`` on this node and exits. One watcher per node: a second one started
while the first runs (`ray up` again) exits at once. Inside the image the containers' ``docker stop``
does the same and the watcher ends with its container.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

LOCK = Path("/tmp/dpgs-nodewatch.lock")


def reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def watch(host: str, port: int, stop: Callable[[], None], grace_s: float = 30.0, poll_s: float = 5.0,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> float:
    """Poll ``host:port`` until it has been unreachable for ``grace_s`` seconds, then call ``stop``;
    returns how long it had been unreachable."""
    down_since = None
    while True:
        now = clock()
        if reachable(host, port, timeout_s=min(poll_s, 5.0)):
            down_since = None
        else:
            down_since = now if down_since is None else down_since
            if clock() - down_since >= grace_s:
                stop()
                return clock() - down_since
        sleep(poll_s)


def ray_stop() -> None:
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpgs.nodewatch", description=__doc__.split("\n")[0])
    parser.add_argument("head", help="the head's GCS address, HOST:PORT ($RAY_HEAD_IP:6379)")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="unreachable this long: stop (%(default)s)")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between checks (%(default)s)")
    args = parser.parse_args(argv)
    host, _, port = args.head.rpartition(":")
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # this node is watched already
    down = watch(host, int(port), ray_stop, args.grace_s, args.poll_s)
    print(f"dpgs nodewatch: {args.head} unreachable for {down:.0f}s: stopped this node's Ray", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
