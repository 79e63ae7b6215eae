"""DPGS's use of the DMGC codec (``dpgs.compression``) in both directions.

* Up: each worker's :class:`GradientEncoder` keeps its error-feedback residual in a
  :class:`~dpgs.compression.TopKCompressor` over the model's trainable-parameter layout (tensors with
  fewer than ``dense_min_numel`` elements are sent dense inside the same payload).
* Down: the master's :class:`DeltaEncoder` wraps a :class:`~dpgs.compression.DeltaBroadcaster`:
  compressed weight deltas with the master's own residual, versioned; a dense snapshot of what in-sync
  workers hold is sent on join and after a failure, and every ``dense_sync_every`` steps.
  With ``dpgs.compression.downlink=false`` the delta is sent in full (fp32).
* ``wire=dgc`` is the baseline of the bandwidth experiments: the same top-k selection and error
  feedback, but encoded as DGC does (raw int32 indices and fp32 values, no entropy coding).
"""

from __future__ import annotations

import struct
import time

import numpy as np
import torch

from dpgs.compression import (
    DeltaBroadcaster,
    KeepRatioSchedule,
    ParamLayout,
    PayloadError,
    TopKCompressor,
    VersionMismatchError,
    apply_payload,
    decompress,
)
from dpgs.config.schema import CompressionConfig

VersionMismatch = VersionMismatchError
DGC_MAGIC = b"DGC1"
_DGC_HEADER = struct.Struct("<4sQQ")


def keep_ratio_at(cfg: CompressionConfig, epoch_progress: float, total_epochs: int) -> float:
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
        + (values.tobytes())
    )


def decode_dgc(payload: bytes) -> torch.Tensor:
    if len(payload) < _DGC_HEADER.size:
        raise PayloadError("DGC payload shorter than its header")
    _, numel, count = _DGC_HEADER.unpack_from(payload)
    if len(payload) != _DGC_HEADER.size + 8 * count:
        raise PayloadError(f"DGC payload has {len(payload)} bytes, header promises {count} entries")
    body = memoryview(payload)[_DGC_HEADER.size :]
    idx = np.frombuffer(body[: 4 * count], dtype="<i4").astype(np.int64)
    if count and (idx.min() < 0 or idx.max() >= numel):
        raise PayloadError("DGC payload index out of range")
    dense = torch.zeros(numel, dtype=torch.float32)
    dense[torch.from_numpy(idx)] = torch.from_numpy(np.frombuffer(body[4 * count :], dtype="<f4").copy())
    return dense


def decode_gradient(payload: bytes) -> torch.Tensor:
    """Dense float32 gradient of a worker payload (either wire format), validated."""
    if payload[:4] == DGC_MAGIC:
        return decode_dgc(payload)
    return decompress(payload)


class GradientEncoder:
    """Worker side: top-k with error feedback over the model's trainable parameters."""

    def __init__(self, cfg: CompressionConfig, model: torch.nn.Module):
        self.cfg = cfg
        layout = ParamLayout.from_module(model, dense_min_numel=cfg.dense_min_numel)
        self.compressor = TopKCompressor(
            keep_ratio=cfg.keep_ratio,
            clip_norm=cfg.clip_norm,
            value_dtype="fp32" if cfg.wire == "dgc" else cfg.value_dtype,
            zstd_level=cfg.zstd_level,
            momentum_correction=cfg.momentum_correction,
            dense_min_numel=cfg.dense_min_numel,
            layout=layout,
        )

    def encode(self, grad: torch.Tensor, keep_ratio: float) -> tuple[bytes, dict]:
        start = time.perf_counter()
        self.compressor.keep_ratio = keep_ratio
        payload = self.compressor.compress(grad)
        stats = self.compressor.last_stats
        if self.cfg.wire == "dgc":
            payload = encode_dgc(decompress(payload))
        return payload, {
            "encode_seconds": time.perf_counter() - start,
            "dense_bytes": stats.dense_bytes,
            "count": stats.count,
            "selection_ms": stats.selection_ms,
        }


class DeltaEncoder:
    """Master side: versioned weight updates for the workers."""

    def __init__(self, cfg: CompressionConfig):
        compress_down = cfg.downlink and cfg.keep_ratio < 1.0
        self.broadcaster = DeltaBroadcaster(
            keep_ratio=cfg.keep_ratio if compress_down else 1.0,
            value_dtype=cfg.value_dtype if compress_down else "fp32",
            dense_sync_every=cfg.dense_sync_every,
            dense_min_numel=cfg.dense_min_numel,
            zstd_level=cfg.zstd_level,
        )
        self.compress_down = compress_down

    def snapshot(self, flat: torch.Tensor) -> bytes:
        """Dense weights that in-sync workers hold (the first call starts the broadcast)."""
        if self.broadcaster.held is None:
            payload, _ = self.broadcaster.step(flat)
            return payload
        return self.broadcaster.snapshot()

    def update(self, flat: torch.Tensor, keep_ratio: float) -> tuple[bytes, dict]:
        if self.compress_down:
            self.broadcaster.keep_ratio = keep_ratio
        payload, meta = self.broadcaster.step(flat)
        return payload, {"dense_bytes": meta.dense_bytes, "snapshot": meta.snapshot}


def apply_update(flat: torch.Tensor, version: int | None, payload: bytes) -> tuple[torch.Tensor, int]:
    """Worker side: (new flat params, new version); raises VersionMismatch for an out-of-order delta."""
    flat = flat.clone()
    return flat, apply_payload(flat, payload, version)
