"""Fixtures of the lab tests (marker ``cluster``; ``make cluster-test`` runs them as root).

One lab and one Ray cluster serve the whole session: the tests of tests/lab/test_cluster.py run in file
order (``ray up``, the user's training, ``dpgs compare``, the real slide, the network faults, ``ray
down``). What they measure goes to the JSON file named by ``DPGS_LAB_RESULTS`` (tests/lab/cluster_test.py
prints the summary line from it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.lab.netlab import Lab, LabError, check_can_run


class Results:
    """Figures of the lab run, kept in a JSON file as they come (a failed test keeps the earlier ones)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.data: dict = {}

    def record(self, key: str, value) -> None:
        self.data[key] = value
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=2))


@pytest.fixture(scope="session")
def results() -> Results:
    return Results(os.environ.get("DPGS_LAB_RESULTS"))


@pytest.fixture(scope="session")
def lab():
    """The lab: client, head and two worker hosts (skips where it cannot run: not root, no namespaces)."""
    try:
        check_can_run()
    except LabError as err:
        pytest.skip(f"the lab cannot run here: {err}")
    with Lab.up(workers=2) as running:
        yield running
