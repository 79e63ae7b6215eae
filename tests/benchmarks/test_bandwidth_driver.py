"""The bandwidth benchmark's recording group stands in for the engine's ``RankGroup``: every method it
overrides must take the arguments the engine passes (a mismatch only shows, as a TypeError, inside a lab
row)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from dpgs.distributed.rank_group import RankGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth_driver import RecordingGroup  # noqa: E402


def test_recording_group_overrides_take_the_groups_arguments():
    overridden = [name for name, member in vars(RecordingGroup).items()
                  if callable(member) and not name.startswith("_") and hasattr(RankGroup, name)]
    assert {"run", "ask_state", "probe_links"} <= set(overridden)
    for name in overridden:
        theirs = inspect.signature(getattr(RankGroup, name)).parameters
        ours = inspect.signature(getattr(RecordingGroup, name)).parameters
        assert list(ours) == list(theirs), f"{name}: {list(ours)} vs the group's {list(theirs)}"
        assert [p.default for p in ours.values()] == [p.default for p in theirs.values()], name


def test_the_next_chunk_waits_for_the_asked_state_to_arrive(monkeypatch, tmp_path):
    """The residuals asked for at an epoch's end cross the workers' links; the recording group waits for
    them to arrive (and pauses) before the next chunk, so that the next epoch's byte window does not count
    them, and records that wait as a pause of the epoch that follows (left out of its time to target)."""
    import bandwidth_driver
    from bandwidth_rows import paused_by_epoch

    from dpgs.distributed.rank_group import AskedState

    def ask(self, weights, sync_states):
        states = ["state-1", "state-2"] if sync_states else None
        self.asked = AskedState("weights-ref" if weights else None, states)

    waited = []
    monkeypatch.setattr(RankGroup, "ask_state", ask)
    monkeypatch.setattr(bandwidth_driver.ray, "wait",
                        lambda refs, **kw: waited.append((list(refs), kw)) or (list(refs), []))
    monkeypatch.setattr(bandwidth_driver, "PAUSE_S", 0.0)
    monkeypatch.setattr(RecordingGroup, "path", tmp_path / "record.json")
    monkeypatch.setattr(RecordingGroup, "pauses", [])
    group = object.__new__(RecordingGroup)
    group.timeout = 5.0
    group.ask_state(weights=True, sync_states=True)
    group.ask_state(weights=False, sync_states=True)
    assert [refs for refs, _ in waited] == [["state-1", "state-2", "weights-ref"], ["state-1", "state-2"]]
    assert all(kw["fetch_local"] and kw["num_returns"] == len(refs) for refs, kw in waited)
    assert [p["before"] for p in RecordingGroup.pauses] == ["ask_state", "chunk after the asked state"] * 2
    for p, seconds in zip(RecordingGroup.pauses, [0.1, 0.2, 0.4, 0.8], strict=True):
        p["seconds"] = seconds
    # epoch 1 is validated before its own ask; the wait after epoch 1's ask comes before epoch 2's
    assert paused_by_epoch(RecordingGroup.pauses, 2) == [0.1, 0.1 + 0.2 + 0.4]
