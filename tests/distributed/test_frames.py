"""The master's frame down (``dpgs.distributed.frames``): round trip, refusal of what the receiver did not
expect, and fuzzing: every corruption of a frame and of the payloads in it is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpgs.compression import ParamLayout, PayloadError, TopKCompressor
from dpgs.config.schema import CompressionConfig
from dpgs.distributed.codec import Uplink
from dpgs.distributed.frames import (
    KIND_DELTA,
    KIND_GRADIENTS,
    KIND_SUM,
    as_part,
    decode_frame,
    encode_frame,
)

N = 1000
GRADIENTS = {KIND_GRADIENTS: 3}


def frame_of(kind: int, version: int, clip: float, parts: list[bytes]) -> torch.Tensor:
    return encode_frame(kind, version, clip, [as_part(p) for p in parts])


def test_frames_round_trip_and_refuse_what_was_not_expected():
    parts = [b"abc", b"", b"\x00" * 8]
    frame = frame_of(KIND_GRADIENTS, 7, 0.5, parts)
    got = decode_frame(frame, parts_of=GRADIENTS, version=7)
    assert [bytes(p.numpy()) for p in got.parts] == parts and got.clip == 0.5 and got.kind == KIND_GRADIENTS
    assert torch.equal(got.buffers(2), torch.zeros(2))
    raw = bytes(frame.numpy())
    cases = {
        "shorter than its": raw[:5],
        "bad magic": b"XXXX" + raw[4:],
        "a delta frame where a gradients or sum frame is expected": bytes(
            frame_of(KIND_DELTA, 7, 1.0, parts).numpy()),
        "frame for version 8, expected 7": bytes(frame_of(KIND_GRADIENTS, 8, 0.5, parts).numpy()),
        "frame with 2 parts, expected 3": bytes(frame_of(KIND_GRADIENTS, 7, 0.5, parts[:2]).numpy()),
        "clip factor 2.0": bytes(frame_of(KIND_GRADIENTS, 7, 2.0, parts).numpy()),
        "clip factor nan": bytes(frame_of(KIND_GRADIENTS, 7, float("nan"), parts).numpy()),
        "parts add up to": raw + b"!",
        "checksum mismatch": raw[:12] + bytes([raw[12] ^ 1]) + raw[13:],  # a flipped version byte
    }
    for match, bad in cases.items():
        with pytest.raises(PayloadError, match=match):
            decode_frame(torch.frombuffer(bytearray(bad), dtype=torch.uint8),
                         parts_of={KIND_GRADIENTS: 3, KIND_SUM: 2}, version=7)
    with pytest.raises(PayloadError, match="buffers part has 8 bytes, expected 12"):
        got.buffers(3)


def test_every_corruption_of_a_frame_of_payloads_is_refused():
    """2,000 random corruptions (bit flips, truncations, extensions) of a frame holding two gradient
    payloads, read as a worker reads it (the frame, then each payload against the model's layout): the
    frame header's CRC-32 and the payloads' own CRC-32 refuse every one of them."""
    rng = np.random.default_rng(0)
    uplink = Uplink(CompressionConfig(value_dtype="fp16"), ParamLayout.from_shapes([("w", (N,))]))
    payloads = [TopKCompressor().compress(torch.randn(N), 0.05) for _ in range(2)]
    good = bytes(frame_of(KIND_GRADIENTS, 3, 1.0, [*payloads, b""]).numpy())

    def read(data: bytes) -> torch.Tensor:
        frame = decode_frame(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                             torch.empty(0, dtype=torch.uint8), parts_of=GRADIENTS, version=3)
        frame.buffers(0)
        return uplink.sum_into(torch.zeros(N), frame.parts[:-1], [1, 1], 0.05)

    read(good)  # the intact frame reads
    accepted = []
    for trial in range(2000):
        data = bytearray(good)
        kind = rng.integers(3)
        if kind == 0:
            for pos in rng.integers(0, len(data), size=rng.integers(1, 4)):
                data[pos] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            data = data[: rng.integers(0, len(data))]
        else:
            data += bytes(rng.integers(0, 256, size=rng.integers(1, 16), dtype=np.uint8))
        try:
            read(bytes(data))
        except PayloadError:
            continue
        accepted.append(trial)
    assert accepted == []
