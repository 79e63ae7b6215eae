"""Actor lifecycle: start a set of actors of one class with their resources and placement, hand each a
large object after it starts (:class:`StartCall`), wait on them with one deadline, wait for Ray to restart
one (and hand it that object again), and release everything.

Used by the DPGS driver for its workers and by a sample-parallel group for its ranks. Placed actors get
one placement-group bundle each (spread over the nodes), so a set starts only when all of it fits; when it
cannot, :class:`ClusterError` names the request and what the cluster has, instead of hanging. A placement
group outlives the actor that created it (its lifetime is the job's), so an actor that Ray restarts
frees what its dead incarnation reserved with :func:`release_named`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray._raylet import PlacementGroupID
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dpgs.distributed.failures import POLL_S, GcsWatch
from dpgs.distributed.runtime import ClusterError

PLACEMENT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Bundle:
    """What one actor reserves: CPUs and GPUs (fractions allowed)."""

    cpus: float
    gpus: float = 0.0

    def resources(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus > 0 else {})}


@dataclass(frozen=True)
class StartCall:
    """``actor.<method>(value)``: called on every actor of a :class:`PlacedActors` right after it starts and
    again after each Ray restart of it, with one ``value`` for all (put in the object store once and held
    by the set until it closes).

    What an actor needs that is large (a dataset's index of bags) goes this way, not as a constructor
    argument: Ray puts a constructor argument over 100 kB in the object store itself and does not keep it
    for the actor's restarts, so an actor restarted after its node was drained fails in its constructor with
    ``ReferenceCountingAssertionError`` (ray-project/ray#53727; Ray also logs an error line for every actor
    with restarts that has one). An object this set holds is still there."""

    method: str
    value: Any


def reserve(
    count: int, bundle: Bundle, timeout_s: float = PLACEMENT_TIMEOUT_S, name: str = ""
) -> PlacementGroup:
    """A placement group of ``count`` bundles spread over the nodes (``name``: for :func:`release_named`)."""
    group = placement_group([bundle.resources() for _ in range(count)], strategy="SPREAD", name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ClusterError(
            f"cannot place {count} actors with {bundle.resources()} each within {timeout_s:.0f}s; the "
            f"cluster has {ray.cluster_resources()}. Lower dpgs.workers, dpgs.cpus_per_worker or "
            "dpgs.gpus_per_worker."
        )
    return group


def release_named(prefix: str) -> int:
    """Remove every live placement group whose name starts with ``prefix``; returns how many."""
    if not prefix:
        raise ValueError("release_named needs a non-empty prefix")
    removed = 0
    for pg_id, info in placement_group_table().items():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            removed += 1
    return removed


def get_all(refs: list, timeout_s: float, what: str, watch: GcsWatch | None = None) -> list:
    """``ray.get(refs)`` with one deadline for all of them; the first failure is raised as soon as it is
    known (``GetTimeoutError`` naming ``what`` when the deadline passes). ``watch``: polled every
    ``POLL_S`` while nothing arrives (ClusterLost when the head is gone)."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = max(deadline - time.monotonic(), 0.0)
        wait_s = left if watch is None else min(POLL_S, left)
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if watch is not None:
            watch.poll()
        if not ready:
            if time.monotonic() >= deadline:
                raise GetTimeoutError(f"{what}: no answer within {timeout_s:g}s")
            continue
        ray.get(ready[0])
    return ray.get(list(refs))


def settle(refs: list, timeout_s: float, watch: GcsWatch | None = None) -> None:
    """Wait until each of ``refs`` has ended (with a value or an error) or ``timeout_s`` has passed, and
    raise nothing; ``watch`` as in :func:`get_all`."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        left = deadline - time.monotonic()
        wait_s = left if watch is None else min(POLL_S, left)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        if watch is not None:
            watch.poll()


def answers_or_none(refs: list, get: Callable[[ray.ObjectRef], object]) -> list:
    """``get(ref)`` of each of ``refs`` in order; None for one whose actor died or did not answer in time."""
    answers = []
    for ref in refs:
        try:
            answers.append(get(ref))
        except (RayActorError, GetTimeoutError):
            answers.append(None)
    return answers


def prefetch(refs: list, timeout_s: float) -> None:
    """Start bringing the objects of ``refs`` to this node, in a daemon thread, and return at once.

    Ray moves an object to a node only when a process there gets it, or waits for it with ``fetch_local``:
    an answer asked for ahead (a worker's state, asked while the driver validates) would otherwise still
    cross the worker's link when it is finally got. The later ``ray.get`` finds it here. A failed or lost
    object is left to that ``ray.get`` to report."""
    if refs:
        threading.Thread(target=_fetch, args=(list(refs), timeout_s), daemon=True).start()


def _fetch(refs: list, timeout_s: float) -> None:
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=True)
    except Exception:  # noqa: BLE001 - a prefetch only moves bytes early; the ray.get that follows reports
        return


class PlacedActors:
    """``count`` actors of ``cls``; ``args_of(i)`` / ``kwargs_of(i)``: the constructor arguments of actor i.

    Each reserves ``bundle``; ``placed``: in its own bundle of a spread placement group (named ``name``),
    else wherever Ray puts it (an actor that places its own sub-actors reserves no CPU). ``max_restarts``:
    how often Ray restarts a dead actor (its tasks are never retried automatically); ``timeout_s``: the
    deadline of every wait; ``start_call``: made on each actor once it started (the constructor returns
    when every actor has taken it) and after each restart (:meth:`await_restart`).
    """

    def __init__(self, cls: type, count: int, args_of: Callable[[int], tuple], *, bundle: Bundle,
                 placed: bool, max_restarts: int, timeout_s: float, name: str = "",
                 kwargs_of: Callable[[int], dict] | None = None, start_call: StartCall | None = None):
        self.timeout_s = timeout_s
        self.start_call = start_call
        self.start_value = None if start_call is None else ray.put(start_call.value)
        self.placement = reserve(count, bundle, timeout_s=min(timeout_s, PLACEMENT_TIMEOUT_S), name=name) \
            if placed else None
        remote = ray.remote(cls)
        self.handles = []
        for i in range(count):
            options = {"num_cpus": bundle.cpus, "num_gpus": bundle.gpus, "max_restarts": max_restarts,
                       "max_task_retries": 0}
            if self.placement is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement, placement_group_bundle_index=i
                )
            kwargs = kwargs_of(i) if kwargs_of is not None else {}
            self.handles.append(remote.options(**options).remote(*args_of(i), **kwargs))
        if start_call is not None:
            try:
                self.get([self._start_call(h) for h in self.handles])
            except BaseException:  # actors that could not start or take the call: leave nothing behind
                self.close()
                raise

    def _start_call(self, handle) -> ray.ObjectRef:
        return getattr(handle, self.start_call.method).remote(self.start_value)

    def __len__(self) -> int:
        return len(self.handles)

    def call(self, method: str, *args) -> list:
        """``handle.method.remote(*args)`` on every actor: the object refs, in actor order."""
        return [getattr(h, method).remote(*args) for h in self.handles]

    def get(self, refs: list, timeout_s: float | None = None) -> list:
        return get_all(refs, self.timeout_s if timeout_s is None else timeout_s, "actors")

    def await_restart(self, index: int) -> None:
        """Wait until Ray has restarted actor ``index`` (it answers ``ping``) and make the start call on it;
        ClusterError past the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                handle = self.handles[index]
                ray.get(handle.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
                if self.start_call is not None:
                    ray.get(self._start_call(handle), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (RayActorError, GetTimeoutError) as err:
                if time.monotonic() > deadline:
                    raise ClusterError(f"actor {index} did not come back within {self.timeout_s:g}s") from err
                time.sleep(0.2)

    def kill(self, index: int, restart: bool) -> None:
        """Kill actor ``index`` (``restart``: let Ray start it again)."""
        ray.kill(self.handles[index], no_restart=not restart)

    def close(self) -> None:
        """Kill every actor and release the placement group."""
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
        self.start_value = None
