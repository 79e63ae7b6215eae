"""BigBatchNorm2d: exact training-mode BatchNorm over a host-resident input, strip by strip.

Forward, training (Algorithm 2 of the Big-Layers paper):

* pass 1 stages every strip and computes its per-channel count n_i, mean m_i and sum of squared
  deviations about the strip mean M2_i (two-pass within the strip, in at least float32); the strips
  are merged in float64 with Chan's parallel form of Welford's update,
  delta = m_b - m_a,  n = n_a + n_b,  m = m_a + delta n_b / n,  M2 = M2_a + M2_b + delta^2 n_a n_b / n;
* the biased variance M2/n normalises, the unbiased M2/(n-1) enters the running variance, and the running
  statistics and ``num_batches_tracked`` are updated exactly once per forward, as ``nn.BatchNorm2d`` does;
* pass 2 stages every strip again and writes y = x * scale + shift with scale = gamma / sqrt(var + eps),
  shift = beta - mean * scale.

In eval mode (with running statistics) only pass 2 runs, with the running mean and variance.

Backward, with xhat = (x - mean) * invstd and sums over all N*H*W positions of a channel:

* one reduction pass: S1 = sum(dy), S2 = sum(dy * (x - mean)) (merged in float64); grad_beta = S1,
  grad_gamma = S2 * invstd;
* one elementwise pass: dx = gamma * invstd * (dy - S1/n - (x - mean) * invstd^2 * S2/n)
  (batch statistics) or dx = gamma * invstd * dy (running statistics). It is evaluated as
  dx = a * dy + b * x + c with per-channel a, b, c (computed in float64), the same folding PyTorch's CPU
  kernel uses for the forward normalisation.
"""

from __future__ import annotations

import torch
from torch import nn

from dpgs.biglayers.config import DEFAULT_MAX_ELEMENTS, BigConfig, stat_dtype
from dpgs.biglayers.planner import RowWindow, Strip, plan_strips
from dpgs.biglayers.transfer import channel_for

_DIMS = (0, 2, 3)


def plan_pointwise(shape, max_elements: int, what: str) -> list[Strip]:
    """Strips of a layer that maps every input element to one output element."""
    n, c, h, w = shape
    return plan_strips(n, h, RowWindow(), c * w, c * w, max_elements, what)


def _band(t: torch.Tensor, s: Strip) -> torch.Tensor:
    return t[s.n0:s.n1] if s.full_height else t[s.n0:s.n1, :, s.r0:s.r1]


