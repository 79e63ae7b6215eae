"""A bandwidth benchmark that is terminated (SIGTERM, SIGHUP) ends as on any other exit: the exception
unwinds through the row being waited for, which stops the row's processes, and through the lab's context,
which takes the lab down. (Python's default action ended the process where it stood and left the lab up.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth import exit_on_termination  # noqa: E402
from bandwidth_rows import Output  # noqa: E402


@pytest.fixture
def termination_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    exit_on_termination()
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def start(command: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.timeout(60)
def test_sigterm_while_a_row_runs_stops_its_process_and_unwinds(termination_handlers, tmp_path):
    proc = start("echo started; sleep 60")
    out = Output(proc, tmp_path / "row.log")
    threading.Timer(0.5, signal.raise_signal, args=(signal.SIGTERM,)).start()
    began = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        out.wait(time.monotonic() + 30)
    assert exc.value.code == 128 + signal.SIGTERM
    assert proc.poll() == -signal.SIGTERM  # stopped, not left running
    assert time.monotonic() - began < 10


@pytest.mark.timeout(60)
def test_a_row_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    proc = start("trap '' TERM; echo ready; sleep 60")
    out = Output(proc, tmp_path / "row.log")
    while not out.lines:  # the trap is set
        time.sleep(0.05)
    out.stop(grace_s=0.5)
    assert proc.poll() == -signal.SIGKILL
