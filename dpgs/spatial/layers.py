"""Sample-parallel layers: each rank computes the part of a layer's output that it owns.

An activation is a pair (tensor, ``Partition``): the tensor is this rank's owned rectangle
``[N, C, rows, cols]`` (host memory), the partition says who owns what (``dpgs.spatial.partition``).

* ``conv2d``: halo exchange (zero edge padding) then ``BigConv2dFunction`` with zero padding on the
  extended input, so the rank's output band is computed strip by strip exactly as the single-process big
  layer computes it. Its weight gradient is the contribution of the owned output positions; the sum over
  ranks (``allreduce_grads``) is the full gradient.
* ``max_pool2d``: halo exchange with -inf edge padding, then ``BigMaxPool2d`` without padding.
* ``batch_norm``: training mode is *exact*: every rank computes (count, mean, M2) of its rectangle strip
  by strip, the G triples are all-gathered and merged in rank order with Chan's formula (the merge of
  ``dpgs.biglayers.batchnorm``); the backward all-reduces the two per-channel sums S1 = sum(dy) and
  S2 = sum(dy * (x - mean)) before forming dx = a*dy + b*x + c. The parameter gradients returned are the
  rank's own parts (S2_local * invstd, S1_local) so that ``allreduce_grads`` sums them once. Running
  statistics are updated identically on every rank. Eval mode is local (no communication).
* ReLU and residual additions are elementwise and need no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpgs.biglayers.batchnorm import _band, _col, _merge, plan_pointwise
from dpgs.biglayers.config import BigConfig, stat_dtype
from dpgs.biglayers.conv import BigConv2dFunction, ConvGeometry
from dpgs.biglayers.planner import RowWindow
from dpgs.biglayers.pooling import BigMaxPool2d
from dpgs.biglayers.transfer import channel_for
from dpgs.spatial.halo import HaloExchange, SpatialContext
from dpgs.spatial.partition import HaloPlan, Partition

_DIMS = (0, 2, 3)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _config(module: nn.Module) -> BigConfig:
    cfg = getattr(module, "big_config", None)
    return cfg if cfg is not None else BigConfig()


def halo(x: torch.Tensor, plan: HaloPlan, sc: SpatialContext, fill: float) -> torch.Tensor:
    """The extended input of ``plan`` for this rank (``x`` itself when nothing moves and nothing pads)."""
    own = plan.inp.owned(sc.rank)
    if plan.halo_elements() == 0 and plan.need(sc.rank) == own:
        return x
    return HaloExchange.apply(x, plan, sc, fill)


def conv2d(x: torch.Tensor, part: Partition, conv: nn.Conv2d, sc: SpatialContext
           ) -> tuple[torch.Tensor, Partition]:
    """This rank's band of ``conv(full input)``; ``conv`` is an ``nn.Conv2d`` or ``BigConv2d``."""
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        raise ValueError(f"sample-parallel conv2d needs integer zero padding, got {conv.padding!r}, "
                         f"padding_mode={conv.padding_mode!r}")
    (kh, kw), (sh, sw) = conv.kernel_size, conv.stride
    (ph, pw), (dh, dw) = _pair(conv.padding), conv.dilation
    what = f"conv {conv.in_channels}->{conv.out_channels} {kh}x{kw}/{sh} on {part.height}x{part.width}"
    plan = HaloPlan(part, RowWindow(kh, sh, ph, dh), RowWindow(kw, sw, pw, dw), what)
    ext = halo(x, plan, sc, 0.0)
    geom = ConvGeometry((sh, sw), (0, 0), (dh, dw), conv.groups)
    return BigConv2dFunction.apply(ext, conv.weight, conv.bias, geom, _config(conv)), plan.out


def max_pool2d(x: torch.Tensor, part: Partition, pool: nn.MaxPool2d, sc: SpatialContext
               ) -> tuple[torch.Tensor, Partition]:
    """This rank's band of ``pool(full input)`` (floor mode)."""
    if pool.ceil_mode:
        raise ValueError("sample-parallel max_pool2d supports ceil_mode=False only")
    (kh, kw), (sh, sw) = _pair(pool.kernel_size), _pair(pool.stride)
    (ph, pw), (dh, dw) = _pair(pool.padding), _pair(pool.dilation)
    what = f"max pool {kh}x{kw}/{sh} on {part.height}x{part.width}"
    plan = HaloPlan(part, RowWindow(kh, sh, ph, dh), RowWindow(kw, sw, pw, dw), what)
    ext = halo(x, plan, sc, float("-inf"))
    local = BigMaxPool2d((kh, kw), (sh, sw), 0, (dh, dw), config=_config(pool))
    return local(ext), plan.out


def batch_norm(x: torch.Tensor, bn: nn.BatchNorm2d, sc: SpatialContext) -> torch.Tensor:
    """``bn`` over the full activation, evaluated on this rank's rectangle (exact in training mode)."""
    if x.shape[1] != bn.num_features:
        raise ValueError(f"batch_norm expects {bn.num_features} channels, got {x.shape[1]}")
    use_batch_stats = bn.training or bn.running_mean is None
    if not use_batch_stats:
        return bn(x)
    update = bn.training and bn.track_running_stats
    stats = (bn.running_mean, bn.running_var, bn.num_batches_tracked) if update else (None, None, None)
    return DistBatchNorm2dFunction.apply(x, bn.weight, bn.bias, *stats, bn.momentum, bn.eps, _config(bn), sc)


