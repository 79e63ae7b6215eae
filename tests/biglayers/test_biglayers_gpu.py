"""CUDA checks of the big layers (run on a GPU machine: `pytest -m gpu tests/test_biglayers_gpu.py`).

* the staging channel itself: pinned double buffering against deliberately slow streams (a missing wait
  shows up as wrong data), halo accumulation order, dtype conversion, buffer growth, byte counters;
* whole big ResNet-18/50 on CUDA against the dense model on CUDA in float64: outputs, input gradient,
  every parameter gradient, BatchNorm running statistics, at 1e-9;
* ``overlap=True`` (double-buffered) against ``overlap=False`` (synchronous): bit-identical;
* mixed precision (``torch.autocast`` bf16/fp16) and half-precision host storage against the dense model
  under the same autocast, with tolerances from the rounding unit of the dtype;
* device memory: ``MemoryMeter`` peaks bounded by ``max_elements`` and peak allocated GPU memory flat as
  the image grows (while the dense model's grows with it).
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpgs.biglayers import BigBatchNorm2d, BigConfig, BigConv2d, BigMaxPool2d, resnet18, resnet50
from dpgs.biglayers.transfer import CudaChannel, channel_for
from tests._biglayers_reference import dense_resnet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

F64 = torch.float64
BUILD = {"resnet18": resnet18, "resnet50": resnet50}
SIZES = {"image": (2, 37, 45), "bag": (6, 20, 20), "large": (1, 70, 61)}
BUDGET = 8192  # every big layer of these inputs is cut into several strips (row bands or sample groups)
SLEEP = 2_000_000  # GPU cycles (about 1 ms) that make a stream slow on purpose
# (output, gradients) relative-error bounds of reduced-precision runs, a few rounding units of the dtype
HALF = {torch.bfloat16: (1e-2, 6e-2), torch.float16: (2e-3, 1.5e-2)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic algorithms, so two runs with the same strips are bit-identical."""
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


# --- the staging channel ---------------------------------------------------------------------------


class _SlowUploads(CudaChannel):
    """A channel whose upload stream is busy before every copy: the compute stream must wait for it and
    the host must not refill a pinned slot whose copy has not run yet."""

    def _issue(self, j, job):
        with torch.cuda.stream(self.up_stream):
            torch.cuda._sleep(SLEEP)
        return super()._issue(j, job)


def _bands(t: torch.Tensor, rows: int, halo: int):
    """Row bands of one sample with ``halo`` rows of overlap: (lo, hi) pairs covering all rows."""
    h, start, out = t.shape[2], 0, []
    while start < h:
        out.append((max(start - halo, 0), min(start + rows + halo, h)))
        start += rows
    return out


@pytest.mark.parametrize("channel_cls", [CudaChannel, _SlowUploads])
@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
def test_channel_round_trip_under_slow_streams(channel_cls, layout):
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(3, 5, 61, 17).contiguous(memory_format=fmt)
    ch = channel_cls(device, overlap=True)
    out = torch.full_like(x, float("nan"))
    acc = torch.zeros_like(x)
    want_acc = torch.zeros_like(x)
    jobs, dsts = [], []
    for n in range(x.shape[0]):
        for lo, hi in _bands(x[n:n + 1], rows=7, halo=2):  # overlapping bands: accumulation in order
            jobs.append([x[n:n + 1, :, lo:hi], x[n:n + 1, :, lo:hi].to(torch.float16)])
            dsts.append((n, lo, hi))
    for k, ((xs, xh), (n, lo, hi)) in enumerate(zip(ch.load(iter(jobs)), dsts, strict=True)):
        assert xs.is_cuda and xs.dtype == torch.float32 and xh.dtype == torch.float16
        torch.cuda._sleep(SLEEP)  # slow compute: the download must wait for it
        y = xs * 2 + k
        ch.store(y.to(torch.bfloat16), acc[n:n + 1, :, lo:hi], accumulate=True)  # dtype converted on host
        ch.store(xh.float() - xs, out[n:n + 1, :, lo:hi])
        want_acc[n:n + 1, :, lo:hi] += (x[n:n + 1, :, lo:hi] * 2 + k).to(torch.bfloat16)
    ch.finish()
    torch.testing.assert_close(out, x.half().float() - x, rtol=0, atol=0)
    torch.testing.assert_close(acc, want_acc, rtol=0, atol=0)
    elements = sum(b[0].numel() for b in jobs)
    assert ch.bytes_to_device == elements * (4 + 2)
    assert ch.bytes_to_host == elements * (2 + 4)


