"""How a DPGS run fails: the errors the driver raises, Ray's own failures as one line, and the watch on the
cluster's head.

Every failure here is a :class:`~dpgs.errors.RunFailure`: the CLI prints it as one ``dpgs train: error:``
line, exits 3 and marks the MLflow run FAILED. A :class:`MasterFailure` (and so a :class:`ClusterLost`) is
resumable from the run's last checkpoint.

Why the head is watched: when the Ray GCS (the head) becomes unreachable, Ray ends the driver process
after 60 s without running any Python, so the user would see the command vanish. :class:`GcsWatch`
notices first: the driver's waits poll it and raise :class:`ClusterLost` naming the head's address after
``GCS_LOST_S``. When the master actor dies (it runs on the head) or the group is released, the driver
asks :meth:`GcsWatch.confirm_lost` first: with the GCS gone, a dead master is the lost head
(:class:`ClusterLost` at once), and releasing actors would block inside Ray until Ray ends the process
(found on the lab: the head's Ray killed, the master gone, the driver silent in ``ray.kill``). A driver
blocked inside Ray anyway runs no Python at all, so the run watcher process (``dpgs.runwatch``) also
watches the head and ends such a driver with the same error line at 40 s.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from ray.exceptions import GetTimeoutError, RayActorError

from dpgs.errors import RunFailure
from dpgs.runwatch import gcs_reachable, head_lost_message

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


class GcsWatch:
    """Watches the cluster's head while the driver waits: :meth:`poll` raises :class:`ClusterLost` once the
    GCS at ``address`` has been unreachable for ``grace_s`` in a row; :attr:`lost` says it happened
    (nothing of the group can be released then: every call would wait for the GCS).

    The driver calls :meth:`poll` on every turn of its waits; it looks at the GCS at most every
    ``interval_s`` (the actors go on stepping without the GCS, so a wait may never time out while it is
    gone)."""

    def __init__(self, address: str, grace_s: float = GCS_LOST_S, interval_s: float = POLL_S):
        self.address = address
        self.grace_s = grace_s
        self.interval_s = interval_s
        self.unreachable_since: float | None = None
        self.lost = False
        self._looked_at = -float("inf")

    def poll(self) -> None:
        if time.monotonic() - self._looked_at < self.interval_s:
            return
        self._looked_at = time.monotonic()
        if gcs_reachable(self.address):
            self.unreachable_since = None
            return
        now = time.monotonic()
        if self.unreachable_since is None:
            self.unreachable_since = now
        if now - self.unreachable_since >= self.grace_s:
            self.lost = True
            raise ClusterLost(head_lost_message(self.address, now - self.unreachable_since))

    def confirm_lost(self) -> bool:
        """Look at the GCS now (no grace period): True, and :attr:`lost` set, when it is unreachable. For the
        moments where the group already failed or is being released."""
        if not self.lost and not gcs_reachable(self.address):
            self.lost = True
        return self.lost


@contextmanager
def ray_failures(what: str, watch: GcsWatch | None = None) -> Iterator[None]:
    """Ray's own failures (an actor that died or could not start, a call past its deadline) as a
    :class:`RunFailure` saying ``what`` failed, in one line instead of a Ray traceback; as
    :class:`ClusterLost` when ``watch`` finds the head unreachable at that moment."""
    try:
        yield
    except (GetTimeoutError, RayActorError) as err:
        if watch is not None and watch.confirm_lost():
            raise ClusterLost(f"{head_lost_message(watch.address)} ({what} failed)") from None
        if isinstance(err, GetTimeoutError):
            raise RunFailure(f"{what}: no answer in time ({err})") from None
        raise RunFailure(f"{what}: {ray_error_summary(err)}") from None


class Watched(Protocol):
    """What :func:`reports_ray_failures` decorates the methods of: an object that watches the head."""

    watch: GcsWatch


def reports_ray_failures(what: str):
    """Method decorator (methods of a :class:`Watched`): :func:`ray_failures` around the whole call."""

    def wrap(method):
        @functools.wraps(method)
        def call(self: Watched, *args, **kwargs):
            with ray_failures(what, self.watch):
                return method(self, *args, **kwargs)

        return call

    return wrap
