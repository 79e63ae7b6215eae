"""The DMGC wire format: one self-describing, validated binary payload (no pickle).

Layout (all integers little-endian)::

    header (57 bytes, struct "<4sBBBBBQQQIQQI")
      magic         4s   b"DMGC"
      format        u8   FORMAT_VERSION
      kind          u8   0 gradient, 1 weight delta, 2 dense snapshot
      value_dtype   u8   0 fp32, 1 fp16, 2 bf16
      flags         u8   bit 0 ALL_INDICES (indices are 0..numel-1, no index section); other bits 0
      index_width   u8   bytes per index gap (1, 2, 4 or 8); 0 when there is no index section
      numel         u64  length of the dense vector
      count         u64  number of index-coded (sparse) entries
      dense_count   u64  number of entries sent in dense ranges
      n_ranges      u32  number of dense ranges
      version       u64  sender's version (model version for deltas/snapshots, step for gradients)
      body_bytes    u64  length of the compressed body that follows the header
      checksum      u32  CRC-32 of the whole payload with these four bytes set to zero
    body: one zstd frame whose content (the raw body) is, in order
      ranges        n_ranges u64 offsets, then n_ranges u64 lengths (sorted, disjoint, non-empty)
      index planes  index_width planes of count bytes: byte j of every gap (gap 0 = first index,
                    gap i = index[i] - index[i-1] >= 1), least significant plane first
      value planes  itemsize planes of (count + dense_count) bytes: byte j of every value's raw bits;
                    the count sparse values first, then the dense ranges' values in range order

The raw body size is fully determined by the header, so the decoder reads at most that many bytes from the
zstd stream (a zstd bomb cannot make it allocate more). Splitting gaps and values into byte planes, each
compressed as its own zstd block (one Huffman table per plane) is what makes the payload small: the high
planes of gaps are nearly constant, the sign/exponent byte of values has a few bits of entropy.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from dpgs.compression.dtypes import BY_CODE, ValueDtype, from_bits

MAGIC = b"DMGC"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBBBBQQQIQQI")
HEADER_SIZE = HEADER.size
_CHECKSUM_OFFSET = HEADER_SIZE - 4

KIND_GRADIENT, KIND_DELTA, KIND_SNAPSHOT = 0, 1, 2
KIND_NAMES = {KIND_GRADIENT: "gradient", KIND_DELTA: "delta", KIND_SNAPSHOT: "snapshot"}
FLAG_ALL_INDICES = 1
INDEX_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}

DEFAULT_MAX_NUMEL = 1 << 28
# A zstd block header (3 bytes) can stand for at most 128 KiB of content: no frame expands beyond this.
MAX_ZSTD_EXPANSION = (128 << 10) // 3 + 1


class PayloadError(ValueError):
    """A payload that is not a valid DMGC payload (the message says which field or check failed)."""


@dataclass(frozen=True)
class PayloadHeader:
    """Decoded header fields (see the module docstring)."""

    kind: int
    value_dtype: ValueDtype
    flags: int
    index_width: int
    numel: int
    count: int
    dense_count: int
    n_ranges: int
    version: int
    body_bytes: int

    @property
    def all_indices(self) -> bool:
        return bool(self.flags & FLAG_ALL_INDICES)

    @property
    def raw_body_bytes(self) -> int:
        """Exact size of the decompressed body implied by the header."""
        return (16 * self.n_ranges + self.count * self.index_width
                + (self.count + self.dense_count) * self.value_dtype.itemsize)


@dataclass
class DecodedPayload:
    """A validated payload: ``positions`` (int64, None for ALL_INDICES) and float32 ``values``."""

    header: PayloadHeader
    positions: torch.Tensor | None
    values: torch.Tensor

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``out += alpha * dense(self)`` in place (one float32 addition per sent element)."""
        if out.numel() != self.header.numel:
            raise PayloadError(f"payload numel {self.header.numel} != target numel {out.numel()}")
        values = self.values if alpha == 1.0 else self.values * alpha
        add_sparse_(out, self.positions, values)
        return out

    def to_dense(self) -> torch.Tensor:
        """The dense float32 vector this payload stands for (zeros where nothing was sent)."""
        if self.positions is None:
            return self.values.clone()
        out = torch.zeros(self.header.numel, dtype=torch.float32)
        out[self.positions] = self.values
        return out


