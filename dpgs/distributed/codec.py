"""DPGS's use of the DMGC codec (``dpgs.compression``): the uplink (worker to master) and the weight-delta
downlink, each with its state and ``state_dict``.

* :class:`Uplink`: a worker encodes its gradient sum at the step's keep ratio. Below 1 it is top-k with
  error feedback (a :class:`~dpgs.compression.TopKCompressor` over the model's trainable-parameter layout;
  tensors with fewer than ``dense_min_numel`` elements go dense inside the same payload); at 1 it is the
  raw float32 vector, plus whatever the residual still held (which is then empty: nothing is ever lost
  when a run switches from sparse to dense). The master, and with ``downlink=gradients`` every worker,
  sums a step's messages in worker order into one float32 buffer, accepting only the configured wire
  format, layout and value dtype.
* :class:`DeltaDownlink` (``downlink=delta``): the master's versioned top-k weight deltas with its own
  residual (a :class:`~dpgs.compression.DeltaBroadcaster`); workers apply them with :func:`apply_delta`.
* ``wire=dgc`` is the baseline of the bandwidth experiments: the same top-k selection and error feedback,
  encoded as DGC does (raw int32 indices and fp32 values, no entropy coding).
"""

from __future__ import annotations

import copy
import struct
import time

import numpy as np
import torch

from dpgs.compression import (
    KIND_GRADIENT,
    VALUE_DTYPES,
    DeltaBroadcaster,
    ParamLayout,
    PayloadError,
    TopKCompressor,
    apply_payload,
    decode,
)
from dpgs.compression.wire import add_sparse_
from dpgs.config.schema import CompressionConfig

DGC_MAGIC = b"DGC1"
_DGC_HEADER = struct.Struct("<4sQQ")
EXACT_TOPK_MAX_NUMEL = 1 << 16  # above this the sampled selection is faster (measured, docs/compression.md)

Addend = tuple[torch.Tensor | None, torch.Tensor] | None
"""A decoded message: ``(positions, values)`` to add to a sum (positions None: every element, in order), or
None for a worker without bags."""


def encode_dgc(dense_sent: torch.Tensor) -> bytes:
    """DGC-style payload of the sent entries: header, int32 indices, fp32 values (no entropy coding)."""
    idx = torch.nonzero(dense_sent, as_tuple=True)[0]
    values = dense_sent[idx].numpy().astype("<f4")
    return (
        _DGC_HEADER.pack(DGC_MAGIC, dense_sent.numel(), idx.numel())
        + idx.numpy().astype("<i4").tobytes()
        + values.tobytes()
    )