def test_channel_grows_buffers_and_reuses_them():
    device = torch.device("cuda", torch.cuda.current_device())
    ch = _SlowUploads(device, overlap=True)
    sizes = [3, 40, 7, 90, 90, 2, 120, 5]  # strips of changing size: slots grow, smaller ones reuse them
    srcs = [torch.randn(1, 4, s, 9, dtype=F64) for s in sizes]
    dsts = [torch.empty_like(s) for s in srcs]
    for (xs,), dst in zip(ch.load([s] for s in srcs), dsts, strict=True):
        ch.store(xs.neg(), dst)
    ch.finish()
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(d, -s)
    # an expanded (stride-0) host gradient, as autograd hands to a layer whose output is summed
    g = torch.ones(()).expand(2, 3, 5, 4)
    (gs,) = next(iter(ch.load([[g]])))
    assert torch.equal(gs.cpu(), torch.ones(2, 3, 5, 4))


def test_channel_for_caches_one_channel_per_device_mode_and_thread():
    a, b = channel_for(torch.device("cuda"), True), channel_for(torch.device("cuda"), False)
    assert isinstance(a, CudaChannel) and a.overlap and not b.overlap
    assert channel_for(torch.device("cuda", torch.cuda.current_device()), True) is a
    other = []
    thread = threading.Thread(target=lambda: other.append(channel_for(torch.device("cuda"), True)))
    thread.start()
    thread.join()
    assert isinstance(other[0], CudaChannel) and other[0] is not a  # pinned slots are not shared


def test_synchronous_channel_matches():
    device = torch.device("cuda", torch.cuda.current_device())
    ch = CudaChannel(device, overlap=False)
    x = torch.randn(2, 3, 11, 7).contiguous(memory_format=torch.channels_last)
    out = torch.zeros_like(x)
    for i, (xs,) in enumerate(ch.load([x[:, :, r:r + 4]] for r in range(0, 11, 4))):
        assert xs.is_cuda
        ch.store(xs * 3, out[:, :, 4 * i:4 * i + xs.shape[2]])
    ch.finish()
    assert torch.equal(out, x * 3)
    assert ch.bytes_to_device == ch.bytes_to_host == x.numel() * 4


# --- whole models, float64 ---------------------------------------------------------------------------


def _pair(arch, big_stages, num_classes=3, max_elements=BUDGET, dtype=F64, **options):
    ref = dense_resnet(arch, num_classes=num_classes, dtype=dtype).cuda()
    big = BUILD[arch](big_stages=big_stages, max_elements=max_elements, num_classes=num_classes,
                      device="cuda", dtype=dtype, **options)
    big.load_state_dict(ref.state_dict())
    return big, ref


def _compare_f64(arch, big_stages, size, rtol=1e-9, train=True, **options):
    big, ref = _pair(arch, big_stages, **options)
    big.train(train)
    ref.train(train)
    torch.manual_seed(1)
    x = torch.randn(size[0], 3, size[1], size[2], dtype=F64)
    xb, xr = x.clone().requires_grad_(), x.cuda().requires_grad_()
    y, r = big(xb), ref(xr)
    assert y.is_cuda
    scale = lambda t: rtol * max(1.0, t.abs().max().item())  # noqa: E731
    torch.testing.assert_close(y, r, rtol=rtol, atol=scale(r))
    w = torch.randn_like(r)
    (y * w).sum().backward()
    (r * w).sum().backward()
    torch.testing.assert_close(xb.grad, xr.grad.cpu(), rtol=rtol, atol=scale(xr.grad), msg="input")
    got = dict(big.named_parameters())
    for name, p in ref.named_parameters():
        assert got[name].grad is not None and got[name].grad.is_cuda, name
        torch.testing.assert_close(got[name].grad, p.grad, rtol=rtol, atol=scale(p.grad), msg=name)
    state = big.state_dict()
    for name, v in ref.state_dict().items():
        torch.testing.assert_close(state[name], v, rtol=rtol, atol=scale(v), msg=name)
    if big_stages >= 0:
        stats = big.memory_stats()
        assert 0 < stats["peak_tensor_elements"] <= big.big_config.max_elements
        assert stats["peak_strip_elements"] <= 4 * big.big_config.max_elements
    return big


@pytest.mark.parametrize("size", ["image", "bag"])
@pytest.mark.parametrize("big_stages", [0, 1, 2, 3, 4])
def test_resnet18_cuda_matches_dense(big_stages, size):
    _compare_f64("resnet18", big_stages, SIZES[size])


@pytest.mark.parametrize("big_stages,size", [(0, "bag"), (1, "image"), (2, "image"), (4, "image"),
                                             (4, "bag")])
