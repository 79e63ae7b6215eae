"""The keep ratio of every DPGS step: the one place that decides how much of a gradient is sent.

* A fixed ``dpgs.compression.keep_ratio`` (1 sends everything, dense) is the steady ratio.
* ``keep_ratio=auto`` chooses it each epoch from what the run measures (:meth:`KeepSchedule.decide`): the
  links between the master and its workers (``dpgs.distributed.link_probe``), the compute time of a
  step (the slowest worker's forward/backward, median over the steps measured) and what the run's steps
  cost at the ratios already run (:class:`StepCosts`). The exchange of a step at keep ratio ``k`` is what
  the last epoch's steps at ``k`` spent beyond their compute when it ran them; otherwise the link time of
  the bytes it moves per worker (:class:`ByteModel`) plus what the steps of the ratio run nearest ``k``
  spent beyond compute and link, moved by the growth of the codec to the entries ``k`` sends
  (:meth:`StepCosts.overhead_at`); auto picks dense when the dense exchange costs at most
  ``auto_share`` of the compute, otherwise the largest of ``auto_ratios`` whose exchange stays within
  that share. When none does, the largest ratio whose exchange is within 10 % of the fastest one: on a
  link whose latency dominates, compressing saves nothing. A compressed choice whose step (compute and
  exchange) is not at least ``auto_min_saving`` (25 %) shorter than a dense step is dropped for dense: a
  compressed step learns less than a dense one (on a fast link and two shared cores, keep 1 %'s steps of
  an ABMIL head were 14-16 % shorter than dense's and reached the validation target 1.35-1.42x later; on
  ``make demo`` keep 1 % never reached the best validation AUC that classic and dense DPGS reach).
  The codec time matters on fast links: top-k selection, zstd and the sparse decode cost more than they
  save on loopback (measured: 30-100 ms a step against 5-15 ms dense for an ABMIL head). The links are
  probed only where a probe could change the choice (:meth:`KeepSchedule.dense_is_settled`).
* Auto's first decision comes before the run's first step: every worker computes its part of that step (kept
  for it) and times its codec on that gradient (``Worker.rehearse``) at the smallest of ``auto_ratios``, on a
  copy of its codec state; the links are probed; the first epoch then runs at the ratio decided from its
  first step on. (Measuring steps run at a
  guessed ratio first had cost the tile encoder its first epoch: two steps at the 25 % warm-up before a
  dense epoch missed the validation target that twelve dense steps reach, 2026-11-27.)
* With ``warmup_epochs = W``, a compressed steady ratio follows DGC's warm-up 25 %, 6.25 %, 1.5625 %, ...
  for the first W epochs (never below the steady ratio); dense stays dense. ``auto`` runs those W epochs
  dense instead where the dense exchange costs at most ``auto_warmup_share`` times the compute: the early
  steps are where compression loses most of what a step learns (the tile encoder at 1 Gbit/s: dense reached
  the validation target in one epoch, the 25 % warm-up in three, at a dense exchange of 1.4x the compute).
  With ``second_moment=frozen`` the W epochs always run dense, fixed ratio or auto: Adam's second moment
  is frozen at the first compressed step, and it must have settled on dense gradients.
* ``second_moment=auto`` with ``keep_ratio=auto`` (where the config leaves it unresolved: a MIL head and
  Adam, ``dpgs.config.schema``) does not make the warm-up dense: it freezes the second moment at the fold's
  first compressed epoch when that is not its first epoch, so that every step before it was dense (auto's
  dense warm-up, or dense epochs before the link made auto compress), and keeps live Adam when the fold's
  first epoch is already compressed (a link on which a dense warm-up costs more than
  ``auto_warmup_share`` times the compute). :meth:`KeepSchedule.second_moment_frozen` decides, once a fold.

The driver writes the ratio into each :class:`~dpgs.distributed.messages.StepPlan`; the uplink and
downlink codecs take it as an argument.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dpgs.compression import KeepRatioSchedule, ParamLayout
from dpgs.compression.dtypes import VALUE_DTYPES
from dpgs.config.schema import CompressionConfig
from dpgs.distributed.link_probe import LinkProbe, LinkWatch
from dpgs.distributed.messages import MasterStep, WorkerStep
from dpgs.distributed.sync.contract import tail_bytes

HEADER_BYTES = 64  # a payload's header and the frame's share, rounded up
INDEX_BYTES = 1.0  # bytes per sent entry for its index after zstd (gaps of top-k at <= 10 %; measured ~0.7)
CODEC_GROWTH = 40.0  # codec seconds at keep k ~ 1 + 40 k: ResNet-18's gradient (benchmarks/compression.py),
# a worker's encode plus 2P decodes at P = 2: 77 ms at 0.1 %, 100 ms at 1 %, 343 ms at 10 % (docs/dpgs.md)


@dataclass(frozen=True)
class ByteModel:
    """Bytes a worker moves per step at a keep ratio: up its message, down the master's.

    ``numel`` trainable parameters of which ``dense_numel`` are always sent dense, ``buffers`` floating-
    point buffer values, ``value_bytes`` per sent value, ``workers`` P, ``relay``: the master relays each
    worker the other P - 1 payloads (``downlink=gradients``; the dense sum when that is smaller) rather
    than one delta.
    ``entry_bytes`` (value + index) is the assumption until a compressed step measured it.
    """

    numel: int
    dense_numel: int
    buffers: int
    value_bytes: int
    workers: int
    relay: bool
    entry_bytes: float

    @classmethod
    def of(cls, cfg: CompressionConfig, layout: ParamLayout, buffers: int, workers: int) -> ByteModel:
        value_bytes = VALUE_DTYPES["fp32" if cfg.wire == "dgc" else cfg.value_dtype].itemsize
        dense_numel = int(layout.with_dense_min_numel(cfg.dense_min_numel).dense_ranges()[:, 1].sum())
        index = 4.0 if cfg.wire == "dgc" else INDEX_BYTES
        return cls(layout.numel, dense_numel, buffers, value_bytes, workers, cfg.downlink == "gradients",
                   value_bytes + index)

    def payload(self, keep: float) -> float:
        """Bytes of one worker's gradient message at ``keep``."""
        if keep >= 1.0:
            return 4.0 * self.numel
        sent = round(keep * (self.numel - self.dense_numel))
        return HEADER_BYTES + self.value_bytes * self.dense_numel + self.entry_bytes * sent

    def per_worker(self, keep: float) -> tuple[float, float]:
        """(up, down) bytes of one worker in a step at ``keep``."""
        up = self.payload(keep) + tail_bytes(self.buffers)
        dense = 4.0 * self.numel
        down = (min((self.workers - 1) * self.payload(keep), dense) if self.relay else self.payload(keep))
        return up, down + 4 * self.buffers + HEADER_BYTES

    def relayed(self, keep: float) -> bool:
        """Whether a step at ``keep`` relays the payloads: its bytes down then flow while its bytes up
        arrive (the gloo transport forwards them piece by piece), rather than after them."""
        return self.relay and keep < 1.0 and (self.workers - 1) * self.payload(keep) < 4.0 * self.numel

    def calibrated(self, keep: float, payload_bytes: float) -> ByteModel:
        """The model with ``entry_bytes`` measured from a worker's mean payload at ``keep`` < 1."""
        sent = round(keep * (self.numel - self.dense_numel))
        if keep >= 1.0 or sent == 0:
            return self
        entry = (payload_bytes - HEADER_BYTES - self.value_bytes * self.dense_numel) / sent
        return replace(self, entry_bytes=max(entry, 1.0))


