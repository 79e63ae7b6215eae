"""The trainer's engine for ``train.mode=dpgs``: one fold's epochs as chunks of steps run by the group.

At the fold's start the driver builds the fold's step synchronisation (``dpgs.distributed.sync``) and sends
it with the initial weights to every rank. Per epoch it plans every optimizer step
(:class:`~dpgs.distributed.messages.StepPlan`): the bags of each of its ``train.accumulation_steps``
micro-batches spread over the workers by length (LPT), the step's learning rate
(``dpgs.train.optim.learning_rate``) and keep ratio (``dpgs.distributed.schedule``). Steps run in chunks
that end at checkpoints (``train.checkpoint_every``) and at the epoch's end; the driver blocks only there.
Where the workers' replicas are exactly the master's model, the epoch's last chunk also has them score the
fold's validation set (``FoldSetup.validation``) once its steps are done, in the same call.
Per-step reports of the master and the workers become the epoch's MLflow metrics (:func:`epoch_metrics`):
the loss, bags and bytes from the master's, which holds every step it took even when a worker fails.
Checkpoints (``dpgs.records``) are written in single-split runs (``Config.writes_checkpoints``): a fold of
a k-fold command writes its weights files alone (``--resume`` keeps a k-fold command's finished folds).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dpgs.compression import ParamLayout
from dpgs.config import config_to_dict
from dpgs.distributed.assignment import assign_lpt, imbalance
from dpgs.distributed.failures import MasterFailure, WorkerFailure
from dpgs.distributed.flat import float_buffers
from dpgs.distributed.fold import FoldStart
from dpgs.distributed.link_probe import probe_sizes
from dpgs.distributed.messages import ChunkPlan, EpochCheckpoint, MasterStep, ShardedScoring, StepPlan
from dpgs.distributed.rank_group import ChunkReports, RankGroup
from dpgs.distributed.schedule import AutoMeasurements, ByteModel, KeepSchedule, step_compute_seconds
from dpgs.distributed.sharded_eval import evaluate_on_workers, shards_by_length
from dpgs.distributed.sync import build_sync
from dpgs.distributed.sync.contract import tail_bytes
from dpgs.records import CHECKPOINT_FILE, Checkpoint, DriverProgress
from dpgs.train.engine import EpochEnd, EpochSoFar, FoldSetup, Validation
from dpgs.train.evaluate import EvalProtocol, Predictions, score_bags
from dpgs.train.optim import learning_rate


def kfold_resume_hint(fold_dir: Path) -> str:
    """What a failure in a fold of a k-fold command (no checkpoint: ``Config.writes_checkpoints``) says."""
    return (f"a fold of a k-fold command writes no checkpoint: --resume {fold_dir.parent} keeps the folds "
            f"that finished and trains {fold_dir.name} again")


@dataclass
class DpgsProgress:
    """The DPGS engine's part of a checkpoint's :class:`~dpgs.records.DriverProgress`: the worker restarts
    so far (``dpgs.max_worker_restarts`` counts on from them), the steady keep ratio (``keep_ratio=auto``'s
    last choice; None in a checkpoint that has none), the fold's first compressed epoch
    (``second_moment=auto`` freezes Adam's second moment from it; None: none yet) and, within an epoch,
    what the steps whose reports reached the driver added to the epoch's metrics (``so_far``)."""

    worker_restarts: int
    keep_ratio: float | None
    first_compressed_epoch: int | None
    so_far: EpochSoFar = EpochSoFar()

    def to_file(self) -> dict:
        return {"worker_restarts": self.worker_restarts, "keep_ratio": self.keep_ratio,
                "first_compressed_epoch": self.first_compressed_epoch, "epoch_so_far": self.so_far.to_file()}

    @classmethod
    def from_file(cls, engine: dict) -> DpgsProgress:
        ratio = engine.get("keep_ratio")
        return cls(int(engine.get("worker_restarts", 0)), None if ratio is None else float(ratio),
                   engine.get("first_compressed_epoch"), EpochSoFar.from_file(engine.get("epoch_so_far")))


@dataclass
class EngineHooks:
    """Fault-injection point for tests: ``after_chunk(engine, epoch, step_in_epoch)`` after each chunk."""

    after_chunk: Any = None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def epoch_so_far(steps: list[MasterStep], before: EpochSoFar) -> EpochSoFar:
    """``before`` (what the epoch's earlier steps added to its metrics) and the master's reports ``steps``
    (in step order): their loss, summed on from ``before``'s, their bags, their count and their bytes."""
    return EpochSoFar(
        sum((s.loss_sum for s in steps), start=before.loss_sum),
        before.bags + sum(s.n_bags for s in steps),
        before.steps + len(steps),
        before.up_bytes + sum(s.up_bytes for s in steps),
        before.down_bytes + sum(s.down_bytes for s in steps),
        before.dense_bytes + sum(s.dense_bytes for s in steps),
    )


def epoch_metrics(reports: ChunkReports, totals: EpochSoFar | None = None) -> dict[str, float]:
    """The epoch's DPGS metrics from the ranks' per-step reports (names: docs/architecture.md); the loss,
    step and byte counts are ``totals``, the epoch's (its steps before a resume included; None: those of
    ``reports``' master steps, :func:`epoch_so_far`).

    Per step: compute = the slowest worker's forward/backward, overhead = step time - compute; phases are
    the slowest worker's (or the master's) seconds, averaged over steps (those after a resume).
    """
    epoch = totals if totals is not None else epoch_so_far(reports.master, EpochSoFar())
    by_step: dict[int, list] = defaultdict(list)
    for report in reports.workers:
        by_step[report.index].append(report)
    master = sorted(reports.master, key=lambda m: m.index)
    up, down, dense = epoch.up_bytes, epoch.down_bytes, epoch.dense_bytes
    slowest = lambda key: _mean(
        [max((getattr(r, key) for r in by_step[m.index]), default=0.0) for m in master]
    )
    compute = {m.index: max((r.compute_seconds for r in by_step[m.index]), default=0.0) for m in master}
    metrics = {
        "train_loss": epoch.loss_sum / max(epoch.bags, 1),
        "comm_bytes_up": float(up),
        "comm_bytes_down": float(down),
        "comm_dense_bytes": float(dense),
        "compression_ratio": dense / (up + down) if up + down else math.nan,
        "comm_bytes_per_step": (up + down) / max(epoch.steps, 1),
        "step_seconds": _mean([m.step_seconds for m in master]),
        "step_overhead_seconds": _mean([m.step_seconds - compute[m.index] for m in master]),
        "worker_imbalance": _mean([imbalance([r.compute_seconds for r in by_step[m.index]]) for m in master]),
        "optimizer_steps": float(epoch.steps),
        "time_read_wait_seconds": slowest("read_wait_seconds"),
        "time_compute_seconds": slowest("compute_seconds"),
        "time_encode_seconds": slowest("encode_seconds"),
        "time_exchange_seconds": slowest("exchange_seconds"),
        "time_apply_seconds": slowest("apply_seconds"),
        "time_master_wait_seconds": _mean([m.wait_seconds for m in master]),
        "time_master_decode_seconds": _mean([m.decode_seconds for m in master]),
        "time_master_optimizer_seconds": _mean([m.optimizer_seconds for m in master]),
        "time_master_encode_seconds": _mean([m.encode_seconds for m in master]),
    }
    if any(r.halo_bytes or r.group_restarts for r in reports.workers):
        metrics["sample_parallel_halo_bytes"] = sum(r.halo_bytes for r in reports.workers) / max(
            len(master), 1
        )
        metrics["sample_parallel_restarts"] = float(sum(r.group_restarts for r in reports.workers))
    if any(r.peak_device_bytes for r in reports.workers):
        metrics["worker_peak_device_mib"] = max(r.peak_device_bytes for r in reports.workers) / float(1 << 20)
    return metrics


class DpgsEngine:
    """One fold on ``group`` (see the module docstring); ``measured``: what ``keep_ratio=auto`` measured in
    the command's earlier folds (the session's, added to by this fold), or None to measure afresh."""

    def __init__(self, group: RankGroup, setup: FoldSetup, measured: AutoMeasurements | None = None):
        self.group = group
        self.config = setup.config
        self.cfg = setup.config.dpgs
        self.model = setup.model  # driver copy, for evaluation of a shard whose worker failed
        self.device = setup.device
        self.lengths = setup.dataset.lengths()
        self.eval_dataset = setup.eval_dataset
        self.eval_lengths = setup.eval_dataset.lengths()  # every instance (eval datasets do not sample)
        self.out_dir = Path(setup.output_dir).resolve()  # the master writes there, from another directory
        # where the master writes the checkpoint; None where no --resume can continue the run (none written)
        self.checkpoint_path = self.out_dir / CHECKPOINT_FILE if setup.config.writes_checkpoints else None
        self.hooks = EngineHooks()
        self.global_step = 0  # the master's version
        self.skip_steps = 0  # steps of the first epoch already done before a resume
        self.so_far = EpochSoFar()  # what they added to that epoch's metrics
        self.restarts_before = group.restarts
        self.measured = AutoMeasurements() if measured is None else measured
        self.keep = KeepSchedule(self.cfg.compression, self.measured)
        if self.measured.bytes is None:
            layout = ParamLayout.from_module(setup.model)
            buffers = sum(b.numel() for b in float_buffers(setup.model))
            self.measured.bytes = ByteModel.of(self.cfg.compression, layout, buffers, len(group.workers))
        self.rehearsed_step: int | None = None  # computed before its chunk (its step time lacks its compute)
        sync = build_sync(setup.config, setup.model)
        self.replicas_exact = sync.exact_replicas
        # scored by the workers with the epoch's last chunk (on exact replicas: their own weights)
        self.validation = setup.validation if sync.exact_replicas else None
        self.validated: Predictions | None = None  # the validation set scored with the current weights
        fold = FoldStart(setup.output_dir.name, setup.model.state_dict(), setup.class_weights, sync)
        group.start_fold(fold)

    @property
    def restarts(self) -> int:
        return self.group.restarts - self.restarts_before

    # ------------------------------------------------------------------ planning
    def _assign(self, batch: list[int]) -> list[tuple[int, ...]]:
        """Bags of ``batch`` per worker (LPT on bag lengths)."""
        plan = assign_lpt([self.lengths[i] for i in batch], len(self.group.workers))
        return [tuple(batch[p] for p in positions) for positions in plan]

    def plan_epoch(self, batches: list[list[int]], epoch: int) -> list[StepPlan]:
        """Every optimizer step of ``epoch``: ``accumulation_steps`` batches each (the last: what is left)."""
        train = self.config.train
        per_step = train.accumulation_steps
        steps = math.ceil(len(batches) / per_step)
        first = self.global_step - self.skip_steps
        plans = []
        for s in range(steps):
            micro = [self._assign(batch) for batch in batches[s * per_step : (s + 1) * per_step]]
            bags = tuple(tuple(m[w] for m in micro) for w in range(len(self.group.workers)))
            plans.append(
                StepPlan(
                    index=first + s,
                    epoch=epoch,
                    step_in_epoch=s,
                    bags=bags,
                    lr=learning_rate(train, epoch, s, steps),
                    keep_ratio=self.keep.ratio(epoch),
                )
            )
        return plans

    def _chunks(self, plans: list[StepPlan]) -> list[list[StepPlan]]:
        """Consecutive steps up to each checkpoint (``train.checkpoint_every`` global steps) or the end."""
        every = self.config.train.checkpoint_every
        chunks, current = [], []
        for plan in plans:
            current.append(plan)
            if every and (plan.index + 1) % every == 0:
                chunks.append(current)
                current = []
        return chunks + ([current] if current else [])

    # ------------------------------------------------------------------ epochs
    def run_epoch(self, batches: list[list[int]], epoch: int, history: list[dict]) -> dict:
        """Run the epoch's steps (skipping those done before a resume); returns the epoch's metrics."""
        start = time.perf_counter()
        self.validated = None
        plans = self.plan_epoch(batches, epoch)
        todo = plans[self.skip_steps :]
        reports, totals, self.so_far = ChunkReports(), self.so_far, EpochSoFar()
        figures = {}
        if self.keep.auto and todo:
            todo, figures = self._choose_keep_ratio(todo, plans, epoch)
        if todo:
            todo = self._second_moment(todo, epoch)
        for chunk in self._chunks(todo):
            totals = self._run_chunk(chunk, plans, epoch, history, reports, totals)
        if self.validation is not None and len(reports.scored) == len(self.group.workers):
            self.validated = Predictions.merge(list(reports.scored.values()), list(self.validation.indices))
        self.skip_steps = 0
        # the trainer's next asks, answered during validation: the checkpoint's residuals (a single-split
        # run's), the weights for validation on inexact replicas
        self.group.ask_state(weights=not self.replicas_exact, sync_states=self.checkpoint_path is not None)
        if self.keep.auto:
            self._measured(reports, todo)
        metrics = epoch_metrics(reports, totals)
        metrics["train_seconds"] = time.perf_counter() - start
        metrics["worker_restarts"] = float(self.restarts)
        metrics["second_moment_frozen"] = float(self.keep.frozen_since is not None)  # Adam's v, this epoch
        return {**metrics, **figures}

    def _run_chunk(self, chunk: list[StepPlan], plans: list[StepPlan], epoch: int, history: list[dict],
                   reports: ChunkReports, totals: EpochSoFar) -> EpochSoFar:
        """Run ``chunk`` (steps of ``plans``) on the group, adding its reports; checkpoint after it. Returns
        ``totals`` (what the epoch's steps before the chunk added to its metrics) with the chunk's steps
        added: each chunk's reports are summed once, in the epoch's order. When workers fail past the
        restart limit, the checkpoint holds the steps the master took of the chunk, with their metrics."""
        following = plans[chunk[-1].step_in_epoch + 1] if chunk[-1].step_in_epoch + 1 < len(plans) else None
        score = None
        if following is None and self.validation is not None:  # the epoch's last chunk
            validation, workers = self.validation, len(self.group.workers)
            shards = shards_by_length(list(validation.indices), self.eval_lengths, workers)
            score = ShardedScoring(tuple(tuple(s) for s in shards), validation.protocol)
        done = ChunkReports()
        try:
            self.group.run(ChunkPlan(tuple(chunk), following, score), done)
        except WorkerFailure as err:
            if self.checkpoint_path is None:
                raise WorkerFailure(f"{err}; {kfold_resume_hint(self.out_dir)}") from err
            # the master reported every step it took (its version): their loss and bytes resume with them
            totals = epoch_so_far(done.master, totals)
            path = self.checkpoint(epoch, self.group.version() - plans[0].index, history, totals)
            raise WorkerFailure(f"{err}; checkpoint written to {path} (resume with --resume)") from err
        except MasterFailure as err:
            path = self.checkpoint_path
            if path is None:
                last = kfold_resume_hint(self.out_dir)
            elif path.is_file():
                last = f"resume from {path} with --resume"
            else:
                last = "no checkpoint was written yet"
            raise type(err)(f"{err}; {last}") from err  # a ClusterLost stays one
        reports.master += done.master
        reports.workers += done.workers
        reports.scored.update(done.scored)
        totals = epoch_so_far(done.master, totals)
        self.global_step = chunk[-1].index + 1
        step_in_epoch = chunk[-1].step_in_epoch + 1
        if self.hooks.after_chunk is not None:
            self.hooks.after_chunk(self, epoch, step_in_epoch)
        if self.config.train.checkpoint_every and step_in_epoch < len(plans):
            self.checkpoint(epoch, step_in_epoch, history, totals)
        return totals

    # ------------------------------------------------------------------ keep_ratio=auto
    def _choose_keep_ratio(self, todo: list[StepPlan], plans: list[StepPlan], epoch: int
                           ) -> tuple[list[StepPlan], dict]:
        """Decide the epoch's ratio before its first step. Without a compute measurement yet (the command's
        first epoch, or after a resume; later folds start from the earlier ones'), the workers compute that
        step first, kept for it, and time their codec (``RankGroup.rehearse``; ``dpgs.distributed.schedule``).
        The links are probed unless no probe could change a dense choice. Returns the epoch's steps at the
        ratio decided, and the figures."""
        measured = self.measured
        if measured.compute_seconds is None:
            first = todo[0]
            following = plans[first.step_in_epoch + 1] if first.step_in_epoch + 1 < len(plans) else None
            rehearsals = self.group.rehearse(first, following, self.keep.rehearsal_ratios())
            self.rehearsed_step = first.index
            measured.compute_seconds = max(r.compute_seconds for r in rehearsals)
            timed = {k for r in rehearsals for k in r.codec_seconds}
            slowest = {k: max(r.codec_seconds.get(k, 0.0) for r in rehearsals) for k in timed}
            self.keep.costs.rehearsed(slowest)
        probed, note = False, " (measured on its steps; the links were not probed)"
        if self.keep.dense_is_settled(measured.compute_seconds):
            decision, link_figures = self.keep.keep_dense(measured.compute_seconds), {}
        else:
            sizes = probe_sizes(4 * measured.bytes.numel)
            link, probed = measured.links.latest(lambda: self.group.probe_links(sizes))
            note = "" if probed else f" ({measured.links.standing()})"
            decision = self.keep.decide(link, measured.compute_seconds, measured.bytes)
            link_figures = link.metrics()
        ratio = self.keep.ratio(epoch)
        print(
            f"[dpgs] epoch {epoch}: keep_ratio=auto chose {decision.ratio:g} (this epoch {ratio:g}): compute "
            f"{decision.compute_seconds:.3f} s/step, dense exchange {decision.dense_exchange_seconds:.3f} s, "
            f"at {decision.ratio:g} {decision.exchange_seconds:.3f} s" + note,
            flush=True,
        )
        figures = {**decision.metrics(), **link_figures, "auto_links_probed": float(probed)}
        return [replace(p, keep_ratio=ratio) for p in todo], figures

    def _second_moment(self, todo: list[StepPlan], epoch: int) -> list[StepPlan]:
        """The epoch's steps marked with whether they freeze Adam's second moment (``KeepSchedule``); the
        decision of ``second_moment=auto`` is printed when it is taken."""
        undecided = self.keep.freezes is None
        frozen = self.keep.second_moment_frozen(epoch, todo[0].keep_ratio)
        if undecided and self.keep.freezes is not None:
            why = ("every step before it was dense" if frozen else
                   "the fold's first epoch is compressed: Adam's second moment never settled on dense steps")
            print(f"[dpgs] epoch {epoch}: second_moment=auto: {'frozen' if frozen else 'live'} ({why})",
                  flush=True)
        return [replace(p, frozen_second_moment=frozen) for p in todo]

    def _measured(self, reports: ChunkReports, steps: list[StepPlan]) -> None:
        """Remember the epoch's compute per step, its step costs per keep ratio and, from its compressed
        steps, the payload bytes per sent entry (the next decision's inputs)."""
        if reports.workers:
            self.measured.compute_seconds = step_compute_seconds(reports.workers)
        keep = {p.index: p.keep_ratio for p in steps}
        # the rehearsed step's time on the master holds no compute: its exchange would look free
        self.keep.costs.observe({i: k for i, k in keep.items() if i != self.rehearsed_step} or keep,
                                reports.workers, reports.master)
        tail = tail_bytes(self.measured.bytes.buffers)
        sparse = [(keep[r.index], r.up_bytes - tail) for r in reports.workers
                  if r.n_bags and keep.get(r.index, 1.0) < 1.0]
        if sparse:
            ratio = min(k for k, _ in sparse)
            sizes = [b for k, b in sparse if k == ratio]
            self.measured.bytes = self.measured.bytes.calibrated(ratio, sum(sizes) / len(sizes))

    # ------------------------------------------------------------------ state
    def _driver_state(self, epoch: int, step_in_epoch: int, history: list[dict],
                      so_far: EpochSoFar) -> DriverProgress:
        """The driver's part of a checkpoint: its progress (resume before ``step_in_epoch`` of ``epoch``,
        whose steps before it added ``so_far`` to the epoch's metrics)."""
        progress = DpgsProgress(self.restarts, self.keep.steady, self.keep.first_compressed, so_far)
        return DriverProgress(epoch, step_in_epoch, history, config_to_dict(self.config), progress.to_file())

    def checkpoint(self, epoch: int, step_in_epoch: int, history: list[dict], so_far: EpochSoFar) -> Path:
        """Master state, workers' residuals and the driver's progress, written before this returns."""
        driver = self._driver_state(epoch, step_in_epoch, history, so_far)
        return Path(self.group.save_checkpoint(str(self.checkpoint_path), driver))

    def save_epoch(self, end: EpochEnd) -> None:
        """The master writes the weights files and the checkpoint that resumes at epoch ``end.epoch + 1``
        (a fold of a k-fold command: the weights files alone) while the driver goes on
        (``RankGroup.save_epoch``): per epoch, the weights no longer travel to the driver, and the writes
        overlap the driver's logging and the workers' first step (a large state's, the next chunk:
        ``Master.save_epoch``)."""
        files = [str(Path(p).resolve()) for p in end.weights_files]  # the master runs in another directory
        checkpoint = None
        if self.checkpoint_path is not None:
            driver = self._driver_state(end.epoch + 1, 0, end.history, EpochSoFar())
            checkpoint = EpochCheckpoint(str(self.checkpoint_path), driver)
        self.group.save_epoch(files, checkpoint)

    def wait_saved(self) -> None:
        self.group.wait_saved()

    def restore(self, checkpoint: Checkpoint) -> DriverProgress:
        """Continue from ``checkpoint``; returns its driver part (epoch, step in epoch, history)."""
        driver = checkpoint.driver
        progress = DpgsProgress.from_file(driver.engine)
        self.validated = None
        self.global_step = self.group.restore(checkpoint)
        self.skip_steps = driver.step_in_epoch
        self.so_far = progress.so_far
        self.restarts_before = self.group.restarts - progress.worker_restarts
        if progress.keep_ratio is not None:
            self.keep.steady = progress.keep_ratio
        self.keep.first_compressed = progress.first_compressed_epoch
        return driver

    def evaluate(self, indices: list[int], protocol: EvalProtocol, state: dict | None = None) -> Predictions:
        """Scored on the workers, shards balanced by the bags' instance counts (module docstring). Without
        ``state`` (the current weights), workers whose replicas are exactly the master's model (dense and
        ``downlink=gradients``) score with their own; otherwise the master's weights are sent to them. The
        fold's validation set (``FoldSetup.validation``) with the current weights was already scored, on
        exact replicas, by the workers at the end of the epoch's last chunk: those predictions."""
        if (state is None and self.validated is not None
                and Validation(tuple(indices), protocol) == self.validation):
            return self.validated
        if state is None and not self.replicas_exact:
            state = self.group.model_state()

        def on_driver(shard: list[int]) -> Predictions:
            self.model.load_state_dict(self.group.model_state() if state is None else state)
            return score_bags(self.model, self.eval_dataset, shard, protocol, self.device)

        return evaluate_on_workers(self.group.workers, state, list(indices), protocol, self.eval_lengths,
                                   on_driver)

    def state_dict(self) -> dict:
        return self.group.model_state()

    def final_metrics(self) -> dict:
        return {"worker_restarts": float(self.restarts)}

    def close(self) -> None:
        """Nothing to release per fold: the session's group serves every fold."""
