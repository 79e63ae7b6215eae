"""``dpgs train`` with a record of its chunks of steps: how the bandwidth benchmark runs a DPGS row.

    python benchmarks/bandwidth_driver.py RECORD.json train --config ... [overrides]

Runs dpgs's own command line (``dpgs.cli.main``) in this process, with one difference: the session's
rank group is a :class:`RecordingGroup`, which writes to RECORD.json, after every chunk of steps and
every link probe, its wall-clock start and end (``time.time()``, the clock of the benchmark's interface
counter sampler, shared by every network namespace of the machine) and the ranks' step reports (the
master's step seconds and bytes, each worker's compute seconds and bytes up and down). The counters
between a chunk's start and end are the chunk's traffic: its steps, without the run's start-up, the fold
start's weights, link probes, evaluations and checkpoints. One other difference: the state asked for at
an epoch's end (``RankGroup.ask_state``) is asked 0.15 s later, and the next chunk starts 0.15 s after it
has arrived on the driver's node; a link probe starts 0.15 s after the chunk before it ended and returns
0.15 s after it ended, so that no such traffic is smeared into a chunk's window by the sampler's
interpolation. (A user's run sends the asked state while the next epoch's first steps run; since the
epoch's validation moved into its last chunk, 2026-11-28, nothing else separated the two, and the
feature-bag rows counted a keep-1 % residual's 0.85 MB a worker into the next epoch's steps: 1.9-2x
dpgs's count instead of 1.1x.) The pauses lengthen a DPGS row's epochs by 0.15 s each;
the record lists them (``pauses``), and a row's time to its target leaves out those before the target's
validation (``bandwidth_rows.paused_by_epoch``): a user's run has none. Until 2026-11-27 they were counted
in, 0.45 s or more of a 4-6 s feature-bag run with ``keep_ratio=auto`` (a probe padded on both sides).

Why both sides of a probe: the sampler reads the counters every 50 ms and interpolates them at a chunk's
edges, so the bytes of the 50 ms around an edge are shared out in proportion to time. Traffic that starts
right after a chunk ends (the probe, 16 MB through the head at 1 Gbit/s: up to 6 MB in 50 ms) is partly
counted in that chunk. Until 2026-11-27 only the end of a probe was padded, and ``keep_ratio=auto``'s rows
(whose first chunk is followed by a probe) counted 0.05-0.25 MB a step more than dpgs sent; per-socket
byte counts (``ss -ti`` in the worker hosts' namespaces) showed the gloo connection carrying exactly dpgs's
count, the probe starting within 50 ms of the chunk's end, and nothing else in the window but Ray's
periodic reports (28 kB every 5 s per host to the GCS).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import ray

import dpgs.distributed.session as session
from dpgs.cli import main as dpgs_main
from dpgs.distributed.rank_group import RankGroup

PAUSE_S = 0.15  # three periods of the benchmark's counter sampler: between a chunk and other traffic


class RecordingGroup(RankGroup):
    """A :class:`RankGroup` that records its chunks, probes and its own pauses into ``RecordingGroup.path``
    (``pauses``: when each ended and why; a run's time to its target leaves them out, ``bandwidth_rows``)."""

    path: Path | None = None
    chunks: list[dict] = []
    probes: list[dict] = []
    pauses: list[dict] = []

    @staticmethod
    def _pause(before: str) -> None:
        time.sleep(PAUSE_S)
        RecordingGroup.pauses.append({"end": time.time(), "seconds": PAUSE_S, "before": before})

    def run(self, plan, reports):
        start = time.time()
        super().run(plan, reports)
        end = time.time()
        RecordingGroup.chunks.append({
            "start": start, "end": end,
            "epoch": plan.steps[0].epoch,
            "steps": [s.index for s in plan.steps],
            "keep_ratios": [s.keep_ratio for s in plan.steps],
            "master": [dataclasses.asdict(m) for m in reports.master],
            "workers": [dataclasses.asdict(r) for r in reports.workers],
        })
        self._write()

    def ask_state(self, weights: bool, sync_states: bool):
        """As the group's, after a pause that lets the counter sampler (every 50 ms, interpolated) take a
        sample between the epoch's last chunk and this traffic: the workers' residuals (46 MB each for the
        tile encoder) would otherwise be smeared into the chunk's window. Then it waits until the answers
        are on this node and pauses again, so that they are not counted in the next chunk's window either.
        Outside every measured step."""
        self._pause("ask_state")
        self._write()
        super().ask_state(weights, sync_states)
        started = time.monotonic()
        asked = self.asked
        refs = [*(asked.sync_states or []), *([] if asked.weights is None else [asked.weights])]
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout, fetch_local=True)
        time.sleep(PAUSE_S)
        RecordingGroup.pauses.append({"end": time.time(), "seconds": time.monotonic() - started,
                                      "before": "chunk after the asked state"})

    def probe_links(self, sizes):
        self._pause("probe")  # the chunk before must not take in the probe's first megabytes
        start = time.time()
        probe = super().probe_links(sizes)
        RecordingGroup.probes.append({"start": start, "end": time.time(), "sizes": list(probe.sizes),
                                      "seconds": [list(s) for s in probe.seconds]})
        self._write()
        self._pause("chunk")  # the probe's last megabytes must not be smeared into the next chunk's window
        return probe

    def _write(self) -> None:
        path = RecordingGroup.path
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"chunks": RecordingGroup.chunks, "probes": RecordingGroup.probes,
                                   "pauses": RecordingGroup.pauses}))
        os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "train":
        sys.exit("usage: bandwidth_driver.py RECORD.json train [dpgs train arguments]")
    RecordingGroup.path = Path(argv[0])
    session.RankGroup = RecordingGroup  # the one rank group DpgsSession builds
    return dpgs_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
