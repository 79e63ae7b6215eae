"""How a DPGS run fails: the errors the driver raises, Ray's own failures as one line, and the watch on the
cluster's head.

Every failure here is a :class:`~dpgs.errors.RunFailure`: the CLI prints it as one ``dpgs train: error:``
line, exits 3 and marks the MLflow run FAILED. A :class:`MasterFailure` (and so a :class:`ClusterLost`) is
resumable from the run's last checkpoint.

Why the head is watched: when the Ray GCS (the head) becomes unreachable, Ray ends the driver process
after 60 s without running any Python, so the user would see the command vanish. :class:`GcsWatch`
notices first (``GCS_LOST_S``) and raises :class:`ClusterLost` naming the head's address.
"""

from __future__ import annotations

import functools
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ray.exceptions import GetTimeoutError, RayActorError

from dpgs.errors import RunFailure

GCS_LOST_S = 20.0  # Ray itself ends a driver whose GCS stays unreachable for 60 s
POLL_S = 5.0  # how often a waiting driver looks at the GCS


class WorkerFailure(RunFailure):
    """Workers kept failing past ``dpgs.max_worker_restarts``."""


class MasterFailure(RunFailure):
    """The master actor died or stopped answering; the run can resume from its last checkpoint."""


class ClusterLost(MasterFailure):
    """The cluster's GCS (its head) stopped answering: nothing of the group can be reached or released."""


def ray_error_summary(err: BaseException) -> str:
    """One line for a Ray error: the innermost Python error Ray reports, and the node's address when Ray
    names it (``... (node 10.0.0.2)``)."""
    text = str(err)
    ip = re.search(r"\bip=([0-9a-fA-F.:]+)", text)
    errors = re.findall(r"^\s*((?:\w+\.)*\w*(?:Error|Exception): .+)$", text, re.M)
    lines = text.strip().splitlines()
    cause = errors[-1].strip() if errors else lines[0] if lines else type(err).__name__
    return f"{cause} (node {ip.group(1)})" if ip else cause


@contextmanager
def ray_failures(what: str) -> Iterator[None]:
    """Ray's own failures (an actor that died or could not start, a call past its deadline) as a
    :class:`RunFailure` saying ``what`` failed, in one line instead of a Ray traceback."""
    try:
        yield
    except GetTimeoutError as err:
        raise RunFailure(f"{what}: no answer in time ({err})") from None
    except RayActorError as err:
        raise RunFailure(f"{what}: {ray_error_summary(err)}") from None


def reports_ray_failures(what: str):
    """Method decorator: :func:`ray_failures` around the whole call."""

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with ray_failures(what):
                return method(self, *args, **kwargs)

        return call

    return wrap


def gcs_reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the GCS at ``host:port`` accepts a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class GcsWatch:
    """Watches the cluster's head while the driver waits: :meth:`poll` raises :class:`ClusterLost` once the
    GCS at ``address`` has been unreachable for ``GCS_LOST_S`` in a row; :attr:`lost` says it happened
    (nothing of the group can be released then: every call would wait for the GCS)."""

    def __init__(self, address: str, grace_s: float = GCS_LOST_S):
        self.address = address
        self.grace_s = grace_s
        self.unreachable_since: float | None = None
        self.lost = False

    def poll(self) -> None:
        if gcs_reachable(self.address):
            self.unreachable_since = None
            return
        now = time.monotonic()
        if self.unreachable_since is None:
            self.unreachable_since = now
        if now - self.unreachable_since >= self.grace_s:
            self.lost = True
            raise ClusterLost(
                f"the cluster's head (Ray GCS at {self.address}) has been unreachable for "
                f"{now - self.unreachable_since:.0f}s: its Ray stopped or the network to it is cut"
            )
