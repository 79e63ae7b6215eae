"""TopKCompressor: exact error-feedback invariant, selection, clipping, momentum, layout, convergence."""

from __future__ import annotations

import pytest
import torch

from dpgs.compression import (
    DeltaBroadcaster,
    ParamLayout,
    TopKCompressor,
    apply_payload,
    decode,
    decompress,
    select_topk,
)
from dpgs.compression.dtypes import VALUE_DTYPES, quantize, ulp32


def heavy_tailed(n: int, generator: torch.Generator) -> torch.Tensor:
    t = torch.distributions.StudentT(3.0).sample((n,))
    scale = torch.exp(torch.randn(n // 100 + 1, generator=generator)).repeat_interleave(100)[:n]
    return t * scale


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("clip_norm", [None, 0.3])
def test_residual_invariant_is_exact_over_many_steps(dtype, clip_norm):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    comp = TopKCompressor(clip_norm=clip_norm, value_dtype=dtype, exact_max_numel=3000)
    for step in range(30):
        n = 5000
        flat = heavy_tailed(n, gen) * 10.0 ** float(torch.randint(-6, 6, (1,)))
        if step % 7 == 3:
            flat[:3] = torch.tensor([1e5, -7e4, 1e-30])  # fp16 overflow and underflow
        old = comp.residual.clone() if comp.residual is not None else torch.zeros(n)
        payload = comp.compress(flat, 0.02)
        assert torch.equal(decompress(payload) + comp.residual, flat + old)
        assert comp.last_stats.payload_bytes == len(payload)


def test_quantize_is_exact_and_representable_for_extreme_inputs():
    g = torch.tensor([3.0e38, -1e20, 65519.0, 1e-45, -1e-40, 0.0, 1.0000001, -5.96e-8, 2.98e-8])
    for dtype in VALUE_DTYPES.values():
        for scale in (1.0, 0.37, 1e-9):
            sent = quantize(g * scale, g, dtype)
            assert torch.equal(sent.to(dtype.torch_dtype).float(), sent)  # representable
            assert torch.equal(sent + (g - sent), g)  # residual exact
            target = (g * scale).clamp(-dtype.max_finite, dtype.max_finite)
            moderate = g.abs() < 2**30  # beyond 2**40 an exact fp16 split is impossible: 0 is sent
            bound = 2**-7 * target.abs() + ulp32(g) + 6e-8  # dtype rounding + exact-split grid
            assert ((sent - target).abs() <= bound)[moderate].all()


def test_ulp32_matches_nextafter():
    x = torch.tensor([1.0, 3.5, 1e-40, 0.0, 1e30, -2.0, 1.1754944e-38])
    expected = torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs()
    assert torch.equal(ulp32(x), expected)


@pytest.mark.parametrize("n, keep", [(1000, 0.01), (20_000, 0.1), (777, 0.5)])
def test_exact_path_equals_torch_topk(n, keep):
    torch.manual_seed(n)
    flat = torch.randn(n)
    comp = TopKCompressor(value_dtype="fp32")
    decoded = decode(comp.compress(flat, keep))
    k = round(keep * n)
    assert comp.last_stats.method == "exact"
    expected = torch.topk(flat.abs(), k).indices.sort().values
    assert torch.equal(decoded.positions, expected)
    assert torch.equal(decoded.values, flat[expected])


@pytest.mark.parametrize("keep", [0.1, 0.01, 0.001, 0.0001])
def test_sampled_path_count_within_window(keep):
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    magnitude = heavy_tailed(400_000, gen).abs()
    k = round(keep * magnitude.numel())
    for seed in range(3):
        sel = select_topk(magnitude, k, exact_max_numel=1000, generator=torch.Generator().manual_seed(seed))
        assert sel.method.startswith("sampled")
        assert 0.8 * k <= sel.indices.numel() <= 1.3 * k
        assert (sel.indices[1:] > sel.indices[:-1]).all()
        if sel.indices.numel() == k:  # candidates covered the top-k: it is the exact top-k
            assert torch.equal(sel.indices, torch.topk(magnitude, k).indices.sort().values)


def test_sampled_path_with_mostly_zero_input_sends_the_nonzeros():
    magnitude = torch.zeros(200_000)
    magnitude[::1000] = torch.rand(200) + 0.1
    sel = select_topk(magnitude, 2000, exact_max_numel=1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sel.indices, torch.arange(0, 200_000, 1000))


def test_large_vector_uses_sampling_and_keeps_invariant():
    torch.manual_seed(0)
    flat = torch.randn(300_000)
    comp = TopKCompressor(exact_max_numel=100_000)
    payload = comp.compress(flat, 0.01)
    assert comp.last_stats.method == "sampled"
    assert 2400 <= comp.last_stats.count <= 3900
    assert torch.equal(decompress(payload) + comp.residual, flat)


def test_clipping_bounds_the_sent_norm():
    torch.manual_seed(0)
    comp = TopKCompressor(clip_norm=0.5, value_dtype="fp32")
    out = decompress(comp.compress(torch.randn(2000) * 100, 0.1))
    assert comp.last_stats.clip_scale < 1
    assert out.norm() <= 0.5 * (1 + 1e-6)


def test_non_finite_input_is_rejected_without_touching_state():
    comp = TopKCompressor()
    comp.compress(torch.randn(100), 0.1)
    before = comp.residual.clone()
    bad = torch.randn(100)
    bad[7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        comp.compress(bad, 0.1)
    assert torch.equal(comp.residual, before)
    with pytest.raises(ValueError, match="set up for 100"):
        comp.compress(torch.randn(99), 0.1)


def test_momentum_correction_matches_dgc_reference():
    torch.manual_seed(0)
    m, n, keep = 0.9, 500, 0.05
    comp = TopKCompressor(value_dtype="fp32", momentum_correction=m, momentum_masking=True)
    u, v = torch.zeros(n), torch.zeros(n)
    for _ in range(20):
        g = torch.randn(n)
        u = m * u + g
        v = v + u
        idx = torch.topk(v.abs(), round(keep * n)).indices.sort().values
        expected = torch.zeros(n)
        expected[idx] = v[idx]
        v[idx] = 0
        u[idx] = 0
        assert torch.equal(decompress(comp.compress(g, keep)), expected)
        assert torch.equal(comp.residual, v) and torch.equal(comp.momentum, u)


def test_momentum_correction_at_full_keep_is_momentum_sgd_without_masking():
    torch.manual_seed(0)
    comp = TopKCompressor(value_dtype="fp32", momentum_correction=0.5, momentum_masking=False)
    u = torch.zeros(10)
    for _ in range(5):
        g = torch.randn(10)
        u = 0.5 * u + g
        assert torch.allclose(decompress(comp.compress(g, 1.0)), u, atol=1e-6)


def test_layout_exempts_small_tensors_and_sends_them_dense():
    model = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3))
    layout = ParamLayout.from_module(model)
    comp = TopKCompressor(value_dtype="fp32", layout=layout, dense_min_numel=100)
    torch.manual_seed(0)
    flat = torch.randn(layout.numel)
    decoded = decode(comp.compress(flat, 0.01))
    dense = [s for s in layout if s.numel < 100]
    assert comp.last_stats.dense_count == sum(s.numel for s in dense)
    dense_positions = torch.cat([torch.arange(s.offset, s.offset + s.numel) for s in dense])
    assert set(dense_positions.tolist()) <= set(decoded.positions.tolist())
    out = decoded.to_dense()
    assert torch.equal(out[dense_positions], flat[dense_positions])
    assert comp.last_stats.count == round(0.01 * (layout.numel - comp.last_stats.dense_count))
    assert torch.equal(out + comp.residual, flat)


def test_flush_sends_residual_plus_gradient_and_empties_the_residual():
    """keep ratio 1 (a dense step of a compressed run): exactly what top-k has not sent yet, plus the new
    gradient, as float32; afterwards nothing is kept."""
    comp = TopKCompressor(value_dtype="fp16")
    first = torch.randn(1000)
    sent = decompress(comp.compress(first, 0.01))
    second = torch.randn(1000)
    flushed = comp.flush(second)
    assert torch.equal(flushed, (first - sent) + second)
    assert comp.residual is None and comp.state_dict()["residual"] is None  # nothing kept, nothing to save
    third = torch.randn(1000)
    assert comp.flush(third) is not None and torch.equal(comp.flush(third), third)  # no copy, no residual
    fourth = torch.randn(1000)
    fresh_start = TopKCompressor(value_dtype="fp16").compress(fourth, 0.01, version=7)
    assert comp.compress(fourth, 0.01, version=7) == fresh_start  # as from a zero residual
    fresh = torch.randn(10)
    assert torch.equal(TopKCompressor().flush(fresh), fresh)  # nothing kept yet: the gradient itself


def test_flush_with_momentum_correction_keeps_the_momentum_and_a_zero_residual():
    comp = TopKCompressor(momentum_correction=0.9, momentum_masking=False)
    comp.compress(torch.randn(1000), 0.01)
    comp.flush(torch.randn(1000))
    assert comp.residual is not None and not comp.residual.any() and comp.momentum.any()


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    a = TopKCompressor(momentum_correction=0.9, exact_max_numel=100)
    a.compress(torch.randn(5000), 0.05)
    b = TopKCompressor(momentum_correction=0.9, exact_max_numel=100)
    b.load_state_dict(a.state_dict())
    g = torch.randn(5000)
    assert a.compress(g, 0.05) == b.compress(g, 0.05)


def test_keep_ratio_validation():
    with pytest.raises(ValueError, match="keep_ratio must be in"):
        TopKCompressor().compress(torch.randn(10), 1.5)
    with pytest.raises(ValueError, match="value_dtype must be one of"):
        TopKCompressor(value_dtype="int8")


def _logistic_problem(d=500, n=2000, lam=0.1):
    torch.manual_seed(0)
    x = torch.randn(n, d, dtype=torch.float64) / d**0.5
    w_true = torch.randn(d, dtype=torch.float64) * 3
    y = (torch.rand(n, dtype=torch.float64) < torch.sigmoid(x @ w_true)).double()

    def grad(w, xs, ys):
        return xs.T @ (torch.sigmoid(xs @ w) - ys) / len(ys) + lam * w

    def loss(w):
        return float(torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y) + lam / 2 * w.dot(w))

    w = torch.zeros(d, dtype=torch.float64)
    for _ in range(2000):
        w -= grad(w, x, y)
    return x, y, grad, loss, w