def test_resnet50_cuda_matches_dense(big_stages, size):
    _compare_f64("resnet50", big_stages, SIZES[size])


@pytest.mark.parametrize("options", [dict(overlap=False), dict(channels_last=False),
                                     dict(channels_last=False, overlap=False)],
                         ids=["sync", "nchw", "nchw-sync"])
def test_resnet18_cuda_options_match_dense(options):
    _compare_f64("resnet18", 4, SIZES["large"], **options)


def test_resnet50_cuda_one_row_strips_and_eval_mode():
    # the smallest budget that holds one output row of every big layer of this input: one-row strips
    _compare_f64("resnet50", 2, SIZES["image"], max_elements=4608)
    _compare_f64("resnet18", 4, SIZES["image"], train=False)


# --- overlap on/off ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,dtype", [("resnet18", F64), ("resnet18", torch.float32),
                                        ("resnet50", torch.float32)])
def test_double_buffered_is_bit_identical_to_synchronous(arch, dtype, deterministic_cudnn):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 67, 53, dtype=dtype)
    results = []
    for overlap in (True, False):
        big, _ = _pair(arch, 4, max_elements=20000, dtype=dtype, overlap=overlap)
        ch = channel_for(big.device, overlap)
        moved = ch.bytes_to_device, ch.bytes_to_host
        y = big(x)
        y.square().sum().backward()
        grads = torch.cat([p.grad.flatten() for p in big.parameters()]).cpu()
        stats = torch.cat([b.flatten().double() for b in big.buffers()]).cpu()
        results.append((y.detach().cpu(), grads, stats,
                        ch.bytes_to_device - moved[0], ch.bytes_to_host - moved[1]))
    (y1, g1, s1, up1, down1), (y2, g2, s2, up2, down2) = results
    assert torch.equal(y1, y2)
    assert torch.equal(g1, g2)
    assert torch.equal(s1, s2)
    assert (up1, down1) == (up2, down2) and up1 > 0 and down1 > 0


# --- mixed precision and half-precision storage ----------------------------------------------------------