@dataclass(frozen=True)
class KeepDecision:
    """What ``keep_ratio=auto`` chose for an epoch, and the figures behind it (logged to MLflow)."""

    ratio: float
    compute_seconds: float
    dense_exchange_seconds: float
    exchange_seconds: float
    warmup_dense: bool = False  # the compression warm-up's epochs run dense (module docstring)

    def metrics(self) -> dict[str, float]:
        return {
            "auto_keep_ratio": self.ratio,
            "auto_warmup_dense": float(self.warmup_dense),
            "auto_compute_seconds": self.compute_seconds,
            "auto_dense_exchange_seconds": self.dense_exchange_seconds,
            "auto_exchange_seconds": self.exchange_seconds,
            "auto_dense_exchange_share": self.dense_exchange_seconds / max(self.compute_seconds, 1e-9),
        }


class StepCosts:
    """What the run's own steps cost at each keep ratio it has run (median over the steps at that ratio,
    the latest measurement of each ratio kept):

    * ``codec[k]``: the slowest worker's encode + apply (decode, optimizer step or weight load) plus the
      master's decode + encode;
    * ``exchange[k]``: the master's wall time of a step minus the slowest worker's compute: everything a
      step spends beyond computing (link, codec, waiting), as it happened.

    A ratio not run yet is estimated from the compressed ratio run nearest to it (:meth:`overhead_at`):
    part of the codec (sampling and selecting over every gradient value, the message's dense part, the
    calls) costs the same at any ratio, the rest grows with the entries sent, encoded, relayed and
    decoded: the codec at ``k`` costs ``1 + CODEC_GROWTH * k`` times its cost at k -> 0. The overhead
    measured at the nearest ratio is moved by that growth of its codec. Auto tries the ratio it chose,
    measures it and decides again at the next epoch with what it cost.
    """

    def __init__(self) -> None:
        self.codec: dict[float, float] = {}
        self.exchange: dict[float, float] = {}

    def observe(self, keep_of: dict[int, float], workers: list[WorkerStep], master: list[MasterStep]) -> None:
        """Add steps (``keep_of``: each step's keep ratio; steps not in it are left out)."""
        codec: dict[int, float] = {}
        compute: dict[int, float] = {}
        for r in workers:
            if r.index in keep_of:
                codec[r.index] = max(codec.get(r.index, 0.0), r.encode_seconds + r.apply_seconds)
                compute[r.index] = max(compute.get(r.index, 0.0), r.compute_seconds)
        by_ratio: dict[float, tuple[list[float], list[float]]] = {}
        for m in master:
            if m.index in codec:
                codecs, exchanges = by_ratio.setdefault(keep_of[m.index], ([], []))
                codecs.append(codec[m.index] + m.decode_seconds + m.encode_seconds)
                exchanges.append(max(m.step_seconds - compute[m.index], 0.0))
        for keep, (codecs, exchanges) in by_ratio.items():
            self.codec[keep] = statistics.median(codecs)
            self.exchange[keep] = statistics.median(exchanges)

    def rehearsed(self, codec: dict[float, float]) -> None:
        """Codec seconds per ratio timed before any step ran (``Worker.rehearse``), for the ratios whose steps
        were not measured yet."""
        for keep, seconds in codec.items():
            self.codec.setdefault(keep, seconds)

    def overhead_at(self, keep: float, link_seconds: Callable[[float], float]) -> float:
        """Seconds a step at the compressed ratio ``keep`` spends beyond its compute and its link time
        (codec, waits), from the compressed ratio run nearest to it (in log scale), ``n``: what n's steps
        spent beyond their compute less ``link_seconds(n)`` (n's codec time where only that was
        measured), plus the growth of the codec from n to ``keep``: ``codec(n) * G (keep - n) / (1 + G n)``
        (G = ``CODEC_GROWTH``: the codec costs ``1 + G k`` times its cost at k -> 0). A ratio below every
        ratio run is charged what the smallest one cost: G was measured on ResNet-18's gradient, and on a
        small model the fixed costs are most of the codec, so a step at 0.1 % costs nearly what one at 25 %
        does (measured on the ABMIL head, 2026-11-27: scaled down from 25 %, 10 % looked 5x cheaper than
        dense, ran, and was not). Once two compressed ratios have run, a ratio below both is charged along
        the line through what they spent (never more than the smaller one's): the run's own measure of
        how the overhead grows (ResNet-18 at 1 Gbit/s, 2026-11-27: 25 % and 10 % spent 0.56 s and 0.24 s,
        and charged 10 %'s cost, 1 % was never tried while 10 % ran at 1.24x the compute). 0 for dense, and
        while no compressed step has run."""
        run = [k for k in self.codec if k < 1.0]  # observe() measures a ratio's codec with its exchange
        if keep >= 1.0 or not run:
            return 0.0

        def spent(n: float) -> float:
            return max(self.exchange[n] - link_seconds(n), 0.0) if n in self.exchange else self.codec[n]

        lowest = sorted(run)[:2]
        if keep < lowest[0] and len(lowest) == 2:
            # below every ratio run, once two were: along the line through the two smallest, which the run
            # itself measured (flat on a small model, steep on ResNet-18), never above the smallest's cost
            (a, b), (cost_a, cost_b) = lowest, map(spent, lowest)
            slope = max((cost_b - cost_a) / (b - a), 0.0)
            return max(cost_a - slope * (a - keep), 0.0)
        keep = self._charged_as(keep)
        n = min(run, key=lambda k: abs(math.log(k / keep)))
        growth = self.codec[n] * CODEC_GROWTH * (keep - n) / (1.0 + CODEC_GROWTH * n)
        return max(spent(n) + growth, 0.0)

    def codec_floor(self, keep: float) -> float:
        """The codec seconds auto charges at least at ``keep``: the cost of the largest ratio measured at or
        below the ratio ``keep`` is charged as (:meth:`_charged_as`) of the same kind, compressed or dense
        (the codec costs no less at a larger ratio), else 0."""
        keep = self._charged_as(keep)
        below = [k for k in self.codec if k <= keep and (k < 1.0) == (keep < 1.0)]
        return self.codec[max(below)] if below else 0.0

    def _charged_as(self, keep: float) -> float:
        """The ratio a step at ``keep`` is charged as: a compressed ratio below every compressed ratio run
        is not assumed cheaper than the smallest of them until it runs (:meth:`overhead_at`)."""
        run = [k for k in self.codec if k < 1.0]
        return max(keep, min(run)) if keep < 1.0 and run else keep


