"""Bag-level evaluation: scoring a shard of bags under one protocol, merging shards, then metrics.

**Protocols** (:class:`EvalProtocol`). *All instances*: every instance of the bag, in stored order.
*Sampled* (the Big-Layers paper's ``K x R``): in repeat ``r`` a bag of ``n`` instances is scored on
``min(K, n)`` distinct instances, sorted, drawn from ``numpy.random.default_rng([seed, r, key])``
where ``key`` is a stable 64-bit hash of the slide id (:func:`slide_key`). The sample is therefore a
function of (seed, repeat, slide) only: it does not depend on the order of the bags, on the manifest
or on which process scores the bag; bags of at most K instances are scored whole in every repeat.

**Scoring** (:func:`score_bags`) runs the model in eval mode under ``torch.no_grad`` (two bugs of
reference repositories are validating in train mode, which updates BatchNorm statistics and uses
dropout, and building autograd graphs during validation). Each bag is opened as a stream of instances
(:class:`InstanceSource`): a tile bag (:class:`~dpgs.wsi.tiles.TileBagDataset`) reads its tiles from the
slide on demand; any other :class:`~dpgs.data.dataset.BagSource` (feature bags) is read whole through
:class:`WholeBags`. For a :class:`~dpgs.models.tilemil.TileMIL` the requested instances are read and
embedded ``model.embed_chunk`` at a time (the next chunk is read on a thread while the current one is
embedded), only the embeddings [n, D] are kept, and the head then scores the bag; no [n, 3, s, s]
float32 bag is ever held whole, and the sampled protocol reads only the K tiles of each repeat.
BatchNorm layers normalise every chunk with fixed statistics, so the chunked score equals a one-pass
score (to float rounding): a trained encoder's with *the bag's own* statistics, as training normalised
it (:func:`dpgs.train.calibration.bag_statistics`: from the scored tiles when they fit in one chunk, whose
statistics pass then gives the embeddings too, one encoder pass in all; else from ``embed_chunk`` of them
evenly spread; one training-mode pass over the bag gives the same score when they are all its tiles), a
frozen encoder's with its running statistics. The per-bag loss is the head's
unweighted loss.

**Shards.** ``score_bags`` may run on any process for any subset of bag indices; its
:class:`Predictions` are merged with :meth:`Predictions.merge` (which restores the requested order),
and metrics are computed only on merged predictions. The single-process path is one shard holding
every bag.

**Metrics.** All instances: ``{prefix}loss`` and ``{prefix}{acc,bacc,auc,f1,qwk}``. Sampled:
per repeat the same metrics; ``{prefix}{m}`` is their mean over the R repeats and ``{prefix}{m}_std``
their (population) standard deviation. :class:`EvalPlan` is what a test evaluation reports: the
all-instances metrics as ``test_*`` with stratified bootstrap intervals ``test_{auc,acc,bacc}_ci_low``
/ ``_ci_high`` (:func:`dpgs.metrics.bootstrap_ci`), and with ``eval.sample_k = K`` the sampled metrics
as ``test_k{K}_*``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from dpgs.metrics import CI_METRICS, METRIC_NAMES, bootstrap_ci, classification_metrics
from dpgs.models.base import MILHead
from dpgs.models.tilemil import TileMIL
from dpgs.train.calibration import bag_statistics, statistics_subset, trained_batchnorms
from dpgs.wsi.tiles import sample_indices


def slide_key(slide_id: str) -> int:
    """A stable 64-bit integer of ``slide_id`` (BLAKE2b), the per-bag part of a sampled protocol's seed."""
    return int.from_bytes(hashlib.blake2b(slide_id.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class EvalProtocol:
    """All instances (``sample_k`` None, one repeat) or ``sample_k`` sampled instances x ``repeats``."""

    sample_k: int | None = None
    repeats: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sample_k is not None and self.sample_k < 1:
            raise ValueError(f"sample_k must be >= 1 or None, got {self.sample_k}")
        if self.repeats < 1 or (self.sample_k is None and self.repeats != 1):
            raise ValueError(f"repeats must be >= 1 (1 on all instances), got {self.repeats}")

    @classmethod
    def sampled(cls, sample_k: int | None, repeats: int, seed: int) -> EvalProtocol:
        """K x R with ``seed``; all instances when ``sample_k`` is None."""
        return cls() if sample_k is None else cls(sample_k, repeats, seed)

    @property
    def is_sampled(self) -> bool:
        return self.sample_k is not None

    def instance_indices(self, n: int, slide_id: str, repeat: int) -> np.ndarray:
        """Sorted instance indices of a bag of ``n`` instances scored in ``repeat`` (see module docstring)."""
        return sample_indices(n, self.sample_k, self.seed, repeat, slide_key(slide_id))


ALL_INSTANCES = EvalProtocol()


# ---------------------------------------------------------------------- bag streams


class InstanceStream(Protocol):
    """The instances of one open bag, read on demand (``dpgs.wsi.tiles.TileStream``, :class:`LoadedBag`)."""

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray | None = None) -> torch.Tensor:
        """Model input of the instances ``indices`` (all, in order, for None)."""

    def __enter__(self) -> InstanceStream: ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class InstanceSource(Protocol):
    """Bags opened one at a time as instance streams (``TileBagDataset``, :class:`WholeBags`)."""

    records: Sequence[Any]  # per bag: ``slide_id``, ``label``

    def open_stream(self, index: int) -> InstanceStream: ...


class LoadedBag(AbstractContextManager):
    """A bag held in memory as one tensor [N, ...]; ``read`` indexes it."""

    def __init__(self, features: torch.Tensor):
        self.features = features

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def read(self, indices: np.ndarray | None = None) -> torch.Tensor:
        return self.features if indices is None else self.features[torch.from_numpy(indices)]

    def __exit__(self, *exc) -> None:
        return None


class WholeBags:
    """An :class:`InstanceSource` over any ``BagSource``: each bag is read whole with ``get(i, 0)``."""

    def __init__(self, source: Any):
        self.source = source
        self.records = source.records

    def open_stream(self, index: int) -> LoadedBag:
        return LoadedBag(self.source.get(index, 0).features)


def instance_source(source: Any) -> InstanceSource:
    """``source`` when it streams its bags itself (tile bags), else :class:`WholeBags` over it."""
    return source if isinstance(source, InstanceSource) else WholeBags(source)


# ---------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class Predictions:
    """Per-bag predictions of one protocol on a shard of bags.

    ``indices`` [n] are the bags' indices in the source, ``probs`` [R, n, C] the class probabilities
    and ``losses`` [R, n] the per-bag losses of each repeat (R = 1 on all instances).
    """

    protocol: EvalProtocol
    indices: np.ndarray
    slide_ids: tuple[str, ...]
    labels: np.ndarray
    probs: np.ndarray
    losses: np.ndarray

    @property
    def mean_probs(self) -> np.ndarray:
        """[n, C]: the probabilities averaged over repeats (the bag's probabilities on all instances)."""
        return self.probs.mean(axis=0)

    @classmethod
    def merge(cls, shards: Sequence[Predictions], order: Sequence[int]) -> Predictions:
        """The shards' predictions of the bags ``order`` in that order; every bag of ``order`` must be in
        exactly one shard, and nothing else."""
        if not shards:
            raise ValueError("no shards to merge")
        protocol = shards[0].protocol
        if any(s.protocol != protocol for s in shards):
            raise ValueError(f"shards of different protocols: {sorted({str(s.protocol) for s in shards})}")
        indices = np.concatenate([s.indices for s in shards]).astype(np.int64)
        position = {int(i): k for k, i in enumerate(indices)}
        order = [int(i) for i in order]
        if len(position) != len(indices) or len(set(order)) != len(order) or set(order) != set(position):
            raise ValueError(f"the shards hold bags {sorted(indices.tolist())}, expected each of "
                             f"{sorted(order)} exactly once")
        take = np.array([position[i] for i in order], dtype=np.int64)
        slide_ids = [sid for s in shards for sid in s.slide_ids]
        return cls(
            protocol,
            indices[take],
            tuple(slide_ids[k] for k in take),
            np.concatenate([s.labels for s in shards])[take],
            np.concatenate([s.probs for s in shards], axis=1)[:, take],
            np.concatenate([s.losses for s in shards], axis=1)[:, take],
        )

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}loss`` and ``{prefix}{acc,bacc,auc,f1,qwk}``; sampled protocols add ``..._std`` over
        repeats (see the module docstring)."""
        per_repeat = []
        for probs, losses in zip(self.probs, self.losses, strict=True):
            scores = classification_metrics(self.labels, probs)
            loss = float(losses.mean()) if losses.size else math.nan
            per_repeat.append({"loss": loss, **{name: scores[name] for name in METRIC_NAMES}})
        out = {}
        for name in per_repeat[0]:
            values = np.array([row[name] for row in per_repeat], dtype=np.float64)
            out[f"{prefix}{name}"] = float(values.mean())
            if self.protocol.is_sampled:
                out[f"{prefix}{name}_std"] = float(values.std())
        return out

    def intervals(self, prefix: str, resamples: int, level: float, seed: int) -> dict[str, float]:
        """``{prefix}{auc,acc,bacc}_ci_low`` / ``_ci_high``: stratified bootstrap intervals of the
        all-instances metrics (:func:`dpgs.metrics.bootstrap_ci`); NaN bounds where undefined."""
        if self.protocol.is_sampled:
            raise ValueError("bootstrap intervals are defined for the all-instances protocol only")
        out = {}
        intervals = bootstrap_ci(self.labels, self.mean_probs, CI_METRICS, resamples, level, seed)
        for name, ci in intervals.items():
            out[f"{prefix}{name}_ci_low"], out[f"{prefix}{name}_ci_high"] = ci.low, ci.high
        return out


# ---------------------------------------------------------------------- scoring


def _parts(model: torch.nn.Module) -> tuple[TileMIL | None, MILHead]:
    """(the tile model whose encoder embeds chunks, or None for a head over feature bags; the head)."""
    if isinstance(model, TileMIL):
        return model, model.head
    return None, model


def _read_ahead(stream: InstanceStream, pieces: list[np.ndarray], pool: ThreadPoolExecutor) -> Iterator:
    """``stream.read(p)`` for each piece in order, the next piece read on ``pool`` while the caller works."""
    ahead: Future | None = None
    for piece in pieces:
        nxt = pool.submit(stream.read, piece)
        if ahead is not None:
            yield ahead.result()
        ahead = nxt
    if ahead is not None:
        yield ahead.result()


def _embeddings(tile_model: TileMIL | None, stream: InstanceStream, indices: np.ndarray,
                device: torch.device, pool: ThreadPoolExecutor, bag_bn: bool) -> torch.Tensor:
    """The head's input [n, D] for the bag's instances ``indices`` (embedded chunk by chunk for tiles;
    with ``bag_bn``, BatchNorm normalises with the bag's own statistics, :mod:`dpgs.train.calibration`)."""
    if tile_model is None:
        whole = len(indices) == len(stream)  # sorted distinct indices of every instance: read in place
        return stream.read(None if whole else indices).to(device)
    chunk = tile_model.embed_chunk
    if len(indices) <= chunk:  # one read and one encoder pass: the statistics pass embeds the tiles
        tiles = stream.read(indices)
        with bag_statistics(tile_model, tiles) if bag_bn else contextlib.nullcontext() as embedded:
            return tile_model.embed(tiles) if embedded is None else embedded
    pieces = [indices[s : s + chunk] for s in range(0, len(indices), chunk)]
    with bag_statistics(tile_model, stream.read(statistics_subset(indices, chunk))) if bag_bn \
            else contextlib.nullcontext():
        return torch.cat([tile_model.embed(x) for x in _read_ahead(stream, pieces, pool)])


def _opened(source: InstanceSource, indices: Sequence[int], pool: ThreadPoolExecutor) -> Iterator:
    """(index, open stream) for each bag of ``indices``, the next bag opened on ``pool`` meanwhile."""
    pending: Future | None = pool.submit(source.open_stream, indices[0]) if indices else None
    try:
        for k, i in enumerate(indices):
            stream, pending = pending.result(), None
            if k + 1 < len(indices):
                pending = pool.submit(source.open_stream, indices[k + 1])
            with stream:
                yield i, stream
    finally:
        if pending is not None:  # leaving early: close the bag opened ahead (its own failure is moot)
            with contextlib.suppress(Exception):
                pending.result().__exit__(None, None, None)


@torch.no_grad()
def score_bags(model: torch.nn.Module, source: Any, indices: Sequence[int], protocol: EvalProtocol,
               device: torch.device) -> Predictions:
    """Predictions of the bags ``indices`` of ``source`` (an :class:`InstanceSource` or any ``BagSource``)
    under ``protocol``, on this process (see the module docstring)."""
    source = instance_source(source)
    tile_model, head = _parts(model)
    bag_bn = tile_model is not None and bool(trained_batchnorms(tile_model))  # as the encoder was trained
    indices = [int(i) for i in indices]
    repeats, n_bags, n_classes = protocol.repeats, len(indices), head.num_classes
    probs = np.empty((repeats, n_bags, n_classes), dtype=np.float64)
    losses = np.empty((repeats, n_bags), dtype=np.float64)
    slide_ids, labels = [], []
    was_training = model.training
    model.eval()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="dpgs-eval-open") as opener, \
                ThreadPoolExecutor(1, thread_name_prefix="dpgs-eval-read") as reader:
            for b, (i, stream) in enumerate(_opened(source, indices, opener)):
                record = source.records[i]
                slide_ids.append(record.slide_id)
                labels.append(int(record.label))
                previous = None
                for r in range(repeats):
                    picked = protocol.instance_indices(len(stream), record.slide_id, r)
                    if previous is not None and np.array_equal(picked, previous):
                        probs[r, b], losses[r, b] = probs[r - 1, b], losses[r - 1, b]
                        continue
                    feats = _embeddings(tile_model, stream, picked, device, reader, bag_bn)
                    out = head.loss(feats, torch.as_tensor(int(record.label), device=feats.device))
                    logits = out["logits"].reshape(-1, n_classes)[0]
                    probs[r, b] = torch.softmax(logits.double(), dim=-1).cpu().numpy()
                    losses[r, b] = float(out["loss"])
                    previous = picked
    finally:
        model.train(was_training)
    return Predictions(protocol, np.asarray(indices, dtype=np.int64), tuple(slide_ids),
                       np.asarray(labels, dtype=np.int64), probs, losses)


