"""What a DPGS bag worker does, independent of Ray (``workers.BagWorker`` wraps it in an actor).

A worker holds a model replica, its weight version and its error-feedback residual (inside the
uplink compressor). Per step it

1. applies the master's weight update (a compressed delta for version v -> v+1, or a dense snapshot);
   an update that does not continue its version is refused (``needs_resync``) and the driver sends
   a dense snapshot,
2. runs forward and backward over its bags, packed in one pass when the head allows it, and
   back-propagates the **sum** of per-bag losses (the master divides by the step's bag count),
3. compresses the flat gradient and returns the payload with per-bag losses and timings, plus its
   floating-point buffers (BatchNorm running statistics) after the step, which the master averages
   over workers weighted by bag count and sends back with the next update.

The step's dropout randomness is seeded from (seed, step, first bag index), so a step re-run after a
failure or a resume computes exactly the same gradient. Bags are read with ``dataset.get(index, epoch)``
(tile bags: the epoch's tile sample and augmentation). The driver also names the bags this worker
will get in the next step (``prefetch``); they are read in a background thread while this step computes.
"""

from __future__ import annotations

import time

import torch

from dpgs.config.schema import CompressionConfig
from dpgs.distributed.bag_reader import BagReader
from dpgs.distributed.codec import GradientEncoder, VersionMismatch, apply_update
from dpgs.distributed.flat import (
    flat_buffers,
    flat_grads,
    flat_params,
    load_flat_buffers,
    load_flat_params,
    trainable,
)
from dpgs.modeling import input_to
from dpgs.train.steps import batch_loss


def receive_update(worker, update: bytes | None) -> tuple[float, dict | None]:
    """Apply the master's ``update`` (if any) with ``worker.receive``.

    Returns (seconds the update spent on the emulated link, the ``needs_resync`` answer of the step when
    the update does not continue the worker's weight version, else None).
    """
    if update is None:
        return 0.0, None
    seconds = emulate_link(len(update), worker.mbps)  # the master's update reaching the worker
    try:
        worker.receive(update)
    except VersionMismatch as err:
        return seconds, {"rank": worker.rank, "needs_resync": True, "reason": str(err)}
    return seconds, None


def emulate_link(nbytes: int, mbps: float | None) -> float:
    """Sleep for the transfer time of ``nbytes`` over a ``mbps`` link; returns the seconds slept."""
    if not mbps:
        return 0.0
    seconds = nbytes * 8 / (mbps * 1e6)
    time.sleep(seconds)
    return seconds


class WorkerState:
    def __init__(
        self,
        rank: int,
        model_spec,
        dataset,
        compression: CompressionConfig,
        class_weights: torch.Tensor | None,
        seed: int,
        device: str = "cpu",
        emulate_bandwidth_mbps: float | None = None,
    ):
        self.rank = rank
        self.device = torch.device(device)
        self.model = model_spec.build().to(self.device)
        self.dataset = dataset
        self.class_weights = None if class_weights is None else class_weights.to(self.device)
        self.seed = seed
        self.version: int | None = None  # no weights received yet
        self.encoder = GradientEncoder(compression, self.model)
        self.mbps = emulate_bandwidth_mbps
        self.reader = BagReader(dataset)

    def receive(self, update: bytes) -> None:
        """Apply a delta or snapshot payload; raises VersionMismatch when it does not fit."""
        flat = flat_params(self.model)
        new_flat, self.version = apply_update(flat, self.version, update)
        load_flat_params(self.model, new_flat)

    def compute(
        self,
        update: bytes | None,
        buffers: torch.Tensor | None,
        indices: list[int],
        step: int,
        keep_ratio: float,
        epoch: int = 0,
        prefetch: list[int] | tuple[int, ...] = (),
    ) -> tuple[bytes, torch.Tensor | None, dict]:
        """Apply ``update`` and ``buffers``; return (gradient payload, buffers, stats) for ``indices``.

        ``prefetch``: bags (of the same ``epoch``) to read in the background for the next step.
        """
        start = time.perf_counter()
        down_link_seconds, resync = receive_update(self, update)
        if resync is not None:
            return b"", None, resync
        load_flat_buffers(self.model, buffers)
        stats: dict = {
            "rank": self.rank,
            "needs_resync": False,
            "version": self.version,
            "n_bags": len(indices),
        }
        if not indices:
            self.reader.read_ahead(list(prefetch), epoch)
            stats.update(compute_seconds=0.0, payload_bytes=0, dense_bytes=0, losses=[], slide_ids=[])
            return b"", None, stats
        load_start = time.perf_counter()
        bags = [self.reader.take(i, epoch) for i in indices]
        self.reader.read_ahead(list(prefetch), epoch)
        compute_start = time.perf_counter()
        torch.manual_seed(self.seed * 1_000_003 + step * 8191 + indices[0])
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        features = [input_to(self.model, b.features, self.device) for b in bags]
        labels = torch.tensor([b.label for b in bags], device=self.device)
        out = batch_loss(self.model, features, labels, "packed", self.class_weights)
        out["per_bag"].sum().backward()
        grad = flat_grads(self.model)
        compute_seconds = time.perf_counter() - compute_start
        payload, enc = self.encoder.encode(grad, keep_ratio)
        link_seconds = emulate_link(len(payload), self.mbps)
        stats.update(
            losses=out["per_bag"].detach().cpu().tolist(),
            slide_ids=[b.slide_id for b in bags],
            instances=sum(f.shape[0] for f in features),
            load_seconds=compute_start - load_start,
            compute_seconds=compute_seconds,
            encode_seconds=enc["encode_seconds"],
            link_seconds=link_seconds + down_link_seconds,
            payload_bytes=len(payload),
            dense_bytes=enc["dense_bytes"],
            sent=enc["count"],
            total_seconds=time.perf_counter() - start,
        )
        return payload, flat_buffers(self.model), stats

    def n_trainable(self) -> int:
        return sum(p.numel() for p in trainable(self.model))
