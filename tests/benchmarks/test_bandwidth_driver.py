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