def _train(x, y, grad, steps, error_feedback):
    workers, d = 4, x.shape[1]
    shards = [(x[i::workers], y[i::workers]) for i in range(workers)]
    comps = [TopKCompressor() for _ in range(workers)]
    broadcaster = DeltaBroadcaster(dense_sync_every=None)
    master = torch.zeros(d)
    first, _ = broadcaster.step(master, 0.01)
    replicas = [torch.zeros(d) for _ in range(workers)]
    versions = [apply_payload(r, first, None) for r in replicas]
    for step in range(1, steps + 1):
        total = torch.zeros(d)
        for i, (xs, ys) in enumerate(shards):
            total += decompress(comps[i].compress(grad(replicas[i].double(), xs, ys).float(), 0.01))
            if not error_feedback:
                comps[i].reset()
        master -= 0.1 * min(1.0, 200 / step) * total / workers  # master: plain SGD, decaying step
        payload, _ = broadcaster.step(master, 0.01)
        versions = [apply_payload(r, payload, v) for r, v in zip(replicas, versions, strict=True)]
    return master.double()


def test_logistic_regression_converges_to_dense_solution_at_one_percent():
    """Both directions compressed at 1 % keep (fp16): reaches the dense optimum; without error feedback
    it does not."""
    x, y, grad, loss, w_star = _logistic_problem()
    w = _train(x, y, grad, 1000, error_feedback=True)
    assert (w - w_star).norm() / w_star.norm() < 0.05
    assert loss(w) - loss(w_star) < 1e-5
    w_no_ef = _train(x, y, grad, 1000, error_feedback=False)
    assert (w_no_ef - w_star).norm() / w_star.norm() > 0.3