def _col(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return v.to(dtype).view(1, -1, 1, 1)


def _merge(acc: list, count: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
    """Chan's merge of (count, mean, M2) into the float64 accumulator ``acc`` (in place)."""
    if acc[0] == 0:
        acc[:] = [count, mean.clone(), m2.clone()]
        return
    n_a, mean_a, m2_a = acc
    total = n_a + count
    delta = mean - mean_a
    acc[:] = [total, mean_a + delta * (count / total), m2_a + m2 + delta * delta * (n_a * count / total)]


class BigBatchNorm2dFunction(torch.autograd.Function):
    """Autograd function of ``BigBatchNorm2d`` (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked,
                use_batch_stats: bool, momentum, eps: float, cfg: BigConfig):
        c = x.shape[1]
        device = weight.device if weight is not None else (
            running_mean.device if running_mean is not None else torch.device("cpu"))
        sdt = stat_dtype(x.dtype)
        strips = plan_pointwise(x.shape, cfg.max_elements, f"BigBatchNorm2d({c}, input {tuple(x.shape)})")
        channel = channel_for(device, cfg.overlap)
        f64 = dict(dtype=torch.float64, device=device)
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            if use_batch_stats:
                acc: list = [0, None, None]
                for xs, in channel.load([_band(x, s)] for s in strips):
                    xs = xs.to(sdt)
                    n_i = xs.numel() // c
                    mean_i = xs.sum(dim=_DIMS) / n_i
                    centred = xs - mean_i.view(1, -1, 1, 1)
                    m2_i = torch.linalg.vector_norm(centred, dim=_DIMS).to(torch.float64).square()
                    cfg.meter.observe(xs, centred)
                    _merge(acc, n_i, mean_i.to(torch.float64), m2_i)
                count, mean, m2 = acc
                if count < 2:
                    raise ValueError(
                        f"BigBatchNorm2d: expected more than 1 value per channel when training, "
                        f"got input of shape {tuple(x.shape)}"
                    )
                var = m2 / count
                if running_mean is not None:
                    num_batches_tracked.add_(1)
                    factor = 1.0 / float(num_batches_tracked.item()) if momentum is None else momentum
                    running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                    unbiased = (m2 / (count - 1)).to(running_var.dtype)
                    running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
            else:
                count = x.numel() // c
                mean = running_mean.to(**f64)
                var = running_var.to(**f64)
            invstd = torch.rsqrt(var + eps)
            gamma = weight.to(**f64) if weight is not None else torch.ones(c, **f64)
            beta = bias.to(**f64) if bias is not None else torch.zeros(c, **f64)
            scale = gamma * invstd
            shift = beta - mean * scale
            out = torch.empty(x.shape, dtype=cfg.host_dtype(x.dtype), memory_format=cfg.memory_format())
            scale_s, shift_s = _col(scale, sdt), _col(shift, sdt)
            for s, (xs,) in zip(strips, channel.load([_band(x, s)] for s in strips), strict=True):
                dst = _band(out, s)
                if channel.host_is_device and dst.dtype == sdt and xs.dtype == sdt:
                    torch.addcmul(shift_s, xs, scale_s, out=dst)
                    cfg.meter.observe(xs, dst)
                else:
                    y = torch.addcmul(shift_s, xs.to(sdt), scale_s)
                    cfg.meter.observe(xs, y)
                    channel.store(y, dst)
            channel.finish()
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.cfg, ctx.strips, ctx.sdt, ctx.count = cfg, strips, sdt, count
        ctx.use_batch_stats, ctx.device = use_batch_stats, device
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        cfg, strips, sdt, count, device = ctx.cfg, ctx.strips, ctx.sdt, ctx.count, ctx.device
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        channel = channel_for(device, cfg.overlap)
        c = x.shape[1]
        f64 = dict(dtype=torch.float64, device=device)
        gamma = weight.to(**f64) if weight is not None else torch.ones(c, **f64)
        grad_w = grad_b = grad_x = None
        with torch.autocast(device.type, enabled=False):
            reduce = need_w or need_b or (need_x and ctx.use_batch_stats)
            s1 = torch.zeros(c, **f64)
            s2 = torch.zeros(c, **f64)
            if reduce:
                mean_r = mean.to(sdt)
                ones = torch.ones(c, dtype=sdt, device=device)
                jobs = ([_band(x, s), _band(grad_out, s)] for s in strips)
                for xs, gys in channel.load(jobs):
                    # fused per-channel reduction: sum(dy * (x - mean)) and sum(dy)
                    _, s2_i, s1_i = torch.ops.aten.native_batch_norm_backward(
                        gys.to(sdt), xs.to(sdt), ones, None, None, mean_r, ones, True, 0.0,
                        [False, True, True])
                    s1 += s1_i.to(torch.float64)
                    s2 += s2_i.to(torch.float64)
                    cfg.meter.observe(xs, gys)
                if need_w:
                    grad_w = (s2 * invstd).to(weight.dtype)
                if need_b:
                    grad_b = s1.to(weight.dtype)
            if need_x:
                # dx = a * dy + b * (x - mean) + c0, folded into dx = a * dy + b * x + (c0 - b * mean)
                a = gamma * invstd
                if ctx.use_batch_stats:
                    b = -gamma * invstd.pow(3) * s2 / count
                    c0 = -a * s1 / count - b * mean
                else:
                    b = torch.zeros_like(a)
                    c0 = torch.zeros_like(a)
                a_s, b_s, c_s = _col(a, sdt), _col(b, sdt), _col(c0, sdt)
                grad_x = torch.empty_like(x)
                jobs = ([_band(x, s), _band(grad_out, s)] for s in strips)
                for s, (xs, gys) in zip(strips, channel.load(jobs), strict=True):
                    dst = _band(grad_x, s)
                    host_out = channel.host_is_device and dst.dtype == sdt
                    if ctx.use_batch_stats:
                        dx = torch.addcmul(c_s, xs.to(sdt), b_s, out=dst) if host_out else \
                            torch.addcmul(c_s, xs.to(sdt), b_s)
                        dx.addcmul_(gys.to(sdt), a_s)
                    else:
                        dx = torch.mul(gys.to(sdt), a_s, out=dst) if host_out else gys.to(sdt) * a_s
                    cfg.meter.observe(xs, gys, dx)
                    if not host_out:
                        channel.store(dx, dst)
                channel.finish()
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


class BigBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` over a host-resident input with exact full-input statistics (see module doc).

    Parameters and buffers (``weight``, ``bias``, ``running_mean``, ``running_var``,
    ``num_batches_tracked``) are those of ``nn.BatchNorm2d``, so state dicts are interchangeable.

    Example:
        >>> bn = BigBatchNorm2d(8, max_elements=1024)
        >>> bn(torch.randn(2, 8, 16, 16)).shape
        torch.Size([2, 8, 16, 16])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        config: BigConfig | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.big_config = config if config is not None else BigConfig(max_elements=max_elements)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"BigBatchNorm2d expects a [N, C, H, W] input, got shape {tuple(x.shape)}")
        if x.shape[1] != self.num_features:
            raise ValueError(f"BigBatchNorm2d expects {self.num_features} channels, got {x.shape[1]}")
        use_batch_stats = self.training or self.running_mean is None
        update = self.training and self.track_running_stats
        stats = (self.running_mean, self.running_var, self.num_batches_tracked) if (
            update or not use_batch_stats) else (None, None, None)
        return BigBatchNorm2dFunction.apply(
            x.cpu(), self.weight, self.bias, *stats, use_batch_stats, self.momentum, self.eps,
            self.big_config,
        )
