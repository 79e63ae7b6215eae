"""A watcher process that ends a training command's MLflow runs when the command itself cannot.

Some failures end the driver process without running any Python: Ray's core worker terminates the
process when the local raylet dies or the GCS stays unreachable (exit code 1), and SIGKILL or the OOM
killer end it outright. The runs it had started would stay RUNNING forever, and a local Ray instance it
had started would leave its processes behind.

``dpgs train`` therefore starts one small watcher (``python -m dpgs.runwatch``) connected by a pipe and
tells it, line by line, which MLflow runs it starts (``run URI RUN_ID``), which of them it ended itself
(``ended RUN_ID``), which local Ray session it started (``session NAME``) and, while a DPGS group runs on
a cluster, the cluster's head (``head HOST:PORT HINT``, until ``head-closed``). The watcher ignores SIGINT
and SIGTERM (the driver handles those itself) and waits for the pipe to close, which happens however the
driver ends. Then, for every run the driver did not end whose store still exists (a deleted SQLite file is
a store that is gone, not one to recreate) and that is still RUNNING, it marks it FAILED with the
``dpgs.error`` tag and prints ``dpgs train: error: ...``; after such an abnormal end it also stops the
processes of the local Ray session the driver had started (never those of a cluster joined with
``--address``). A watcher the system refuses to start (twice) leaves the driver training unwatched, with a
warning.

The head watch is for a driver that cannot report a lost head itself: found on a multi-host cluster, a
driver on the head whose Ray was killed stayed blocked inside Ray until Ray ended it 60 s later, without a
word (exit 1). The watcher polls the head's GCS every ``POLL_S``; once it has been unreachable for
``HEAD_LOST_S``, it prints ``dpgs train: error: the cluster's head (Ray GCS at ...) has been unreachable
...; HINT``, marks the runs FAILED with that reason and kills the driver. (The driver's own waits notice a
lost head first, at 20 s, whenever its Python runs: ``dpgs.distributed.failures``.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dpgs.records import TAG_ERROR

REASON = ("the dpgs train process ended without closing its MLflow run (killed, out of memory, or ended "
          "by Ray when its raylet or GCS died)")
HEAD_LOST_S = 40.0  # before Ray's own 60 s
POLL_S = 5.0
START_ATTEMPTS = 2
START_RETRY_S = 0.5


def gcs_reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the Ray GCS at ``host:port`` accepts a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def head_lost_message(address: str, seconds: float | None = None) -> str:
    """The error line's text for a lost head (``seconds``: how long it has been unreachable, if known)."""
    since = "is unreachable" if seconds is None else f"has been unreachable for {seconds:.0f}s"
    return f"the cluster's head (Ray GCS at {address}) {since}: its Ray stopped or the network to it is cut"


class RunWatcher:
    """The driver's end of the pipe (one per process, started on first use)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._failed = False  # the watcher could not be started: the driver goes on unwatched
        self._lock = threading.Lock()

    def _start(self) -> None:
        """Start the watcher; when the system refuses (seen once on the lab: ``[Errno 14] Bad address``
        from the exec of Python), try once more, then warn and let the driver train unwatched: a run
        without its safety net is better than no run."""
        for attempt in range(START_ATTEMPTS):
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "dpgs.runwatch"], stdin=subprocess.PIPE, text=True,
                    start_new_session=True,  # a Ctrl-C or a kill of the driver's process group spares it
                )
                return
            except OSError as err:
                if attempt + 1 < START_ATTEMPTS:
                    time.sleep(START_RETRY_S)
                    continue
                self._failed = True
                print(f"dpgs train: warning: the run watcher could not start ({err}); training goes on, but "
                      "if this process is killed its MLflow runs stay RUNNING and a local Ray it started "
                      "stays up", file=sys.stderr, flush=True)

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None and not self._failed:
                self._start()
            if self._proc is None:
                return
            try:
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()
            except OSError:  # the watcher is gone: the driver goes on, unwatched
                pass

    def watch_run(self, tracking_uri: str, run_id: str) -> None:
        self._send(f"run {tracking_uri} {run_id}")

    def run_ended(self, run_id: str) -> None:
        if self._proc is not None:
            self._send(f"ended {run_id}")

    def watch_ray_session(self, session_name: str) -> None:
        self._send(f"session {session_name}")

    def watch_head(self, gcs_address: str, resume_hint: str) -> None:
        """Watch the cluster's head while a DPGS group runs on it (module docstring)."""
        self._send(f"head {gcs_address} {' '.join(resume_hint.split())}")

    def head_closed(self) -> None:
        if self._proc is not None:
            self._send("head-closed")


