"""The base of every DPGS worker role (ranks 1..P of the group).

A worker holds a model replica (weights, floating-point buffers and, with ``downlink=gradients``, a
replica of the master's optimizer), its weight version, its error-feedback residual (inside the uplink
encoder) and a bag reader. For each step of a chunk (``ChunkPlan``) it

1. reads its bags of the step (read ahead while the previous step computed) and starts reading the next
   step's;
2. computes, per micro-batch, the gradient of the **sum** of its bags' losses with
   :meth:`Worker.bag_gradients` (the master divides by the step's bag count);
3. hands the sum to the fold's step synchronisation (``dpgs.distributed.sync.StepSync``: raw float32 at
   keep ratio 1, top-k with error feedback below), which exchanges it through the group and leaves the
   replica at the step's new version.

Before ``keep_ratio=auto``'s first decision the driver asks every worker to :meth:`Worker.rehearse` the
epoch's first step: steps 1-2 for that step only (the gradient sum is kept as :class:`Computed`), and its
codec timed on it; the step then runs from 3 at the ratio decided.

A step's contribution is kept until its exchange completes: after a failure elsewhere the same
contribution is sent again (never recomputed), so every bag counts exactly once. Randomness (dropout) of a
micro-batch is seeded from (seed, step, first bag), so a step computed again after this worker's own
restart gives the same gradient.
"""

from __future__ import annotations

import copy
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import ray
import torch

from dpgs.config import Config
from dpgs.distributed.fold import FoldStart
from dpgs.distributed.gpu_share import cap_to_share, peak_bytes, reset_peak
from dpgs.distributed.link_probe import probe_as_worker
from dpgs.distributed.messages import ChunkPlan, ChunkResult, Rehearsal, ReplicaState, StepPlan, WorkerStep
from dpgs.distributed.rendezvous import Rendezvous
from dpgs.distributed.replica import Replica
from dpgs.distributed.roles import WorkerLaunch
from dpgs.distributed.runtime import worker_resources
from dpgs.distributed.sync import Contribution, StepSync
from dpgs.distributed.transport import Channel, ChannelBroken, EmulatedLink, worker_rank
from dpgs.heap import freeze_startup_heap
from dpgs.train.evaluate import EvalProtocol, Predictions, score_bags
from dpgs.workers.reader import BagReader


@dataclass
class Computed:
    """This worker's gradient sum of step ``step`` over ``n_bags`` bags (None without bags), the sum of
    their losses and its buffers after the step's forward passes, not yet encoded; with its report."""

    step: int
    n_bags: int
    loss_sum: float
    grad: torch.Tensor | None
    buffers: torch.Tensor | None
    report: WorkerStep


@dataclass
class Pending:
    """A contribution computed for step ``part.step`` and not yet exchanged, with its report."""

    part: Contribution
    report: WorkerStep


@dataclass
class BagGradients:
    """What :meth:`Worker.bag_gradients` returns for one micro-batch of bags."""

    grad: torch.Tensor  # flat float32 CPU: sum over the bags of d loss_b / d theta (trainable order)
    losses: list[float]  # per bag
    instances: int
    halo_bytes: int = 0  # sample-parallel groups: traffic among the ranks
    group_restarts: int = 0


