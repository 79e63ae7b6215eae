"""docs/cluster.md on the lab: the config a user makes from configs/cluster.yaml, and the user's commands.

A user without Docker edits configs/cluster.yaml as docs/cluster.md says: deletes the ``docker`` section,
puts the machines' addresses for the placeholders (``HEAD_IP`` twice: ``provider.head_ip`` and the head's
start command), the ssh user and key. :func:`lab_config` makes exactly those edits for a lab; everything
else is the file as committed. The commands (``ray up``, ``ray exec``, ``ray down``) run on the lab's
``client`` host from the checkout, as a user runs them from theirs.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.lab.netlab import ROOT, Lab, LabError

CONFIG = ROOT / "configs" / "cluster.yaml"
SRC = "/opt/dpgs-src"  # where file_mounts put the checkout on every node


def lab_config(lab: Lab, source: Path = CONFIG) -> str:
    """``source`` with the edits docs/cluster.md asks of a user without Docker, for ``lab``'s hosts."""
    config = yaml.safe_load(source.read_text())
    head = lab.hosts["head"].address
    placeholder = re.compile(r"\bHEAD_IP\b")
    starts = config["head_start_ray_commands"]
    if config["provider"]["head_ip"] != "HEAD_IP" or sum(bool(placeholder.search(c)) for c in starts) != 1:
        raise LabError(f"{source}: expected the HEAD_IP placeholder in provider.head_ip and the head's start")
    config["provider"]["head_ip"] = head
    config["head_start_ray_commands"] = [placeholder.sub(head, c) for c in starts]
    del config["docker"]
    config["provider"]["worker_ips"] = [lab.hosts[w].address for w in lab.workers]
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(lab.key)}
    return yaml.safe_dump(config, sort_keys=False, width=1000)


@dataclass
class Timed:
    seconds: float
    result: subprocess.CompletedProcess = field(repr=False)


