"""A watcher process that ends a training command's MLflow runs when the command itself cannot.

Some failures end the driver process without running any Python: Ray's core worker terminates the
process when the local raylet dies or the GCS stays unreachable (exit code 1), and SIGKILL or the OOM
killer end it outright. The runs it had started would stay RUNNING forever, and a local Ray instance it
had started would leave its processes behind.

``dpgs train`` therefore starts one small watcher (``python -m dpgs.runwatch``) connected by a pipe and
tells it, line by line, which MLflow runs it starts (``run URI RUN_ID``), which of them it ended itself
(``ended RUN_ID``), which local Ray session it started (``session NAME``) and, when it knows it is about
to be ended abnormally, why (``reason TEXT``: recorded instead of the generic reason). The watcher ignores
SIGINT and SIGTERM (the driver handles those itself) and waits for the pipe to close, which happens
however the driver ends. Then, for every run the driver did not end whose store still exists (a deleted
SQLite file is a store that is gone, not one to recreate) and that is still RUNNING, it marks it FAILED
with the ``dpgs.error`` tag and prints ``dpgs train: error: ...``; after such an abnormal end it also
stops the processes of the local Ray session the driver had started (never those of a cluster joined with
``--address``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from dpgs.records import TAG_ERROR

REASON = ("the dpgs train process ended without closing its MLflow run (killed, out of memory, or ended "
          "by Ray when its raylet or GCS died)")


class RunWatcher:
    """The driver's end of the pipe (one per process, started on first use)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "dpgs.runwatch"], stdin=subprocess.PIPE, text=True,
                    start_new_session=True,  # a Ctrl-C or a kill of the driver's process group spares it
                )
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

    def run_failed(self, reason: str) -> None:
        """The reason to record for runs the driver will not end itself (one line)."""
        if self._proc is not None:
            self._send(f"reason {' '.join(reason.split())}")


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
    """Mark the runs still RUNNING as FAILED with ``reason``; returns how many."""
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


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    runs: list[tuple[str, str]] = []
    sessions: list[str] = []
    reason = REASON
    for line in sys.stdin:  # until the driver's end of the pipe closes
        kind, _, rest = line.strip().partition(" ")
        if kind == "run":
            uri, _, run_id = rest.rpartition(" ")
            runs.append((uri, run_id))
        elif kind == "ended":
            runs = [(uri, run_id) for uri, run_id in runs if run_id != rest]
        elif kind == "session":
            sessions.append(rest)
        elif kind == "reason":
            reason = rest
    if _end_runs(runs, reason):
        print(f"dpgs train: error: {reason}; its MLflow run was marked FAILED", file=sys.stderr, flush=True)
        for session in sessions:
            for pid in _ray_session_pids(session):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
