"""Halo exchange and gather-to-root as autograd functions over ``torch.distributed``.

``HaloExchange`` (forward): every rank builds the extended input of a windowed layer
(``HaloPlan.need``): its own rectangle, the halo rows/columns received from the ranks that own them, and
edge padding (``fill``: 0 for convolutions, -inf for max pooling) outside the image. Backward: the
gradient of the extended input is cut along the same transfers; the pieces that came from other ranks
are sent back and **added** to the owner's gradient, so an input element read by several ranks receives
the sum of all its contributions, exactly as in the single-process layer.

``GatherToRoot`` (forward): rank 0 assembles the full activation from every rank's rectangle; the other
ranks return an empty placeholder. Backward: rank 0 sends every rank the gradient of its rectangle.

All point-to-point traffic goes through ``dist.batch_isend_irecv`` (gloo on CPU, NCCL on GPUs; with
NCCL, host tensors are staged through ``SpatialContext.comm_device``). Bytes sent by this rank are
counted in ``SpatialContext.meter``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpgs.spatial.partition import Grid, HaloPlan, Partition, Rect


@dataclass
class CommMeter:
    """Bytes this rank sent, by kind."""

    halo_bytes: int = 0
    gather_bytes: int = 0
    stats_bytes: int = 0
    grad_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"halo_bytes": self.halo_bytes, "gather_bytes": self.gather_bytes,
                "stats_bytes": self.stats_bytes, "grad_bytes": self.grad_bytes}

    def reset(self) -> None:
        self.halo_bytes = self.gather_bytes = self.stats_bytes = self.grad_bytes = 0


@dataclass
class SpatialContext:
    """This rank's place in the group: grid, rank, device the backend communicates from, meter."""

    grid: Grid
    rank: int
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    meter: CommMeter = field(default_factory=CommMeter)

    def __post_init__(self) -> None:
        self.grid.coords(self.rank)  # validates the rank


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def exchange(ctx: SpatialContext, sends: list[tuple[int, torch.Tensor]],
             recvs: list[tuple[int, tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Send ``(dst, tensor)`` pairs and receive ``(src, shape, dtype)`` tensors, all at once.

    Returns the received tensors in host memory, in the order of ``recvs``. Every rank must post the
    matching operations (the plans are identical on all ranks, so they do).
    """
    dev = ctx.comm_device
    out = [torch.empty(shape, dtype=dtype, device=dev) for _, shape, dtype in recvs]
    ops = [dist.P2POp(dist.irecv, buf, src) for (src, _, _), buf in zip(recvs, out, strict=True)]
    ops += [dist.P2POp(dist.isend, t.to(dev).contiguous(), dst) for dst, t in sends]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return [t.cpu() if dev.type != "cpu" else t for t in out]


def _view(t: torch.Tensor, rect: Rect, origin: tuple[int, int]) -> torch.Tensor:
    rows, cols = rect.shift(*origin)
    return t[:, :, rows, cols]


class HaloExchange(torch.autograd.Function):
    """Own rectangle -> extended input of a windowed layer (see module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: HaloPlan, sc: SpatialContext, fill: float):
        own = plan.inp.owned(sc.rank)
        need = plan.need(sc.rank)
        n, c = x.shape[:2]
        ext = x.new_full((n, c, need.r1 - need.r0, need.c1 - need.c0), fill)
        sends = [(t.dst, _view(x, t.rect, (own.r0, own.c0))) for t in plan.sends(sc.rank) if t.dst != sc.rank]
        recvs = [t for t in plan.receives(sc.rank) if t.src != sc.rank]
        likes = [(t.src, (n, c, t.rect.r1 - t.rect.r0, t.rect.c1 - t.rect.c0), x.dtype) for t in recvs]
        got = exchange(sc, sends, likes)
        sc.meter.halo_bytes += sum(_nbytes(t) for _, t in sends)
        for t in plan.receives(sc.rank):
            if t.src == sc.rank:
                _view(ext, t.rect, (need.r0, need.c0)).copy_(_view(x, t.rect, (own.r0, own.c0)))
        for t, piece in zip(recvs, got, strict=True):
            _view(ext, t.rect, (need.r0, need.c0)).copy_(piece)
        ctx.plan, ctx.sc, ctx.shape = plan, sc, x.shape
        return ext

    @staticmethod
    def backward(ctx, grad_ext):
        plan, sc = ctx.plan, ctx.sc
        own = plan.inp.owned(sc.rank)
        need = plan.need(sc.rank)
        n, c = ctx.shape[:2]
        grad_x = torch.zeros(ctx.shape, dtype=grad_ext.dtype)
        # the halo this rank received goes back to its owners; what it sent comes back as gradient
        back = [(t.src, _view(grad_ext, t.rect, (need.r0, need.c0)))
                for t in plan.receives(sc.rank) if t.src != sc.rank]
        returned = [t for t in plan.sends(sc.rank) if t.dst != sc.rank]
        likes = [(t.dst, (n, c, t.rect.r1 - t.rect.r0, t.rect.c1 - t.rect.c0), grad_ext.dtype)
                 for t in returned]
        got = exchange(sc, back, likes)
        sc.meter.halo_bytes += sum(_nbytes(t) for _, t in back)
        for t in plan.receives(sc.rank):
            if t.src == sc.rank:
                _view(grad_x, t.rect, (own.r0, own.c0)).add_(_view(grad_ext, t.rect, (need.r0, need.c0)))
        for t, piece in zip(returned, got, strict=True):
            _view(grad_x, t.rect, (own.r0, own.c0)).add_(piece)
        return grad_x, None, None, None


class GatherToRoot(torch.autograd.Function):
    """Every rank's rectangle -> the full activation on rank 0 (placeholder elsewhere)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, part: Partition, sc: SpatialContext):
        n, c = x.shape[:2]
        ctx.part, ctx.sc, ctx.shape = part, sc, x.shape
        if sc.rank != 0:
            exchange(sc, [(0, x)], [])
            sc.meter.gather_bytes += _nbytes(x)
            return x.new_empty(0)
        full = x.new_empty((n, c, part.height, part.width))
        others = list(range(1, part.grid.size))
        likes = [(r, (n, c, *part.shape(r)), x.dtype) for r in others]
        got = exchange(sc, [], likes)
        _view(full, part.owned(0), (0, 0)).copy_(x)
        for r, piece in zip(others, got, strict=True):
            _view(full, part.owned(r), (0, 0)).copy_(piece)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        part, sc, shape = ctx.part, ctx.sc, ctx.shape
        if sc.rank != 0:
            (grad,) = exchange(sc, [], [(0, tuple(shape), grad_full.dtype)])
            return grad, None, None
        sends = [(r, _view(grad_full, part.owned(r), (0, 0))) for r in range(1, part.grid.size)]
        exchange(sc, sends, [])
        sc.meter.gather_bytes += sum(_nbytes(t) for _, t in sends)
        return _view(grad_full, part.owned(0), (0, 0)).contiguous(), None, None
