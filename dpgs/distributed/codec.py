"""DPGS's use of the DMGC codec (``dpgs.compression``), worker to master and back.

* Up: each worker's :class:`GradientEncoder` keeps its error-feedback residual in a
  :class:`~dpgs.compression.TopKCompressor` over the model's trainable-parameter layout (tensors with
  fewer than ``dense_min_numel`` elements are sent dense inside the same payload). The master, and with
  ``downlink=gradients`` every worker, sums the step's payloads with a :class:`GradientDecoder`, which
  accepts only the configured wire format and layout and adds each payload's entries straight into one
  float32 buffer.
* Down (``downlink=delta``): the master's :class:`DeltaEncoder` wraps a
  :class:`~dpgs.compression.DeltaBroadcaster` (top-k weight deltas with the master's own residual; a
  dense snapshot every ``dense_sync_every`` steps); workers apply them with :func:`apply_delta`.
* ``wire=dgc`` is the baseline of the bandwidth experiments: the same top-k selection and error
  feedback, encoded as DGC does (raw int32 indices and fp32 values, no entropy coding).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np
import torch

from dpgs.compression import (
    KIND_GRADIENT,
    VALUE_DTYPES,
    DeltaBroadcaster,
    KeepRatioSchedule,
    ParamLayout,
    PayloadError,
    TopKCompressor,
    VersionMismatchError,
    apply_payload,
    decode,
)
from dpgs.compression.wire import add_sparse_
from dpgs.config.schema import CompressionConfig

DGC_MAGIC = b"DGC1"
_DGC_HEADER = struct.Struct("<4sQQ")
EXACT_TOPK_MAX_NUMEL = 1 << 16  # above this the sampled selection is faster (measured, docs/compression.md)


def keep_ratio_at(cfg: CompressionConfig, epoch_progress: float) -> float:
    """Keep ratio at a point of training (``epoch_progress`` = completed epochs, fractional).

    With ``warmup_epochs = W`` the ratio follows DGC's warm-up 25%, 6.25%, 1.5625%, ... for the first W
    epochs (never below the target), then the target.
    """
    if cfg.warmup_epochs == 0 or cfg.keep_ratio >= 1.0:
        return cfg.keep_ratio
    schedule = KeepRatioSchedule.exponential(cfg.keep_ratio, epochs=cfg.warmup_epochs)
    return schedule.ratio(int(epoch_progress))


def encode_dgc(dense_sent: torch.Tensor) -> bytes:
    """DGC-style payload of the sent entries: header, int32 indices, fp32 values (no entropy coding)."""
    idx = torch.nonzero(dense_sent, as_tuple=True)[0]
    values = dense_sent[idx].numpy().astype("<f4")
    return (
        _DGC_HEADER.pack(DGC_MAGIC, dense_sent.numel(), idx.numel())
        + idx.numpy().astype("<i4").tobytes()
        + values.tobytes()
    )


def decode_dgc(payload: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64, values float32) of a DGC-style payload for a vector of ``numel`` elements.

    Everything is checked against the header and ``numel`` before any allocation: magic, size, entry
    count, strictly increasing in-range indices, finite values. Any problem raises ``PayloadError``.
    """
    if len(payload) < _DGC_HEADER.size:
        raise PayloadError(
            f"DGC payload of {len(payload)} bytes is shorter than its {_DGC_HEADER.size}-byte header"
        )
    magic, declared, count = _DGC_HEADER.unpack_from(payload)
    if magic != DGC_MAGIC:
        raise PayloadError(f"bad magic {magic!r}: not a DGC payload (expected {DGC_MAGIC!r})")
    if declared != numel:
        raise PayloadError(f"DGC payload is for {declared} elements, expected {numel}")
    if count > numel:
        raise PayloadError(f"DGC payload claims {count} entries for {numel} elements")
    if len(payload) != _DGC_HEADER.size + 8 * count:
        raise PayloadError(
            f"DGC payload has {len(payload)} bytes, its header promises {count} entries "
            f"({_DGC_HEADER.size + 8 * count} bytes)"
        )
    body = memoryview(payload)[_DGC_HEADER.size :]
    idx = np.frombuffer(body[: 4 * count], dtype="<i4").astype(np.int64)
    if count and (idx[0] < 0 or idx[-1] >= numel or (np.diff(idx) <= 0).any()):
        raise PayloadError("DGC payload indices are not strictly increasing within [0, numel)")
    values = torch.from_numpy(np.frombuffer(body[4 * count :], dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(values).all()):
        raise PayloadError("DGC payload holds a non-finite value")
    return torch.from_numpy(idx), values


@dataclass(frozen=True)
class EncodeStats:
    seconds: float
    dense_bytes: int
    count: int


class GradientEncoder:
    """Worker side: top-k with error feedback over the model's trainable parameters."""

    def __init__(self, cfg: CompressionConfig, model: torch.nn.Module):
        self.cfg = cfg
        self.layout = ParamLayout.from_module(model, dense_min_numel=cfg.dense_min_numel)
        self.compressor = self._compressor()

    def _compressor(self) -> TopKCompressor:
        cfg = self.cfg
        return TopKCompressor(
            keep_ratio=cfg.keep_ratio,
            clip_norm=cfg.clip_norm,
            value_dtype="fp32" if cfg.wire == "dgc" else cfg.value_dtype,
            zstd_level=cfg.zstd_level,
            momentum_correction=cfg.momentum_correction,
            dense_min_numel=cfg.dense_min_numel,
            layout=self.layout,
            exact_max_numel=EXACT_TOPK_MAX_NUMEL,
        )

    def encode(self, grad: torch.Tensor, keep_ratio: float) -> tuple[bytes, EncodeStats]:
        start = time.perf_counter()
        self.compressor.keep_ratio = keep_ratio
        payload = self.compressor.compress(grad)
        stats = self.compressor.last_stats
        if self.cfg.wire == "dgc":
            payload = encode_dgc(decode(payload).to_dense())
        return payload, EncodeStats(time.perf_counter() - start, stats.dense_bytes, stats.count)

    def reset(self) -> None:
        """A new fold: forget the residual (and the momentum)."""
        self.compressor = self._compressor()

    def state_dict(self) -> dict:
        """The error-feedback state (residual, momentum, step, selection generator) for checkpoints."""
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state)


