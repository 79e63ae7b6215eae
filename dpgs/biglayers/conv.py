"""BigConv2d: a 2-D convolution on a host-resident input, computed on the device strip by strip.

Forward (Algorithm 3 of the Big-Layers paper): for each strip (samples [n0, n1), output rows [r0, r1))
the input band with its halo rows is staged to the device, rows outside the image become explicit zero
rows, and ``conv2d`` with the layer's width padding produces exactly the output band, which is written to
its place in the host output. Strips spanning the full height use the layer's own padding directly.

Backward (Algorithm 4): the same strips are replayed. ``convolution_backward`` of a strip gives the
weight/bias gradient contribution of the output rows the strip owns (each output row is owned by exactly
one strip, so nothing is counted twice) and the gradient of its input band; bands overlap by the halo,
and overlapping input gradients are summed in host RAM. Weight and bias gradients are accumulated on the
device in the parameter dtype.

Under ``torch.autocast`` the device computes in the autocast dtype (float32 parameters only); host
activations keep the input dtype unless ``BigConfig.storage_dtype`` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpgs.biglayers.config import DEFAULT_MAX_ELEMENTS, BigConfig, compute_dtype
from dpgs.biglayers.planner import RowWindow, Strip, plan_strips
from dpgs.biglayers.transfer import channel_for


@dataclass(frozen=True)
class ConvGeometry:
    """Stride, padding, dilation and groups of a convolution, as (height, width) pairs."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    def window(self, kernel_h: int) -> RowWindow:
        return RowWindow(kernel_h, self.stride[0], self.padding[0], self.dilation[0])

    def strip_padding(self, strip: Strip) -> list[int]:
        """Padding passed to the device op: the layer's own for full-height strips, width-only otherwise."""
        return [self.padding[0] if strip.full_height else 0, self.padding[1]]


def plan_conv(x_shape, weight_shape, geom: ConvGeometry, max_elements: int) -> tuple[list[Strip], int, int]:
    """Strips of a convolution plus its output height and width."""
    n, c, h, w = x_shape
    c_out, _, kh, kw = weight_shape
    width = RowWindow(kw, geom.stride[1], geom.padding[1], geom.dilation[1])
    out_w = width.out_rows(w)
    what = f"BigConv2d({c}->{c_out}, kernel {kh}x{kw}, input {tuple(x_shape)})"
    if out_w < 1:
        raise ValueError(f"{what}: input width {w} is too small for the kernel")
    window = geom.window(kh)
    strips = plan_strips(n, h, window, c * w, c_out * out_w, max_elements, what)
    return strips, window.out_rows(h), out_w


def _band(t: torch.Tensor, s: Strip) -> torch.Tensor:
    return t[s.n0:s.n1] if s.full_height else t[s.n0:s.n1, :, s.lo:s.hi]


def _pad_rows(t: torch.Tensor, s: Strip) -> torch.Tensor:
    if s.full_height or (s.pad_top == 0 and s.pad_bottom == 0):
        return t
    return F.pad(t, (0, 0, s.pad_top, s.pad_bottom))