def two_scale_layout() -> tuple[ParamLayout, torch.Tensor]:
    """A layout of a large-gradient tensor ``a`` (20k), a 1000x smaller-gradient tensor ``b`` (60k) and a
    small dense tensor ``c``, and a vector on it."""
    shapes = [("a", (20_000,)), ("b", (300, 200)), ("c", (10,))]
    layout = ParamLayout.from_shapes(shapes, dense_min_numel=1024)
    gen = torch.Generator().manual_seed(3)
    flat = torch.cat([torch.randn(20_000, generator=gen), 1e-3 * torch.randn(60_000, generator=gen),
                      torch.randn(10, generator=gen)])
    return layout, flat


def sent_per_tensor(layout: ParamLayout, out: torch.Tensor) -> dict[str, int]:
    return {s.name: int((out[s.offset : s.offset + s.numel] != 0).sum()) for s in layout}


def test_magnitude_ranking_starves_a_tensor_of_small_gradients():
    layout, flat = two_scale_layout()
    comp = TopKCompressor(value_dtype="fp32", layout=layout, dense_min_numel=1024, ranking="magnitude")
    counts = sent_per_tensor(layout, decode(comp.compress(flat, 0.01)).to_dense())
    assert counts == {"a": 800, "b": 0, "c": 10}


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_tensor_rms_ranking_gives_every_tensor_its_share_and_keeps_the_invariant(dtype):
    layout, flat = two_scale_layout()
    comp = TopKCompressor(value_dtype=dtype, layout=layout, dense_min_numel=1024, ranking="tensor_rms")
    for _ in range(3):
        before = comp.residual + flat if comp.residual is not None else flat.clone()
        out = decode(comp.compress(flat, 0.01)).to_dense()
        counts = sent_per_tensor(layout, out)
        assert counts["c"] == 10 and counts["a"] + counts["b"] == 800
        assert 150 <= counts["a"] <= 250 and 550 <= counts["b"] <= 650  # 1:3 like their sizes
        assert torch.equal(out + comp.residual, before)