def decode_dgc(payload, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64, values float32) of a DGC-style payload (bytes-like) for ``numel`` elements.

    Everything is checked against the header and ``numel`` before any allocation: magic, size, entry
    count, strictly increasing in-range indices, finite values. Any problem raises ``PayloadError``.
    """
    payload = memoryview(payload).cast("B")
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
    body = payload[_DGC_HEADER.size :]
    idx = np.frombuffer(body[: 4 * count], dtype="<i4").astype(np.int64)
    if count and (idx[0] < 0 or idx[-1] >= numel or (np.diff(idx) <= 0).any()):
        raise PayloadError("DGC payload indices are not strictly increasing within [0, numel)")
    values = torch.from_numpy(np.frombuffer(body[4 * count :], dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(values).all()):
        raise PayloadError("DGC payload holds a non-finite value")
    return torch.from_numpy(idx), values


class Uplink:
    """Worker to master: a worker's gradient sum at a keep ratio, and the sum of a step's messages."""

    def __init__(self, cfg: CompressionConfig, layout: ParamLayout):
        self.wire = cfg.wire
        self.numel = layout.numel
        self.dtype = VALUE_DTYPES["fp32" if cfg.wire == "dgc" else cfg.value_dtype]
        self.compressor = TopKCompressor(
            clip_norm=cfg.clip_norm,
            value_dtype="fp32" if cfg.wire == "dgc" else cfg.value_dtype,
            zstd_level=cfg.zstd_level,
            momentum_correction=cfg.momentum_correction,
            dense_min_numel=cfg.dense_min_numel,
            layout=layout,
            exact_max_numel=EXACT_TOPK_MAX_NUMEL,
            ranking=cfg.ranking,
        )

    def encode(self, grad: torch.Tensor, keep_ratio: float) -> bytes | torch.Tensor:
        """What a worker sends for ``grad`` (flat float32): raw float32 at ``keep_ratio >= 1`` (a vector this
        codec keeps no hold of: ``grad`` itself or the emptied residual), else the payload of the top
        ``keep_ratio`` of ``residual + grad``."""
        if keep_ratio >= 1.0:
            return self.compressor.flush(grad)
        payload = self.compressor.compress(grad, keep_ratio)
        if self.wire == "dgc":
            payload = encode_dgc(decode(payload).to_dense())
        return payload

    def decode_part(self, worker: int, part: torch.Tensor, count: int, keep_ratio: float) -> Addend:
        """Worker ``worker``'s message validated and decoded, ready to add (:data:`Addend`). ``part``: raw
        float32 at ``keep_ratio >= 1``, else a payload; ``count``: the bags it had (an empty message stands
        for a worker without bags, and only for one)."""
        if count == 0 or part.numel() == 0:
            if count != 0 or part.numel():
                raise PayloadError(f"worker {worker} sent {part.numel()} bytes for {count} bags")
            return None
        if keep_ratio >= 1.0:
            if part.numel() != 4 * self.numel:
                raise PayloadError(f"worker {worker} sent {part.numel()} bytes of dense gradient, "
                                   f"expected {4 * self.numel}")
            return None, part.view(torch.float32)
        try:
            if self.wire == "dgc":
                return decode_dgc(part.numpy(), self.numel)
            decoded = decode(memoryview(part.numpy()), expected_numel=self.numel,
                             expected_kinds=(KIND_GRADIENT,), expected_dtype=self.dtype)
            return decoded.positions, decoded.values
        except PayloadError as err:
            raise PayloadError(f"gradient payload of worker {worker}: {err}") from None

    def sum_into(
        self, total: torch.Tensor, parts: list[torch.Tensor], counts: list[int], keep_ratio: float,
        decoded: dict[int, Addend] | None = None,
    ) -> torch.Tensor:
        """``total += sum_w part_w`` in worker order, one float32 addition per element a message carries (so
        every rank that sums the same messages gets the same bits). ``parts``, ``counts``: as in
        :meth:`decode_part`; ``decoded``: messages some workers' :meth:`decode_part` already gave (by
        worker; their ``parts`` entries are not read)."""
        for worker, (part, count) in enumerate(zip(parts, counts, strict=True)):
            if decoded is not None and worker in decoded:
                addend = decoded[worker]
            else:
                addend = self.decode_part(worker, part, count, keep_ratio)
            if addend is not None:
                add_sparse_(total, *addend)
        return total

    def codec_seconds(self, grad: torch.Tensor, keep_ratio: float, decodes: int) -> float:
        """Seconds to encode ``grad`` at ``keep_ratio`` < 1 and to decode and sum ``decodes`` messages of its
        payload's size: the codec of one step of this worker (its encode, then a step's P payloads summed).
        Run on a copy of the error-feedback state (this codec is left as it was), on a copy of ``grad``."""
        scratch, grad, total = copy.deepcopy(self), grad.clone(), torch.zeros(self.numel)
        start = time.perf_counter()  # the sum's vector is allocated once a run (Replica.gradient_buffer)
        payload = scratch.encode(grad, keep_ratio)
        part = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        scratch.sum_into(total, [part] * decodes, [1] * decodes, keep_ratio)
        return time.perf_counter() - start

    def state_dict(self) -> dict:
        """The error-feedback state (residual, momentum, step, selection generator)."""
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state)


class DeltaDownlink:
    """Master to workers with ``downlink=delta``: versioned top-k weight deltas with the master's residual
    (``held`` = what in-sync workers hold), or the weights themselves at keep ratio 1."""

    def __init__(self, cfg: CompressionConfig):
        self.value_dtype = cfg.value_dtype
        self.broadcaster = DeltaBroadcaster(
            value_dtype=cfg.value_dtype,
            dense_sync_every=cfg.dense_sync_every,
            dense_min_numel=cfg.dense_min_numel,
            zstd_level=cfg.zstd_level,
            exact_max_numel=EXACT_TOPK_MAX_NUMEL,
        )

    def restart(self, params: torch.Tensor, version: int) -> None:
        """Workers hold ``params`` at ``version`` (new fold, dense step)."""
        self.broadcaster.restart(params, version)

    @property
    def held(self) -> torch.Tensor:
        """What in-sync workers hold (the master's parameters minus the broadcast residual)."""
        return self.broadcaster.held

    def update(self, params: torch.Tensor, keep_ratio: float) -> bytes:
        """The delta payload taking in-sync workers one version towards ``params``."""
        payload, _ = self.broadcaster.step(params, keep_ratio)
        return payload

    def state_dict(self) -> dict:
        return self.broadcaster.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.broadcaster.load_state_dict(state)


def apply_delta(flat: torch.Tensor, version: int, payload: torch.Tensor, value_dtype: str) -> int:
    """Worker side of ``downlink=delta``: apply the master's delta (or snapshot) ``payload`` (uint8 tensor)
    to ``flat`` in place; returns the new version. Raises ``PayloadError`` (``VersionMismatchError`` for an
    out-of-order delta)."""
    return apply_payload(flat, memoryview(payload.numpy()), version, expected_dtype=VALUE_DTYPES[value_dtype])