class GradientDecoder:
    """Sums the workers' gradient payloads of a step into one float32 vector, validating each.

    Only the configured wire format is accepted, with the model's element count and the configured value
    dtype; an empty payload stands for a worker that had no bag in the step.
    """

    def __init__(self, cfg: CompressionConfig, numel: int):
        self.wire = cfg.wire
        self.dtype = VALUE_DTYPES["fp32" if cfg.wire == "dgc" else cfg.value_dtype]
        self.numel = numel

    def sum_into(self, total: torch.Tensor, payloads: list[bytes], counts: list[int]) -> torch.Tensor:
        """``total += sum_w decode(payloads[w])`` in worker order; ``counts[w]``: bags worker w had."""
        for worker, (payload, count) in enumerate(zip(payloads, counts, strict=True)):
            if count == 0 or not payload:
                if count != 0 or payload:
                    raise PayloadError(f"worker {worker} sent {len(payload)} bytes for {count} bags")
                continue
            try:
                if self.wire == "dgc":
                    add_sparse_(total, *decode_dgc(payload, self.numel))
                else:
                    decode(
                        payload,
                        expected_numel=self.numel,
                        expected_kinds=(KIND_GRADIENT,),
                        expected_dtype=self.dtype,
                    ).add_to(total)
            except PayloadError as err:
                raise PayloadError(f"gradient payload of worker {worker}: {err}") from None
        return total


class DeltaEncoder:
    """Master side of ``downlink=delta``: versioned top-k weight deltas with the master's residual."""

    def __init__(self, cfg: CompressionConfig):
        self.broadcaster = DeltaBroadcaster(
            keep_ratio=cfg.keep_ratio,
            value_dtype=cfg.value_dtype,
            dense_sync_every=cfg.dense_sync_every,
            dense_min_numel=cfg.dense_min_numel,
            zstd_level=cfg.zstd_level,
            exact_max_numel=EXACT_TOPK_MAX_NUMEL,
        )

    def start(self, params: torch.Tensor, version: int) -> None:
        """Workers hold ``params`` at ``version`` (new fold, resume, resync)."""
        self.broadcaster.restart(params, version)

    @property
    def held(self) -> torch.Tensor:
        """What in-sync workers hold (the master's parameters minus the broadcast residual)."""
        return self.broadcaster.held

    def update(self, params: torch.Tensor, keep_ratio: float) -> bytes:
        self.broadcaster.keep_ratio = keep_ratio
        payload, _ = self.broadcaster.step(params)
        return payload


def apply_delta(flat: torch.Tensor, version: int, payload: bytes, value_dtype: str) -> int:
    """Worker side of ``downlink=delta``: apply the master's delta (or snapshot) to ``flat`` in place;
    returns the new version. Raises ``PayloadError`` (``VersionMismatchError`` for an out-of-order delta)."""
    return apply_payload(flat, payload, version, expected_dtype=VALUE_DTYPES[value_dtype])


__all__ = ["VersionMismatchError", "apply_delta", "decode_dgc", "encode_dgc", "keep_ratio_at"]