def test_tensor_rms_ranking_of_a_single_tensor_is_the_magnitude_ranking():
    gen = torch.Generator().manual_seed(4)
    flat = heavy_tailed(50_000, gen)
    layout = ParamLayout.from_shapes([("w", (50_000,))])
    payloads = [TopKCompressor(layout=layout, ranking=r).compress(flat, 0.01)
                for r in ("magnitude", "tensor_rms")]
    assert payloads[0] == payloads[1]


def test_tensor_rms_ranking_on_the_sampled_path_keeps_the_count_and_the_invariant():
    layout = ParamLayout.from_shapes([("a", (1 << 20,)), ("b", (1 << 20,))])
    gen = torch.Generator().manual_seed(5)
    flat = torch.cat([torch.randn(1 << 20, generator=gen), 1e-4 * torch.randn(1 << 20, generator=gen)])
    comp = TopKCompressor(value_dtype="fp32", layout=layout, ranking="tensor_rms", exact_max_numel=1 << 16)
    out = decode(comp.compress(flat, 0.001)).to_dense()
    assert comp.last_stats.method == "sampled"
    counts = sent_per_tensor(layout, out)
    assert counts["a"] + counts["b"] == round(0.001 * (2 << 20))
    assert min(counts.values()) > 0.4 * (counts["a"] + counts["b"])
    assert torch.equal(out + comp.residual, flat)


def test_unknown_ranking_is_refused():
    with pytest.raises(ValueError, match="ranking must be 'magnitude' or 'tensor_rms'"):
        TopKCompressor(ranking="largest")


def test_tensor_rms_ranking_with_an_all_zero_tensor_sends_only_the_others():
    layout = ParamLayout.from_shapes([("a", (5000,)), ("zero", (5000,))])
    flat = torch.cat([torch.randn(5000, generator=torch.Generator().manual_seed(6)), torch.zeros(5000)])
    comp = TopKCompressor(value_dtype="fp32", layout=layout, ranking="tensor_rms")
    out = decode(comp.compress(flat, 0.02)).to_dense()
    assert sent_per_tensor(layout, out) == {"a": 200, "zero": 0}
    assert torch.equal(out + comp.residual, flat)