def step_compute_seconds(reports: list[WorkerStep]) -> float:
    """Median over steps of the slowest worker's forward/backward time."""
    by_step: dict[int, float] = {}
    for r in reports:
        by_step[r.index] = max(by_step.get(r.index, 0.0), r.compute_seconds)
    return statistics.median(by_step.values()) if by_step else 0.0


@dataclass
class AutoMeasurements:
    """What ``keep_ratio=auto`` has measured, kept by the DPGS session for every fold of a command: the same
    actors on the same links train the same model in each fold, so a fold starts from what the folds
    before it measured instead of measuring again. A later fold's first epoch therefore neither rehearses
    its first step (``compute_seconds`` is known) nor probes the links where dense is settled
    (:meth:`KeepSchedule.dense_is_settled` on ``costs`` and ``ratio``). Probed afresh at every fold's
    start, a loopback link measured a dense exchange of 5-13 ms against the 2-3 ms its dense steps took
    (MUSK1, ABMIL, 2 cores, 2026-11-29), and auto compressed the first epochs of 2 and 4 folds of 10.

    ``compute_seconds``: a step's compute as last measured; ``costs``: the steps' costs per ratio run;
    ``links``: the last probe; ``bytes``: the byte model (None until the first fold builds it; calibrated
    on the compressed payloads run); ``ratio``: the steady ratio auto chose last (None before its first
    decision)."""

    compute_seconds: float | None = None
    costs: StepCosts = field(default_factory=StepCosts)
    links: LinkWatch = field(default_factory=LinkWatch)
    bytes: ByteModel | None = None
    ratio: float | None = None


