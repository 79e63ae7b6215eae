"""dpgs.distributed.failures: Ray's failures as one line, and the watch on the cluster's head."""

from __future__ import annotations

import socket
import time

import pytest
from ray.exceptions import GetTimeoutError

from dpgs.distributed import failures
from dpgs.distributed.failures import ClusterLost, GcsWatch, MasterFailure, ray_error_summary, ray_failures
from dpgs.errors import RunFailure


def test_ray_error_summary_names_the_python_error_and_the_node():
    text = ("The actor died because of an error raised in its creation task, ray::BagWorker.__init__() "
            "(pid=19041, ip=10.213.0.11, actor_id=4a28)\nRuntimeError: The actor with name BagWorker failed "
            "to import on the worker.\n\nModuleNotFoundError: No module named 'dpgs.workers'")
    assert ray_error_summary(RuntimeError(text)) == (
        "ModuleNotFoundError: No module named 'dpgs.workers' (node 10.213.0.11)")
    assert ray_error_summary(TimeoutError("Get timed out: some object(s) not ready.")) == (
        "Get timed out: some object(s) not ready.")


def test_a_timed_out_ray_call_is_one_run_failure_line_saying_what_failed():
    with pytest.raises(RunFailure, match=r"^writing the checkpoint: no answer in time \(late\)$"):
        with ray_failures("writing the checkpoint"):
            raise GetTimeoutError("late")


def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket closes


def test_an_unreachable_head_is_a_cluster_loss_after_the_grace_period():
    watch = GcsWatch(closed_address())
    watch.poll()  # unreachable, within the grace period
    assert watch.unreachable_since is not None and not watch.lost
    watch.unreachable_since = time.monotonic() - failures.GCS_LOST_S - 1
    lost = r"head \(Ray GCS at 127\.0\.0\.1:\d+\) has been unreachable for 2\ds"
    with pytest.raises(ClusterLost, match=lost):
        watch.poll()
    assert watch.lost and issubclass(ClusterLost, MasterFailure)  # resumable, like a lost master


def test_a_head_that_answers_again_resets_the_grace_period():
    server = socket.create_server(("127.0.0.1", 0))
    watch = GcsWatch(f"127.0.0.1:{server.getsockname()[1]}")
    watch.unreachable_since = time.monotonic() - 1000
    watch.poll()
    assert watch.unreachable_since is None and not watch.lost
    server.close()