def _all_gather_moments(local: torch.Tensor, sc: SpatialContext) -> list[torch.Tensor]:
    dev = sc.comm_device
    sent = local.to(dev)
    parts = [torch.empty_like(sent) for _ in range(sc.grid.size)]
    dist.all_gather(parts, sent)
    sc.meter.stats_bytes += sent.numel() * sent.element_size()
    return [p.to(local.device) for p in parts]


def _all_reduce(t: torch.Tensor, sc: SpatialContext, kind: str) -> torch.Tensor:
    sent = t.to(sc.comm_device)
    dist.all_reduce(sent)
    setattr(sc.meter, kind, getattr(sc.meter, kind) + sent.numel() * sent.element_size())
    return sent.to(t.device)


class DistBatchNorm2dFunction(torch.autograd.Function):
    """Training-mode BatchNorm over the union of all ranks' rectangles (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                cfg: BigConfig, sc: SpatialContext):
        c = x.shape[1]
        device = weight.device if weight is not None else torch.device("cpu")
        sdt = stat_dtype(x.dtype)
        strips = plan_pointwise(x.shape, cfg.max_elements, f"batch_norm({c}, band {tuple(x.shape)})")
        channel = channel_for(device, cfg.overlap)
        f64 = dict(dtype=torch.float64, device=device)
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            acc: list = [0, None, None]
            for (xs,) in channel.load([_band(x, s)] for s in strips):
                xs = xs.to(sdt)
                n_i = xs.numel() // c
                mean_i = xs.sum(dim=_DIMS) / n_i
                m2_i = torch.linalg.vector_norm(xs - mean_i.view(1, -1, 1, 1), dim=_DIMS).to(torch.float64)
                _merge(acc, n_i, mean_i.to(torch.float64), m2_i.square())
            local = torch.cat([torch.tensor([float(acc[0])], **f64), acc[1], acc[2]])
            total: list = [0, None, None]
            for part in _all_gather_moments(local, sc):  # rank order: identical result on every rank
                _merge(total, int(part[0].item()), part[1:1 + c], part[1 + c:])
            count, mean, m2 = total
            if count < 2:
                raise ValueError(f"batch_norm: expected more than 1 value per channel when training, "
                                 f"got {count} positions over all ranks")
            if running_mean is not None:
                num_batches_tracked.add_(1)
                factor = 1.0 / float(num_batches_tracked.item()) if momentum is None else momentum
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_((m2 / (count - 1)).to(running_var.dtype), alpha=factor)
            invstd = torch.rsqrt(m2 / count + eps)
            gamma = weight.to(**f64) if weight is not None else torch.ones(c, **f64)
            beta = bias.to(**f64) if bias is not None else torch.zeros(c, **f64)
            scale = gamma * invstd
            scale_s, shift_s = _col(scale, sdt), _col(beta - mean * scale, sdt)
            out = torch.empty(x.shape, dtype=cfg.host_dtype(x.dtype), memory_format=cfg.memory_format())
            for s, (xs,) in zip(strips, channel.load([_band(x, s)] for s in strips), strict=True):
                channel.store(torch.addcmul(shift_s, xs.to(sdt), scale_s), _band(out, s))
            channel.finish()
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.cfg, ctx.strips, ctx.sdt, ctx.count, ctx.sc, ctx.device = cfg, strips, sdt, count, sc, device
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        cfg, strips, sdt, count, sc, device = ctx.cfg, ctx.strips, ctx.sdt, ctx.count, ctx.sc, ctx.device
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        channel = channel_for(device, cfg.overlap)
        c = x.shape[1]
        f64 = dict(dtype=torch.float64, device=device)
        grad_x = grad_w = grad_b = None
        with torch.autocast(device.type, enabled=False):
            s1 = torch.zeros(c, **f64)
            s2 = torch.zeros(c, **f64)
            mean_r, ones = mean.to(sdt), torch.ones(c, dtype=sdt, device=device)
            for xs, gys in channel.load([_band(x, s), _band(grad_out, s)] for s in strips):
                _, s2_i, s1_i = torch.ops.aten.native_batch_norm_backward(
                    gys.to(sdt), xs.to(sdt), ones, None, None, mean_r, ones, True, 0.0, [False, True, True])
                s1 += s1_i.to(torch.float64)
                s2 += s2_i.to(torch.float64)
            if need_w:
                grad_w = (s2 * invstd).to(weight.dtype)
            if need_b:
                grad_b = s1.to(weight.dtype)
            if need_x:
                both = _all_reduce(torch.cat([s1, s2]), sc, "stats_bytes")
                g1, g2 = both[:c], both[c:]
                gamma = weight.to(**f64) if weight is not None else torch.ones(c, **f64)
                a = gamma * invstd
                b = -gamma * invstd.pow(3) * g2 / count
                c0 = -a * g1 / count - b * mean
                a_s, b_s, c_s = _col(a, sdt), _col(b, sdt), _col(c0, sdt)
                grad_x = torch.empty_like(x)
                jobs = ([_band(x, s), _band(grad_out, s)] for s in strips)
                for s, (xs, gys) in zip(strips, channel.load(jobs), strict=True):
                    dx = torch.addcmul(c_s, xs.to(sdt), b_s).addcmul_(gys.to(sdt), a_s)
                    channel.store(dx, _band(grad_x, s))
                channel.finish()
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def allreduce_grads(params: list[torch.Tensor], sc: SpatialContext) -> None:
    """Sum the gradients of ``params`` over all ranks, in one flat all-reduce (missing grads count as 0)."""
    if not params or sc.grid.size == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    flat = _all_reduce(flat, sc, "grad_bytes")
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.device).clone()
        offset += p.numel()
