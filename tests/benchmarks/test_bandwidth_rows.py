"""Which steps a DPGS row of the bandwidth benchmark measures, from its driver's chunk record."""

from __future__ import annotations

import sys
from pathlib import Path

from dpgs.distributed.schedule import MEASURING_STEPS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth_rows import measured_steps  # noqa: E402


def test_auto_rows_measure_the_steps_at_the_ratio_chosen_not_the_measuring_steps():
    """``--quick``'s epoch of 4 steps with ``dpgs-auto``: the first MEASURING_STEPS run at the cheapest
    ratio (one chunk), the rest at the ratio it chose."""
    chunks = [{"steps": list(range(MEASURING_STEPS)), "keep_ratios": [0.001] * MEASURING_STEPS},
              {"steps": list(range(MEASURING_STEPS, 4)), "keep_ratios": [0.01] * (4 - MEASURING_STEPS)}]
    assert measured_steps(chunks) == list(range(MEASURING_STEPS, 4))


def test_fixed_ratio_rows_measure_every_step_after_the_first():
    chunks = [{"steps": [0, 1], "keep_ratios": [0.01, 0.01]}, {"steps": [2, 3], "keep_ratios": [0.01, 0.01]}]
    assert measured_steps(chunks) == [1, 2, 3]
