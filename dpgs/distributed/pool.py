"""The driver's handle on a DPGS group: Ray, the master actor, P worker actors and their channel.

A pool lives for a whole ``dpgs train`` command: Ray starts, the actors are created and the model is
shipped once; each fold only resets the actors' state (:meth:`WorkerPool.start_fold`). The driver hands
the ranks a chunk of steps (:meth:`WorkerPool.run`) and blocks only when the chunk ends (epoch end,
checkpoint): the steps themselves run between the actors (``dpgs.distributed.channel``).

Faults. A worker that dies, or does not answer within ``dpgs.call_timeout_s`` after the others stopped, is
restarted by Ray (``max_restarts``; tasks are never retried automatically), the group is formed again, the
restarted worker gets the fold's state, every worker is resynchronised with exactly what the master says
in-sync workers hold, and the chunk continues at the master's version. Workers that had computed their
part of the interrupted step send that same part again, the restarted worker computes only its own bags:
every bag of the step counts exactly once. More than ``dpgs.max_worker_restarts`` restarts of one worker
raise :class:`WorkerFailure`; a master that dies raises :class:`MasterFailure` (the run resumes from its
last checkpoint). The restarted worker's error-feedback residual is lost (docs/reliability.md).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from dpgs.config import Config
from dpgs.distributed.assignment import assign_lpt
from dpgs.distributed.channel import JOIN_TIMEOUT_S, Rendezvous
from dpgs.distributed.mailbox import Mailbox
from dpgs.distributed.messages import MASTER_RANK, ChunkPlan, FoldStart, MasterStep, WorkerStep
from dpgs.distributed.runtime import connect, release, release_named, reserve, worker_resources
from dpgs.errors import RunFailure
from dpgs.master import Master
from dpgs.train.evaluate import EvalProtocol, Predictions
from dpgs.workers import BagWorker, GroupWorker


class WorkerFailure(RunFailure):
    """Workers kept failing past ``dpgs.max_worker_restarts``."""


class MasterFailure(RunFailure):
    """The master actor died or stopped answering; the run can resume from its last checkpoint."""


@dataclass
class ChunkReports:
    """What the ranks did in a chunk (every attempt after failures included)."""

    master: list[MasterStep] = field(default_factory=list)
    workers: list[WorkerStep] = field(default_factory=list)


@dataclass
class PoolHooks:
    """Fault-injection points for tests: ``after_submit(pool)`` runs once a chunk is submitted."""

    after_submit: Any = None


class WorkerPool:
    def __init__(self, config: Config, spec, dataset):
        self.cfg = config.dpgs
        self.timeout = self.cfg.call_timeout_s
        self.hooks = PoolHooks()
        self.restarts = 0
        self.restarts_per_worker = [0] * self.cfg.workers
        self.generation = 0
        self.transport: str | None = None
        self.mailbox = None
        self.group = None
        self.group_prefix = ""
        self.fold: FoldStart | None = None
        connect(self.cfg)
        self.here = ray.get_runtime_context().get_node_id()
        if self.cfg.sample_parallel > 1:
            self.workers, threads = self._start_groups(config, spec, dataset)
        else:
            self.workers, threads = self._start_workers(config, spec, dataset)
        self.master = (
            ray.remote(Master)
            .options(
                num_cpus=0, max_restarts=0, max_task_retries=0, scheduling_strategy=self._on_driver_node()
            )
            .remote(spec, config, threads)
        )
        try:
            self._form_group()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- actors
    def _on_driver_node(self) -> NodeAffinitySchedulingStrategy:
        return NodeAffinitySchedulingStrategy(node_id=self.here, soft=False)

    def _start_workers(self, config: Config, spec, dataset) -> tuple[list, int]:
        res = worker_resources(self.cfg, config.train.device)
        self.group = reserve(self.cfg.workers, res)
        workers = [
            ray.remote(BagWorker)
            .options(
                num_cpus=res.cpus,
                num_gpus=res.gpus,
                max_restarts=self.cfg.max_worker_restarts,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=w
                ),
            )
            .remote(w, spec, dataset, config, res.device, res.threads)
            for w in range(self.cfg.workers)
        ]
        where = self._get([w.where.remote() for w in workers])
        for w, info in enumerate(where):
            print(
                f"[dpgs] worker {w}: node={info['node'][:12]} pid={info['pid']} device={info['device']} "
                f"cpus={res.cpus:g} gpus={res.gpus:g} threads={res.threads}",
                flush=True,
            )
        return workers, res.threads

    def _start_groups(self, config: Config, spec, dataset) -> tuple[list, int]:
        """P ``GroupWorker`` coordinators (no CPU, no bundle of their own), each with G ranks.

        The ranks are sized as P * G workers would be (``worker_resources``; ``dpgs.cpus_per_worker`` and
        ``dpgs.gpus_per_worker`` are per rank). On CUDA every rank needs a whole GPU (NCCL).
        """
        p, g = self.cfg.workers, self.cfg.sample_parallel
        res = worker_resources(self.cfg.model_copy(update={"workers": p * g}), config.train.device)
        if 0 < res.gpus < 1:
            source = (
                f"dpgs.gpus_per_worker={self.cfg.gpus_per_worker:g}"
                if self.cfg.gpus_per_worker
                else f"{ray.cluster_resources().get('GPU', 0):g} GPUs for {p * g} ranks"
            )
            raise ValueError(
                f"dpgs.sample_parallel={g}: NCCL needs one whole GPU per rank, never two ranks on one GPU "
                f"({source}); set dpgs.gpus_per_worker=1 with dpgs.workers * dpgs.sample_parallel <= GPUs, "
                f"or train.device=cpu"
            )
        prefix = self.group_prefix = f"dpgs-group-{uuid.uuid4().hex[:12]}-"
        grid = None if self.cfg.sample_grid is None else tuple(self.cfg.sample_grid)
        workers = [
            ray.remote(GroupWorker)
            .options(num_cpus=0, max_restarts=self.cfg.max_worker_restarts, max_task_retries=0)
            .remote(
                w,
                spec,
                dataset,
                config,
                ranks=g,
                grid=grid,
                rank_device=res.device,
                cpus_per_rank=res.cpus,
                gpus_per_rank=res.gpus,
                rank_threads=res.threads,
                name=f"{prefix}{w}-",
            )
            for w in range(p)
        ]
        try:
            where = self._get([w.where.remote() for w in workers])
        except BaseException:  # a group that could not start: leave no ranks or reservations behind
            for w in workers:
                ray.kill(w, no_restart=True)
            release_named(prefix)
            raise
        rows, cols = grid or (g, 1)
        for w, info in enumerate(where):
            print(
                f"[dpgs] worker {w}: sample-parallel group of {g} ranks ({rows}x{cols} grid), "
                f"coordinator node={info['node'][:12]} pid={info['pid']}",
                flush=True,
            )
            for r in info["ranks"]:
                print(
                    f"[dpgs]   rank {r['rank']}: node={r['node'][:12]} pid={r['pid']} device={r['device']} "
                    f"cpus={res.cpus:g} gpus={res.gpus:g} threads={res.threads}",
                    flush=True,
                )
        return workers, 1

    def _get(self, refs, timeout: float | None = None):
        return ray.get(refs, timeout=self.timeout if timeout is None else timeout)

    @property
    def ranks(self) -> list:
        return [self.master, *self.workers]

    # ---------------------------------------------------------------- the group
    def _join(self, rendezvous: Rendezvous) -> None:
        self._get([r.join.remote(rendezvous) for r in self.ranks], timeout=JOIN_TIMEOUT_S + 30)

    def _form_group(self) -> None:
        """A new generation of the group: gloo where it can be formed, else Ray object refs."""
        self.generation += 1
        world = 1 + len(self.workers)
        if self.transport in (None, "gloo") and self.cfg.transport != "ray":
            address = self._get(self.master.address.remote())
            try:
                self._join(Rendezvous("gloo", self.generation, world, self.timeout, address=address))
                self.transport = "gloo"
                return
            except (RayTaskError, GetTimeoutError) as err:
                if self.cfg.transport == "gloo" or self.transport == "gloo":
                    raise RunFailure(
                        f"cannot form the gloo group of the master and {world - 1} workers: {err}"
                    ) from None
                print(
                    f"[dpgs] no gloo group ({type(err).__name__}); exchanging through Ray object refs",
                    flush=True,
                )
                self.generation += 1
        if self.mailbox is None:
            self.mailbox = Mailbox.options(scheduling_strategy=self._on_driver_node()).remote()
        self._join(Rendezvous("ray", self.generation, world, self.timeout, mailbox=self.mailbox))
        self.transport = "ray"

    # ---------------------------------------------------------------- folds, state
    def start_fold(self, fold: FoldStart) -> None:
        """Every rank takes the fold's initial weights and class weights (version 0)."""
        self.fold = ray.put(fold)
        self._get([r.start_fold.remote(self.fold) for r in self.ranks])

    def resync(self) -> int:
        """Every worker holds what the master says in-sync workers hold; returns the master's version."""
        state = self.master.replica_state.remote()
        self._get([w.resync.remote(state) for w in self.workers])
        return self.version()

    def version(self) -> int:
        """The master's version (optimizer steps taken in this fold)."""
        return self._get(self.master.version.remote())

    def model_state(self) -> dict:
        return self._get(self.master.model_state.remote())

    def encoder_states(self) -> list:
        """Each worker's error-feedback state (None for a dead worker and in dense mode)."""
        states = []
        for ref in [w.encoder_state.remote() for w in self.workers]:  # asked of every worker at once
            try:
                states.append(self._get(ref))
            except (RayActorError, GetTimeoutError):
                states.append(None)
        return states

    def save_checkpoint(self, path: str, driver: dict) -> str:
        """Master state, the workers' error-feedback residuals and ``driver``, atomically to ``path``."""
        return self._get(self.master.save_checkpoint.remote(path, driver, self.encoder_states()))

    def restore(self, checkpoint: dict) -> int:
        """Load a checkpoint's master state and the workers' residuals; returns the version."""
        self._get(self.master.load_state_dict.remote(checkpoint["master"]))
        residuals = checkpoint.get("workers") or []
        if len(residuals) == len(self.workers):
            self._get([w.load_encoder_state.remote(s) for w, s in zip(self.workers, residuals, strict=True)])
        return self.resync()

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, state: dict | None, indices: list[int], protocol: EvalProtocol, lengths: list[int],
                 fallback: Callable[[list[int]], Predictions]) -> Predictions:
        """Predictions of the bags ``indices`` with the weights ``state`` (None: each worker's replica,
        which must then be exact), sharded over the workers by ``lengths`` (instances per bag, LPT) and
        merged in the order of ``indices``. A shard whose worker fails is scored by ``fallback`` (on the
        driver; the pool notices the failure at its next chunk)."""
        state_ref = None if state is None else ray.put(state)
        plan = assign_lpt([lengths[i] for i in indices], len(self.workers))
        shards = [[indices[p] for p in positions] for positions in plan]
        refs = [w.evaluate.remote(state_ref, s, protocol) for w, s in zip(self.workers, shards, strict=True)]
        scored = []
        for ref in refs:
            try:
                scored.append(self._get(ref))
            except (RayActorError, GetTimeoutError):
                scored.append(None)
        missing = [shard for shard, preds in zip(shards, scored, strict=True) if preds is None]
        if missing:
            print(f"[dpgs] {len(missing)} evaluation shard(s) lost with their worker: scoring them here",
                  flush=True)
        shards = [p for p in scored if p is not None] + [fallback(shard) for shard in missing]
        return Predictions.merge(shards, indices)

    # ---------------------------------------------------------------- running steps
    def run(self, plan: ChunkPlan) -> ChunkReports:
        """Run ``plan`` on the group, recovering from worker failures (module docstring)."""
        reports = ChunkReports()
        attempts = 0
        while plan.steps:
            results, dead, errors = self._run_once(plan)
            for rank, result in results.items():
                (reports.master if rank == MASTER_RANK else reports.workers).extend(result.steps)
            if errors:
                rank, err = next(iter(errors.items()))
                who = "master" if rank == MASTER_RANK else f"worker {rank - 1}"
                raise RunFailure(f"the {who} failed: {err.cause if err.cause is not None else err}") from None
            stopped = [r for r in results.values() if r.interrupted_at is not None]
            if not dead and not stopped:
                return reports
            attempts += 1
            if not dead and attempts > self.cfg.max_worker_restarts + 1:
                reasons = "; ".join(sorted({r.reason for r in stopped}))
                raise RunFailure(
                    f"step {min(r.interrupted_at for r in stopped)} could not complete after "
                    f"{attempts} attempts: {reasons}"
                )
            plan = plan.from_index(self._recover(dead))
        return reports

    def _run_once(self, plan: ChunkPlan) -> tuple[dict, set[int], dict]:
        """Submit ``plan`` to every rank; collect (results by rank, dead ranks, ranks that raised)."""
        plan_ref = ray.put(plan)
        pending = {r.run_chunk.remote(plan_ref): rank for rank, r in enumerate(self.ranks)}
        if self.hooks.after_submit is not None:
            self.hooks.after_submit(self)
        results, dead, errors = {}, set(), {}
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:  # the others stopped call_timeout_s ago: these hang
                for rank in pending.values():
                    ray.kill(self.ranks[rank], no_restart=False)
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
                deadline = time.monotonic() + self.timeout
                if self.transport == "ray":
                    self.mailbox.abort.remote(self.generation)
        return results, dead, errors

    def _recover(self, dead: set[int]) -> int:
        """Restart what died, form the group again, resynchronise; returns the version to continue at."""
        if MASTER_RANK in dead:
            raise MasterFailure(
                f"the master actor died or stopped answering within dpgs.call_timeout_s={self.timeout:g}s"
            )
        for rank in sorted(dead):
            self._await_restart(rank - 1)
        self._form_group()
        restarted = [self.workers[rank - 1] for rank in sorted(dead)]
        self._get([w.start_fold.remote(self.fold) for w in restarted])
        return self.resync()

    def _await_restart(self, worker: int) -> None:
        """Wait until Ray has restarted ``worker``; raise WorkerFailure past the restart limit."""
        self.restarts += 1
        self.restarts_per_worker[worker] += 1
        if self.restarts_per_worker[worker] > self.cfg.max_worker_restarts:
            raise WorkerFailure(
                f"worker {worker} failed {self.restarts_per_worker[worker]} times "
                f"(dpgs.max_worker_restarts={self.cfg.max_worker_restarts})"
            )
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._get(self.workers[worker].ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (RayActorError, GetTimeoutError) as err:
                if time.monotonic() > deadline:
                    raise WorkerFailure(
                        f"worker {worker} did not come back within {self.timeout:g}s"
                    ) from err
                time.sleep(0.2)

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Release the groups' ranks, kill the actors, release the placement group."""
        if self.cfg.sample_parallel > 1:
            refs = [w.close.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout, 60.0))
        for actor in [*self.workers, getattr(self, "master", None), self.mailbox]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.group is not None:
            release(self.group)
        if self.group_prefix:  # reservations of group workers that died without closing their group
            release_named(self.group_prefix)