class BigConv2dFunction(torch.autograd.Function):
    """Autograd function of ``BigConv2d`` (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, geom: ConvGeometry, cfg: BigConfig):
        device = weight.device
        cdt = compute_dtype(device, weight.dtype)
        strips, out_h, out_w = plan_conv(x.shape, weight.shape, geom, cfg.max_elements)
        channel = channel_for(device, cfg.overlap)
        out_dtype = cfg.host_dtype(x.dtype)
        fmt = cfg.memory_format()
        with torch.autocast(device.type, enabled=False):
            w = weight.to(cdt)
            b = None if bias is None else bias.to(cdt)
            whole = len(strips) == 1 and strips[0].samples == x.shape[0] and strips[0].full_height
            if whole and channel.host_is_device:
                y = F.conv2d(x.to(cdt), w, b, geom.stride, geom.padding, geom.dilation, geom.groups)
                cfg.meter.observe(x, y)
                out = y.to(dtype=out_dtype, memory_format=fmt)
            else:
                out = torch.empty(
                    (x.shape[0], weight.shape[0], out_h, out_w), dtype=out_dtype, memory_format=fmt
                )
                jobs = ([_band(x, s)] for s in strips)
                for s, (xs,) in zip(strips, channel.load(jobs), strict=True):
                    xp = _pad_rows(xs.to(cdt), s)
                    y = F.conv2d(xp, w, b, geom.stride, geom.strip_padding(s), geom.dilation, geom.groups)
                    cfg.meter.observe(xs, xp, y)
                    channel.store(y, out[s.n0:s.n1, :, s.r0:s.r1])
                channel.finish()
        ctx.save_for_backward(x, weight, bias)
        ctx.geom, ctx.cfg, ctx.cdt, ctx.strips = geom, cfg, cdt, strips
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        geom, cfg, cdt, strips = ctx.geom, ctx.cfg, ctx.cdt, ctx.strips
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        device = weight.device
        channel = channel_for(device, cfg.overlap)
        mask = [need_x, need_w, need_b and bias is not None]
        bias_sizes = [weight.shape[0]] if bias is not None else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if mask[2] else None
        grad_x = None
        with torch.autocast(device.type, enabled=False):
            w = weight.to(cdt)
            whole = len(strips) == 1 and strips[0].samples == x.shape[0] and strips[0].full_height
            if need_x and not (whole and channel.host_is_device):
                grad_x = torch.zeros_like(x)
            jobs = ([_band(x, s), grad_out[s.n0:s.n1, :, s.r0:s.r1]] for s in strips)
            for s, (xs, gys) in zip(strips, channel.load(jobs), strict=True):
                xp = _pad_rows(xs.to(cdt), s)
                gy = gys.to(cdt)
                gi, gw, gb = torch.ops.aten.convolution_backward(
                    gy, xp, w, bias_sizes, geom.stride, geom.strip_padding(s), geom.dilation,
                    False, [0, 0], geom.groups, mask,
                )
                cfg.meter.observe(xs, xp, gy, gi)
                if need_w:
                    grad_w += gw
                if mask[2]:
                    grad_b += gb
                if need_x:
                    if grad_x is None:
                        grad_x = gi.to(x.dtype)
                        continue
                    if not s.full_height:
                        gi = gi[:, :, s.pad_top:gi.shape[2] - s.pad_bottom]
                    channel.store(gi, _band(grad_x, s), accumulate=not s.full_height)
            channel.finish()
        return grad_x, grad_w, grad_b, None, None


def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return (int(v[0]), int(v[1]))
    raise ValueError(f"BigConv2d.{name} must be an int or a pair of ints, got {v!r}")


class BigConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose input and output live in host RAM and that computes strip by strip.

    Parameters (``weight``, ``bias``) and their initialisation are those of ``nn.Conv2d``, so state dicts
    are interchangeable. Only ``padding_mode='zeros'`` and integer paddings are supported.

    Example:
        >>> conv = BigConv2d(3, 8, 3, stride=2, padding=1, max_elements=4096)
        >>> conv(torch.randn(1, 3, 64, 64)).shape
        torch.Size([1, 8, 32, 32])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        config: BigConfig | None = None,
        device=None,
        dtype=None,
    ) -> None:
        if padding_mode != "zeros":
            raise ValueError(f"BigConv2d.padding_mode must be 'zeros', got {padding_mode!r}")
        if isinstance(padding, str):
            raise ValueError(f"BigConv2d.padding must be an int or a pair of ints, got {padding!r}")
        super().__init__(
            in_channels, out_channels, kernel_size, stride, _pair(padding, "padding"), dilation, groups,
            bias, padding_mode, device=device, dtype=dtype,
        )
        self.big_config = config if config is not None else BigConfig(max_elements=max_elements)
        self.geometry = ConvGeometry(
            _pair(self.stride, "stride"), _pair(self.padding, "padding"),
            _pair(self.dilation, "dilation"), groups,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"BigConv2d expects a [N, C, H, W] input, got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"BigConv2d expects {self.in_channels} input channels, got {x.shape[1]}")
        return BigConv2dFunction.apply(x.cpu(), self.weight, self.bias, self.geometry, self.big_config)
