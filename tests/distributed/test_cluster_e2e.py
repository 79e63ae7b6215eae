"""A real two-node Ray cluster started with `ray start`, and `dpgs train --address auto` on it."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
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


@pytest.fixture
def cluster(tmp_path):
    port = free_port()
    # token authentication, as the README recommends for clusters; the token is the test's own (a fresh
    # machine has no ~/.ray/auth_token), passed to every node and to the driver through the environment
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_JOB_ID", None)
    temp = Path("/tmp") / f"dpgs-ray-{port}"  # Ray limits socket path lengths: keep it short
    head = [
        RAY,
        "start",
        "--head",
        "--port",
        str(port),
        "--num-cpus",
        "2",
        "--include-dashboard",
        "false",
        "--temp-dir",
        str(temp),
        "--object-store-memory",
        str(150 << 20),
        "--disable-usage-stats",
    ]
    subprocess.run(head, check=True, env=env, capture_output=True, timeout=120)
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
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


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
