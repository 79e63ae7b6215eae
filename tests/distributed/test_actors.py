"""Actor lifecycle (``dpgs.distributed.actors``): the start call survives a restart on another node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.node_drain import PAYLOAD_BYTES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_an_actor_restarted_on_another_node_is_given_its_start_call_again():
    """The actor's node is drained; Ray restarts it elsewhere and ``await_restart`` hands it the object
    again. (Passed as a constructor argument instead, the restarted actor's constructor fails with
    ReferenceCountingAssertionError: ray-project/ray#53727.)"""
    done = subprocess.run([sys.executable, "-m", "tests.distributed.node_drain"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"]["held"] == PAYLOAD_BYTES
    assert result["after"]["held"] == PAYLOAD_BYTES
    assert result["after"]["node"] != result["before"]["node"]
