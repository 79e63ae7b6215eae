"""The driver side of DPGS: Ray master + P bag workers behind the trainer's engine interface.

Per step the driver assigns the step's bags to workers by length (LPT), submits
``worker.compute(update, bags)`` to every worker and ``master.step(B, *payload_refs)``; gradient and
weight payloads move between actors as object references, never through the driver. The master's
weight update for step s is the input of the workers' step s + 1.

Faults: every call has a timeout (``dpgs.call_timeout_s``). A worker that dies or times out is
restarted by Ray (``max_restarts``; tasks are never retried automatically, since a retried step could
apply a gradient twice), resynchronised with a dense snapshot of exactly what the in-sync workers hold,
and only its bags are re-run; the master steps once all B bags have a gradient, so every bag counts
exactly once.
More than ``dpgs.max_worker_restarts`` restarts of one worker stop the run with a checkpoint.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from dpgs.config import Config, config_to_dict
from dpgs.distributed.assignment import assign_lpt, imbalance
from dpgs.distributed.codec import keep_ratio_at
from dpgs.distributed.runtime import connect, release, release_named, reserve, worker_resources
from dpgs.errors import RunFailure
from dpgs.master import Master
from dpgs.modeling import ModelSpec
from dpgs.workers import BagWorker, GroupWorker

CHECKPOINT_NAME = "checkpoint.pt"


class WorkerFailure(RunFailure):
    """Workers kept failing past ``dpgs.max_worker_restarts``; a checkpoint was written."""


class DpgsEngine:
    """Trainer engine for ``train.mode=dpgs``."""

    def __init__(self, config: Config, model: torch.nn.Module, class_weights, data, spec: ModelSpec):
        dataset, _ = data
        self.config = config
        self.cfg = config.dpgs
        self.model = model  # driver copy, used for evaluation only
        self.lengths = dataset.lengths()
        self.out_dir = Path(config.train.output_dir)
        self.timeout = self.cfg.call_timeout_s
        self.hooks: dict[str, Callable] = {}
        self.restarts = 0
        self.restarts_per_worker = [0] * self.cfg.workers
        self.global_step = 0
        self.skip_steps = 0
        connect(self.cfg)
        here = ray.get_runtime_context().get_node_id()
        self.master = Master.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        ).remote(spec, config.train, self.cfg.compression)
        self.group_prefix = ""
        if self.cfg.sample_parallel > 1:
            self.group = None  # every GroupWorker's ranks reserve their own placement group
            self.workers = self._start_groups(config, spec, dataset, class_weights)
        else:
            res = worker_resources(self.cfg, config.train.device)
            self.resources = res
            self.group = reserve(self.cfg.workers, res)
            self.workers = [
                BagWorker.options(
                    num_cpus=res.cpus,
                    num_gpus=res.gpus,
                    max_restarts=self.cfg.max_worker_restarts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.group, placement_group_bundle_index=rank
                    ),
                ).remote(
                    rank=rank,
                    threads=res.threads,
                    model_spec=spec,
                    dataset=dataset,
                    compression=self.cfg.compression,
                    class_weights=class_weights,
                    seed=config.seed,
                    device=res.device,
                    emulate_bandwidth_mbps=self.cfg.emulate_bandwidth_mbps,
                )
                for rank in range(self.cfg.workers)
            ]
            where = ray.get([w.where.remote() for w in self.workers], timeout=self.timeout)
            for rank, info in enumerate(where):
                print(
                    f"[dpgs] worker {rank}: node={info['node'][:12]} pid={info['pid']} "
                    f"device={info['device']} cpus={res.cpus:g} gpus={res.gpus:g} threads={res.threads}",
                    flush=True,
                )
        ray.get(self.master.load_model_state.remote(model.state_dict()), timeout=self.timeout)
        self.update = self.master.snapshot.remote()
        self.buffers = self.master.buffers.remote()

    def _start_groups(self, config: Config, spec: ModelSpec, dataset, class_weights) -> list:
        """P ``GroupWorker`` coordinators (no CPU, no bundle of their own), each with G ranks.

        The ranks are sized as P * G workers would be (``worker_resources``; ``dpgs.cpus_per_worker`` and
        ``dpgs.gpus_per_worker`` are per rank). On CUDA every rank needs a whole GPU (NCCL).
        """
        p, g = self.cfg.workers, self.cfg.sample_parallel
        res = worker_resources(self.cfg.model_copy(update={"workers": p * g}), config.train.device)
        if 0 < res.gpus < 1:
            source = (f"dpgs.gpus_per_worker={self.cfg.gpus_per_worker:g}" if self.cfg.gpus_per_worker
                      else f"{ray.cluster_resources().get('GPU', 0):g} GPUs for {p * g} ranks")
            raise ValueError(
                f"dpgs.sample_parallel={g}: NCCL needs one whole GPU per rank, never two ranks on one GPU "
                f"({source}); set dpgs.gpus_per_worker=1 with dpgs.workers * dpgs.sample_parallel <= GPUs, "
                f"or train.device=cpu"
            )
        self.resources = res
        prefix = self.group_prefix = f"dpgs-group-{uuid.uuid4().hex[:12]}-"
        workers = [
            GroupWorker.options(num_cpus=0, max_restarts=self.cfg.max_worker_restarts).remote(
                rank=rank,
                model_spec=spec,
                dataset=dataset,
                compression=self.cfg.compression,
                class_weights=class_weights,
                seed=config.seed,
                ranks=g,
                grid=None if self.cfg.sample_grid is None else tuple(self.cfg.sample_grid),
                device=res.device,
                cpus_per_rank=res.cpus,
                gpus_per_rank=res.gpus,
                threads=res.threads,
                call_timeout_s=self.timeout,
                emulate_bandwidth_mbps=self.cfg.emulate_bandwidth_mbps,
                name=f"{prefix}{rank}-",
            )
            for rank in range(p)
        ]
        grid = self.cfg.sample_grid or (g, 1)
        try:
            where = ray.get([w.where.remote() for w in workers], timeout=self.timeout)
        except BaseException:  # a group that could not start: leave no ranks or reservations behind
            for w in workers:
                ray.kill(w, no_restart=True)
            ray.kill(self.master, no_restart=True)
            release_named(prefix)
            raise
        for rank, info in enumerate(where):
            print(f"[dpgs] worker {rank}: sample-parallel group of {g} ranks ({grid[0]}x{grid[1]} grid), "
                  f"coordinator node={info['node'][:12]} pid={info['pid']}", flush=True)
            for r in info["ranks"]:
                print(f"[dpgs]   rank {r['rank']}: node={r['node'][:12]} pid={r['pid']} device={r['device']} "
                      f"cpus={res.cpus:g} gpus={res.gpus:g} threads={res.threads}", flush=True)
        return workers

    # ------------------------------------------------------------------ resume
    def restore(self, checkpoint: dict) -> dict:
        """Load a checkpoint's master state; returns the driver part (epoch, step in epoch, history)."""
        ray.get(self.master.load_checkpoint.remote(checkpoint["master"]), timeout=self.timeout)
        driver = checkpoint["driver"]
        self.global_step = int(checkpoint["master"]["step"])
        self.skip_steps = int(driver["step_in_epoch"])
        self.restarts = int(driver.get("worker_restarts", 0))
        torch.set_rng_state(driver["torch_rng"])
        self.update = self.master.snapshot.remote()
        self.buffers = self.master.buffers.remote()
        return driver

    def checkpoint(self, epoch: int, step_in_epoch: int, history: list[dict]) -> Path:
        extra = {
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "history": history,
            "worker_restarts": self.restarts,
            "torch_rng": torch.get_rng_state(),
            "seed": self.config.seed,
            "config": config_to_dict(self.config),  # what a resume compares its own config with
        }
        path = self.out_dir / CHECKPOINT_NAME
        ray.get(self.master.save_checkpoint.remote(str(path), extra), timeout=self.timeout)
        return path

    # ------------------------------------------------------------------ faults
    def _await_restart(self, rank: int) -> None:
        """Wait until Ray has restarted worker ``rank``; raise WorkerFailure past the restart limit."""
        self.restarts += 1
        self.restarts_per_worker[rank] += 1
        if self.restarts_per_worker[rank] > self.cfg.max_worker_restarts:
            raise WorkerFailure(
                f"worker {rank} failed {self.restarts_per_worker[rank]} times "
                f"(dpgs.max_worker_restarts={self.cfg.max_worker_restarts})"
            )
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                ray.get(self.workers[rank].ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (RayActorError, GetTimeoutError) as err:
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"worker {rank} did not come back within {self.timeout}s") from err
                time.sleep(0.2)

    # ------------------------------------------------------------------ a step
    def _assign(self, batch: list[int]) -> dict[int, list[int]]:
        """Bags of ``batch`` per worker rank (LPT on bag lengths)."""
        plan = assign_lpt([self.lengths[i] for i in batch], len(self.workers))
        return {rank: [batch[p] for p in positions] for rank, positions in enumerate(plan)}

    def _run_step(self, batch: list[int], keep: float, epoch: int, next_batch: list[int] | None) -> dict:
        start = time.perf_counter()
        pending = self._assign(batch)
        ahead = self._assign(next_batch) if next_batch else {}
        updates = {rank: self.update for rank in pending}
        done: dict[int, tuple] = {}
        while pending:
            if "before_submit" in self.hooks:
                self.hooks["before_submit"](self, self.global_step)
            calls = {
                rank: self.workers[rank].compute.remote(
                    updates[rank], self.buffers, bags, self.global_step, keep, epoch, ahead.get(rank, [])
                )
                for rank, bags in pending.items()
            }
            if "after_submit" in self.hooks:
                self.hooks["after_submit"](self, self.global_step)
            stats_refs = {rank: refs[2] for rank, refs in calls.items()}
            ray.wait(list(stats_refs.values()), num_returns=len(stats_refs), timeout=self.timeout)
            crashed, stale = [], []
            for rank, ref in stats_refs.items():
                try:
                    stats = ray.get(ref, timeout=0.1)
                except GetTimeoutError:
                    ray.kill(self.workers[rank], no_restart=False)
                    crashed.append(rank)
                    continue
                except RayActorError:
                    crashed.append(rank)
                    continue
                if stats["needs_resync"]:
                    stale.append(rank)
                    continue
                done[rank] = (calls[rank][0], calls[rank][1], stats)
                del pending[rank]
            if crashed or stale:
                snapshot = self.master.snapshot.remote()
                for rank in crashed:
                    self._await_restart(rank)
                for rank in crashed + stale:
                    updates[rank] = snapshot
        n_bags = len(batch)
        busy = [entry for entry in done.values() if entry[2]["n_bags"] > 0]
        counts = [entry[2]["n_bags"] for entry in busy]
        update_ref, buffers_ref, master_stats_ref = self.master.step.remote(
            n_bags, counts, keep, *[entry[0] for entry in busy], *[entry[1] for entry in busy]
        )
        self.update = update_ref
        self.buffers = buffers_ref
        self.global_step += 1
        worker_stats = [entry[2] for entry in done.values()]
        compute = [s.get("compute_seconds", 0.0) for s in worker_stats]
        step_seconds = time.perf_counter() - start
        receivers = len(self.workers)
        return {
            "loss_sum": sum(sum(s["losses"]) for s in worker_stats),
            "n_bags": n_bags,
            "up_bytes": sum(s["payload_bytes"] for s in worker_stats),
            "up_dense": sum(s["dense_bytes"] for s in worker_stats),
            "master_stats": master_stats_ref,  # resolved at epoch end: the driver never waits on the master
            "receivers": receivers,
            "step_seconds": step_seconds,
            "overhead_seconds": step_seconds - max(compute, default=0.0),
            "imbalance": imbalance(compute),
            "link_seconds": max((s.get("link_seconds", 0.0) for s in worker_stats), default=0.0),
            "halo_bytes": sum(s.get("halo_bytes", 0) for s in worker_stats),
            "group_restarts": sum(s.get("group_restarts", 0) for s in worker_stats),
        }

    # ------------------------------------------------------------------ epochs
    def run_epoch(self, batches: list[list[int]], epoch: int, history: list[dict] | None = None) -> dict:
        """Run the epoch's steps (skipping those already done before a resume)."""
        from tqdm.auto import tqdm

        steps = []
        start = time.perf_counter()
        total_epochs = self.config.train.epochs
        for s, batch in enumerate(tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=None)):
            if s < self.skip_steps:
                continue
            keep = keep_ratio_at(self.cfg.compression, epoch - 1 + s / max(len(batches), 1), total_epochs)
            try:
                next_batch = batches[s + 1] if s + 1 < len(batches) else None
                steps.append(self._run_step(batch, keep, epoch, next_batch))
            except WorkerFailure as err:
                path = self.checkpoint(epoch, s, history or [])
                raise WorkerFailure(f"{err}; checkpoint written to {path} (resume with --resume)") from err
            if "after_step" in self.hooks:
                self.hooks["after_step"](self, epoch, s + 1)
            every = self.cfg.checkpoint_every
            if every and self.global_step % every == 0 and s + 1 < len(batches):
                self.checkpoint(epoch, s + 1, history or [])
        self.skip_steps = 0
        ray.get(self.master.end_epoch.remote(), timeout=self.timeout)
        for step, master_stats in zip(
            steps, ray.get([s["master_stats"] for s in steps], timeout=self.timeout), strict=True
        ):
            step["down_bytes"] = master_stats["down_bytes"] * step["receivers"]
            step["down_dense"] = master_stats["down_dense_bytes"] * step["receivers"]
        n_bags = sum(s["n_bags"] for s in steps)
        up = sum(s["up_bytes"] for s in steps)
        down = sum(s["down_bytes"] for s in steps)
        dense = sum(s["up_dense"] + s["down_dense"] for s in steps)
        mean = lambda key: sum(s[key] for s in steps) / max(len(steps), 1)
        groups = {}
        if self.cfg.sample_parallel > 1:  # halo traffic of the groups (summed over groups), rank rebuilds
            groups = {"sample_parallel_halo_bytes": mean("halo_bytes"),
                      "sample_parallel_restarts": float(sum(s["group_restarts"] for s in steps))}
        return {
            **groups,
            "train_loss": sum(s["loss_sum"] for s in steps) / max(n_bags, 1),
            "train_seconds": time.perf_counter() - start,
            "comm_bytes_up": float(up),
            "comm_bytes_down": float(down),
            "comm_dense_bytes": float(dense),
            "compression_ratio": dense / (up + down) if up + down else math.nan,
            "step_seconds": mean("step_seconds"),
            "step_overhead_seconds": mean("overhead_seconds"),
            "worker_imbalance": mean("imbalance"),
            "worker_restarts": float(self.restarts),
            "comm_bytes_per_step": (up + down) / max(len(steps), 1),
            "optimizer_steps": float(len(steps)),
        }

    def eval_model(self) -> torch.nn.Module:
        self.model.load_state_dict(ray.get(self.master.model_state.remote(), timeout=self.timeout))
        return self.model

    def state_dict(self) -> dict:
        return self.eval_model().state_dict()

    def final_metrics(self) -> dict:
        return {"worker_restarts": float(self.restarts)}

    def close(self) -> None:
        if self.cfg.sample_parallel > 1:  # the groups release their ranks and placement groups
            refs = [w.close.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout, 60.0))
        for actor in [*self.workers, self.master]:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            release(self.group)
        if self.group_prefix:  # reservations of coordinators that died without closing their group
            release_named(self.group_prefix)
