"""A private Docker daemon for the image test: started by hand, on its own socket, stopped and cleaned up.

``PrivateDockerd(data_root)`` starts Debian's ``dockerd`` (package ``docker.io``) with its own data root
(kept between runs: the image cache), and a fresh exec root, pid file and socket in a temporary folder
under ``/run``. It uses no bridge and never touches iptables (``--bridge=none --iptables=false``), so the
host's network is left as it was: containers run with ``--network none`` or the host's network.
``netns`` runs the daemon inside that network namespace (``ip netns exec``), one daemon per host of a
multi-host lab.

``stop()`` (also on leaving the ``with`` block, after errors and Ctrl-C) removes the containers, ends the
daemon and the containerd it started (SIGTERM, then SIGKILL after ``stop_timeout_s``), unmounts whatever
is still mounted under its folders, and deletes the temporary folder. Every docker command goes through
:meth:`docker` with this daemon's socket; the client is Debian's ``/usr/bin/docker`` of the same release
(its built-in BuildKit needs no buildx plug-in).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"


class DockerdError(RuntimeError):
    """The daemon could not be started or used; the message says why (with its log's last lines)."""


def processes_using(path: Path) -> list[int]:
    """Pids with a command-line argument that is ``path`` or lies below it (a daemon of an earlier run
    still holding a data root; the containerd and shims of a run folder)."""
    needle = str(path).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(a == needle or a.startswith(needle + b"/") for a in cmdline.split(b"\0")):
            pids.append(int(entry.name))
    return pids


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below ``folder``, deepest first."""
    prefix = str(folder.resolve())
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


class PrivateDockerd:
    """A dockerd of our own; use as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(self, data_root: str | Path, netns: str | None = None, start_timeout_s: float = 60.0,
                 stop_timeout_s: float = 30.0):
        self.data_root = Path(data_root).resolve()
        self.netns = netns
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.run_dir: Path | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        """The ``DOCKER_HOST`` of this daemon."""
        return f"unix://{self.run_dir / 'docker.sock'}"

    @property
    def log_path(self) -> Path:
        return self.data_root.parent / "dockerd.log"

    def env(self) -> dict[str, str]:
        """The environment of a docker client talking to this daemon (BuildKit on)."""
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "1"}

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> PrivateDockerd:
        holders = processes_using(self.data_root)
        if holders:
            raise DockerdError(
                f"processes {holders} already use the data root {self.data_root} (a daemon of another "
                f"run?); stop them first"
            )
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix="dpgs-dockerd-", dir="/run"))
        cmd = [
            DOCKERD, "--data-root", str(self.data_root), "--exec-root", str(self.run_dir / "exec"),
            "--pidfile", str(self.run_dir / "dockerd.pid"), "-H", self.host,
            "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
        ]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        with self.log_path.open("w") as log:
            # a session of its own: a Ctrl-C at the terminal reaches us, and we stop the daemon in order
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DockerdError(f"dockerd exited with status {self.proc.returncode}:\n{self._log_tail()}")
            ping = subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"], env=self.env(),
                                  capture_output=True, text=True)
            if ping.returncode == 0:
                return self
            time.sleep(0.5)
        raise DockerdError(f"dockerd did not answer within {self.start_timeout_s:g} s:\n{self._log_tail()}")

    def docker(self, *args: str, check: bool = True, capture: bool = True, timeout: float | None = None,
               log: Path | None = None) -> subprocess.CompletedProcess:
        """Run ``docker ARGS`` against this daemon; with ``log`` the output goes to that file."""
        if log is not None:
            with log.open("w") as fh:
                proc = subprocess.run([DOCKER, *args], env=self.env(), stdout=fh, stderr=subprocess.STDOUT,
                                      text=True, timeout=timeout)
        else:
            proc = subprocess.run([DOCKER, *args], env=self.env(), capture_output=capture, text=True,
                                  timeout=timeout)
        if check and proc.returncode != 0:
            where = f"see {log}" if log is not None else (proc.stderr or proc.stdout or "").strip()[-2000:]
            raise DockerdError(f"docker {' '.join(args[:2])} failed (exit {proc.returncode}): {where}")
        return proc

    def stop(self) -> None:
        """Remove the containers, stop the daemon and its containerd, unmount, delete the run folder."""
        if self.proc is not None and self.proc.poll() is None:
            listed = subprocess.run([DOCKER, "ps", "-aq"], env=self.env(), capture_output=True, text=True)
            ids = listed.stdout.split() if listed.returncode == 0 else []
            if ids:
                subprocess.run([DOCKER, "rm", "-f", *ids], env=self.env(), capture_output=True)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.run_dir is not None:
            # a killed dockerd leaves its containerd (and shims) behind: they name our run folder
            for pid in processes_using(self.run_dir):
                os.kill(pid, signal.SIGTERM)
                if not _wait_gone(pid, 10):
                    os.kill(pid, signal.SIGKILL)
            for folder in (self.run_dir, self.data_root):
                for point in mounts_under(folder):
                    subprocess.run(["umount", "-l", point], capture_output=True)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
        self.proc = None

    def leftovers(self) -> list[str]:
        """What of this daemon is still there after :meth:`stop` (empty when the tear-down was complete)."""
        found = [f"process {pid}" for pid in processes_using(self.data_root)]
        found += [f"mount {point}" for point in mounts_under(self.data_root)]
        return found

    def __enter__(self) -> PrivateDockerd:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
