"""The master's per-step message to the workers in the compressed modes: one validated binary frame.

Layout (little-endian)::

    header  struct "<4sBQdI": magic b"DPGF", kind (1 gradients, 2 delta), version (u64, the model version
            after the step), clip (f64, the factor every gradient is multiplied by), n_parts (u32)
    sizes   n_parts u64
    parts   concatenated

``kind=gradients`` (``downlink=gradients``): parts are the step's P worker payloads in worker order, then
the merged floating-point buffers as raw float32 (empty without BatchNorm). ``kind=delta``: the master's
weight-delta payload, then the buffers. The receiver knows the kind, the version, the number of parts and
the buffer size it expects, and refuses anything else with ``PayloadError`` before using the frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from dpgs.compression import PayloadError

MAGIC = b"DPGF"
HEADER = struct.Struct("<4sBQdI")
KIND_GRADIENTS, KIND_DELTA = 1, 2
KIND_NAMES = {KIND_GRADIENTS: "gradients", KIND_DELTA: "delta"}


@dataclass(frozen=True)
class Frame:
    kind: int
    version: int
    clip: float
    parts: list[bytes]

    def buffers(self, numel: int) -> torch.Tensor | None:
        """The last part as ``numel`` float32 buffers (None when the model has none)."""
        raw = self.parts[-1]
        if len(raw) != 4 * numel:
            raise PayloadError(f"frame buffers part has {len(raw)} bytes, expected {4 * numel}")
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy()) if numel else None


def buffers_bytes(buffers: torch.Tensor | None) -> bytes:
    """The buffers part of a frame (float32)."""
    return b"" if buffers is None else buffers.to(torch.float32).numpy().astype("<f4").tobytes()


def encode_frame(kind: int, version: int, clip: float, parts: list[bytes]) -> bytes:
    sizes = struct.pack(f"<{len(parts)}Q", *(len(p) for p in parts))
    return HEADER.pack(MAGIC, kind, version, clip, len(parts)) + sizes + b"".join(parts)


def decode_frame(data: bytes, *, kind: int, version: int, n_parts: int) -> Frame:
    """Validate ``data`` against what the receiver expects; raise ``PayloadError`` otherwise."""
    if len(data) < HEADER.size:
        raise PayloadError(f"frame of {len(data)} bytes is shorter than its {HEADER.size}-byte header")
    magic, got_kind, got_version, clip, got_parts = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}: not a DPGS frame (expected {MAGIC!r})")
    if got_kind != kind:
        raise PayloadError(
            f"a {KIND_NAMES.get(got_kind, got_kind)} frame where a {KIND_NAMES[kind]} frame is expected"
        )
    if got_version != version:
        raise PayloadError(f"frame for version {got_version}, expected {version}")
    if got_parts != n_parts:
        raise PayloadError(f"frame with {got_parts} parts, expected {n_parts}")
    if not (np.isfinite(clip) and 0.0 < clip <= 1.0):
        raise PayloadError(f"frame clip factor {clip} is not in (0, 1]")
    offset = HEADER.size + 8 * n_parts
    if len(data) < offset:
        raise PayloadError(f"frame of {len(data)} bytes cannot hold its {n_parts} part sizes")
    sizes = struct.unpack_from(f"<{n_parts}Q", data, HEADER.size)
    if offset + sum(sizes) != len(data):
        raise PayloadError(
            f"frame parts add up to {sum(sizes)} bytes, the frame carries {len(data) - offset}"
        )
    parts = []
    for size in sizes:
        parts.append(data[offset : offset + size])
        offset += size
    return Frame(kind, version, clip, parts)