class _Round(nn.Module):
    """Rounds a float32 activation to ``dtype`` and back (and its gradient, through autograd)."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x if self.dtype is None else x.to(self.dtype).float()


def _stack(big: bool, storage=None, max_elements=4096) -> nn.Sequential:
    """A stem-like stack (strided 7x7 conv, train-mode BN, max pool, 3x3 convs) small enough that rounding
    errors are not amplified by depth, so AMP results can be compared tightly.

    The dense stack with ``storage`` rounds every activation (and gradient) where the big stack stores it
    in host RAM: the reference for half-precision storage.
    """
    cfg = BigConfig(max_elements=max_elements, storage_dtype=storage, channels_last=True)
    if big:
        conv = lambda *a: BigConv2d(*a, bias=False, config=cfg)  # noqa: E731
        bn = lambda c: BigBatchNorm2d(c, config=cfg)  # noqa: E731
        pool = BigMaxPool2d(3, 2, 1, config=cfg)
        return nn.Sequential(conv(3, 16, 7, 2, 3), bn(16), nn.ReLU(), pool, conv(16, 32, 3, 1, 1), bn(32),
                             nn.ReLU(), conv(32, 32, 3, 2, 1), bn(32))
    r = lambda: _Round(storage)  # noqa: E731
    return nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), r(), nn.BatchNorm2d(16), r(), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 32, 3, 1, 1, bias=False), r(),
                         nn.BatchNorm2d(32), r(), nn.ReLU(), nn.Conv2d(32, 32, 3, 2, 1, bias=False), r(),
                         nn.BatchNorm2d(32), r())


def _same_names(big: nn.Sequential, dense: nn.Sequential) -> dict:
    """The dense stack's state dict under the big stack's module indices (the dense one has _Round)."""
    layers = [m for m in dense if not isinstance(m, (_Round, nn.ReLU, nn.MaxPool2d))]
    index = [i for i, m in enumerate(big) if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))]
    return {f"{i}.{k}": v for i, m in zip(index, layers, strict=True) for k, v in m.state_dict().items()}


def _run(model, x, w, amp):
    """Output and gradients (parameters in order, then the input) of ``sum(model(x) * w)``."""
    xr = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=amp or torch.float16, enabled=amp is not None):
        y = model(xr)
    (y.float().cuda() * w).sum().backward()
    grads = [p.grad.detach().clone() for p in model.parameters()] + [xr.grad.detach().clone()]
    return y.detach().float().cuda(), grads


def _stack_pair(big_storage, ref_storage=None, dtype=torch.float32):
    """A dense stack with non-trivial BatchNorm affine parameters and a big stack with its weights."""
    ref = _stack(False, ref_storage).cuda().to(dtype)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    big = _stack(True, big_storage).cuda()
    state = {k: v.clone().float() for k, v in _same_names(big, ref).items()}
    big.load_state_dict(state)
    names = [n for n, _ in big.named_parameters()] + ["input"]
    return big, ref, names


@pytest.mark.parametrize("storage", [None, "same"])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_big_layers_match_dense_under_autocast(amp, storage):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 70, 61)
    w = torch.randn(2, 32, 9, 8, device="cuda")
    big, ref, names = _stack_pair(amp if storage == "same" else None)
    exact = _stack(False).cuda().double()
    exact.load_state_dict(ref.state_dict())
    y64, g64 = _run(exact, x.double().cuda(), w.double(), None)
    y_dense, g_dense = _run(ref, x.cuda(), w, amp)
    y_big, g_big = _run(big, x, w, amp)
    tol_y, tol_g = HALF[amp]
    if storage is None:
        # float32 host activations where the dense model keeps half-precision ones: rounding moves some
        # max-pool winners, and each moved winner routes a whole gradient element elsewhere
        tol_g = 3 * tol_g
    assert torch.isfinite(y_big).all()
    assert _rel(y_big, y_dense) < tol_y, _rel(y_big, y_dense)
    # no worse than the dense model's own rounding error (against float64), up to a small margin
    assert _rel(y_big, y64) < 2 * _rel(y_dense, y64) + tol_y / 4
    for name, gb, gd, ge in zip(names, g_big, g_dense, g64, strict=True):
        assert _rel(gb, gd) < tol_g, (name, _rel(gb, gd))
        assert _rel(gb, ge) < 2 * _rel(gd, ge) + tol_g / 4, (name, _rel(gb, ge), _rel(gd, ge))
    big_state = big.state_dict()
    for name, v in _same_names(big, ref).items():
        if v.is_floating_point():
            assert _rel(big_state[name], v) < tol_g, name
        else:
            assert int(big_state[name]) == int(v) == 1, name


def _resnet_grads(model, x, w, amp):
    with torch.autocast("cuda", dtype=amp or torch.float16, enabled=amp is not None):
        y = model(x)
    (y.float() * w).sum().backward()
    return y.detach().float(), torch.cat([p.grad.flatten().double() for p in model.parameters()])


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_resnet_matches_dense_under_autocast(arch, amp):
    """Whole models in eval mode (a randomly initialised network in training mode amplifies rounding
    differences chaotically; the train-mode BatchNorm path under autocast is checked on the stack)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    ref = dense_resnet(arch, num_classes=0, dtype=torch.float32).cuda().eval()
    w = torch.randn(2, 512 * (4 if arch == "resnet50" else 1), device="cuda")
    big = BUILD[arch](big_stages=4, max_elements=BUDGET, num_classes=0, device="cuda", storage_dtype=amp)
    big.load_state_dict(ref.state_dict())
    big.eval()
    y_dense, g_dense = _resnet_grads(ref, x.cuda(), w, amp)
    y_big, g_big = _resnet_grads(big, x, w, amp)
    exact = dense_resnet(arch, num_classes=0, dtype=F64).cuda().eval()
    exact.load_state_dict(ref.state_dict())
    y64, g64 = _resnet_grads(exact, x.double().cuda(), w.double(), None)
    tol_y, tol_g = HALF[amp]
    assert torch.isfinite(g_big).all()
    assert _rel(y_big, y_dense) < 2 * tol_y, _rel(y_big, y_dense)
    assert _rel(g_big, g_dense) < 2 * tol_g, _rel(g_big, g_dense)
    assert _rel(g_big, g64) < 2 * _rel(g_dense, g64) + tol_g / 4


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_storage(storage):
    torch.manual_seed(0)
    # train mode, shallow stack, against a dense stack that rounds each activation and gradient where the
    # big one stores it: only the summation order differs
    x = torch.randn(2, 3, 70, 61)
    w = torch.randn(2, 32, 9, 8, device="cuda")
    big, ref, names = _stack_pair(storage, storage)
    seen = []
    big[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    y_ref, g_ref = _run(ref, x.cuda(), w, None)
    y_big, g_big = _run(big, x, w, None)
    assert seen == [storage]
    tol_y, tol_g = HALF[storage]
    assert _rel(y_big, y_ref) < tol_y / 4, _rel(y_big, y_ref)
    for name, gb, gr in zip(names, g_big, g_ref, strict=True):
        assert _rel(gb, gr) < tol_g / 4, (name, _rel(gb, gr))
    # against plain float32 the output moves by a rounding unit or so
    plain = _stack(False).cuda()
    plain.load_state_dict(ref.state_dict())
    y32, _ = _run(plain, x.cuda(), w, None)
    assert _rel(y_big, y32) < tol_y, _rel(y_big, y32)
    # whole ResNet-18 in eval mode: host activations in half precision, float32 output
    ref = dense_resnet("resnet18", num_classes=0, dtype=torch.float32).cuda().eval()
    big = resnet18(big_stages=4, max_elements=BUDGET, num_classes=0, device="cuda", storage_dtype=storage)
    big.load_state_dict(ref.state_dict())
    big.eval()
    wf = torch.randn(2, 512, device="cuda")
    y_ref, g_ref = _resnet_grads(ref, x.cuda(), wf, None)
    y_big, g_big = _resnet_grads(big, x, wf, None)
    assert y_big.dtype == torch.float32 and torch.isfinite(g_big).all()
    assert _rel(y_big, y_ref) < 2 * tol_y, _rel(y_big, y_ref)
    assert _rel(g_big, g_ref) < 0.1, _rel(g_big, g_ref)  # rounding moves some max-pool winners


# --- device memory ---------------------------------------------------------------------------------------


def test_memory_meter_is_bounded_by_max_elements():
    budget = 1 << 16
    for arch in ("resnet18", "resnet50"):
        model = BUILD[arch](big_stages=4, max_elements=budget, num_classes=0, device="cuda")
        model(torch.randn(2, 3, 160, 144)).sum().backward()
        stats = model.memory_stats()
        assert stats["strips"] > 100
        assert 0.25 * budget < stats["peak_tensor_elements"] <= budget, stats
        assert stats["peak_strip_elements"] <= 4 * budget, stats


def _peak(model_fn, side: int, big: bool) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = model_fn()
    x = torch.randn(1, 3, side, side)
    model(x if big else x.cuda()).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model
    return peak


def test_peak_gpu_memory_is_flat_as_the_image_grows():
    sides = (512, 1024, 2048)
    peaks, dense = [], []
    for side in sides:
        peaks.append(_peak(lambda: resnet18(big_stages=4, max_elements=1 << 20, device="cuda"), side, True))
        dense.append(_peak(lambda: resnet18(big_stages=-1, device="cuda"), side, False))
    # 16x more pixels, nearly the same device memory (parameters, gradients and a few strips) ...
    assert peaks[-1] < 1.5 * peaks[0], peaks
    # ... while the dense model's activations grow with the area (4x per doubling of the side)
    assert dense[2] - dense[1] > 3 * (dense[1] - dense[0]) > 0, dense
    assert peaks[-1] - peaks[0] < 0.1 * (dense[-1] - dense[0]), (peaks, dense)


def test_big_model_runs_where_the_dense_model_does_not_fit():
    """Under a device-memory cap of 2.5x the dense ResNet-18's peak on a 1024^2 image, the dense model
    cannot train on a 2048^2 image (4x the activations), the big one can, within the cap."""
    dense_1024 = _peak(lambda: resnet18(big_stages=-1, device="cuda"), 1024, False)
    cap = 2.5 * dense_1024
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        failed = False
        try:
            _peak(lambda: resnet18(big_stages=-1, device="cuda"), 2048, False)
        except torch.OutOfMemoryError:
            failed = True
        assert failed, "the dense model fitted under the cap"
        big = _peak(lambda: resnet18(big_stages=4, max_elements=1 << 20, device="cuda"), 2048, True)
        assert big < cap
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_maxpool_and_bn_helpers_on_cuda_against_functional():
    """Single layers on CUDA (device parameters, host activations) against the functional ops."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 33, 29, dtype=F64, requires_grad=True)
    bn = BigBatchNorm2d(6, max_elements=300, dtype=F64, device="cuda")
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    y = bn(x)
    r = F.batch_norm(x.cuda(), None, None, bn.weight, bn.bias, training=True)
    torch.testing.assert_close(y, r.cpu(), rtol=1e-9, atol=1e-9)
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, bn.weight, bn.bias], gy)
    want = torch.autograd.grad(r, [x, bn.weight, bn.bias], gy.cuda())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-9, atol=1e-9)
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_var.cpu(), 0.9 + 0.1 * x.detach().var(dim=(0, 2, 3)),
                               rtol=1e-9, atol=1e-9)
