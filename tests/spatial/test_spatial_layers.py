"""Sample-parallel layers on G gloo ranks (local processes) against the dense and big-layer references.

Float64 on the CPU: outputs, input gradients, parameter gradients (after the all-reduce) and BatchNorm
running statistics of a conv/BN/ReLU/max-pool/strided/dilated chain must match to 1e-9, for row bands,
column bands, odd sizes and a band of a single row.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpgs.biglayers import BigBatchNorm2d, BigConv2d, BigMaxPool2d
from dpgs.spatial.halo import SpatialContext
from dpgs.spatial.layers import allreduce_grads, batch_norm, conv2d, max_pool2d
from dpgs.spatial.partition import Partition, make_grid
from tests.spatial_helpers import run_ranks

pytestmark = pytest.mark.ray
TOL = 1e-9


def _chain(big: bool):
    torch.manual_seed(3)
    kw = dict(max_elements=700) if big else {}
    conv = (BigConv2d if big else nn.Conv2d)
    bn = (BigBatchNorm2d if big else nn.BatchNorm2d)
    layers = nn.ModuleList([
        conv(3, 4, 7, 2, 3, **kw), bn(4, **kw),
        BigMaxPool2d(3, 2, 1, **kw) if big else nn.MaxPool2d(3, 2, 1),
        conv(4, 5, 1, 2, bias=False, **kw), bn(5, momentum=None, **kw), conv(5, 3, 3, 1, 2, dilation=2, **kw),
    ]).double()
    return layers


def _reference(layers, x):
    c1, b1, pool, c2, b2, c3 = layers
    return c3(b2(c2(pool(torch.relu(b1(c1(x)))))))


def _sharded(layers, x, part, sc):
    c1, b1, pool, c2, b2, c3 = layers
    y, part = conv2d(x, part, c1, sc)
    y = torch.relu(batch_norm(y, b1, sc))
    y, part = max_pool2d(y, part, pool, sc)
    y, part = conv2d(y, part, c2, sc)
    y = batch_norm(y, b2, sc)
    return conv2d(y, part, c3, sc)


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= TOL * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def _check(rank, world, grid, h, w):
    sc = SpatialContext(make_grid(world, grid), rank)
    torch.manual_seed(0)
    x = torch.randn(2, 3, h, w, dtype=torch.float64)
    dense, big, mine = _chain(False), _chain(True), _chain(True)  # ranks also compute in strips
    for m in (big, mine):
        m.load_state_dict(dense.state_dict())
    outs, grads = [], []
    for ref in (dense, big):
        xr = x.clone().requires_grad_()
        y = _reference(ref, xr)
        torch.manual_seed(1)
        dy = torch.randn(y.shape, dtype=torch.float64)
        (y * dy).sum().backward()
        outs.append(y.detach())
        grads.append(xr.grad)
    part = Partition(sc.grid, h, w)
    own = part.owned(rank)
    xb = x[:, :, own.r0:own.r1, own.c0:own.c1].clone().requires_grad_()
    yb, ypart = _sharded(mine, xb, part, sc)
    o = ypart.owned(rank)
    if grid == (3, 1) and h == 23:
        assert yb.shape[2] == 1, "this case must give every rank a band of one row"
    (yb * dy[:, :, o.r0:o.r1, o.c0:o.c1]).sum().backward()
    allreduce_grads(list(mine.parameters()), sc)
    for ref, y_ref, g_ref in zip((dense, big), outs, grads, strict=True):
        _close(yb.detach(), y_ref[:, :, o.r0:o.r1, o.c0:o.c1], f"rank {rank} output")
        _close(xb.grad, g_ref[:, :, own.r0:own.r1, own.c0:own.c1], f"rank {rank} input gradient")
        for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
            _close(p.grad, q.grad, f"rank {rank} gradient of {name}")
        for (name, b), q in zip(mine.named_buffers(), ref.buffers(), strict=True):
            _close(b.double(), q.double(), f"rank {rank} buffer {name}")
    # eval mode uses the running statistics and needs no communication
    mine.eval()
    dense.eval()
    ye, _ = _sharded(mine, xb.detach(), part, sc)
    _close(ye, _reference(dense, x)[:, :, o.r0:o.r1, o.c0:o.c1].detach(), f"rank {rank} eval output")
    assert sc.meter.halo_bytes > 0 and sc.meter.stats_bytes > 0 and sc.meter.grad_bytes > 0


def _cases(rank, world, cases):
    for grid, h, w in cases:
        _check(rank, world, grid, h, w)


def test_two_ranks_row_bands_odd_sizes():
    run_ranks(2, _cases, [((2, 1), 29, 17), ((1, 2), 15, 21)])


def test_three_ranks_rows_columns_and_one_row_bands():
    run_ranks(3, _cases, [((3, 1), 23, 13), ((1, 3), 9, 31)])


def test_two_by_two_grid_exchanges_corners():
    run_ranks(4, _cases, [((2, 2), 27, 25)])
