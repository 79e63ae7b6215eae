"""Wire format: round trips of edge cases and every corruption case raising PayloadError."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
import zstandard

from dpgs.compression import (
    HEADER_SIZE,
    MAGIC,
    PayloadError,
    TopKCompressor,
    decode,
    decompress,
    read_header,
)
from dpgs.compression.wire import HEADER

FP16 = 1


def forge(raw: bytes, *, numel: int, count: int, dense_count: int = 0, n_ranges: int = 0, width: int = 2,
          kind: int = 0, dtype: int = FP16, flags: int = 0, version: int = 0, magic: bytes = MAGIC,
          fmt: int = 1, body: bytes | None = None) -> bytes:
    """A payload built by hand from the documented format (header + one zstd frame), correctly signed."""
    body = zstandard.ZstdCompressor().compress(raw) if body is None else body
    header = HEADER.pack(magic, fmt, kind, dtype, flags, width, numel, count, dense_count, n_ranges, version,
                         len(body), 0)
    return header[:-4] + struct.pack("<I", zlib.crc32(body, zlib.crc32(header))) + body


def planes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array.view(np.uint8).reshape(-1, array.dtype.itemsize).T).tobytes()


def sparse_raw(indices, values, width=2) -> bytes:
    gaps = np.diff(np.asarray(indices, dtype=np.int64), prepend=0).astype(f"<u{width}")
    return planes(gaps) + planes(np.asarray(values, dtype=np.float16).view("<u2"))


def test_forged_payload_matches_documented_format():
    payload = forge(sparse_raw([1, 5, 9], [1.0, -2.0, 0.5]), numel=10, count=3)
    expected = torch.zeros(10)
    expected[[1, 5, 9]] = torch.tensor([1.0, -2.0, 0.5])
    assert torch.equal(decompress(payload), expected)


@pytest.mark.parametrize("numel, keep", [(0, 0.5), (1, 1.0), (1, 0.0), (100, 0.0), (100, 1.0), (1000, 0.3)])
def test_round_trip_edge_sizes(numel, keep):
    x = torch.randn(numel)
    comp = TopKCompressor(value_dtype="fp32")
    payload = comp.compress(x, keep)
    out = decompress(payload)
    assert out.dtype == torch.float32 and out.shape == (numel,)
    assert torch.equal(out + comp.residual, x)
    assert comp.last_stats.count == (0 if keep == 0 else round(keep * numel) if numel else 0)
    if keep == 1.0:
        assert torch.equal(out, x)  # fp32 at keep 1 is lossless


def test_fp16_overflow_and_tiny_values_are_finite_and_conserved():
    x = torch.tensor([1e6, -3e5, 7e4, 1e-30, -1e-9, 0.5])
    comp = TopKCompressor(value_dtype="fp16")
    out = decompress(comp.compress(x, 1.0))
    assert torch.isfinite(out).all()
    assert out[0] <= 65504 and out[1] >= -65504
    assert out[3] == 0 and out[4] == 0  # below the fp16 subnormal range: kept in the residual
    assert torch.equal(out + comp.residual, x)
    total = out.clone()
    for _ in range(20):  # the overflowed mass is delivered over later calls
        total += decompress(comp.compress(torch.zeros(6), 1.0))
    assert torch.allclose(total[:3], x[:3], rtol=1e-3)


def test_bytes_reported_equal_len_payload():
    comp = TopKCompressor()
    for _ in range(3):
        payload = comp.compress(torch.randn(50_000), 0.01)
        assert comp.last_stats.payload_bytes == len(payload)
        assert comp.last_stats.dense_bytes == 4 * 50_000
        assert comp.last_stats.ratio == pytest.approx(200_000 / len(payload))


def valid_payload() -> bytes:
    return TopKCompressor(seed=1).compress(torch.randn(4000), 0.05)


def test_every_single_byte_flip_is_detected():
    payload = valid_payload()
    for position in range(0, len(payload), max(1, len(payload) // 200)):
        corrupt = bytearray(payload)
        corrupt[position] ^= 0x5A
        with pytest.raises(PayloadError):
            decode(bytes(corrupt))


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, -1, -7])
def test_truncation_is_detected(cut):
    payload = valid_payload()
    with pytest.raises(PayloadError, match="truncated"):
        decode(payload[:cut])


def test_trailing_bytes_are_detected():
    with pytest.raises(PayloadError, match="trailing bytes"):
        decode(valid_payload() + b"\x00")


def test_checksum_mismatch_message():
    payload = bytearray(valid_payload())
    payload[-3] ^= 1
    with pytest.raises(PayloadError, match="checksum mismatch"):
        decode(bytes(payload))


def test_bad_magic_and_version():
    raw = sparse_raw([0], [1.0])
    with pytest.raises(PayloadError, match="bad magic"):
        decode(forge(raw, numel=3, count=1, magic=b"XXXX"))
    with pytest.raises(PayloadError, match="unsupported format version 7"):
        decode(forge(raw, numel=3, count=1, fmt=7))
    with pytest.raises(PayloadError, match="bad magic"):
        decode(b"not a payload at all, definitely longer than the header is........")


@pytest.mark.parametrize("field, message", [
    (dict(kind=9), "unknown payload kind 9"),
    (dict(dtype=5), "unknown value dtype code 5"),
    (dict(flags=4), "unknown flags"),
    (dict(width=3), "index_width 3"),
    (dict(numel=2), "exceeds numel"),
    (dict(count=2), "exceeds the 8 bytes the header .count 2"),  # count smaller than the body holds
    (dict(count=5, numel=100), "truncated body: decompressed 12 bytes, the header .count 5"),
    (dict(dense_count=1), "n_ranges 0 is inconsistent"),
])
def test_forged_header_fields(field, message):
    raw = sparse_raw([1, 5, 9], [1.0, -2.0, 0.5])
    args = dict(numel=10, count=3) | field
    with pytest.raises(PayloadError, match=message):
        decode(forge(raw, **args))


def test_count_mismatch_larger_body():
    raw = sparse_raw([1, 5, 9], [1.0, -2.0, 0.5])
    with pytest.raises(PayloadError, match="exceeds the .* bytes the header"):
        decode(forge(raw + b"\x00" * 6, numel=10, count=3))


def test_numel_and_version_expectations():
    payload = TopKCompressor().compress(torch.randn(100), 0.1, version=42)
    assert read_header(payload).version == 42
    with pytest.raises(PayloadError, match="numel mismatch: payload has 100, expected 99"):
        decode(payload, expected_numel=99)
    with pytest.raises(PayloadError, match="version mismatch"):
        decode(payload, expected_version=41)
    with pytest.raises(PayloadError, match="exceeds max_numel"):
        decode(payload, max_numel=50)


def test_indices_out_of_range_and_not_increasing():
    with pytest.raises(PayloadError, match="index out of range"):
        decode(forge(sparse_raw([1, 5, 10], [1.0, 1.0, 1.0]), numel=10, count=3))
    with pytest.raises(PayloadError, match="index out of range: gap"):
        decode(forge(sparse_raw([300], [1.0]), numel=10, count=1))
    with pytest.raises(PayloadError, match="not strictly increasing at position 2"):
        decode(forge(sparse_raw([1, 5, 5], [1.0, 1.0, 1.0]), numel=10, count=3))


def test_non_finite_values():
    for bad in (np.inf, -np.inf, np.nan):
        with pytest.raises(PayloadError, match="non-finite value"):
            decode(forge(sparse_raw([1, 2], [1.0, bad]), numel=10, count=2))


def test_dense_range_validation():
    values = planes(np.ones(4, dtype=np.float16).view("<u2"))
    gaps = planes(np.array([1], dtype="<u1"))
    ranges_ok = np.array([5, 3], dtype="<u8").tobytes()
    ok = forge(ranges_ok + gaps + values, numel=10, count=1, dense_count=3, n_ranges=1, width=1)
    assert torch.equal(decompress(ok), torch.tensor([0, 1, 0, 0, 0, 1, 1, 1, 0, 0], dtype=torch.float32))
    beyond = np.array([8, 3], dtype="<u8").tobytes()
    with pytest.raises(PayloadError, match="dense range ends beyond numel"):
        decode(forge(beyond + gaps + values, numel=10, count=1, dense_count=3, n_ranges=1, width=1))
    inside = planes(np.array([6], dtype="<u1"))
    with pytest.raises(PayloadError, match="sparse index 6 lies inside a dense range"):
        decode(forge(ranges_ok + inside + values, numel=10, count=1, dense_count=3, n_ranges=1, width=1))


def test_corrupt_zstd_body():
    with pytest.raises(PayloadError, match="corrupt zstd body"):
        decode(forge(b"", numel=10, count=1, body=b"\x28\xb5\x2f\xfd" + b"\xff" * 20))


def test_zstd_bomb_is_refused_without_allocating():
    """A frame expanding to 256 MiB behind a header allowing 6 bytes: refused, memory stays small."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    chunk = bytes(1 << 20)
    bomb = b"".join(compressor.compress(chunk) for _ in range(256)) + compressor.flush()
    assert len(bomb) < 100_000
    payload = forge(b"", numel=10, count=1, width=2, body=bomb)
    tracemalloc.start()
    with pytest.raises(PayloadError, match="exceeds the 4 bytes the header"):
        decode(payload)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20


def test_header_claiming_more_than_the_frame_can_hold():
    payload = forge(sparse_raw([1], [1.0]), numel=1 << 27, count=1 << 26)
    with pytest.raises(PayloadError, match="more than a .*-byte zstd frame can hold"):
        decode(payload)