def add_sparse_(out: torch.Tensor, positions: torch.Tensor | None, values: torch.Tensor) -> None:
    """``out[positions] += values`` (all of ``out`` when ``positions`` is None); positions are unique, so
    every touched element gets exactly one float32 addition, identically on master and workers."""
    if positions is None:
        out.add_(values.to(out.device))
    else:
        out.index_add_(0, positions.to(out.device), values.to(out.device))


def _planes(array: np.ndarray) -> list[bytes]:
    """Byte planes of a little-endian unsigned array, least significant first."""
    if array.size == 0:
        return []
    grid = array.view(np.uint8).reshape(-1, array.dtype.itemsize)
    return [np.ascontiguousarray(grid[:, j]).tobytes() for j in range(array.dtype.itemsize)]


def _unplane(raw: memoryview, offset: int, n: int, dtype: str) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    planes = np.frombuffer(raw, dtype=np.uint8, count=n * width, offset=offset).reshape(width, n)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(n)


def gap_width(indices: np.ndarray) -> int:
    """Smallest of 1, 2, 4, 8 bytes that holds every gap of the sorted ``indices``."""
    if indices.size == 0:
        return 0
    largest = int(max(indices[0], np.diff(indices).max(initial=0)))
    return next(w for w in (1, 2, 4, 8) if largest < 1 << (8 * w))


def encode(*, kind: int, numel: int, indices: np.ndarray | None, value_bits: np.ndarray, dtype: ValueDtype,
           ranges: np.ndarray | None = None, version: int = 0, zstd_level: int = 3) -> bytes:
    """Build a payload. ``indices``: sorted unique int64 positions of the sparse values (None = all
    positions, ``value_bits`` then holds numel values); ``value_bits``: raw bits (``dtype.bits_dtype``) of the
    sparse values followed by the dense ranges' values; ``ranges``: int64 array [n, 2] of (offset, length)."""
    ranges = np.zeros((0, 2), dtype=np.int64) if ranges is None else np.asarray(ranges, dtype=np.int64)
    dense_count = int(ranges[:, 1].sum())
    flags = 0
    if indices is None:
        flags |= FLAG_ALL_INDICES
        count, width, gaps = numel, 0, None
        if ranges.shape[0]:
            raise ValueError("ALL_INDICES payloads cannot carry dense ranges")
    else:
        indices = np.asarray(indices, dtype=np.int64)
        count, width = int(indices.size), gap_width(indices)
        gaps = np.diff(indices, prepend=0).astype(INDEX_WIDTHS[width]) if count else None
    if value_bits.size != count + dense_count:
        raise ValueError(f"{value_bits.size} values for {count} sparse + {dense_count} dense entries")
    streams = [np.concatenate([ranges[:, 0], ranges[:, 1]]).astype("<u8").tobytes()] if len(ranges) else []
    if gaps is not None:
        streams += _planes(gaps)
    streams += _planes(np.ascontiguousarray(value_bits).astype(dtype.bits_dtype, copy=False))
    raw_size = sum(len(s) for s in streams)
    compressor = zstandard.ZstdCompressor(level=zstd_level).compressobj(size=raw_size)
    chunks = []
    for stream in streams:  # one zstd block (one entropy table) per plane, all in one frame
        chunks.append(compressor.compress(stream))
        chunks.append(compressor.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    chunks.append(compressor.flush())
    body = b"".join(chunks)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, kind, dtype.code, flags, width, numel, count, dense_count,
                         len(ranges), version, len(body), 0)
    checksum = zlib.crc32(body, zlib.crc32(header))
    return header[:_CHECKSUM_OFFSET] + struct.pack("<I", checksum) + body