WATCHER = RunWatcher()


def _ray_session_pids(session_name: str) -> list[int]:
    """Processes whose command line names the Ray session (its GCS, raylet, agents and workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if session_name in cmdline:
            pids.append(int(proc.name))
    return pids


def _end_runs(runs: list[tuple[str, str]], reason: str = REASON) -> int:
    """Mark the runs still RUNNING as FAILED with ``reason``; returns how many. MLflow is imported only when
    there is a run to look at (after a normal end there is none, and the import cost ~1.6 s of CPU after
    every command, for which a caller that reads the command's output also waited)."""
    if not runs:
        return 0
    from mlflow.tracking import MlflowClient

    ended = 0
    for uri, run_id in runs:
        if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
            continue  # the store was deleted (a temporary one): no run left to mark
        try:
            client = MlflowClient(tracking_uri=uri)
            if client.get_run(run_id).info.status != "RUNNING":
                continue
            client.set_tag(run_id, TAG_ERROR, reason)
            client.set_terminated(run_id, status="FAILED")
            ended += 1
        except Exception as err:  # noqa: BLE001 - a watcher reports, it never raises
            print(f"[dpgs] run watcher: could not end MLflow run {run_id}: {err}", file=sys.stderr)
    return ended


class HeadWatch:
    """The watcher's thread on the cluster's head: ``on_lost(message)`` once the GCS has been unreachable
    for ``limit_s`` in a row while watched."""

    def __init__(self, on_lost, limit_s: float = HEAD_LOST_S, poll_s: float = POLL_S):
        self.on_lost, self.limit_s, self.poll_s = on_lost, limit_s, poll_s
        self._head: tuple[str, str] | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="head-watch", daemon=True).start()

    def watch(self, address: str, hint: str) -> None:
        with self._lock:
            self._head = (address, hint)

    def stop(self) -> None:
        with self._lock:
            self._head = None

    def _run(self) -> None:
        since = None
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                head = self._head
            if head is None or gcs_reachable(head[0]):
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since >= self.limit_s:
                self.on_lost(f"{head_lost_message(head[0], time.monotonic() - since)}; {head[1]}")
                return


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    driver = os.getppid()
    runs: list[tuple[str, str]] = []
    sessions: list[str] = []
    lock = threading.Lock()

    lost: list[str] = []

    def head_lost(message: str) -> None:
        print(f"dpgs train: error: {message}", file=sys.stderr, flush=True)
        with lock:
            _end_runs(runs, message)
            runs.clear()
            lost.append(message)
        try:
            os.kill(driver, signal.SIGKILL)  # blocked inside Ray: nothing else ends it before Ray does
        except OSError:
            pass

    head = HeadWatch(head_lost)
    for line in sys.stdin:  # until the driver's end of the pipe closes
        kind, _, rest = line.strip().partition(" ")
        with lock:
            if kind == "run":
                uri, _, run_id = rest.rpartition(" ")
                runs.append((uri, run_id))
            elif kind == "ended":
                runs[:] = [(uri, run_id) for uri, run_id in runs if run_id != rest]
            elif kind == "session":
                sessions.append(rest)
        if kind == "head":
            address, _, hint = rest.partition(" ")
            head.watch(address, hint)
        elif kind == "head-closed":
            head.stop()
    head.stop()
    with lock:
        ended = _end_runs(runs)
    if ended:
        print(f"dpgs train: error: {REASON}; its MLflow run was marked FAILED", file=sys.stderr, flush=True)
    if ended or lost:
        for session in sessions:
            for pid in _ray_session_pids(session):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
