"""dpgs.distributed.failures: Ray's failures as one line, and the watch on the cluster's head."""

from __future__ import annotations

import socket
import time

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

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
    watch = GcsWatch(closed_address(), interval_s=0.0)
    watch.poll()  # unreachable, within the grace period
    assert watch.unreachable_since is not None and not watch.lost
    watch.unreachable_since = time.monotonic() - failures.GCS_LOST_S - 1
    lost = r"head \(Ray GCS at 127\.0\.0\.1:\d+\) has been unreachable for 2\ds"
    with pytest.raises(ClusterLost, match=lost):
        watch.poll()
    assert watch.lost and issubclass(ClusterLost, MasterFailure)  # resumable, like a lost master


def test_a_head_that_answers_again_resets_the_grace_period():
    server = socket.create_server(("127.0.0.1", 0))
    watch = GcsWatch(f"127.0.0.1:{server.getsockname()[1]}", interval_s=0.0)
    watch.unreachable_since = time.monotonic() - 1000
    watch.poll()
    assert watch.unreachable_since is None and not watch.lost
    server.close()


def test_the_head_is_looked_at_once_per_interval_however_often_the_driver_polls(monkeypatch):
    """The driver polls on every turn of its waits (steps can flow without the GCS, so waits need not time
    out); a connection to the GCS is tried at most once per interval."""
    tried = []
    monkeypatch.setattr(failures, "gcs_reachable", lambda address: tried.append(address) or True)
    watch = GcsWatch("10.0.0.1:6379", interval_s=60.0)
    for _ in range(100):
        watch.poll()
    assert tried == ["10.0.0.1:6379"]


def test_confirm_lost_looks_at_once_without_a_grace_period():
    """For a group that already failed (its master dead) or is being released: no 20 s wait."""
    server = socket.create_server(("127.0.0.1", 0))
    answering = GcsWatch(f"127.0.0.1:{server.getsockname()[1]}", interval_s=60.0)
    assert not answering.confirm_lost() and not answering.lost
    server.close()
    gone = GcsWatch(closed_address(), interval_s=60.0)
    assert gone.confirm_lost() and gone.lost


@pytest.mark.parametrize("error", [RayActorError(), GetTimeoutError("late")])
def test_a_ray_failure_with_the_head_unreachable_is_the_lost_cluster(error):
    watch = GcsWatch(closed_address())
    lost = (r"^the cluster's head \(Ray GCS at 127\.0\.0\.1:\d+\) is unreachable: .* "
            r"\(writing the checkpoint failed\)$")
    with pytest.raises(ClusterLost, match=lost):
        with ray_failures("writing the checkpoint", watch):
            raise error
    assert watch.lost


def test_a_ray_failure_with_the_head_answering_stays_what_failed():
    server = socket.create_server(("127.0.0.1", 0))
    watch = GcsWatch(f"127.0.0.1:{server.getsockname()[1]}")
    with pytest.raises(RunFailure, match=r"^writing the checkpoint: no answer in time") as raised:
        with ray_failures("writing the checkpoint", watch):
            raise GetTimeoutError("late")
    assert not isinstance(raised.value, ClusterLost) and not watch.lost
    server.close()
