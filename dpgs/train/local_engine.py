"""The single-process engine: every non-distributed mode (classic, padding, sampling, packed).

Gradient accumulation over ``accumulation_steps`` batches back-propagates ``loss / accumulation_steps``
and zeroes gradients only after the optimizer step that consumed them. A partial accumulation window at
the end of an epoch is rescaled to the mean over the batches it holds and applied.

A single-split run writes ``checkpoint.pt`` at every epoch's end, and within an epoch after every
``train.checkpoint_every``-th optimizer step of the run (``dpgs.records``' format, the process in the
master's place: its weights, optimizer and steps taken; no step synchronisation, no workers). The driver's
part also holds the random states that the next step draws from: torch's default generator (dropout; on
CUDA the device's too) and the generator of ``train.mode=sampling``; within an epoch also what its steps
so far added to its metrics (:class:`~dpgs.train.engine.EpochSoFar`), so the resumed epoch's
``train_loss`` and ``optimizer_steps`` are the uninterrupted one's. Batches, learning rates and tile
samples follow from the seed and the epoch, so a run resumed from the checkpoint skips the epoch's
batches of the steps already taken and takes the steps an uninterrupted run takes, bit for bit on the
same machine. A checkpoint is written only after an optimizer step, where no gradient of an
accumulation window is pending.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dpgs.config import config_to_dict
from dpgs.config.schema import TrainConfig
from dpgs.data import Prefetcher
from dpgs.modeling import input_to
from dpgs.outputs import save_torch_atomically
from dpgs.records import CHECKPOINT_FILE, Checkpoint, DriverProgress, MasterCheckpoint, save_checkpoint
from dpgs.train.engine import EpochEnd, EpochSoFar, FoldSetup
from dpgs.train.evaluate import EvalProtocol, Predictions, score_bags
from dpgs.train.optim import build_optimizer, clip_coefficient, grad_norm, learning_rate, optimizer_step
from dpgs.train.steps import batch_loss, check_mode_supported


@dataclass(frozen=True)
class CheckpointTarget:
    """Where a run's epoch-end checkpoint goes, and the run's config that it records (what ``--resume``
    compares its own config with, ``dpgs.train.resume_check``)."""

    path: Path
    config: dict


@dataclass
class RandomStates:
    """What the next step draws from. ``cpu``: torch's default generator (dropout); ``sampling``: the bag
    sampler of ``train.mode=sampling``; ``cuda``: the training device's generator (None on the CPU)."""

    cpu: torch.Tensor
    sampling: torch.Tensor
    cuda: torch.Tensor | None = None

    @classmethod
    def of(cls, device: torch.device, sampling: torch.Generator) -> RandomStates:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), sampling.get_state(), cuda)

    def restore(self, device: torch.device, sampling: torch.Generator) -> None:
        """Set the generators to these states (a run resumed on another device draws afresh there)."""
        torch.set_rng_state(self.cpu)
        sampling.set_state(self.sampling)
        if device.type == "cuda" and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)


@dataclass
class LocalProgress:
    """The single-process engine's part of a checkpoint's :class:`~dpgs.records.DriverProgress`: the random
    states, and what the epoch's steps already taken added to its metrics (nothing at an epoch's start)."""

    random: RandomStates
    so_far: EpochSoFar = EpochSoFar()

    def to_file(self) -> dict:
        r = self.random
        return {"rng": {"cpu": r.cpu, "sampling": r.sampling, "cuda": r.cuda},
                "epoch_so_far": self.so_far.to_file()}

    @classmethod
    def from_file(cls, engine: dict) -> LocalProgress:
        rng = engine["rng"]
        return cls(RandomStates(rng["cpu"], rng["sampling"], rng.get("cuda")),
                   EpochSoFar.from_file(engine.get("epoch_so_far")))


class LocalSession:
    """Single-process modes: a fresh :class:`LocalEngine` per fold, nothing held between folds."""

    def engine(self, setup: FoldSetup) -> LocalEngine:
        cfg = setup.config
        target = None
        if cfg.writes_checkpoints:
            target = CheckpointTarget(setup.output_dir / CHECKPOINT_FILE, config_to_dict(cfg))
        return LocalEngine(setup.model, cfg.train, setup.device, setup.class_weights, cfg.seed, setup.dataset,
                           cfg.data.prefetch, setup.eval_dataset, target)

    def close(self) -> None:
        """Nothing to release."""


