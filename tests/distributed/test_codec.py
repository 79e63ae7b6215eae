"""The uplink codec (``dpgs.distributed.codec``): what it sends at each keep ratio, and what the master and
the workers accept: only the configured format and layout, refused with PayloadError before any large
allocation (no Ray needed)."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import torch

from dpgs.compression import KIND_DELTA, VALUE_DTYPES, ParamLayout, PayloadError, TopKCompressor, wire
from dpgs.config.schema import CompressionConfig
from dpgs.distributed.codec import Uplink, decode_dgc, encode_dgc
from dpgs.distributed.frames import as_part

N = 1000
KEEP = 0.05


def payload(n: int = N, keep: float = KEEP, dtype: str = "fp16") -> bytes:
    return TopKCompressor(value_dtype=dtype).compress(torch.randn(n), keep)


def uplink(cfg: CompressionConfig, n: int = N) -> Uplink:
    return Uplink(cfg, ParamLayout.from_shapes([("w", (n,))]))


def sum_into(cfg: CompressionConfig, parts: list, counts: list[int], keep: float = KEEP) -> torch.Tensor:
    return uplink(cfg).sum_into(torch.zeros(N), [as_part(p) for p in parts], counts, keep)


def test_decoder_sums_payloads_like_dense_decoding():
    cfg = CompressionConfig(value_dtype="fp16")
    payloads = [payload(), payload(), b""]
    total = sum_into(cfg, payloads, [2, 1, 0])
    reference = wire.decompress(payloads[0]) + wire.decompress(payloads[1])
    torch.testing.assert_close(total, reference, rtol=0, atol=0)


@pytest.mark.parametrize("wire_format", ["dmgc", "dgc"])
def test_a_message_decoded_ahead_sums_to_the_same_bits_in_worker_order(wire_format):
    """A worker decodes its own payload while the others' arrive and passes it to ``sum_into``: the sum of
    three overlapping payloads is bit for bit the one decoded in place, whichever worker decoded ahead (a
    worker that added its own first would differ in the last bits: float addition does not associate)."""
    cfg = CompressionConfig(wire=wire_format, value_dtype="fp32")
    codec = uplink(cfg)
    torch.manual_seed(0)
    parts = [as_part(codec.encode(torch.randn(N) * (w + 1), 0.5)) for w in range(3)]
    counts = [1, 2, 1]
    reference = codec.sum_into(torch.zeros(N), parts, counts, 0.5)
    for me in range(3):
        ahead = {me: codec.decode_part(me, parts[me], counts[me], 0.5)}
        blanked = [torch.empty(0, dtype=torch.uint8) if w == me else p for w, p in enumerate(parts)]
        total = codec.sum_into(torch.zeros(N), blanked, counts, 0.5, ahead)
        assert torch.equal(total, reference)
    own_first = torch.zeros(N)
    for w in (2, 0, 1):
        codec.sum_into(own_first, [parts[w]], [1], 0.5)
    assert not torch.equal(own_first, reference)  # the order matters, so the test above can fail


def test_keep_ratio_is_an_argument_and_keep_one_flushes_the_residual_exactly():
    """Sparse steps leave a residual; a dense step then sends gradient + residual as raw float32 and the
    residual is empty: over the three steps exactly the sum of the gradients arrived (error feedback)."""
    cfg = CompressionConfig(value_dtype="fp32", dense_min_numel=0)
    up = uplink(cfg)
    grads = [torch.randn(N, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    arrived = torch.zeros(N, dtype=torch.float64)
    for grad, keep in zip(grads, (0.01, 0.2, 1.0), strict=True):
        sent = up.encode(grad, keep)
        if keep < 1:
            assert isinstance(sent, bytes) and wire.decode(sent).header.count == round(keep * N)
            arrived += wire.decompress(sent).double()
        else:
            assert isinstance(sent, torch.Tensor) and sent.dtype == torch.float32 and sent.numel() == N
            arrived += sent.double()
    assert up.compressor.residual is None  # nothing kept after the dense step
    torch.testing.assert_close(arrived, sum(g.double() for g in grads), rtol=0, atol=1e-5)


@pytest.mark.parametrize("wire_format", ["dmgc", "dgc"])
def test_timing_the_codec_leaves_its_state_and_the_gradient_as_they_were(wire_format):
    """``keep_ratio=auto`` times the codec on the first step's gradient before it is sent: the residual
    (and the selection's generator) must be what they were, or that step's message would differ."""
    up = uplink(CompressionConfig(wire=wire_format))
    up.encode(torch.randn(N, generator=torch.Generator().manual_seed(0)), 0.01)  # a residual to keep
    grad = torch.randn(N, generator=torch.Generator().manual_seed(1))
    before, kept = up.state_dict(), grad.clone()
    assert up.codec_seconds(grad, 0.25, decodes=2) > 0
    after = up.state_dict()
    assert torch.equal(grad, kept)
    assert torch.equal(after["residual"], before["residual"]) and after.keys() == before.keys()
    reference = uplink(CompressionConfig(wire=wire_format))
    reference.load_state_dict(before)
    assert up.encode(grad, 0.01) == reference.encode(grad.clone(), 0.01)


def test_a_dense_run_sends_the_gradient_itself():
    grad = torch.randn(N)
    sent = uplink(CompressionConfig()).encode(grad, 1.0)
    assert torch.equal(sent, grad) and sent.data_ptr() == grad.data_ptr()  # no residual, no copy


def test_dense_messages_are_summed_in_worker_order_and_checked():
    cfg = CompressionConfig()
    a, b = torch.randn(N), torch.randn(N)
    total = sum_into(cfg, [a, None, b], [1, 0, 2], keep=1.0)
    assert torch.equal(total, (torch.zeros(N) + a) + b)
    with pytest.raises(PayloadError, match="worker 0 sent 3996 bytes of dense gradient, expected 4000"):
        sum_into(cfg, [a[1:]], [1], keep=1.0)


@pytest.mark.parametrize("case,match", [
    ("numel", "numel mismatch: payload has 999, expected 1000"),
    ("dtype", "value dtype fp32, expected fp16"),
    ("kind", "a delta payload where a gradient payload is expected"),
    ("dgc-on-dmgc", "bad magic b'DGC1'"),
    ("empty-with-bags", "worker 0 sent 0 bytes for 2 bags"),
    ("bytes-without-bags", r"worker 0 sent \d+ bytes for 0 bags"),
])
def test_decoder_refuses_anything_but_the_configured_layout(case, match):
    cfg = CompressionConfig(value_dtype="fp16")
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
        sum_into(cfg, [sent], [count])


def test_dgc_decoder_checks_everything_before_allocating():
    cfg = CompressionConfig(wire="dgc")
    dense = wire.decompress(TopKCompressor(value_dtype="fp32").compress(torch.randn(N), KEEP))
    good = encode_dgc(dense)
    torch.testing.assert_close(sum_into(cfg, [good], [1]), dense)
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
        sum_into(CompressionConfig(value_dtype="fp16"), [huge], [1])
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


@pytest.mark.parametrize("ranking", ["magnitude", "tensor_rms"])
def test_uplink_ranks_entries_as_configured(ranking):
    """``dpgs.compression.ranking`` reaches the workers' top-k: with tensor_rms a tensor of 1000x smaller
    gradients still sends its share; with magnitude it sends nothing."""
    layout = ParamLayout.from_shapes([("big", (4000,)), ("small", (4000,))])
    grad = torch.cat([torch.randn(4000), 1e-3 * torch.randn(4000)])
    up = Uplink(CompressionConfig(ranking=ranking, dense_min_numel=0), layout)
    sent = wire.decode(up.encode(grad, 0.05)).to_dense()
    small_sent = int((sent[4000:] != 0).sum())
    assert int((sent != 0).sum()) == 400
    assert (small_sent > 100) if ranking == "tensor_rms" else (small_sent == 0)
