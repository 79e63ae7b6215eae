"""The group protocol of a DPGS run: the master actor and P worker actors as one group.

The driver forms the group (a gloo group where one can be formed, else a Ray mailbox), gives every rank
the fold's start, hands the ranks a chunk of steps (:meth:`RankGroup.run`) and blocks only when the chunk
ends (epoch end, checkpoint): the steps themselves run between the actors.

Faults. A worker that dies, or does not answer within ``dpgs.call_timeout_s`` after the others stopped, is
restarted by Ray (``dpgs.max_worker_restarts``), the group is formed again, the restarted worker gets the
fold's start, every worker is resynchronised with exactly what the master says in-sync workers hold, and
the chunk continues at the master's version. Workers that had computed their part of the interrupted step
send that same part again, the restarted worker computes only its own bags: every bag of the step counts
exactly once. More than ``dpgs.max_worker_restarts`` restarts of one worker raise :class:`WorkerFailure`;
a master that dies raises :class:`MasterFailure` (the run resumes from its last checkpoint). The restarted
worker's error-feedback residual is lost (docs/reliability.md).

Errors. A rank whose chunk raises (a bag file that cannot be read, a worker beyond its share of a GPU)
ends the run with a :class:`RunFailure` that carries its error. The other ranks are blocked in the step's
exchange with it; they get ``ERROR_GRACE_S`` to end by themselves (a master that died meanwhile is still
reported as a :class:`MasterFailure`), then they are stopped: the run ends within seconds, not after
``dpgs.call_timeout_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dpgs.config.schema import DpgsConfig
from dpgs.distributed.actors import PlacedActors, answers_or_none, get_all, prefetch, settle
from dpgs.distributed.failures import (
    POLL_S,
    ClusterLost,
    GcsWatch,
    MasterFailure,
    WorkerFailure,
    ray_error_summary,
    ray_failures,
    reports_ray_failures,
)
from dpgs.distributed.fold import FoldStart
from dpgs.distributed.link_probe import LinkProbe
from dpgs.distributed.mailbox import Mailbox
from dpgs.distributed.messages import (
    ChunkPlan,
    ChunkResult,
    EpochCheckpoint,
    MasterStep,
    Rehearsal,
    StepPlan,
    WorkerStep,
)
from dpgs.distributed.rendezvous import Rendezvous
from dpgs.distributed.runtime import ClusterError
from dpgs.distributed.transport import JOIN_TIMEOUT_S, MASTER_RANK
from dpgs.errors import RunFailure
from dpgs.records import Checkpoint, DriverProgress
from dpgs.runwatch import head_lost_message

if TYPE_CHECKING:
    from dpgs.train.evaluate import Predictions

ERROR_GRACE_S = 5.0  # after a rank raised: how long the others may take to end by themselves


@dataclass
class ChunkReports:
    """What the ranks did in a chunk (every attempt after failures included)."""

    master: list[MasterStep] = field(default_factory=list)
    workers: list[WorkerStep] = field(default_factory=list)
    scored: dict[int, Predictions] = field(default_factory=dict)  # worker -> its shard of ChunkPlan.score


@dataclass
class GroupHooks:
    """Fault-injection point for tests: ``after_submit(group)`` runs once a chunk is submitted."""

    after_submit: Any = None


@dataclass(frozen=True)
class AskedState:
    """Object refs of answers asked for ahead (:meth:`RankGroup.ask_state`): the master's weights and each
    worker's step-synchronisation state (None when not asked)."""

    weights: ray.ObjectRef | None
    sync_states: list | None


