"""The DPGS master role (rank 0 of the group): the parameters, the optimizer and the step count.

The driver runs it as a Ray actor on its own node. Per step it receives every worker's gradient message,
forms the mini-batch gradient

    g = (1 / B) * sum_w g_w,    B = number of bags in the step,

(``g_w``: worker w's sum of per-bag loss gradients), which is the gradient of the mean per-bag loss over
the B bags whatever their lengths and however they were spread, steps its optimizer and sends the update
(the fold's :class:`~dpgs.distributed.sync.StepSync`). It is the authority the workers are resynchronised
from after a failure, and what checkpoints save and evaluation reads.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor

import ray
import torch

from dpgs.config import Config
from dpgs.distributed.actors import answers_or_none
from dpgs.distributed.fold import FoldStart
from dpgs.distributed.link_probe import LinkProbe, probe_as_master
from dpgs.distributed.messages import ChunkPlan, ChunkResult, EpochCheckpoint, ReplicaState
from dpgs.distributed.rendezvous import Rendezvous, host_store
from dpgs.distributed.replica import Replica
from dpgs.distributed.sync import StepSync, UpdateNotSent, step_bounds
from dpgs.distributed.transport import JOIN_TIMEOUT_S, MASTER_RANK, Channel, ChannelBroken
from dpgs.heap import freeze_startup_heap
from dpgs.outputs import save_torch_atomically
from dpgs.records import DriverProgress, MasterCheckpoint, save_checkpoint

BACKGROUND_WRITE_BYTES = 64 << 20
"""A master state (weights, optimizer, step synchronisation) of at least this many bytes writes an epoch's
files on a thread while the next chunk runs; a smaller one writes them before the chunk. Measured on the
lab: with the ResNet-18 tile model (a 0.14 GB state, 0.3 GB of files with the workers' residuals), each
epoch after the first spent 1.0-1.5 s of its training outside its steps while the master wrote before the
chunk, 0.2-0.4 s with the thread. An ABMIL head's files take ~15 ms, and writing them on a thread made the
MUSK1 k-fold command slower (126-128 s against 114-116 s: ``torch.save`` holds Python's lock while the
master's short steps wait for it)."""


def tensor_bytes(state) -> int:
    """Bytes of the tensors in a nested state (mappings, sequences, dataclass fields)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    if dataclasses.is_dataclass(state):
        return sum(tensor_bytes(getattr(state, f.name)) for f in dataclasses.fields(state))
    return 0


class Master:
    def __init__(self, model_spec, config: Config, threads: int = 1):
        torch.set_num_threads(threads)  # the workers' count: replica optimizer steps are then bit-identical
        self.replica = Replica(model_spec.build(), config.train)
        self.sync: StepSync | None = None
        self.channel: Channel | None = None
        self.store = None  # the next gloo group's store: served from :meth:`address` until :meth:`join`
        self.timeout = config.dpgs.call_timeout_s
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpgs-epoch-files")
        self.writing: Future | None = None  # an epoch's files being written (:meth:`save_epoch`)
        freeze_startup_heap()

    # ---------------------------------------------------------------- the group
    def address(self) -> tuple[str, int]:
        """Serve the next gloo group's rendezvous store in this process from now on; where it listens."""
        self.store = host_store(JOIN_TIMEOUT_S)
        return self.store.host, self.store.port

    def join(self, rendezvous: Rendezvous) -> int:
        if self.channel is not None:
            self.channel.close()
        self.channel = None
        store, self.store = self.store, None  # one group's: a later generation is served anew
        self.channel = rendezvous.open(MASTER_RANK, store)
        return os.getpid()

    # ---------------------------------------------------------------- folds and state
    def start_fold(self, fold: FoldStart) -> int:
        self.sync = fold.sync
        self.replica.restart(fold.model_state, with_optimizer=True)
        self.sync.restart(self.replica)
        return self.replica.version

    def replica_state(self) -> ReplicaState:
        """What every in-sync worker holds now."""
        return self.replica.state(self.sync.held(self.replica))

    def version(self) -> int:
        return self.replica.version

    def model_state(self) -> dict:
        return self.replica.model.state_dict()

    # ---------------------------------------------------------------- steps
    def run_chunk(self, plan: ChunkPlan) -> ChunkResult:
        """Run the chunk's steps; on a broken exchange, release the live workers and report where it
        stopped (the step that did not complete; None when every step of the chunk completed)."""
        result = ChunkResult(MASTER_RANK)
        for position, step in enumerate(plan.steps):
            if step.index != self.replica.version:
                raise RuntimeError(
                    f"master holds version {self.replica.version}, asked to run step {step.index}"
                )
            try:
                result.steps.append(self.sync.master(self.channel, step, self.replica))
            except UpdateNotSent as err:
                result.steps.append(err.taken)  # taken: its bags, loss and bytes count
                return self._stopped(result, plan, position, err)
            except ChannelBroken as err:
                return self._stopped(result, plan, position, err)
        return result

    def _stopped(self, result: ChunkResult, plan: ChunkPlan, position: int, err: ChannelBroken
                 ) -> ChunkResult:
        """``result`` of a chunk whose exchange of step ``plan.steps[position]`` broke. Not stepped: the live
        workers wait for this step's update. Stepped (sending failed): the live workers took the step and,
        unless it was the chunk's last, send their next part."""
        stepped = self.replica.version > plan.steps[position].index
        more = position + 1 < len(plan.steps)
        if not stepped or more:
            drained = step_bounds(plan.steps[position + 1], self.replica).up if stepped else None
            self.channel.abort(drain=stepped, bound=drained)
        result.interrupted_at = self.replica.version if not stepped or more else None
        result.reason = str(err)
        return result

    def probe_link(self, sizes: tuple[int, int]) -> LinkProbe:
        """Time a probe exchange with every worker (``dpgs.distributed.link_probe``)."""
        return probe_as_master(self.channel, sizes)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> MasterCheckpoint:
        """Everything a resume needs from the master (the learning rate is a function of the step)."""
        return MasterCheckpoint(
            model=self.replica.model.state_dict(),
            optimizer=self.replica.optimizer.state_dict(),
            step=self.replica.version,
            sync=self.sync.state_dict(),
        )

    def load_state_dict(self, state: MasterCheckpoint) -> int:
        self.replica.model.load_state_dict(state.model)
        self.replica.load_optimizer(state.optimizer)
        self.replica.version = state.step
        self.sync.load_state_dict(state.sync)
        return self.replica.version

    def save_checkpoint(self, path: str, driver: DriverProgress, workers: list) -> str:
        """Write the run's checkpoint (``dpgs.records``) to ``path`` atomically; ``workers``: each worker's
        step-synchronisation state (its error-feedback residual). An epoch's files still being written
        are written first, so an older checkpoint never replaces this one."""
        self.saved()
        return str(save_checkpoint(path, self.state_dict(), driver, workers))

    def save_epoch(self, weights_files: list[str], checkpoint: EpochCheckpoint | None, workers: list) -> None:
        """An epoch's end: the weights to each of ``weights_files`` (``last.pt``, ``best.pt``), then the
        ``checkpoint`` (None: a fold of a k-fold command writes the weights alone); each file atomically.
        ``workers``: object refs of the workers' step-synchronisation states (the checkpoint's). A state of
        ``BACKGROUND_WRITE_BYTES`` or more (the weights, or the checkpoint's whole master state) is copied
        and the files are written on a thread while the next chunk runs (the copy costs a second set of it
        meanwhile); a smaller one is written before this returns. :meth:`saved` waits; one epoch's files
        are pending at most."""
        self.saved()
        state = None if checkpoint is None else self.state_dict()
        weights = self.model_state() if state is None else state.model
        if tensor_bytes(weights if state is None else state) < BACKGROUND_WRITE_BYTES:
            self._write_epoch(weights_files, weights, checkpoint, state, workers)
            return
        weights, state = copy.deepcopy((weights, state))  # one copy of the weights: state.model is weights
        self.writing = self.writer.submit(self._write_epoch, weights_files, weights, checkpoint, state,
                                          list(workers))

    def _write_epoch(self, weights_files: list[str], weights: dict, checkpoint: EpochCheckpoint | None,
                     state: MasterCheckpoint | None, workers: list) -> str | None:
        for file in weights_files:
            save_torch_atomically(weights, file)
        if checkpoint is None:
            return None
        # a worker that does not answer: None, as ``RankGroup.sync_states`` (resumed without its residual)
        states = answers_or_none(workers, lambda ref: ray.get(ref, timeout=self.timeout))
        return str(save_checkpoint(checkpoint.path, state, checkpoint.driver, states))

    def saved(self) -> str | None:
        """Wait for the files of :meth:`save_epoch`; returns the checkpoint's path (None: nothing was
        pending). A write that failed raises its ``OSError`` (naming the file; the previous file of that
        name is intact)."""
        writing, self.writing = self.writing, None
        return None if writing is None else writing.result()

    def ping(self) -> int:
        return os.getpid()
