"""A real two-node Ray cluster started with `ray start`, and `dpgs train --address auto` on it."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dpgs_helpers import write_bags

pytestmark = pytest.mark.ray

RAY = str(Path(sys.executable).with_name("ray"))
DPGS = str(Path(sys.executable).with_name("dpgs"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEAD_ATTEMPTS = 3


def start_head(base_env: dict) -> tuple[int, dict, Path]:
    """``ray start --head`` on a free port: (port, the nodes' and driver's environment, temporary directory).

    The port is free when chosen and taken only when the head's GCS binds it, a second or two later; a
    socket of the suite's other Ray processes can take it in between (as one took the DPGS master's store
    port in CI). A head that fails to start is cleaned up and started again on another port, up to
    ``HEAD_ATTEMPTS`` times; then every attempt's failure is raised with Ray's output."""
    failures = []
    for _ in range(HEAD_ATTEMPTS):
        port = free_port()
        env = {**base_env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
        temp = Path("/tmp") / f"dpgs-ray-{port}"  # Ray limits socket path lengths: keep it short
        head = [RAY, "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard",
                "false", "--temp-dir", str(temp), "--object-store-memory", str(150 << 20),
                "--disable-usage-stats"]
        try:
            subprocess.run(head, check=True, env=env, capture_output=True, timeout=120)
            return port, env, temp
        except subprocess.CalledProcessError as err:
            stop_cluster(str(temp), f":{port}")
            shutil.rmtree(temp, ignore_errors=True)
            failures.append(f"port {port}: {err.stdout.decode()[-1500:]}\n{err.stderr.decode()[-1500:]}")
    raise AssertionError(f"ray start --head failed {HEAD_ATTEMPTS} times:\n" + "\n".join(failures))


@pytest.fixture
def cluster(tmp_path):
    # token authentication, as the README recommends for clusters; the token is the test's own (a fresh
    # machine has no ~/.ray/auth_token), passed to every node and to the driver through the environment
    base = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    base.pop("RAY_JOB_ID", None)
    port, env, temp = start_head(base)
    try:
        subprocess.run(
            [
                RAY,
                "start",
                "--address",
                f"127.0.0.1:{port}",
                "--num-cpus",
                "2",
                "--object-store-memory",
                str(150 << 20),
            ],
            check=True,
            env=env,
            capture_output=True,
            timeout=120,
        )
        yield env
    finally:
        stop_cluster(str(temp), f":{port}")
        shutil.rmtree(temp, ignore_errors=True)


def stop_cluster(temp_dir: str, port_suffix: str, grace_s: float = 10.0) -> None:
    """End this test's cluster: every process whose command line names its temporary directory (GCS,
    raylets of both nodes, monitors, dashboard) or an address ending in its port (the client server), and
    their descendants (the actors), SIGTERM then SIGKILL after ``grace_s``. Not ``ray stop``, which ends
    every Ray process on the machine: a user's training, or a benchmark running beside the tests."""
    parents, ours = {}, set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if any(temp_dir in arg or arg.endswith(port_suffix) for arg in argv):
            ours.add(int(entry.name))
    while grown := {pid for pid, ppid in parents.items() if ppid in ours} - ours:
        ours |= grown
    ours.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(map(running, ours)):
            time.sleep(0.2)


def running(pid: int) -> bool:
    """Whether ``pid`` exists and has not ended (a zombie waits for its parent, it does not run)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stopping_the_cluster_ends_its_processes_and_no_others(tmp_path):
    """The teardown ends what names the cluster's directory or port, with its descendants, and leaves a
    bystander that looks like another Ray instance's raylet running."""
    marker = str(tmp_path / "dpgs-ray-1234")
    sleep = "import time; time.sleep(300)"
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    ours = subprocess.Popen([sys.executable, "-c", parent, f"--temp_dir={marker}"])
    port = subprocess.Popen([sys.executable, "-c", sleep, "--address=10.0.0.1:1234"])
    other = ["--raylet_socket_name=/tmp/ray/session_other/sockets/raylet", "--port=12345"]
    bystander = subprocess.Popen([sys.executable, "-c", sleep, *other])
    try:
        time.sleep(1.0)  # the child of ``ours`` has started
        [child] = [int(p) for p in subprocess.run(["pgrep", "-P", str(ours.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        stop_cluster(marker, ":1234", grace_s=5.0)
        assert not running(ours.pid) and not running(child) and not running(port.pid)
        assert running(bystander.pid)
    finally:
        for proc in (ours, port, bystander):
            proc.kill()
            proc.wait()


def test_dpgs_train_on_a_two_node_cluster(cluster, tmp_path):
    manifest, feats = write_bags(tmp_path / "data", [5, 40, 3, 17, 60, 2, 9, 30, 12, 4, 25, 8])
    cmd = [
        DPGS,
        "train",
        "--address",
        "auto",
        f"data.manifest={manifest}",
        f"data.features_dir={feats}",
        "train.mode=dpgs",
        "dpgs.workers=2",
        "train.epochs=1",
        "train.batch_size=4",
        f"train.output_dir={tmp_path / 'run'}",
        f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
        "dpgs.compression.keep_ratio=0.1",
        "dpgs.compression.second_moment=live",  # compressed from the first step (frozen: a dense warm-up)
        "dpgs.compression.value_dtype=fp16",
    ]
    result = subprocess.run(cmd, env=cluster, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Connecting to existing Ray cluster" in result.stderr
    assert "MLflow run id:" in result.stdout
    assert (tmp_path / "run" / "best.pt").is_file()
    nodes = {line.split("node=")[1].split()[0] for line in result.stdout.splitlines() if "node=" in line}
    assert len(nodes) == 2, f"workers were not spread over both nodes: {result.stdout}"

    # Without --address the run starts its own Ray, even with this cluster running and RAY_ADDRESS set.
    local = [c for c in cmd if c not in ("--address", "auto")]
    local[local.index(f"train.output_dir={tmp_path / 'run'}")] = f"train.output_dir={tmp_path / 'local'}"
    result = subprocess.run(local, env=cluster, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting a local Ray instance" in result.stdout
    assert "Started a local Ray instance" in result.stderr
    assert "Connecting to existing Ray cluster" not in result.stderr


def test_address_without_cluster_is_a_clear_error(tmp_path):
    manifest, feats = write_bags(tmp_path / "data", [5, 4, 3, 6, 2, 7, 8, 9, 3, 4])
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    cmd = [
        DPGS,
        "train",
        "--address",
        "auto",
        f"data.manifest={manifest}",
        f"data.features_dir={feats}",
        "train.mode=dpgs",
        f"train.output_dir={tmp_path / 'run'}",
        f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "no Ray cluster found" in result.stderr
