"""A private network namespace whose loopback stands for a shaped link (the scaling checks' lab).

``run_in_namespace(script, spec)`` runs ``python script --inside JSON`` under ``unshare --net`` (root):
the namespace has only a loopback, every process of the check talks over it, and the kernel removes the
namespace, its qdisc and every socket in it when the child exits, also after a failure or Ctrl-C, so
nothing is left to tear down. Inside, :func:`setup_namespace` brings the loopback up with the lab's
1500-byte MTU and, for a shaped check, a tc ``tbf`` qdisc at the given rate (this kernel has no
``netem``, so no delay is added). One queue then carries all traffic in both directions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

MTU = 1500


def setup_namespace(rate_bps: float | None) -> None:
    """Inside a fresh network namespace: loopback up, MTU 1500, tbf at ``rate_bps`` when given."""
    subprocess.run(["ip", "link", "set", "lo", "up", "mtu", str(MTU)], check=True)
    if rate_bps:
        burst = max(16 * 1024, int(rate_bps / 8 / 1000))  # 1 ms of tokens, at least 16 KiB
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate_bps)}bit",
                        "burst", str(burst), "latency", "2000ms"], check=True)


def run_in_namespace(script: Path, spec: dict, timeout_s: float = 3600) -> dict:
    """The JSON ``script --inside spec`` prints last, run in a new network namespace; the child's
    stderr goes to a log file named in the error when it fails."""
    cmd = ["unshare", "--net", "--", sys.executable, str(script), "--inside", json.dumps(spec)]
    with tempfile.NamedTemporaryFile("w+", prefix=f"{script.stem}-", suffix=".log", delete=False) as log:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=script.parent,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{script.name} in a network namespace took more than {timeout_s:.0f} s "
                               f"(its stderr: {log.name})") from err
        if proc.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"{script.name} in a network namespace failed ({proc.returncode}); its stderr "
                               f"is in {log.name}, ending:\n{log.read()[-3000:]}")
    Path(log.name).unlink()
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main_inside(inside) -> None:
    """``script --inside JSON``: print ``inside(spec)`` as JSON (the last line of stdout)."""
    if len(sys.argv) == 3 and sys.argv[1] == "--inside":
        print(json.dumps(inside(json.loads(sys.argv[2]))))
    else:
        sys.exit(f"usage: {Path(sys.argv[0]).name} --inside JSON (run through benchmarks/scaling.py)")
