"""Master -> workers: compressed weight deltas with error feedback, dense snapshots, versioning.

The master keeps ``held``, a bit-exact copy of what every in-sync worker holds, and a version number. Each
``step(params)`` either

* sends a dense fp32 snapshot (first call, or every ``dense_sync_every`` steps): ``held = params``; or
* sends the top-k of ``delta = params - held`` (plus dense-exempt tensors), rounded to the value dtype,
  and applies exactly the same float32 additions to ``held`` as the workers do.

Either way the version increases by one. The broadcast residual is ``params - held``: whatever has not been
sent yet stays in it and is sent later (error feedback; it is recomputed from ``held`` each step, so it
cannot drift). Invariant: a worker that applied every payload holds ``held`` bit for bit, hence
``worker + residual(params) == params`` (``residual`` is returned in float64, where the difference of two
float32 numbers is exact unless their exponents differ by more than 29).

A worker applies payloads with ``apply_payload``; a delta whose version is not the worker's version + 1
raises ``VersionMismatchError`` (the worker is out of step: the DPGS driver then resynchronises it with
``held``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from dpgs.compression import wire
from dpgs.compression.dtypes import VALUE_DTYPES, ValueDtype, get_value_dtype, to_bits
from dpgs.compression.layout import ParamLayout
from dpgs.compression.sparsify import check_finite, dense_positions, keep_count, sparsify_
from dpgs.compression.wire import PayloadError


class VersionMismatchError(PayloadError):
    """A delta payload does not follow the worker's version; the worker needs a snapshot."""

    def __init__(self, worker_version: int, payload_version: int):
        super().__init__(f"version mismatch: worker holds version {worker_version}, the delta payload "
                         f"produces version {payload_version} (needs {worker_version + 1}); "
                         "request a snapshot")
        self.worker_version = worker_version
        self.payload_version = payload_version


@dataclass(frozen=True)
class BroadcastMeta:
    """Accounting of one broadcast payload."""

    version: int
    snapshot: bool
    numel: int
    count: int
    payload_bytes: int
    dense_bytes: int
    ratio: float
    encode_ms: float


_FP32 = VALUE_DTYPES["fp32"]


