"""``make cluster-test``: the lab tests (marker ``cluster``), then proof that nothing of the lab is left.

Ends with one line: ``cluster-test: ok, <hosts> hosts, ray up <s> s, train <s> s, worker actors on
<addresses>``, or ``cluster-test: FAILED: <why>`` and exit code 1. Runs as root on a machine with Linux
namespaces (tests/lab/netlab.py); any lab left by an earlier, interrupted run is removed first.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.lab.netlab import NAME, ROOT, LabError, check_can_run, ensure_tools, leftovers, sweep


class Outcomes:
    """pytest plugin: the first failure's test and its last line."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            last = str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""
            self.failures.append(f"{report.nodeid.split('::')[-1]} ({report.when}): {last[:300]}")
        elif report.passed and report.when == "call":
            self.passed += 1


def main() -> int:
    start = time.monotonic()
    try:
        check_can_run()
        ensure_tools()
        sweep(NAME)
    except LabError as err:
        print(f"cluster-test: FAILED: {err}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        results_path = Path(tmp) / "results.json"
        os.environ["DPGS_LAB_RESULTS"] = str(results_path)
        outcomes = Outcomes()
        code = pytest.main(["-m", "cluster", "-p", "no:cacheprovider", "-o", "addopts=-ra",
                            str(ROOT / "tests" / "lab" / "test_cluster.py")], plugins=[outcomes])
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
    try:
        sweep(NAME)
        left = leftovers(NAME)
    except LabError as err:
        left = [str(err)]
    print(json.dumps(results, indent=2))
    took = time.monotonic() - start
    if left:
        why = f"the lab left {left}"
    elif outcomes.failures:
        why = outcomes.failures[0]
    elif code != 0 or not outcomes.passed:
        why = f"pytest exited with {code} ({outcomes.passed} passed)"
    elif "train_s" not in results:
        why = "no training was measured"
    else:
        hosts = 1 + len(results["worker_addresses"])
        print(f"(cluster-test took {took:.0f} s)")
        print(f"cluster-test: ok, {hosts} hosts, ray up {results['ray_up_s']:.0f} s, "
              f"train {results['train_s']:.0f} s, worker actors on {', '.join(results['worker_addresses'])}")
        return 0
    print(f"(cluster-test took {took:.0f} s)")
    print(f"cluster-test: FAILED: {why}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
