"""What a DPGS row of the bandwidth benchmark measures, and the driver's own pauses, from its record."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth_rows import measured_steps, paused_by_epoch  # noqa: E402


def test_auto_rows_measure_the_steps_at_the_ratio_chosen_last():
    """A ``dpgs-auto`` run whose warm-up epoch ran dense (its dense exchange was cheap enough) and whose
    steady choice is 1 %: the row's step time is that of its 1 % steps."""
    chunks = [{"steps": [0, 1, 2, 3], "keep_ratios": [1.0] * 4},
              {"steps": [4, 5, 6, 7], "keep_ratios": [0.01] * 4}]
    assert measured_steps(chunks) == [4, 5, 6, 7]


def test_fixed_ratio_rows_measure_every_step_after_the_first():
    chunks = [{"steps": [0, 1], "keep_ratios": [0.01, 0.01]}, {"steps": [2, 3], "keep_ratios": [0.01, 0.01]}]
    assert measured_steps(chunks) == [1, 2, 3]


def test_the_drivers_pauses_count_against_the_epoch_whose_validation_follows_them():
    """Auto's probe at the start of epoch 1 (a pause before and after it), every epoch's pause before its
    states are asked (right after its last chunk, before its validation): epoch 1 holds three, epoch 2 one
    more; a run with no record of its pauses has none."""
    pauses = [{"end": 1.0, "seconds": 0.15, "before": "probe"},
              {"end": 2.0, "seconds": 0.15, "before": "chunk"},
              {"end": 9.0, "seconds": 0.15, "before": "ask_state"},
              {"end": 19.0, "seconds": 0.15, "before": "ask_state"}]
    assert paused_by_epoch(pauses, 2) == pytest.approx([0.45, 0.6])
    assert paused_by_epoch([], 2) == [0, 0]
