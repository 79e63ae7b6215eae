"""Host-side MaxPool2d for big activations, computed in strips without storing argmax indices.

Max pooling is cheap, so it runs where the activation lives (host RAM), as the Big-Layers paper does.
The input is cut into the same strips as a convolution with the same window (``max_elements`` bounds
the temporary bands). Rows outside the image are filled with -inf, so a padded position never wins and
ties are broken exactly as in ``F.max_pool2d`` (first maximum in window scan order).

Backward recomputes the argmax of each strip instead of keeping int64 indices for the whole output
(twice the bytes of a float32 output, in host RAM), routes the output gradient to the argmax positions,
and sums the contributions of overlapping bands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpgs.biglayers.config import DEFAULT_MAX_ELEMENTS, BigConfig
from dpgs.biglayers.planner import RowWindow, Strip, plan_strips


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


class _PoolGeometry:
    def __init__(self, kernel, stride, padding, dilation) -> None:
        self.kernel, self.stride = _pair(kernel), _pair(stride)
        self.padding, self.dilation = _pair(padding), _pair(dilation)
        for k, p, name in zip(self.kernel, self.padding, ("height", "width"), strict=True):
            if 2 * p > k:
                raise ValueError(
                    f"BigMaxPool2d: padding must be at most half the kernel ({name}: {p} > {k}/2)")

    def window(self, axis: int) -> RowWindow:
        return RowWindow(self.kernel[axis], self.stride[axis], self.padding[axis], self.dilation[axis])

    def plan(self, shape, max_elements: int) -> tuple[list[Strip], int, int]:
        n, c, h, w = shape
        out_w = self.window(1).out_rows(w)
        what = f"BigMaxPool2d(kernel {self.kernel}, input {tuple(shape)})"
        if out_w < 1:
            raise ValueError(f"{what}: input width {w} is too small for the kernel")
        strips = plan_strips(n, h, self.window(0), c * w, c * out_w, max_elements, what)
        return strips, self.window(0).out_rows(h), out_w

    def band(self, x: torch.Tensor, s: Strip) -> tuple[torch.Tensor, list[int]]:
        """The padded input band of a strip and the padding to pass to the pooling op."""
        if s.full_height:
            return x[s.n0:s.n1], list(self.padding)
        xs = x[s.n0:s.n1, :, s.lo:s.hi]
        if s.pad_top or s.pad_bottom:
            xs = F.pad(xs, (0, 0, s.pad_top, s.pad_bottom), value=float("-inf"))
        return xs, [0, self.padding[1]]


class BigMaxPool2dFunction(torch.autograd.Function):
    """Autograd function of ``BigMaxPool2d`` (see module docstring)."""

    @staticmethod
    def forward(ctx, x, geom: _PoolGeometry, cfg: BigConfig):
        strips, out_h, out_w = geom.plan(x.shape, cfg.max_elements)
        if len(strips) == 1 and strips[0].full_height:
            out = F.max_pool2d(x, geom.kernel, geom.stride, geom.padding, geom.dilation)
        else:
            out = torch.empty((x.shape[0], x.shape[1], out_h, out_w), dtype=x.dtype,
                              memory_format=cfg.memory_format())
            for s in strips:
                xs, pad = geom.band(x, s)
                out[s.n0:s.n1, :, s.r0:s.r1] = F.max_pool2d(xs, geom.kernel, geom.stride, pad, geom.dilation)
        ctx.save_for_backward(x)
        ctx.geom, ctx.strips = geom, strips
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        geom, strips = ctx.geom, ctx.strips
        whole = len(strips) == 1 and strips[0].full_height
        grad_x = None if whole else torch.zeros_like(x)
        for s in strips:
            xs, pad = geom.band(x, s)
            _, idx = F.max_pool2d(xs, geom.kernel, geom.stride, pad, geom.dilation, return_indices=True)
            gi = torch.ops.aten.max_pool2d_with_indices_backward(
                grad_out[s.n0:s.n1, :, s.r0:s.r1], xs, list(geom.kernel), list(geom.stride), pad,
                list(geom.dilation), False, idx,
            )
            if whole:
                grad_x = gi
            elif s.full_height:
                grad_x[s.n0:s.n1] = gi
            else:
                grad_x[s.n0:s.n1, :, s.lo:s.hi] += gi[:, :, s.pad_top:gi.shape[2] - s.pad_bottom]
        return grad_x, None, None


class BigMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` (floor mode) on a host-resident activation, computed in strips on the host.

    Example:
        >>> pool = BigMaxPool2d(3, 2, 1, max_elements=512)
        >>> pool(torch.randn(1, 4, 15, 15)).shape
        torch.Size([1, 4, 8, 8])
    """

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, *,
                 max_elements: int = DEFAULT_MAX_ELEMENTS, config: BigConfig | None = None) -> None:
        super().__init__(kernel_size, stride, padding, dilation)
        self.big_config = config if config is not None else BigConfig(max_elements=max_elements)
        self.geometry = _PoolGeometry(self.kernel_size, self.stride, self.padding, self.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"BigMaxPool2d expects a [N, C, H, W] input, got shape {tuple(x.shape)}")
        return BigMaxPool2dFunction.apply(x.cpu(), self.geometry, self.big_config)