class KeepSchedule:
    """Keep ratio of each step from the run's compression settings (see the module docstring); ``measured``:
    what auto measured before this fold (:class:`AutoMeasurements`), whose step costs it adds to."""

    def __init__(self, cfg: CompressionConfig, measured: AutoMeasurements | None = None):
        self.measured = AutoMeasurements() if measured is None else measured
        self.cfg = cfg
        self.auto = cfg.keep_ratio == "auto"
        # auto, until its first decision: the ratio it chose last, else the cheapest. After a resume: the
        # ratio the checkpoint ran.
        first = min(cfg.auto_ratios) if self.measured.ratio is None else self.measured.ratio
        self.steady = first if self.auto else float(cfg.keep_ratio)
        self.warmup_dense = False
        self.costs = self.measured.costs
        self.first_compressed: int | None = None  # the fold's first compressed epoch (checkpointed)

    @property
    def freezes(self) -> bool | None:
        """None until the fold's first compressed epoch, then whether its steps froze Adam's second moment
        (``auto``: if every epoch before it ran dense)."""
        if self.first_compressed is None:
            return None
        mode = self.cfg.second_moment
        return mode == "frozen" or (mode == "auto" and self.first_compressed > 1)  # auto: after dense epochs

    @property
    def frozen_since(self) -> int | None:
        """The fold's epoch whose steps froze Adam's second moment, or None."""
        return self.first_compressed if self.freezes else None

    def second_moment_frozen(self, epoch: int, ratio: float) -> bool:
        """Whether the steps of ``epoch``, run at ``ratio``, freeze (or keep frozen) Adam's second moment
        (:attr:`dpgs.distributed.messages.StepPlan.frozen_second_moment`): always with
        ``second_moment=frozen``, never with ``live``; with ``auto``, decided at the fold's first compressed
        epoch (module docstring) and kept for the rest of the fold."""
        if ratio < 1.0 and self.first_compressed is None:
            self.first_compressed = epoch
        if self.cfg.second_moment == "auto":
            return bool(self.freezes)
        return self.cfg.second_moment == "frozen"

    def rehearsal_ratios(self) -> tuple[float, ...]:
        """The compressed ratio whose codec auto's first decision times: its cheapest choice (the others are
        charged from it, :meth:`StepCosts.overhead_at`). Timing the 25 % warm-up's codec as well cost the
        tile encoder's first decision 0.8 s (2026-11-27) and changed no choice: the warm-up's ratio is not
        one of the choices."""
        cheapest = min(self.cfg.auto_ratios)
        return (cheapest,) if cheapest < 1.0 else ()

    def dense_is_settled(self, compute_seconds: float) -> bool:
        """Whether no probe of the links could change a dense choice: the run is dense, its dense steps were
        measured, and either they fit the budget or every compressed ratio's codec time alone (the least
        auto charges for its exchange, :meth:`StepCosts.codec_floor`) fits neither the budget nor within
        10 % of dense's measured exchange, or would save ``auto_min_saving`` of dense's step."""
        dense = self.costs.exchange.get(1.0)
        if not self.auto or self.steady < 1.0 or dense is None:
            return False
        budget = self.cfg.auto_share * compute_seconds
        if dense <= budget:
            return True
        lower = [self.costs.codec_floor(k) for k in self.cfg.auto_ratios if k < 1.0]
        return all((b > budget and 1.1 * b >= dense) or not self._saves(compute_seconds, b, dense)
                   for b in lower)

    def _saves(self, compute_seconds: float, exchange: float, dense_exchange: float) -> bool:
        """Whether a compressed step whose exchange takes ``exchange`` is at most ``1 - auto_min_saving`` of a
        dense step's time (the compute plus each one's exchange)."""
        step, dense_step = compute_seconds + exchange, compute_seconds + dense_exchange
        return step <= (1.0 - self.cfg.auto_min_saving) * dense_step

    def keep_dense(self, compute_seconds: float) -> KeepDecision:
        """The decision when :meth:`dense_is_settled`: dense, from what its steps cost."""
        dense = self.costs.exchange[1.0]
        self.warmup_dense = False
        self.measured.ratio = self.steady
        return KeepDecision(1.0, compute_seconds, dense, dense)

    def decide(self, link: LinkProbe, compute_seconds: float, bytes_model: ByteModel) -> KeepDecision:
        """``keep_ratio=auto``: the steady ratio from the measured link, compute and step costs (module
        docstring). A ratio whose steps were measured after the first one is judged by what they cost."""
        budget = self.cfg.auto_share * compute_seconds

        def link_seconds(keep: float) -> float:
            return link.exchange_seconds(*bytes_model.per_worker(keep), overlapped=bytes_model.relayed(keep))

        def exchange(keep: float) -> float:
            if keep in self.costs.exchange:
                return self.costs.exchange[keep]
            return link_seconds(keep) + self.costs.overhead_at(keep, link_seconds)

        candidates = sorted(set(self.cfg.auto_ratios) | {1.0}, reverse=True)
        seconds = {k: exchange(k) for k in candidates}
        fitting = [k for k in candidates if seconds[k] <= budget]
        fastest = min(seconds.values())
        self.steady = fitting[0] if fitting else next(k for k in candidates if seconds[k] <= 1.1 * fastest)
        if self.steady < 1.0 and not self._saves(compute_seconds, seconds[self.steady], seconds[1.0]):
            self.steady = 1.0  # a compressed step learns less than a dense one: a small saving loses time
        self.warmup_dense = (self.steady < 1.0 and self.cfg.warmup_epochs > 0
                             and (self.cfg.second_moment == "frozen"
                                  or seconds[1.0] <= self.cfg.auto_warmup_share * compute_seconds))
        self.measured.ratio = self.steady
        return KeepDecision(self.steady, compute_seconds, seconds[1.0], seconds[self.steady],
                            self.warmup_dense)

    def ratio(self, epoch: int) -> float:
        """Keep ratio of the steps of ``epoch`` (1-based): the steady one, or its warm-up (dense stays dense,
        a compressed ratio follows the warm-up for the first ``warmup_epochs``, or runs them dense where
        auto's last decision said so or the second moment is frozen after them)."""
        if self.steady >= 1.0 or not self.cfg.warmup_epochs:
            return self.steady
        if (self.warmup_dense or self.cfg.second_moment == "frozen") and epoch <= self.cfg.warmup_epochs:
            return 1.0
        return KeepRatioSchedule.exponential(self.steady, epochs=self.cfg.warmup_epochs).ratio(epoch - 1)