# ---------------------------------------------------------------------- what validation and test report


def validation_protocol(eval_cfg: Any, seed: int) -> EvalProtocol:
    """All instances, or ``eval.val_sample_k`` x ``eval.val_repeats`` (the same instances every epoch)."""
    return EvalProtocol.sampled(eval_cfg.val_sample_k, eval_cfg.val_repeats, seed)


@dataclass(frozen=True)
class EvalPlan:
    """What a test evaluation reports: all instances with bootstrap intervals (``bootstrap`` resamples
    at ``ci_level``; none for 0), and the ``sampled`` protocol when given."""

    sampled: EvalProtocol | None
    bootstrap: int
    ci_level: float
    seed: int

    @classmethod
    def from_config(cls, eval_cfg: Any, seed: int) -> EvalPlan:
        k = eval_cfg.sample_k
        sampled = None if k is None else EvalProtocol(k, eval_cfg.repeats, seed)
        return cls(sampled, eval_cfg.bootstrap, eval_cfg.ci_level, seed)

    @property
    def protocols(self) -> list[EvalProtocol]:
        """The protocols to score, all instances first."""
        return [ALL_INSTANCES] + ([self.sampled] if self.sampled is not None else [])

    def sampled_prefix(self) -> str:
        return f"test_k{self.sampled.sample_k}_"

    def metrics(self, predictions: Sequence[Predictions]) -> dict[str, float]:
        """``test_*`` (+ intervals) and ``test_k{K}_*`` of the merged predictions of :attr:`protocols`."""
        by_protocol = {p.protocol: p for p in predictions}
        full = by_protocol[ALL_INSTANCES]
        out = full.metrics("test_")
        if self.bootstrap:
            out.update(full.intervals("test_", self.bootstrap, self.ci_level, self.seed))
        if self.sampled is not None:
            out.update(by_protocol[self.sampled].metrics(self.sampled_prefix()))
        return out
