"""Grid, ownership and halo plans of the sample-parallel partition (pure geometry, no communication)."""

from __future__ import annotations

import pytest

from dpgs.biglayers.planner import RowWindow
from dpgs.spatial.partition import Grid, HaloPlan, Partition, Rect, make_grid


@pytest.mark.parametrize("grid", [Grid(3, 1), Grid(1, 2), Grid(2, 3)])
def test_every_position_is_owned_by_exactly_one_rank(grid):
    part = Partition(grid, 11, 7)
    owners = [[0] * 7 for _ in range(11)]
    for r in range(grid.size):
        o = part.owned(r)
        for i in range(o.r0, o.r1):
            for j in range(o.c0, o.c1):
                owners[i][j] += 1
    assert all(v == 1 for row in owners for v in row)
    heights = {part.shape(r)[0] for r in range(grid.size)}
    assert max(heights) - min(heights) <= 1


def test_halo_plan_covers_the_window_of_every_owned_output():
    grid = Grid(3, 2)
    part = Partition(grid, 19, 17)
    rows, cols = RowWindow(7, 2, 3), RowWindow(3, 1, 1, dilation=2)
    plan = HaloPlan(part, rows, cols)
    assert (plan.out.height, plan.out.width) == (rows.out_rows(19), cols.out_rows(17))
    image = Rect(0, 19, 0, 17)
    for rank in range(grid.size):
        need = plan.need(rank)
        o = plan.out.owned(rank)
        assert (need.r0, need.r1) == rows.input_span(o.r0, o.r1)
        pieces = plan.receives(rank)
        assert sum(t.rect.area for t in pieces) == need.intersect(image).area
        for t in pieces:  # each piece comes from its owner
            assert t.rect.intersect(part.owned(t.src)) == t.rect
    # halo traffic is what crosses rank boundaries only
    assert plan.halo_elements() == sum(t.rect.area for t in plan.transfers if t.src != t.dst) > 0


def test_pointwise_window_moves_nothing():
    plan = HaloPlan(Partition(Grid(3), 10, 4), RowWindow(), RowWindow())
    assert plan.halo_elements() == 0
    assert all(plan.need(r) == plan.inp.owned(r) for r in range(3))


def test_grid_and_partition_errors_name_the_setting():
    assert make_grid(4, None) == Grid(4, 1)
    assert make_grid(4, [2, 2]) == Grid(2, 2)
    with pytest.raises(ValueError, match=r"sample_grid \[2, 3\] has 6 ranks but dpgs.sample_parallel=4"):
        make_grid(4, [2, 3])
    with pytest.raises(ValueError, match="sample_parallel must be an int >= 1"):
        make_grid(0)
    with pytest.raises(ValueError, match="conv 3x3: a 2x5 activation cannot be split over a 3x1 grid"):
        Partition(Grid(3), 2, 5, "conv 3x3")
    with pytest.raises(ValueError, match="rank 4 is outside a 2x2 grid"):
        Grid(2, 2).coords(4)
