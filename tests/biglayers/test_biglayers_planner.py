"""Strip planner: ownership of output rows, halos, budget and batch partitioning."""

import pytest

from dpgs.biglayers.planner import RowWindow, plan_strips


def _check(strips, batch, height, window):
    out_h = window.out_rows(height)
    owned = [(n, r) for s in strips for n in range(s.n0, s.n1) for r in range(s.r0, s.r1)]
    assert sorted(owned) == [(n, r) for n in range(batch) for r in range(out_h)]  # each row exactly once
    for s in strips:
        # brute force: every input row read by an owned output row, clipped to the image
        rows = {r * window.stride - window.padding + j * window.dilation
                for r in range(s.r0, s.r1) for j in range(window.kernel)}
        lo, hi = min(rows), max(rows) + 1
        assert (s.lo, s.hi) == (max(lo, 0), min(hi, height))
        assert s.pad_top == max(lo, 0) - lo and s.pad_bottom == hi - min(hi, height)
        if s.full_height:
            assert (s.r0, s.r1) == (0, out_h)


@pytest.mark.parametrize(
    "k,s,p,d", [(7, 2, 3, 1), (3, 2, 1, 1), (1, 2, 0, 1), (3, 1, 1, 1), (3, 1, 2, 2), (2, 2, 0, 1)])
@pytest.mark.parametrize("height", [1, 2, 9, 17, 30])
@pytest.mark.parametrize("budget", [1, 2, 3, 10, 10**9])
def test_strips_cover_each_output_row_once(k, s, p, d, height, budget):
    window = RowWindow(k, s, p, d)
    if window.out_rows(height) < 1:
        with pytest.raises(ValueError, match="too small"):
            plan_strips(2, height, window, 5, 4, 10**9)
        return
    # budget counted in output rows of one sample (in/out row elements chosen so one row fits)
    max_elements = budget * 4 * window.in_rows(1) * 5
    strips = plan_strips(2, height, window, 5, 4, max_elements)
    _check(strips, 2, height, window)
    for st in strips:
        in_rows = height if st.full_height else window.in_rows(st.rows)
        assert st.samples * max(in_rows * 5, st.rows * 4) <= max_elements


def test_batch_partition_groups_whole_samples():
    window = RowWindow(3, 1, 1, 1)
    per_sample = 8 * 10
    strips = plan_strips(7, 8, window, 10, 10, 3 * per_sample)
    assert [(s.n0, s.n1) for s in strips] == [(0, 3), (3, 5), (5, 7)]
    assert all(s.full_height for s in strips)
    assert len(plan_strips(7, 8, window, 10, 10, 10**9)) == 1


def test_rows_are_spread_evenly_and_prime_counts_are_possible():
    window = RowWindow(1, 1, 0, 1)
    strips = plan_strips(1, 13, window, 1, 1, 1)
    assert len(strips) == 13 and all(s.rows == 1 for s in strips)
    strips = plan_strips(1, 13, window, 1, 1, 3)  # ceil(13/3) = 5 strips of 3,3,3,2,2
    assert [s.rows for s in strips] == [3, 3, 3, 2, 2]


def test_full_height_strips_count_rows_a_strided_window_skips():
    window = RowWindow(1, 2, 0, 1)  # 1x1 stride 2 on 2 rows reads only row 0
    strips = plan_strips(3, 2, window, 100, 100, 200)
    assert all(s.samples == 1 and s.full_height for s in strips)  # a whole sample holds 2 rows


def test_budget_too_small_names_the_layer():
    with pytest.raises(ValueError, match=r"conv7: max_elements=10 is smaller than a single output row needs"):
        plan_strips(1, 20, RowWindow(7, 2, 3, 1), 12, 8, 10, what="conv7")
    with pytest.raises(ValueError, match="max_elements must be a positive integer"):
        plan_strips(1, 20, RowWindow(), 1, 1, 0)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        RowWindow(3, 0)