class RankGroup:
    """The master (rank 0) and the workers (ranks 1..P), formed into one group (module docstring).

    ``master``: the master actor (on the driver's node); ``workers``: the worker actors; ``on_node``: a
    scheduling strategy for the driver's node (where the mailbox goes when one is needed).
    """

    def __init__(self, cfg: DpgsConfig, master, workers: PlacedActors, on_node):
        self.cfg = cfg
        self.timeout = cfg.call_timeout_s
        self.master = master
        self.workers = workers
        self.on_node = on_node
        self.hooks = GroupHooks()
        self.restarts = 0
        self.restarts_per_worker = [0] * len(workers)
        self.generation = 0
        self.transport: str | None = None
        self.mailbox = None
        self.fold = None  # object ref of the fold's start (sent again to restarted workers)
        self.asked: AskedState | None = None  # answers asked for ahead (:meth:`ask_state`)
        self.saving: ray.ObjectRef | None = None  # the master writing an epoch's files (:meth:`save_epoch`)
        self.watch = GcsWatch(ray.get_runtime_context().gcs_address)
        with ray_failures("the DPGS master and workers could not form their group", self.watch):
            self.form()

    @property
    def ranks(self) -> list:
        return [self.master, *self.workers.handles]

    def _get(self, refs, timeout: float | None = None):
        one = not isinstance(refs, list)
        got = get_all([refs] if one else refs, self.timeout if timeout is None else timeout, "the DPGS group",
                      self.watch)
        return got[0] if one else got

    # ---------------------------------------------------------------- rendezvous
    def _join(self, rendezvous: Rendezvous) -> None:
        """Every rank joins ``rendezvous``. When one fails, the others' joins are waited out (for up to
        ``2 * JOIN_TIMEOUT_S``: a gloo join can outlast its deadline by a back-off, see ``GlooChannel``)
        before the error is raised: a rank still joining would take the next rendezvous only after that,
        when the ranks that came first had given up on it (CI: the master's store failed at once, a
        worker's join went on for 84 s, and the Ray-transport group then timed out)."""
        refs = [r.join.remote(rendezvous) for r in self.ranks]
        try:
            self._get(refs, timeout=JOIN_TIMEOUT_S + 30)
        except (RayTaskError, GetTimeoutError):
            settle(refs, 2 * JOIN_TIMEOUT_S, self.watch)
            raise

    def form(self) -> None:
        """A new generation of the group: gloo where it can be formed, else Ray object refs.

        A failed gloo join is waited out on every rank (:meth:`_join`), so the ranks can join the
        Ray-transport group right after."""
        self.generation += 1
        world = len(self.ranks)
        if self.transport in (None, "gloo") and self.cfg.transport != "ray":
            address = self._get(self.master.address.remote())
            try:
                self._join(Rendezvous("gloo", self.generation, world, self.timeout, address=address))
                self.transport = "gloo"
                return
            except (RayTaskError, GetTimeoutError) as err:
                reason = ray_error_summary(err)
                if self.cfg.transport == "gloo" or self.transport == "gloo":
                    raise RunFailure(
                        f"cannot form the gloo group of the master and {world - 1} workers: {reason}"
                    ) from None
                print(f"[dpgs] no gloo group ({reason}); exchanging through Ray object refs", flush=True)
                self.generation += 1
        if self.mailbox is None:
            self.mailbox = Mailbox.options(scheduling_strategy=self.on_node).remote()
        try:
            self._join(Rendezvous("ray", self.generation, world, self.timeout, mailbox=self.mailbox))
        except (RayTaskError, GetTimeoutError) as err:
            raise RunFailure(
                f"the master and {world - 1} workers cannot form a group: {ray_error_summary(err)}"
            ) from None
        self.transport = "ray"

    # ---------------------------------------------------------------- folds and state
    @reports_ray_failures("starting the fold on the master and workers")
    def start_fold(self, fold: FoldStart) -> None:
        """Every rank takes the fold's initial weights, class weights and step synchronisation."""
        self.asked = None
        self.fold = ray.put(fold)
        self._get([r.start_fold.remote(self.fold) for r in self.ranks])

    @reports_ray_failures("resynchronising the workers with the master")
    def resync(self) -> int:
        """Every worker holds what the master says in-sync workers hold; returns the master's version."""
        self.asked = None
        state = self.master.replica_state.remote()
        self._get(self.workers.call("resync", state))
        return self.version()

    @reports_ray_failures("asking the master for its version")
    def version(self) -> int:
        """The master's version (optimizer steps taken in this fold)."""
        return self._get(self.master.version.remote())

    def ask_state(self, weights: bool, sync_states: bool) -> None:
        """Ask the master for its weights when ``weights`` and every worker for its step-synchronisation
        state when ``sync_states`` (a checkpoint's), without waiting: the answers arrive while the driver
        does other work (validation), and :meth:`model_state`, :meth:`save_checkpoint` and
        :meth:`save_epoch` take them, until the group's state changes (steps, a new fold, a
        resynchronisation, a restore). One round trip less each, at every epoch's end."""
        states = None
        if sync_states:
            states = self.workers.call("sync_state")
            prefetch(states, self.timeout)  # across the workers' links now, not when the checkpoint's written
        self.asked = AskedState(self.master.model_state.remote() if weights else None, states)

    @reports_ray_failures("fetching the weights from the master")
    def model_state(self) -> dict:
        asked = self.asked.weights if self.asked else None
        return self._get(asked if asked is not None else self.master.model_state.remote())

    def sync_states(self) -> list:
        """Each worker's step-synchronisation state (None for a worker that does not answer)."""
        return answers_or_none(self._sync_state_refs(), self._get)

    def _sync_state_refs(self) -> list:
        """Object refs of every worker's step-synchronisation state: those asked ahead, else asked now (all
        at once)."""
        if self.asked and self.asked.sync_states is not None:
            return list(self.asked.sync_states)
        return self.workers.call("sync_state")

    @reports_ray_failures("writing the DPGS checkpoint")
    def save_checkpoint(self, path: str, driver: DriverProgress) -> str:
        """Master state, the workers' synchronisation states and ``driver``, atomically to ``path``."""
        return self._get(self.master.save_checkpoint.remote(path, driver, self.sync_states()))

    def save_epoch(self, weights_files: list[str], checkpoint: EpochCheckpoint | None) -> None:
        """Have the master write an epoch's weights files and ``checkpoint`` (``Master.save_epoch``; None:
        the weights files alone) without waiting for them: it copies its state and writes the files
        on a thread while the next chunk runs, taking the workers' states from their object refs (asked
        ahead by :meth:`ask_state`), so neither the driver nor the next chunk waits for the workers' states
        or the disk. :meth:`wait_saved` waits (and is called first here: one epoch's files at most are
        pending)."""
        self.wait_saved()
        states = [] if checkpoint is None else self._sync_state_refs()
        self.saving = self.master.save_epoch.remote(weights_files, checkpoint, states)

    @reports_ray_failures("writing the epoch's weights files and checkpoint")
    def wait_saved(self) -> None:
        """Wait for the files of :meth:`save_epoch`; a write that failed in the master raises its own
        ``OSError`` (naming the file; the previous file of that name is intact)."""
        if self.saving is None:
            return
        ref, self.saving = self.saving, None
        try:
            self._get(ref)  # the master's state copied
            self._get(self.master.saved.remote())  # and the files written
        except RayTaskError as err:
            if isinstance(err.cause, OSError):
                raise err.cause from None
            raise

    @reports_ray_failures("restoring the DPGS checkpoint")
    def restore(self, checkpoint: Checkpoint) -> int:
        """Load a checkpoint's master state and the workers' states; returns the version."""
        self.asked = None
        self._get(self.master.load_state_dict.remote(checkpoint.master))
        states = checkpoint.workers
        if len(states) == len(self.workers) and all(s is not None for s in states):
            handles = self.workers.handles
            self._get([w.load_sync_state.remote(s) for w, s in zip(handles, states, strict=True)])
        return self.resync()

    @reports_ray_failures("probing the links between the master and the workers")
    def probe_links(self, sizes: tuple[int, int]) -> LinkProbe:
        """Round trips of a probe exchange between the master and every worker (between two chunks): the
        small size of ``sizes`` and a second chosen from its round (``link_probe.probe_as_master``)."""
        refs = [self.master.probe_link.remote(sizes), *self.workers.call("probe_link")]
        return self._get(refs)[0]

    @reports_ray_failures("computing the first step for keep_ratio=auto's first decision")
    def rehearse(self, step: StepPlan, following: StepPlan | None,
                 ratios: tuple[float, ...]) -> list[Rehearsal]:
        """Every worker computes its part of ``step`` (kept for it) and times its codec at ``ratios``
        (``Worker.rehearse``; no rank's state changes); their answers in worker order."""
        return self._get(self.workers.call("rehearse", step, following, ratios))

    # ---------------------------------------------------------------- running steps
    def run(self, plan: ChunkPlan, reports: ChunkReports) -> None:
        """Run ``plan`` on the group, recovering from worker failures (module docstring); the ranks'
        reports go to ``reports`` as each attempt ends, so that what completed before a failure stays there
        (the master's reports then hold every step it took)."""
        self.asked = None
        attempts = 0
        while plan.steps:
            results, dead, errors = self._run_once(plan)
            for rank, result in results.items():
                (reports.master if rank == MASTER_RANK else reports.workers).extend(result.steps)
                if result.scored is not None:  # with the chunk's last weights: every step completed
                    reports.scored[rank - 1] = result.scored
            if MASTER_RANK in dead:  # the workers' own errors then are its loss (a gloo peer gone)
                self._master_lost()
            if errors:
                rank, err = next(iter(errors.items()))
                who = "master" if rank == MASTER_RANK else f"worker {rank - 1}"
                raise RunFailure(f"the {who} failed: {err.cause if err.cause is not None else err}") from None
            stopped = [r for r in results.values() if r.interrupted_at is not None]
            if not dead and not stopped:
                return
            attempts += 1
            if not dead and attempts > self.cfg.max_worker_restarts + 1:
                reasons = "; ".join(sorted({r.reason for r in stopped}))
                raise RunFailure(
                    f"step {min(r.interrupted_at for r in stopped)} could not complete after "
                    f"{attempts} attempts: {reasons}"
                )
            plan = plan.from_index(self._recover(dead))

    def _run_once(self, plan: ChunkPlan) -> tuple[dict[int, ChunkResult], set[int], dict]:
        """Submit ``plan`` to every rank; collect (results by rank, dead ranks, ranks that raised)."""
        plan_ref = ray.put(plan)
        pending = {r.run_chunk.remote(plan_ref): rank for rank, r in enumerate(self.ranks)}
        if self.hooks.after_submit is not None:
            self.hooks.after_submit(self)
        results, dead, errors = {}, set(), {}
        deadline = None
        while pending:
            timeout = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            self.watch.poll()
            if not ready:
                if deadline is None or time.monotonic() < deadline:
                    continue
                for rank in pending.values():  # the others stopped a while ago: these hang
                    ray.kill(self.ranks[rank], no_restart=False)
                    if not errors:  # lost, to be recovered; after an error the run ends (:meth:`run`)
                        dead.add(rank)
                break
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError:
                    dead.add(rank)
                except RayTaskError as err:
                    errors[rank] = err
            trouble = dead or errors or any(r.interrupted_at is not None for r in results.values())
            if trouble and deadline is None:
                deadline = time.monotonic() + (min(ERROR_GRACE_S, self.timeout) if errors else self.timeout)
                if self.transport == "ray":
                    self.mailbox.abort.remote(self.generation)
        return results, dead, errors

    def _recover(self, dead: set[int]) -> int:
        """Restart the workers that died (a dead master ends the run before: :meth:`run`), form the group
        again, resynchronise; returns the version to continue at."""
        for rank in sorted(dead):
            self._await_restart(rank - 1)
        self.form()
        restarted = [self.workers.handles[rank - 1] for rank in sorted(dead)]
        self._get([w.start_fold.remote(self.fold) for w in restarted])
        return self.resync()

    def _master_lost(self) -> None:
        """Raise what a dead master means: the lost head (ClusterLost) when its GCS is unreachable now (the
        master runs on the head), else a resumable MasterFailure."""
        if self.watch.confirm_lost():
            raise ClusterLost(f"{head_lost_message(self.watch.address)}; the master actor died with it")
        raise MasterFailure(
            f"the master actor died or stopped answering within dpgs.call_timeout_s={self.timeout:g}s"
        )

    def _await_restart(self, worker: int) -> None:
        """Wait until Ray has restarted ``worker``; WorkerFailure past the restart limit."""
        self.restarts += 1
        self.restarts_per_worker[worker] += 1
        if self.restarts_per_worker[worker] > self.cfg.max_worker_restarts:
            raise WorkerFailure(
                f"worker {worker} failed {self.restarts_per_worker[worker]} times "
                f"(dpgs.max_worker_restarts={self.cfg.max_worker_restarts})"
            )
        try:
            self.workers.await_restart(worker)
        except ClusterError as err:
            raise WorkerFailure(f"worker {worker} did not come back within {self.timeout:g}s") from err

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Release the workers' own resources (their ranks), kill every actor, release the placements
        (nothing to release when the cluster is lost: its GCS is gone and every call would wait for it)."""
        if self.watch.confirm_lost():
            return
        refs = self.workers.call("close")
        ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout, 60.0))
        self.workers.close()
        for actor in (self.master, self.mailbox):
            if actor is not None:
                ray.kill(actor, no_restart=True)