def read_header(payload: bytes, *, max_numel: int = DEFAULT_MAX_NUMEL) -> PayloadHeader:
    """Parse and validate the header (and the checksum over the whole payload); raise ``PayloadError``."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise PayloadError(f"payload must be bytes, got {type(payload).__name__}")
    payload = memoryview(payload).cast("B")
    if len(payload) < HEADER_SIZE:
        raise PayloadError(f"truncated payload: {len(payload)} bytes, the header alone needs {HEADER_SIZE}")
    (magic, fmt, kind, dtype_code, flags, width, numel, count, dense_count, n_ranges, version, body_bytes,
     checksum) = HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r}: not a DMGC payload (expected {MAGIC!r})")
    if fmt != FORMAT_VERSION:
        raise PayloadError(f"unsupported format version {fmt} (this build reads version {FORMAT_VERSION})")
    actual_body = len(payload) - HEADER_SIZE
    if actual_body < body_bytes:
        raise PayloadError(f"truncated payload: header announces {body_bytes} body bytes, got {actual_body}")
    if actual_body > body_bytes:
        raise PayloadError(f"{actual_body - body_bytes} trailing bytes after the {body_bytes}-byte body")
    expected = zlib.crc32(payload[HEADER_SIZE:], zlib.crc32(bytes(payload[:_CHECKSUM_OFFSET]) + bytes(4)))
    if expected != checksum:
        raise PayloadError(f"checksum mismatch: header says {checksum:#010x}, "
                           f"payload hashes to {expected:#010x}")
    if kind not in KIND_NAMES:
        raise PayloadError(f"unknown payload kind {kind} (expected one of {sorted(KIND_NAMES)})")
    if dtype_code not in BY_CODE:
        raise PayloadError(f"unknown value dtype code {dtype_code} (expected one of {sorted(BY_CODE)})")
    if flags & ~FLAG_ALL_INDICES:
        raise PayloadError(f"unknown flags {flags:#04x}")
    if numel > max_numel:
        raise PayloadError(f"numel {numel} exceeds max_numel {max_numel}")
    if count + dense_count > numel:
        raise PayloadError(f"count {count} + dense_count {dense_count} exceeds numel {numel}")
    if n_ranges > dense_count or (dense_count > 0 and n_ranges == 0):
        raise PayloadError(f"n_ranges {n_ranges} is inconsistent with dense_count {dense_count}")
    if flags & FLAG_ALL_INDICES:
        if count != numel or width != 0:
            raise PayloadError(f"ALL_INDICES payload needs count == numel ({count} != {numel}) and "
                               f"index_width 0 (got {width})")
    elif count == 0 and width != 0:
        raise PayloadError(f"index_width {width} for a payload without sparse entries")
    elif count > 0 and width not in INDEX_WIDTHS:
        raise PayloadError(f"index_width {width} is not one of {sorted(INDEX_WIDTHS)}")
    if kind == KIND_SNAPSHOT and not flags & FLAG_ALL_INDICES:
        raise PayloadError("a snapshot payload must carry every element (ALL_INDICES flag)")
    header = PayloadHeader(kind, BY_CODE[dtype_code], flags, width, numel, count, dense_count, n_ranges,
                           version, body_bytes)
    if header.raw_body_bytes > body_bytes * MAX_ZSTD_EXPANSION:
        raise PayloadError(f"header implies a {header.raw_body_bytes}-byte body, more than a "
                           f"{body_bytes}-byte zstd frame can hold")
    return header


def _decompress_body(payload: memoryview, header: PayloadHeader) -> memoryview:
    expected = header.raw_body_bytes
    reader = zstandard.ZstdDecompressor().stream_reader(payload[HEADER_SIZE:], read_across_frames=True)
    try:
        raw = reader.read(expected) if expected else b""
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"corrupt zstd body: {exc}") from exc
    if len(raw) < expected:
        raise PayloadError(f"truncated body: decompressed {len(raw)} bytes, the header (count "
                           f"{header.count}, dense_count {header.dense_count}) implies {expected}")
    if extra:
        raise PayloadError(f"decompressed body exceeds the {expected} bytes the header "
                           f"(count {header.count}, dense_count {header.dense_count}) allows")
    return memoryview(raw)


def _ranges(raw: memoryview, header: PayloadHeader) -> np.ndarray:
    n = header.n_ranges
    flat = np.frombuffer(raw, dtype="<u8", count=2 * n).astype(np.int64)
    offsets, lengths = flat[:n], flat[n:]
    if n and ((flat < 0).any() or (lengths < 1).any()):
        raise PayloadError("dense range with length 0 or beyond 2**63")
    ends = offsets + lengths
    if n and (ends[-1] > header.numel or (ends < offsets).any()):
        raise PayloadError(f"dense range ends beyond numel {header.numel}")
    if n > 1 and (offsets[1:] < ends[:-1]).any():
        raise PayloadError("dense ranges are not sorted and disjoint")
    if int(lengths.sum()) != header.dense_count:
        raise PayloadError(f"dense ranges cover {int(lengths.sum())} elements, header says dense_count "
                           f"{header.dense_count}")
    return np.stack([offsets, lengths], axis=1)


def _indices(raw: memoryview, offset: int, header: PayloadHeader, ranges: np.ndarray) -> np.ndarray:
    gaps = _unplane(raw, offset, header.count, INDEX_WIDTHS[header.index_width]).astype(np.uint64)
    if (gaps >= header.numel).any():
        bad = int(np.argmax(gaps >= header.numel))
        raise PayloadError(f"index out of range: gap {bad} is {int(gaps[bad])} >= numel {header.numel}")
    if header.count > 1 and (gaps[1:] == 0).any():
        bad = int(np.argmax(gaps[1:] == 0)) + 1
        raise PayloadError(f"indices not strictly increasing at position {bad}")
    indices = np.cumsum(gaps.astype(np.int64))  # gaps < numel <= 2**28: no overflow
    if indices[-1] >= header.numel:
        bad = int(np.argmax(indices >= header.numel))
        raise PayloadError(f"index out of range: index {bad} is {int(indices[bad])} >= numel {header.numel}")
    if len(ranges):
        slot = np.searchsorted(ranges[:, 0], indices, side="right") - 1
        inside = (slot >= 0) & (indices < (ranges[:, 0] + ranges[:, 1])[np.maximum(slot, 0)])
        if inside.any():
            bad = int(np.argmax(inside))
            raise PayloadError(f"sparse index {int(indices[bad])} lies inside a dense range")
    return indices


def decode(payload: bytes, *, expected_numel: int | None = None, expected_version: int | None = None,
           expected_kinds: tuple[int, ...] | None = None, expected_dtype: ValueDtype | None = None,
           max_numel: int = DEFAULT_MAX_NUMEL) -> DecodedPayload:
    """Validate and decode a payload; any inconsistency raises ``PayloadError``.

    The ``expected_*`` arguments are the layout the receiver knows (vector size, version, payload kinds,
    value dtype); a payload that differs is refused from its header, before anything is decompressed.
    """
    header = read_header(payload, max_numel=max(max_numel, expected_numel or 0))
    if expected_numel is not None and header.numel != expected_numel:
        raise PayloadError(f"numel mismatch: payload has {header.numel}, expected {expected_numel}")
    if expected_version is not None and header.version != expected_version:
        raise PayloadError(f"version mismatch: payload has {header.version}, expected {expected_version}")
    if expected_kinds is not None and header.kind not in expected_kinds:
        wanted = " or ".join(KIND_NAMES[k] for k in expected_kinds)
        raise PayloadError(f"a {KIND_NAMES[header.kind]} payload where a {wanted} payload is expected")
    wrong_dtype = expected_dtype is not None and header.value_dtype.code != expected_dtype.code
    if wrong_dtype and header.kind != KIND_SNAPSHOT:
        raise PayloadError(f"value dtype {header.value_dtype.name}, expected {expected_dtype.name} "
                           "(snapshots are always fp32)")
    raw = _decompress_body(memoryview(payload).cast("B"), header)
    ranges = _ranges(raw, header)
    offset = 16 * header.n_ranges
    positions = None
    if not header.all_indices:
        sparse = _indices(raw, offset, header, ranges) if header.count else np.zeros(0, dtype=np.int64)
        offset += header.count * header.index_width
        dense = [np.arange(o, o + n, dtype=np.int64) for o, n in ranges]
        positions = torch.from_numpy(np.concatenate([sparse, *dense]))
    bits = _unplane(raw, offset, header.count + header.dense_count, header.value_dtype.bits_dtype)
    values = from_bits(bits, header.value_dtype)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0])
        raise PayloadError(f"non-finite value {values[bad].item()} at entry {bad}")
    return DecodedPayload(header, positions, values)


def decompress(payload: bytes, *, expected_numel: int | None = None, expected_version: int | None = None,
               max_numel: int = DEFAULT_MAX_NUMEL) -> torch.Tensor:
    """Dense float32 CPU tensor of a validated payload (zeros where nothing was sent)."""
    return decode(payload, expected_numel=expected_numel, expected_version=expected_version,
                  max_numel=max_numel).to_dense()
