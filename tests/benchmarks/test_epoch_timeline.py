"""The epoch timeline (benchmarks/epoch_timeline.py) on a timeline written here: each epoch boundary's phases
come from the right tasks, and boundaries without an epoch's end or with a lost task are left out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from epoch_timeline import epoch_phases, table  # noqa: E402

MASTER, W0, W1 = "worker:m", "worker:a", "worker:b"


def task(category: str, actor: str, start_ms: float, dur_ms: float) -> dict:
    return {"cat": f"task::{category}", "name": category.split(".")[-1], "pid": "10.0.0.1", "tid": actor,
            "ts": start_ms * 1000.0, "dur": dur_ms * 1000.0, "ph": "X"}


def epoch(start: float, save: bool = True) -> list[dict]:
    """One epoch's chunk: the workers start 10 ms before the master, whose steps take 40 ms; worker 1
    scores validation until 6 ms after the master; the driver asks for the save 12 ms later, which takes
    20 ms. Unrelated tasks (the asks for the workers' states) are in the timeline too."""
    events = [
        task("BagWorker.run_chunk", W0, start - 10, 52),
        task("BagWorker.run_chunk", W1, start - 9, 55),
        task("Master.run_chunk", MASTER, start, 40),
        task("BagWorker.sync_state", W0, start + 47, 0.5),
        {"cat": "submit_task", "name": "submit_task", "pid": "10.0.0.1", "tid": "driver", "ts": 1.0},
    ]
    if save:
        events.append(task("Master.save_epoch", MASTER, start + 58, 20))
    return events


def test_each_epoch_boundary_gives_its_phases_and_other_chunks_are_skipped():
    # epochs at 0 and 100 ms; a chunk at 200 that ends no epoch (checkpoint_every), then one at 260
    events = epoch(0) + epoch(100) + epoch(200, save=False) + epoch(260)
    rows = epoch_phases(list(reversed(events)))  # any order
    assert len(rows) == 2  # 0 -> 100 and 100 -> 200; 200 -> 260 has no save_epoch between
    for row in rows:
        assert row == pytest.approx({"cycle": 100, "steps": 40, "validation": 6, "before_save": 12,
                                     "save": 20, "after_save": 22, "workers_wait": 10})
    text = table(rows)
    assert "| master's save_epoch | 20.0 | 20.0-20.0 |" in text
    assert "| workers wait for the master | 10.0 | 10.0-10.0 |" in text


def test_a_boundary_whose_worker_chunk_the_timeline_lost_is_left_out_not_paired_with_another():
    events = epoch(0) + epoch(100) + epoch(200)
    lost = next(e for e in events if e["tid"] == W1 and e["cat"].endswith("run_chunk") and e["ts"] > 50_000)
    events.remove(lost)  # worker 1's chunk of the epoch at 100 ms: both boundaries around it need it
    assert epoch_phases(events) == []
    assert len(epoch_phases(epoch(0) + epoch(100) + epoch(200))) == 2


def test_a_timeline_without_epoch_boundaries_is_an_error():
    with pytest.raises(ValueError, match="no epoch boundary"):
        table(epoch_phases(epoch(0)))