class Worker(ABC):
    """Base worker; subclasses build the model (:meth:`build_model`) and implement :meth:`bag_gradients`;
    :meth:`on_weights_changed` and :meth:`step_buffers` are there for workers that compute elsewhere than
    in their replica (``GroupWorker``)."""

    def __init__(self, worker: int, model_spec, config: Config, device: str = "cpu", threads: int = 1):
        torch.set_num_threads(threads)
        self.worker = worker
        self.rank = worker_rank(worker)
        self.device = torch.device(device)
        self.gpu_share = cap_to_share(worker, self.device)
        self.seed = config.seed
        self.mbps = config.dpgs.emulate_bandwidth_mbps
        self.model = self.build_model(model_spec)
        self.replica = Replica(self.model, config.train)
        self.sync: StepSync | None = None  # the fold's (FoldStart.sync)
        self.reader: BagReader | None = None  # :meth:`read_from`
        self.class_weights: torch.Tensor | None = None
        self.channel: Channel | None = None
        self.pending: Pending | None = None
        self.computed: Computed | None = None  # a step computed by :meth:`rehearse`, to encode when it runs
        self.eval_model: torch.nn.Module | None = None
        freeze_startup_heap()

    @classmethod
    def launch(cls, config: Config) -> WorkerLaunch:
        """One placement-group bundle per worker with its share of the cluster (``worker_resources``)."""
        res = worker_resources(config.dpgs, config.train.device)
        return WorkerLaunch(cpus=res.cpus, gpus=res.gpus, placed=True, threads=res.threads, device=res.device)

    # ---------------------------------------------------------------- hooks
    @abstractmethod
    def build_model(self, model_spec) -> torch.nn.Module:
        """The replica this worker holds (and, for bag workers, computes with)."""

    @abstractmethod
    def bag_gradients(self, indices: list[int], bags: list, step: StepPlan) -> BagGradients:
        """Gradient of the sum of the losses of ``bags`` (dataset ``indices``; one micro-batch of this
        worker in ``step``)."""

    def on_weights_changed(self) -> None:  # noqa: B027 - an optional hook, nothing to do by default
        """Called after the replica's weights change outside a step (fold start, resync)."""

    def step_buffers(self) -> torch.Tensor | None:
        """Floating-point buffers after this worker's forward passes (float64; None without any)."""
        return self.replica.flat_buffers()

    # ---------------------------------------------------------------- control (driver)
    def read_from(self, dataset) -> None:
        """The bags this worker reads: the run's dataset, given by the driver once the actor has started and
        again after each restart (``dpgs.distributed.actors.StartCall``: a large constructor argument would
        not survive a restart on another node)."""
        self.reader = BagReader(dataset)

    def ping(self) -> int:
        """Process id (to detect restarts, and for fault-injection tests)."""
        return os.getpid()

    def where(self) -> list[str]:
        """Where this worker runs, one line per process (the driver prints them at start-up)."""
        context = ray.get_runtime_context()
        resources = ", ".join(f"{k}={v:g}" for k, v in sorted(context.get_assigned_resources().items()))
        share = "" if self.gpu_share is None else f" {self.gpu_share.describe()}"
        return [
            f"worker {self.worker}: node={context.get_node_id()[:12]} ip={ray.util.get_node_ip_address()} "
            f"pid={os.getpid()} device={self.device} threads={torch.get_num_threads()} "
            f"resources=[{resources}]{share}"
        ]

    def close(self) -> None:  # noqa: B027 - an optional hook, nothing to do by default
        """Release what the worker holds besides itself (called before the driver kills the actor)."""

    def join(self, rendezvous: Rendezvous) -> int:
        if self.channel is not None:
            self.channel.close()
        self.channel = None
        channel = rendezvous.open(self.rank)
        self.channel = EmulatedLink(channel, self.mbps) if self.mbps else channel
        return os.getpid()

    def start_fold(self, fold: FoldStart) -> int:
        """The fold's initial weights, class weights and step synchronisation (an empty residual); the
        pending contribution is forgotten."""
        self.sync = fold.sync
        self.replica.restart(fold.model_state, with_optimizer=self.sync.worker_optimizer)
        self.class_weights = None if fold.class_weights is None else fold.class_weights.to(self.device)
        self.pending = self.computed = None
        self.on_weights_changed()
        return self.replica.version

    def resync(self, state: ReplicaState) -> int:
        """Hold exactly what the master says in-sync workers hold; a contribution to a step the master has
        already taken is dropped (it was counted), one to the next step is kept (it will be sent)."""
        self.replica.load_state(state)
        if self.pending is not None and self.pending.part.step < state.version:
            self.pending = None
        if self.computed is not None and self.computed.step < state.version:
            self.computed = None
        self.on_weights_changed()
        return self.replica.version

    def replica_state(self) -> ReplicaState:
        """What this worker holds (tests compare it with the master's)."""
        return self.replica.state(self.replica.flat_params())

    def evaluate(self, state: dict | None, indices: list[int], protocol: EvalProtocol) -> Predictions:
        """Predictions of a shard of the evaluation bags with the weights ``state``, or with the replica's
        own when None (only where replicas are exact: ``self.sync.exact_replicas``). Scored on a copy of
        the replica, so training state is untouched; tile bags stream from the slides chunk by chunk."""
        if state is None and not self.sync.exact_replicas:
            raise ValueError("this worker's replica is not the master's model: evaluation needs its weights")
        if self.eval_model is None:
            self.eval_model = copy.deepcopy(self.model)
        self.eval_model.load_state_dict(self.model.state_dict() if state is None else state)
        return score_bags(self.eval_model, self.reader.dataset, indices, protocol, self.device)

    def sync_state(self) -> dict:
        """This worker's step-synchronisation state (its error-feedback residual; checkpointed)."""
        return self.sync.state_dict()

    def load_sync_state(self, state: dict) -> None:
        self.sync.load_state_dict(state)

    def probe_link(self) -> None:
        """Answer the master's link probe (``dpgs.distributed.link_probe``)."""
        probe_as_worker(self.channel)

    # ---------------------------------------------------------------- steps
    def run_chunk(self, plan: ChunkPlan) -> ChunkResult:
        """Run the chunk's steps; stop at the first exchange that cannot complete (see ChunkResult). Once
        every step completed, score this worker's shard of ``plan.score`` with the replica."""
        result = ChunkResult(self.rank)
        for position, step in enumerate(plan.steps):
            following = plan.steps[position + 1] if position + 1 < len(plan.steps) else plan.after
            try:
                result.steps.append(self._step(step, following))
            except ChannelBroken as err:
                result.interrupted_at, result.reason = step.index, str(err)
                break
        if plan.score is not None and result.interrupted_at is None:
            result.scored = self.evaluate(None, list(plan.score.shards[self.worker]), plan.score.protocol)
        return result

    def _holds_version_of(self, step: StepPlan, asked: str) -> None:
        if step.index != self.replica.version:
            raise RuntimeError(f"worker {self.worker} holds version {self.replica.version}, "
                               f"asked to {asked} step {step.index}")

    def _step(self, step: StepPlan, following: StepPlan | None) -> WorkerStep:
        self._holds_version_of(step, "run")
        if self.pending is None or self.pending.part.step != step.index:
            ready = self.computed is not None and self.computed.step == step.index
            self.pending = self._encode(step, self.computed if ready else self._compute(step, following))
            self.computed = None
        report = self.pending.report
        received = self.sync.worker(self.channel, step, self.pending.part, self.replica)
        self.pending = None
        report.exchange_seconds, report.apply_seconds = received.exchange_seconds, received.apply_seconds
        report.down_bytes = received.down_bytes
        return report

    def rehearse(self, step: StepPlan, following: StepPlan | None, ratios: tuple[float, ...]) -> Rehearsal:
        """``keep_ratio=auto``'s first decision: compute this worker's part of ``step`` (kept: the step
        encodes it at the ratio then decided, nothing is computed twice) and time the codec on that gradient
        at each of ``ratios`` (on a copy of the codec state: the residual is untouched)."""
        self._holds_version_of(step, "rehearse")
        self.computed = self._compute(step, following)
        codec = {k: self.sync.codec_seconds(self.computed.grad, k, len(step.bags))
                 for k in ratios if k < 1.0 and self.computed.n_bags}
        return Rehearsal(self.worker, self.computed.report.compute_seconds, codec)

    def _compute(self, step: StepPlan, following: StepPlan | None) -> Computed:
        """Read and compute this worker's part of ``step``: the gradient sum over its bags."""
        micro_batches = [list(m) for m in step.bags[self.worker] if m]
        wait = time.perf_counter()
        bags = [[self.reader.take(i, step.epoch) for i in micro] for micro in micro_batches]
        if following is not None:
            self.reader.read_ahead(following.worker_bags(self.worker), following.epoch)
        start = time.perf_counter()
        total, losses, instances, halo, restarts = None, [], 0, 0, 0
        self.model.train()
        reset_peak(self.device)
        try:
            for indices, micro in zip(micro_batches, bags, strict=True):
                out = self.bag_gradients(indices, micro, step)
                total = out.grad if total is None else total.add_(out.grad)
                losses += out.losses
                instances += out.instances
                halo += out.halo_bytes
                restarts += out.group_restarts
        except torch.OutOfMemoryError as err:
            if self.gpu_share is None:
                raise
            raise self.gpu_share.exceeded(err) from err
        computed = time.perf_counter()
        n_bags = len(losses)  # without bags the residual waits for this worker's next ones
        report = WorkerStep(
            index=step.index,
            worker=self.worker,
            n_bags=n_bags,
            instances=instances,
            read_wait_seconds=start - wait,
            compute_seconds=computed - start,
            encode_seconds=0.0,
            exchange_seconds=0.0,
            apply_seconds=0.0,
            up_bytes=0,
            down_bytes=0,
            halo_bytes=halo,
            group_restarts=restarts,
            peak_device_bytes=peak_bytes(self.device),
        )
        return Computed(step.index, n_bags, sum(losses), total, self.step_buffers(), report)

    def _encode(self, step: StepPlan, computed: Computed) -> Pending:
        """This worker's message up of ``step`` at the step's keep ratio."""
        start = time.perf_counter()
        part = self.sync.contribute(step, computed.n_bags, computed.loss_sum, computed.grad, computed.buffers,
                                    self.replica)
        computed.report.encode_seconds = time.perf_counter() - start
        computed.report.up_bytes = part.up_bytes
        return Pending(part, computed.report)