class LocalEngine:
    """Trains ``model`` in-process on batches of loaded bags; writes ``checkpoint`` (when given) at every
    epoch's end and every ``train.checkpoint_every`` optimizer steps (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        device: torch.device,
        class_weights: torch.Tensor | None,
        seed: int,
        dataset,
        prefetch: int = 2,
        eval_dataset=None,
        checkpoint: CheckpointTarget | None = None,
    ):
        check_mode_supported(model, cfg.mode)
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        self.class_weights = None if class_weights is None else class_weights.to(device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg)
        self.sample_gen = torch.Generator().manual_seed(seed)
        self.dataset = dataset
        self.eval_dataset = dataset if eval_dataset is None else eval_dataset
        self.prefetch = prefetch
        self.checkpoint = checkpoint
        self.pending = 0  # batches back-propagated since the last optimizer step
        self.steps = 0
        self.lr = cfg.lr  # learning rate of the next optimizer step
        self.so_far = EpochSoFar()  # the next epoch's steps taken before a resume

    def _apply(self) -> None:
        if self.pending == 0:
            return
        if self.pending != self.cfg.accumulation_steps:
            scale = self.cfg.accumulation_steps / self.pending
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        clip = clip_coefficient(grad_norm(self.params), self.cfg.grad_clip) if self.cfg.grad_clip else 1.0
        optimizer_step(self.optimizer, self.params, self.lr, clip)
        self.pending = 0
        self.steps += 1

    def train_batch(self, bags: list) -> tuple[float, int]:
        """Back-propagate one batch; step when the accumulation window is full. Returns (loss sum, B)."""
        features = [input_to(self.model, b.features, self.device) for b in bags]
        labels = torch.tensor([b.label for b in bags], device=self.device)
        out = batch_loss(
            self.model,
            features,
            labels,
            self.cfg.mode,
            self.class_weights,
            self.cfg.sample_size,
            self.sample_gen,
        )
        (out["loss"] / self.cfg.accumulation_steps).backward()
        self.pending += 1
        if self.pending == self.cfg.accumulation_steps:
            self._apply()
        return float(out["loss"].detach()) * len(bags), len(bags)

    def run_epoch(self, batches: list[list[int]], epoch: int, history: list[dict] | None = None) -> dict:
        """Train on every batch of bag indices (loaded ahead in a background thread), from the first batch
        of the first step not taken before a resume; write a checkpoint after every
        ``train.checkpoint_every``-th optimizer step of the run that does not end the epoch (with
        ``history``, the finished epochs' rows).

        Returns ``train_loss`` (mean per bag of the epoch), ``train_seconds`` and ``optimizer_steps`` (the
        epoch's, those before a resume included).
        """
        self.model.train()
        accumulate, every = self.cfg.accumulation_steps, self.cfg.checkpoint_every
        done, self.so_far = self.so_far, EpochSoFar()
        total, count = done.loss_sum, done.bags
        first = done.steps * accumulate  # the first batch still to train
        steps_before = self.steps - done.steps
        start = time.perf_counter()
        steps_per_epoch = math.ceil(len(batches) / accumulate)
        # tiles: the epoch's sample of each bag (the same whichever batches are skipped)
        loaded = Prefetcher(self.dataset, batches[first:], depth=self.prefetch, epoch=epoch)
        for b, bags in enumerate(tqdm(loaded, total=len(batches), initial=first, desc=f"epoch {epoch}",
                                      leave=False, disable=None), start=first):
            self.lr = learning_rate(self.cfg, epoch, b // accumulate, steps_per_epoch)
            loss_sum, n = self.train_batch(bags)
            total += loss_sum
            count += n
            stepped = self.pending == 0
            if stepped and every and self.steps % every == 0 and b + 1 < len(batches):
                so_far = EpochSoFar(total, count, self.steps - steps_before)
                self._save_within(epoch, history or [], LocalProgress(
                    RandomStates.of(self.device, self.sample_gen), so_far))
        self._apply()
        return {
            "train_loss": total / max(count, 1),
            "train_seconds": time.perf_counter() - start,
            "optimizer_steps": float(self.steps - steps_before),
        }

    def _save_within(self, epoch: int, history: list[dict], progress: LocalProgress) -> None:
        """The checkpoint that continues ``epoch`` after the steps of ``progress.so_far``."""
        if self.checkpoint is None:
            return
        master = MasterCheckpoint(self.model.state_dict(), self.optimizer.state_dict(), self.steps, sync={})
        driver = DriverProgress(epoch, progress.so_far.steps, history, self.checkpoint.config,
                                progress.to_file())
        save_checkpoint(self.checkpoint.path, master, driver, workers=[])

    def evaluate(self, indices: list[int], protocol: EvalProtocol, state: dict | None = None) -> Predictions:
        """On this process: one shard holding every bag (``state``: scored on a copy of the model)."""
        model = self.model
        if state is not None:
            model = copy.deepcopy(self.model)
            model.load_state_dict(state)
        return score_bags(model, self.eval_dataset, indices, protocol, self.device)

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def save_epoch(self, end: EpochEnd) -> None:
        """The weights files, then the checkpoint that resumes at epoch ``end.epoch + 1`` (module
        docstring), each written atomically before this returns."""
        weights = self.model.state_dict()
        for path in end.weights_files:
            save_torch_atomically(weights, path)
        if self.checkpoint is None:
            return
        master = MasterCheckpoint(weights, self.optimizer.state_dict(), self.steps, sync={})
        progress = LocalProgress(RandomStates.of(self.device, self.sample_gen))
        driver = DriverProgress(end.epoch + 1, 0, end.history, self.checkpoint.config, progress.to_file())
        save_checkpoint(self.checkpoint.path, master, driver, workers=[])

    def wait_saved(self) -> None:
        """Nothing is pending: :meth:`save_epoch` writes before it returns."""

    def restore(self, checkpoint: Checkpoint) -> DriverProgress:
        """Continue from ``checkpoint`` (written at an epoch's end or within one): weights, optimizer, steps
        taken, the random states, and within an epoch the steps to skip and the loss summed so far; returns
        its driver part."""
        self.model.load_state_dict(checkpoint.master.model)
        self.optimizer.load_state_dict(checkpoint.master.optimizer)
        self.steps = checkpoint.master.step
        progress = LocalProgress.from_file(checkpoint.driver.engine)
        progress.random.restore(self.device, self.sample_gen)
        self.so_far = progress.so_far
        return checkpoint.driver

    def final_metrics(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing to release in-process."""