def _flat32(params: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(params):
        raise ValueError(f"params must be a floating-point tensor, got {params.dtype}")
    return params.detach().reshape(-1).to("cpu", torch.float32)


def encode_snapshot(values: torch.Tensor, version: int, zstd_level: int = 3) -> bytes:
    """Dense fp32 snapshot payload (workers replace their parameters with it)."""
    return wire.encode(kind=wire.KIND_SNAPSHOT, numel=values.numel(), indices=None,
                       value_bits=to_bits(values, _FP32), dtype=_FP32, version=version, zstd_level=zstd_level)


class DeltaBroadcaster:
    """Master-side encoder of parameter updates for the workers (module docstring)."""

    def __init__(self, value_dtype: str = "fp16", dense_sync_every: int | None = 100,
                 layout: ParamLayout | None = None, dense_min_numel: int = 0, zstd_level: int = 3,
                 exact_max_numel: int = 1 << 20, sample_ratio: float = 0.01, seed: int = 0):
        if dense_sync_every is not None and dense_sync_every < 1:
            raise ValueError(f"dense_sync_every must be >= 1 or None, got {dense_sync_every}")
        self.dtype = get_value_dtype(value_dtype)
        self.dense_sync_every = dense_sync_every
        self.layout = layout
        self.dense_min_numel = int(dense_min_numel)
        self.zstd_level = int(zstd_level)
        self.exact_max_numel = int(exact_max_numel)
        self.sample_ratio = float(sample_ratio)
        self.generator = torch.Generator().manual_seed(seed)
        self.held: torch.Tensor | None = None
        self.version = 0
        self.steps_since_sync = 0
        self._ranges = np.zeros((0, 2), dtype=np.int64)
        self._dense_pos = torch.zeros(0, dtype=torch.long)
        self._magnitude: torch.Tensor | None = None
        self.last_meta: BroadcastMeta | None = None

    def restart(self, held: torch.Tensor, version: int) -> None:
        """Continue from workers that hold ``held`` at ``version`` (a new run, a resume or a resync): the next
        ``step`` sends the delta from ``held`` to the new parameters as version ``version + 1``."""
        held = _flat32(held)
        if self._magnitude is None or self._magnitude.numel() != held.numel():
            self._setup(held.numel())
        check_finite(held, self._magnitude, "params")
        self.held = held.clone()
        self.version = int(version)
        self.steps_since_sync = 0

    def state_dict(self) -> dict:
        """``held``, the version, the steps since the last snapshot and the selection generator."""
        return {"held": None if self.held is None else self.held.clone(), "version": self.version,
                "steps_since_sync": self.steps_since_sync, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if state["held"] is None:
            self.held = None
        else:
            self.restart(state["held"], state["version"])
        self.version = int(state["version"])
        self.steps_since_sync = int(state["steps_since_sync"])
        self.generator.set_state(state["generator"])

    def _setup(self, n: int) -> None:
        if self.layout is not None:
            if self.layout.numel != n:
                raise ValueError(f"params have {n} elements, the layout has {self.layout.numel}")
            self._ranges = self.layout.with_dense_min_numel(self.dense_min_numel).dense_ranges()
        elif 0 < n < self.dense_min_numel:
            self._ranges = np.array([[0, n]], dtype=np.int64)
        self._dense_pos = dense_positions(self._ranges, torch.device("cpu"))
        self._magnitude = torch.empty(n, dtype=torch.float32)

    def step(self, params: torch.Tensor, keep_ratio: float) -> tuple[bytes, BroadcastMeta]:
        """Payload bringing in-sync workers from ``version`` to ``version + 1`` towards ``params``,
        sending the top ``keep_ratio`` fraction (in [0, 1]) of ``params - held`` (or a snapshot, above)."""
        start = time.perf_counter()
        if not 0.0 <= keep_ratio <= 1.0:
            raise ValueError(f"keep_ratio must be in [0, 1], got {keep_ratio}")
        params = _flat32(params)
        n = params.numel()
        if self.held is not None and n != self.held.numel():
            raise ValueError(f"params have {n} elements, the broadcaster holds {self.held.numel()}")
        periodic = self.dense_sync_every is not None and self.steps_since_sync + 1 >= self.dense_sync_every
        dense = self.held is None or periodic
        if self.held is None:
            self._setup(n)
        if dense:
            check_finite(params, self._magnitude, "params")
            self.held = params.clone()
            self.version += 1
            self.steps_since_sync = 0
            payload, count = encode_snapshot(self.held, self.version, self.zstd_level), n
        else:
            delta = params - self.held
            k = keep_count(keep_ratio, n - int(self._ranges[:, 1].sum()))
            sent = sparsify_(delta, k, ranges=self._ranges, dense_pos=self._dense_pos, dtype=self.dtype,
                             clip_norm=None, magnitude=self._magnitude, exact_max_numel=self.exact_max_numel,
                             sample_ratio=self.sample_ratio, generator=self.generator)
            wire.add_sparse_(self.held, sent.positions, sent.values)  # the workers' exact operation
            self.version += 1
            self.steps_since_sync += 1
            every = sent.positions is None
            payload = wire.encode(kind=wire.KIND_DELTA, numel=n,
                                  indices=None if every else sent.indices.numpy(),
                                  value_bits=to_bits(sent.values, self.dtype), dtype=self.dtype,
                                  ranges=None if every else self._ranges, version=self.version,
                                  zstd_level=self.zstd_level)
            count = sent.indices.numel()
        self.last_meta = BroadcastMeta(self.version, dense, n, count, len(payload), 4 * n,
                                       4 * n / len(payload), (time.perf_counter() - start) * 1e3)
        return payload, self.last_meta


def apply_payload(flat: torch.Tensor, payload: bytes, version: int | None,
                  expected_dtype: ValueDtype | None = None) -> int:
    """Worker side: apply a delta or snapshot payload to the float32 vector ``flat`` in place and return
    the new version. ``version`` is the worker's current version (None = nothing received yet, only a
    snapshot is accepted). Raises ``VersionMismatchError`` for a delta that does not follow ``version`` and
    ``PayloadError`` for invalid payloads; ``flat`` is untouched on error."""
    if flat.dtype != torch.float32 or flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D float32 tensor, got {flat.dim()}-D {flat.dtype}")
    decoded = wire.decode(payload, expected_numel=flat.numel(), expected_dtype=expected_dtype,
                          expected_kinds=(wire.KIND_DELTA, wire.KIND_SNAPSHOT))
    header = decoded.header
    if header.kind == wire.KIND_DELTA and (version is None or header.version != version + 1):
        raise VersionMismatchError(-1 if version is None else version, header.version)
    if header.kind == wire.KIND_SNAPSHOT:
        flat.copy_(decoded.values)
    else:
        wire.add_sparse_(flat, decoded.positions, decoded.values)
    return header.version
