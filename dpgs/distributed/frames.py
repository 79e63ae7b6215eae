"""The master's per-step message to the workers: one validated binary frame.

Layout (little-endian)::

    header  struct "<4sBQdII3x": magic b"DPGF", kind, version (u64, the model version after the step),
            clip (f64, the factor every rank multiplies the step's mean gradient by), n_parts (u32),
            checksum (u32: CRC-32 of the header with these four bytes zero, then the sizes), 3 zero bytes
            (so the first part starts 8-byte aligned: a dense part is read in place as float32)
    sizes   n_parts u64
    parts   concatenated (compressed parts carry their own CRC-32: ``dpgs.compression.wire``)

Kinds (each names its parts; the last part is always the merged floating-point buffers as raw float32,
empty for a model without BatchNorm):

* ``KIND_GRADIENTS``: no part of its own: the step's other worker payloads were relayed during the gather
  (``Channel.recv_relayed``), and the frame brings the clip factor and the buffers (``downlink=gradients``,
  compressed);
* ``KIND_SUM``: the sum of the workers' gradients as raw float32 (``downlink=gradients``, dense, or when
  the P payloads would be larger than the sum);
* ``KIND_DELTA``: the master's top-k weight-delta payload (``downlink=delta``, compressed);
* ``KIND_WEIGHTS``: the master's parameters as raw float32 (``downlink=delta``, dense).

The receiver says which kinds it accepts and how many parts each has, the version it expects and the
buffer size, and :func:`decode_frame` refuses anything else with ``PayloadError`` before the frame is used.
Frames are built and read as ``uint8`` tensors; the parts of a decoded frame are views (no copy).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from dpgs.compression import PayloadError

MAGIC = b"DPGF"
HEADER = struct.Struct("<4sBQdII3x")
_CHECKSUM_OFFSET = HEADER.size - 7
KIND_GRADIENTS, KIND_DELTA, KIND_SUM, KIND_WEIGHTS = 1, 2, 3, 4
KIND_NAMES = {KIND_GRADIENTS: "gradients", KIND_DELTA: "delta", KIND_SUM: "sum", KIND_WEIGHTS: "weights"}


@dataclass(frozen=True)
class Frame:
    kind: int
    version: int
    clip: float
    parts: list[torch.Tensor]  # uint8 views into the received message

    def floats(self, index: int, numel: int, what: str) -> torch.Tensor:
        """Part ``index`` as ``numel`` float32 values (a view); PayloadError when its size differs."""
        part = self.parts[index]
        if part.numel() != 4 * numel:
            raise PayloadError(f"frame {what} part has {part.numel()} bytes, expected {4 * numel}")
        aligned = part if part.storage_offset() % 4 == 0 else part.clone()
        return aligned.view(torch.float32)

    def buffers(self, numel: int) -> torch.Tensor | None:
        """The last part as ``numel`` float32 buffers (None when the model has none)."""
        values = self.floats(len(self.parts) - 1, numel, "buffers")
        return values.clone() if numel else None


def as_part(data: bytes | torch.Tensor | None) -> torch.Tensor:
    """A frame part from payload bytes, a tensor (its raw bytes) or None (empty)."""
    if data is None:
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(data, torch.Tensor):
        return data.contiguous().reshape(-1).view(torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def buffers_part(buffers: torch.Tensor | None) -> torch.Tensor:
    """The buffers part of a frame (float32)."""
    return as_part(None if buffers is None else buffers.to(torch.float32))


def frame_bytes(part_sizes: list[int]) -> int:
    """The size of a frame whose parts have ``part_sizes`` bytes (what :func:`encode_frame` returns)."""
    return HEADER.size + 8 * len(part_sizes) + sum(part_sizes)


def encode_frame(kind: int, version: int, clip: float, parts: list[torch.Tensor]) -> torch.Tensor:
    """The frame as one ``uint8`` tensor (``parts``: uint8 tensors, see :func:`as_part`)."""
    sizes = struct.pack(f"<{len(parts)}Q", *(p.numel() for p in parts))
    unsigned = HEADER.pack(MAGIC, kind, version, clip, len(parts), 0)
    head = HEADER.pack(MAGIC, kind, version, clip, len(parts), zlib.crc32(unsigned + sizes)) + sizes
    return torch.cat([torch.frombuffer(bytearray(head), dtype=torch.uint8), *parts])


def decode_frame(data: torch.Tensor, *, parts_of: dict[int, int], version: int) -> Frame:
    """Validate ``data`` against what the receiver expects (``parts_of``: accepted kind -> its number of
    parts); raise ``PayloadError`` otherwise."""
    raw = data.numpy()
    if raw.size < HEADER.size:
        raise PayloadError(f"frame of {raw.size} bytes is shorter than its {HEADER.size}-byte header")
    magic, kind, got_version, clip, n_parts, checksum = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}: not a DPGS frame (expected {MAGIC!r})")
    offset = HEADER.size + 8 * n_parts
    if raw.size < offset:
        raise PayloadError(f"frame of {raw.size} bytes cannot hold its {n_parts} part sizes")
    signed = bytes(raw[:_CHECKSUM_OFFSET]) + bytes(4) + bytes(raw[_CHECKSUM_OFFSET + 4 : offset])
    if zlib.crc32(signed) != checksum:
        raise PayloadError("frame header checksum mismatch: the header or the part sizes are corrupt")
    if kind not in parts_of:
        wanted = " or ".join(KIND_NAMES[k] for k in parts_of)
        raise PayloadError(f"a {KIND_NAMES.get(kind, kind)} frame where a {wanted} frame is expected")
    if got_version != version:
        raise PayloadError(f"frame for version {got_version}, expected {version}")
    if n_parts != parts_of[kind]:
        raise PayloadError(f"frame with {n_parts} parts, expected {parts_of[kind]}")
    if not (np.isfinite(clip) and 0.0 < clip <= 1.0):
        raise PayloadError(f"frame clip factor {clip} is not in (0, 1]")
    sizes = struct.unpack_from(f"<{n_parts}Q", raw, HEADER.size)
    if offset + sum(sizes) != raw.size:
        raise PayloadError(f"frame parts add up to {sum(sizes)} bytes, the frame carries {raw.size - offset}")
    parts = []
    for size in sizes:
        parts.append(data[offset : offset + size])
        offset += size
    return Frame(kind, version, clip, parts)