class UserSession:
    """A user on the lab's client host, in the checkout, with the cluster config at ``config``."""

    def __init__(self, lab: Lab, config_text: str, name: str = "lab-cluster.yaml"):
        self.lab = lab
        self.config = f"/root/{name}"  # on the client (its private home)
        self.lab.path_on("client", self.config).write_text(config_text)

    def sh(self, command: str, timeout: float = 900, check: bool = True) -> Timed:
        """``command`` in a login shell on the client, in the checkout (as the user types it)."""
        start = time.monotonic()
        result = self.lab.run("client", ["bash", "-lc", command], cwd=str(ROOT), timeout=timeout, check=False)
        took = time.monotonic() - start
        if check and result.returncode != 0:
            raise LabError(f"`{command}` failed ({result.returncode}) after {took:.0f}s:\n"
                           f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return Timed(took, result)

    def make_token(self) -> None:
        """docs/cluster.md step 2: the cluster's Ray auth token, on the user's machine."""
        self.sh("mkdir -p -m 700 ~/.dpgs/ray-auth && ray get-auth-token --generate > ~/.dpgs/ray-auth/token"
                " && chmod 600 ~/.dpgs/ray-auth/token")

    def ray_up(self, timeout: float = 900) -> Timed:
        return self.sh(f"ray up --yes --no-config-cache {self.config}", timeout=timeout)

    def ray_down(self, timeout: float = 600) -> Timed:
        return self.sh(f"ray down --yes {self.config}", timeout=timeout)

    def on_head(self, command: str, timeout: float = 900, check: bool = True) -> Timed:
        """``command`` on the head node through ``ray exec`` (what `ray attach` gives interactively)."""
        return self.sh(f"ray exec {self.config} {shlex.quote(command)}", timeout=timeout, check=check)

    def start_on_head(self, command: str) -> Streamed:
        """:meth:`on_head` without waiting: its output is followed line by line."""
        proc = self.lab.popen("client", ["bash", "-lc", f"ray exec {self.config} {shlex.quote(command)}"],
                              cwd=str(ROOT))
        return Streamed(proc)


class Streamed:
    """A running command whose output lines are collected by a thread (so that a test can act on them)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.start = proc, [], time.monotonic()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout_s: float = 600) -> float:
        """Seconds since the start until a line matches ``pattern`` (LabError if the command ends first)."""
        regex, seen = re.compile(pattern), 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                if regex.search(line):
                    return time.monotonic() - self.start
            seen = len(self.lines)
            if self.proc.poll() is not None and seen == len(self.lines):
                break
            time.sleep(0.2)
        raise LabError(f"no line matching {pattern!r}; output:\n{self.output()[-4000:]}")

    def finish(self, timeout_s: float = 1800) -> tuple[int, float]:
        """(exit code, seconds since the start) once the command ends."""
        rc = self.proc.wait(timeout=timeout_s)
        self._reader.join(30)
        return rc, time.monotonic() - self.start

    def output(self) -> str:
        return "".join(self.lines)


def alive_nodes(lab: Lab) -> dict[str, float]:
    """Alive Ray nodes seen from the head: address -> CPUs (through `ray status`-like state API)."""
    code = ("import json, ray; ray.init(address='auto', log_to_driver=False); "
            "print(json.dumps({n['NodeManagerAddress']: n['Resources'].get('CPU', 0.0) "
            "for n in ray.nodes() if n['Alive']}))")
    out = lab.ssh("head", f"python3 -c {shlex.quote(code)}", timeout=120).stdout
    return yaml.safe_load(out.strip().splitlines()[-1])


def wait_for_nodes(lab: Lab, count: int, timeout_s: float = 300, hold_s: float = 15,
                   nodes: Callable[[], dict[str, float]] | None = None) -> float:
    """Seconds until ``count`` Ray nodes are alive (the head and its workers) and still are ``hold_s``
    seconds later (a raylet can die right after registering). ``nodes``: how to ask for the alive nodes
    (default :func:`alive_nodes` on the head host; with Docker, in the head's container)."""
    ask = nodes if nodes is not None else lambda: alive_nodes(lab)
    start, since = time.monotonic(), None
    while True:
        try:
            alive = len(ask()) >= count
        except LabError:
            alive = False
        now = time.monotonic()
        if alive and since is None:
            since = now
        elif not alive:
            since = None
        if since is not None and now - since >= hold_s:
            return since - start
        if now - start > timeout_s:
            raise LabError(f"fewer than {count} Ray nodes alive for {hold_s:g}s within {timeout_s:g}s")
        time.sleep(2)


WORKER_LINE = re.compile(r"\[dpgs\] worker (\d+): node=(\w+) ip=([\d.]+)")


def worker_addresses(output: str) -> list[str]:
    """The node address of each worker actor, from the run's start-up lines (in worker order)."""
    found = {int(m.group(1)): m.group(3) for m in WORKER_LINE.finditer(output)}
    return [found[w] for w in sorted(found)]


def mlflow_run(db: Path, run_name: str) -> dict:
    """The latest MLflow run called ``run_name`` in the SQLite store ``db``: status and metrics (read from
    a copy: the store lives in a host's file system, reached through /proc)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "mlflow.db"
        shutil.copyfile(db, copy)
        con = sqlite3.connect(copy)
        try:
            row = con.execute(
                "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                "WHERE t.key = 'mlflow.runName' AND t.value = ? ORDER BY r.start_time DESC LIMIT 1",
                (run_name,),
            ).fetchone()
            if row is None:
                raise LabError(f"no MLflow run named {run_name} in {db}")
            metrics = dict(con.execute("SELECT key, value FROM latest_metrics WHERE run_uuid = ?", (row[0],)))
            tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (row[0],)))
        finally:
            con.close()
    return {"id": row[0], "status": row[1], "metrics": metrics, "tags": tags}
