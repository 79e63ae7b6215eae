"""What the master and the workers accept on the wire: only the configured format and layout, refused
with PayloadError before any large allocation (no Ray needed)."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import torch

from dpgs.compression import KIND_DELTA, VALUE_DTYPES, PayloadError, TopKCompressor, wire
from dpgs.config.schema import CompressionConfig
from dpgs.distributed.codec import GradientDecoder, decode_dgc, encode_dgc
from dpgs.distributed.frames import KIND_DELTA as FRAME_DELTA
from dpgs.distributed.frames import KIND_GRADIENTS, decode_frame, encode_frame

N = 1000


def payload(n: int = N, keep: float = 0.05, dtype: str = "fp16") -> bytes:
    return TopKCompressor(keep, value_dtype=dtype).compress(torch.randn(n))


def test_decoder_sums_payloads_like_dense_decoding():
    cfg = CompressionConfig(keep_ratio=0.05, value_dtype="fp16")
    payloads = [payload(), payload(), b""]
    total = GradientDecoder(cfg, N).sum_into(torch.zeros(N), payloads, [2, 1, 0])
    reference = wire.decompress(payloads[0]) + wire.decompress(payloads[1])
    torch.testing.assert_close(total, reference, rtol=0, atol=0)


@pytest.mark.parametrize("case,match", [
    ("numel", "numel mismatch: payload has 999, expected 1000"),
    ("dtype", "value dtype fp32, expected fp16"),
    ("kind", "a delta payload where a gradient payload is expected"),
    ("dgc-on-dmgc", "bad magic b'DGC1'"),
    ("empty-with-bags", "worker 0 sent 0 bytes for 2 bags"),
    ("bytes-without-bags", r"worker 0 sent \d+ bytes for 0 bags"),
])
def test_decoder_refuses_anything_but_the_configured_layout(case, match):
    cfg = CompressionConfig(keep_ratio=0.05, value_dtype="fp16")
    good = payload()
    sent, count = {
        "numel": (payload(N - 1), 1),
        "dtype": (payload(dtype="fp32"), 1),
        "kind": (wire.encode(kind=KIND_DELTA, numel=N, indices=np.arange(3), dtype=VALUE_DTYPES["fp16"],
                             value_bits=np.zeros(3, dtype="<u2")), 1),
        "dgc-on-dmgc": (encode_dgc(wire.decompress(good)), 1),
        "empty-with-bags": (b"", 2),
        "bytes-without-bags": (good, 0),
    }[case]
    with pytest.raises(PayloadError, match=match):
        GradientDecoder(cfg, N).sum_into(torch.zeros(N), [sent], [count])


def test_dgc_decoder_checks_everything_before_allocating():
    cfg = CompressionConfig(keep_ratio=0.05, wire="dgc")
    dense = wire.decompress(TopKCompressor(0.05, value_dtype="fp32").compress(torch.randn(N)))
    good = encode_dgc(dense)
    torch.testing.assert_close(GradientDecoder(cfg, N).sum_into(torch.zeros(N), [good], [1]), dense)
    header = struct.Struct("<4sQQ")
    count = (len(good) - header.size) // 8
    body = good[header.size :]
    idx = np.frombuffer(body[: 4 * count], dtype="<i4").copy()
    vals = np.frombuffer(body[4 * count :], dtype="<f4").copy()

    def build(numel=N, n=count, i=idx, v=vals, magic=b"DGC1"):
        return header.pack(magic, numel, n) + i.astype("<i4").tobytes() + v.astype("<f4").tobytes()

    dup, unsorted, nan = idx.copy(), idx[::-1].copy(), vals.copy()
    dup[1] = dup[0]
    nan[0] = np.nan
    cases = {
        "DGC payload of 3 bytes": good[:3],
        "bad magic": build(magic=b"DMGC"),
        "for 2000 elements, expected 1000": build(numel=2 * N),
        "claims 4294967296 entries": header.pack(b"DGC1", N, 1 << 32),
        "promises": build()[:-4],
        "not strictly increasing": build(i=dup),
        "not strictly increasing ": build(i=unsorted),
        "non-finite": build(v=nan),
    }
    for match, bad in cases.items():
        with pytest.raises(PayloadError, match=match.strip()):
            decode_dgc(bad, N)
    # a 20-byte header claiming 2**40 entries of a 2**40-element vector: refused with almost no memory
    tracemalloc.start()
    with pytest.raises(PayloadError):
        decode_dgc(header.pack(b"DGC1", 1 << 40, 1 << 40), N)
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


def test_an_honest_huge_payload_is_refused_from_its_header():
    """A tiny payload for a 2**26-element vector: the decoder knows the model's size and stops it from the
    header, before decompressing or allocating anything."""
    huge = wire.encode(kind=wire.KIND_GRADIENT, numel=1 << 26, indices=np.array([0, (1 << 26) - 1]),
                       dtype=VALUE_DTYPES["fp16"], value_bits=np.zeros(2, dtype="<u2"))
    assert len(huge) < 200
    tracemalloc.start()
    with pytest.raises(PayloadError, match=f"numel mismatch: payload has {1 << 26}, expected {N}"):
        GradientDecoder(CompressionConfig(keep_ratio=0.05, value_dtype="fp16"), N).sum_into(
            torch.zeros(N), [huge], [1])
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


def test_frames_round_trip_and_refuse_what_was_not_expected():
    parts = [b"abc", b"", b"\x00" * 8]
    frame = encode_frame(KIND_GRADIENTS, 7, 0.5, parts)
    got = decode_frame(frame, kind=KIND_GRADIENTS, version=7, n_parts=3)
    assert got.parts == parts and got.clip == 0.5
    assert torch.equal(got.buffers(2), torch.zeros(2))
    cases = {
        "shorter than its": frame[:5],
        "bad magic": b"XXXX" + frame[4:],
        "a delta frame where a gradients frame is expected": encode_frame(FRAME_DELTA, 7, 1.0, parts),
        "frame for version 8, expected 7": encode_frame(KIND_GRADIENTS, 8, 0.5, parts),
        "frame with 2 parts, expected 3": encode_frame(KIND_GRADIENTS, 7, 0.5, parts[:2]),
        "clip factor 2.0": encode_frame(KIND_GRADIENTS, 7, 2.0, parts),
        "clip factor nan": encode_frame(KIND_GRADIENTS, 7, float("nan"), parts),
        "parts add up to": frame + b"!",
    }
    for match, bad in cases.items():
        with pytest.raises(PayloadError, match=match):
            decode_frame(bad, kind=KIND_GRADIENTS, version=7, n_parts=3)
    with pytest.raises(PayloadError, match="buffers part has 8 bytes, expected 12"):
        got.buffers(3)


def test_fuzzed_payloads_and_frames_raise_nothing_but_payload_error():
    """2,000 random corruptions (bit flips, truncations, extensions) of valid payloads and frames."""
    rng = np.random.default_rng(0)
    cfg = CompressionConfig(keep_ratio=0.05, value_dtype="fp16")
    decoder = GradientDecoder(cfg, N)
    good = payload()
    frame = encode_frame(KIND_GRADIENTS, 3, 1.0, [good, good, b""])
    for trial in range(2000):
        data = bytearray(good if trial % 2 else frame)
        kind = rng.integers(3)
        if kind == 0:
            for pos in rng.integers(0, len(data), size=rng.integers(1, 4)):
                data[pos] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            data = data[: rng.integers(0, len(data))]
        else:
            data += bytes(rng.integers(0, 256, size=rng.integers(1, 16), dtype=np.uint8))
        try:
            if trial % 2:
                decoder.sum_into(torch.zeros(N), [bytes(data)], [1])
            else:
                decode_frame(bytes(data), kind=KIND_GRADIENTS, version=3, n_parts=3)
        except PayloadError:
            continue
