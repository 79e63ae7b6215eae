"""A `dpgs train` process that dies without running Python (SIGKILL, or Ray ending it when its raylet or
GCS dies) still leaves its MLflow run FAILED with a reason, a `dpgs train: error:` line, and no Ray
processes of the session it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.dpgs_helpers import write_bags

DPGS = str(Path(sys.executable).with_name("dpgs"))


def start_training(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    manifest, feats = write_bags(tmp_path / "data", [5, 40, 3, 17, 60, 2, 9, 30, 12, 4, 25, 8] * 3)
    cmd = [DPGS, "train", f"data.manifest={manifest}", f"data.features_dir={feats}", "train.epochs=10000",
           f"train.output_dir={tmp_path / 'run'}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
           "train.batch_size=4", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_epoch(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if "epoch 1/" in line:
            return
    raise AssertionError(f"training ended before its first epoch: {proc.stderr.read()[-2000:]}")


def children(pid: int, name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def runs(tmp_path: Path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    experiment = client.get_experiment_by_name("dpgs")
    return client.search_runs([experiment.experiment_id])


def finish(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=180)  # stderr closes once the watcher, which shares it, is done too
    return err


def test_killed_driver_leaves_its_run_failed(tmp_path):
    proc = start_training(tmp_path, "train.mode=packed")
    wait_for_epoch(proc)
    os.kill(proc.pid, signal.SIGKILL)
    err = finish(proc)
    assert proc.returncode == -signal.SIGKILL
    assert "dpgs train: error: the dpgs train process ended without closing its MLflow run" in err
    [run] = runs(tmp_path)
    assert run.info.status == "FAILED" and "ended without closing" in run.data.tags["dpgs.error"]


@pytest.mark.slow  # 30 s; the run watcher's part is also in test_killed_driver_leaves_its_run_failed
@pytest.mark.ray
def test_raylet_death_fails_the_run_and_leaves_no_ray_processes(tmp_path):
    """Depending on timing, the driver reports the lost master itself (exit 3) or Ray ends the process
    first (exit 1) and the watcher reports; the run is FAILED with a reason either way."""
    proc = start_training(tmp_path, "train.mode=dpgs", "dpgs.workers=2", "dpgs.call_timeout_s=30")
    wait_for_epoch(proc)
    [gcs] = children(proc.pid, "gcs_server")
    [raylet] = children(proc.pid, "raylet/raylet")
    os.kill(raylet, signal.SIGKILL)
    err = finish(proc)
    assert proc.returncode in (1, 3), err[-2000:]
    assert "dpgs train: error:" in err
    [run] = runs(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags.get("dpgs.error")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{gcs}"):
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{gcs}"), "the run's GCS outlived it"


@pytest.mark.slow
@pytest.mark.ray
def test_gcs_death_fails_the_run_naming_the_head(tmp_path):
    """Ray would end the driver 60 s after its GCS died, without a word; the driver's watch on the GCS
    ends the run first: one error line naming the head, exit 3, the run FAILED."""
    proc = start_training(tmp_path, "train.mode=dpgs", "dpgs.workers=2")
    wait_for_epoch(proc)
    [gcs] = children(proc.pid, "gcs_server")
    os.kill(gcs, signal.SIGKILL)
    err = finish(proc)
    assert proc.returncode == 3, err[-3000:]
    assert "dpgs train: error: the cluster's head (Ray GCS at " in err
    assert "has been unreachable for" in err
    [run] = runs(tmp_path)
    assert run.info.status == "FAILED"


def test_watcher_leaves_runs_the_driver_ended_and_stores_that_are_gone(tmp_path):
    """``ended RUN_ID`` takes a run off the watcher's list (the driver closed it, whatever its state
    now); a SQLite store that was deleted (a temporary one) is neither recreated nor reported."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("dpgs")
    left, ended = (client.create_run(experiment).info.run_id for _ in range(2))
    gone = tmp_path / "gone" / "m.db"
    lines = [f"run {uri} {left}", f"run {uri} {ended}", f"ended {ended}", f"run sqlite:///{gone} abc123"]
    done = subprocess.run([sys.executable, "-m", "dpgs.runwatch"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert client.get_run(left).info.status == "FAILED"
    assert client.get_run(ended).info.status == "RUNNING"  # not the watcher's to end
    assert "could not end" not in done.stderr and "dpgs train: error:" in done.stderr
    assert not gone.parent.exists()


def test_a_watcher_with_no_run_left_ends_without_importing_mlflow():
    """After a normal end (every run ended by the driver) the watcher has nothing to check: it must not
    import MLflow (~1.6 s of CPU after every command, and a caller reading the command's output, whose
    pipes the watcher holds, waited for it)."""
    lines = ["run sqlite:////nonexistent/m.db abc123", "ended abc123"]
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "dpgs.runwatch"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert "dpgs" in imported  # -X importtime reports the imports
    assert not [name for name in imported if name.startswith("mlflow")]


def closed_address() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket closes


def test_the_head_watch_reports_a_head_that_stays_unreachable():
    """For a driver blocked inside Ray on a cluster whose head is gone: the watcher process reports it."""
    from dpgs.runwatch import HeadWatch

    said = []
    watch = HeadWatch(said.append, limit_s=0.3, poll_s=0.05)
    address = closed_address()
    watch.watch(address, "resume from runs/x with --resume")
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(said) == 1
    assert said[0].startswith(f"the cluster's head (Ray GCS at {address}) has been unreachable for")
    assert said[0].endswith("; resume from runs/x with --resume")


def test_the_head_watch_stays_quiet_when_stopped_or_when_the_head_answers():
    import socket

    from dpgs.runwatch import HeadWatch

    said = []
    stopped = HeadWatch(said.append, limit_s=0.2, poll_s=0.05)
    stopped.watch(closed_address(), "hint")
    stopped.stop()  # the driver closed its group
    server = socket.create_server(("127.0.0.1", 0))
    answering = HeadWatch(said.append, limit_s=0.2, poll_s=0.05)
    answering.watch(f"127.0.0.1:{server.getsockname()[1]}", "hint")
    time.sleep(1.0)
    server.close()
    assert said == []


def test_a_watcher_the_system_refuses_to_start_warns_once_and_the_driver_goes_on(monkeypatch, capsys):
    """Seen once on the lab: exec of Python failing with EFAULT. The driver tries twice, then warns and
    trains unwatched; later messages neither raise nor try again."""
    from dpgs import runwatch

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(14, "Bad address", sys.executable)

    monkeypatch.setattr(runwatch.subprocess, "Popen", refuse)
    monkeypatch.setattr(runwatch, "START_RETRY_S", 0.0)
    watcher = runwatch.RunWatcher()
    watcher.watch_run("sqlite:///x.db", "abc")
    watcher.watch_ray_session("session_x")
    watcher.run_ended("abc")
    assert len(attempts) == runwatch.START_ATTEMPTS == 2
    err = capsys.readouterr().err
    assert err.count("dpgs train: warning: the run watcher could not start") == 1
    assert "Bad address" in err and "training goes on" in err


def test_a_watcher_that_starts_at_the_second_attempt_gets_every_line(monkeypatch):
    from dpgs import runwatch

    started = []

    class Pipe:
        def __init__(self):
            self.lines = []

        def write(self, text):
            self.lines.append(text)

        def flush(self):
            pass

    class Process:
        def __init__(self, *args, **kwargs):
            if not started:
                started.append(False)
                raise OSError(11, "Resource temporarily unavailable")
            started.append(True)
            self.stdin = Pipe()

    monkeypatch.setattr(runwatch.subprocess, "Popen", Process)
    monkeypatch.setattr(runwatch, "START_RETRY_S", 0.0)
    watcher = runwatch.RunWatcher()
    watcher.watch_run("sqlite:///x.db", "abc")
    watcher.run_ended("abc")
    assert started == [False, True]
    assert watcher._proc.stdin.lines == ["run sqlite:///x.db abc\n", "ended abc\n"]
