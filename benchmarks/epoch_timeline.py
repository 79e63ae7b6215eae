"""Where a DPGS epoch's wall time goes between its steps, read from Ray's own task timeline.

    python benchmarks/epoch_timeline.py [--data musk1|musk2|synthetic] [--folds 3] [--epochs 40]
        [--out FILE] [--timeline FILE] [override ...]

Runs one ``dpgs train`` (feature bags, ABMIL, ``train.mode=dpgs``, P = 2, the k-fold command's settings:
``benchmarks/kfold_command.py``; extra ``key=value`` overrides are appended) in this process, with Ray
started here first so that ``ray.timeline()`` can be read once the command is done. Every epoch boundary
(a master ``run_chunk``, the master's ``save_epoch``, the next ``run_chunk``) gives one row of phases, in
milliseconds; the table is their medians:

* **cycle**: from one epoch's chunk starting on the master to the next one's;
* **master's steps**: the master's ``run_chunk`` (the epoch's steps, the exchange included);
* **validation after the steps**: the last worker's chunk end after the master's (the workers score the
  validation set at the end of the epoch's last chunk);
* **driver before save_epoch**: from the last rank's chunk end to the master's ``save_epoch`` starting
  (the driver's validation metrics, its asks for the workers' states, the wait for the last files);
* **master's save_epoch**: the master's task, as long as it holds the master;
* **save_epoch to the next chunk**: from the save's end to the master's next ``run_chunk`` starting (the
  driver's logging, history file and planning, when longer than the save);
* **workers wait for the master**: how long the first worker's next chunk started before the master's.

A task starts when its actor begins it (``ray.timeline`` reports execution, not submission): a phase that
waits for another actor shows as that actor's lateness. One run's medians move by ~10 % with the VM's
state: compare changes by whole commands (``benchmarks/kfold_command.py``), as docs/benchmarks.md does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _common import emit, machine_line, markdown
from kfold_command import ROWS, command_overrides, write_musk_like
from musk_data import write_musk

MASTER_CHUNK, WORKER_CHUNK = "task::Master.run_chunk", "task::BagWorker.run_chunk"
SAVE = "task::Master.save_epoch"
PHASES = {
    "cycle": "cycle",
    "steps": "master's steps",
    "validation": "validation after the steps",
    "before_save": "driver before save_epoch",
    "save": "master's save_epoch",
    "after_save": "save_epoch to the next chunk",
    "workers_wait": "workers wait for the master",
}


@dataclass(frozen=True)
class Task:
    actor: str
    start: float  # microseconds
    end: float


def tasks(events: list[dict], category: str) -> list[Task]:
    """The timeline's executions of ``category`` (``task::Class.method``), in start order."""
    found = [Task(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == category]
    return sorted(found, key=lambda t: t.start)


def overlapping(chunks: list[Task], master: Task) -> Task | None:
    """The worker's chunk that ran while the master's ``master`` ran (they exchange every step)."""
    return next((c for c in chunks if c.start < master.end and c.end > master.start), None)


def epoch_phases(events: list[dict]) -> list[dict[str, float]]:
    """One row per epoch boundary (a master chunk, then ``save_epoch``, then the master's next chunk), each
    phase in milliseconds (module docstring). A boundary with a task missing from the timeline (Ray drops
    task events when its buffers fill) is left out."""
    masters, saves = tasks(events, MASTER_CHUNK), tasks(events, SAVE)
    by_worker: dict[str, list[Task]] = {}
    for task in tasks(events, WORKER_CHUNK):
        by_worker.setdefault(task.actor, []).append(task)
    rows = []
    for this, following in zip(masters, masters[1:], strict=False):
        save = next((s for s in saves if this.end <= s.start < following.start), None)
        here = [overlapping(chunks, this) for chunks in by_worker.values()]
        after = [overlapping(chunks, following) for chunks in by_worker.values()]
        if save is None or not by_worker or None in here + after:  # no epoch's end (checkpoint_every, a
            continue  # fold's last chunk) or a task the timeline lost
        ends = [chunk.end for chunk in here]
        rows.append({
            "cycle": following.start - this.start,
            "steps": this.end - this.start,
            "validation": max(ends) - this.end,
            "before_save": save.start - max(this.end, *ends),
            "save": save.end - save.start,
            "after_save": following.start - save.end,
            "workers_wait": following.start - min(chunk.start for chunk in after),
        })
    return [{key: value / 1000.0 for key, value in row.items()} for row in rows]


def table(rows: list[dict[str, float]]) -> str:
    """Median and quartiles of each phase (milliseconds)."""
    if not rows:
        raise ValueError("no epoch boundary in the timeline (did the command run DPGS epochs?)")
    lines = []
    for key, name in PHASES.items():
        values = sorted(row[key] for row in rows)
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
        lines.append([name, f"{statistics.median(values):.1f}", f"{q1:.1f}-{q3:.1f}"])
    return markdown(["phase (ms)", "median", "quartiles"], lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=["musk1", "musk2", "synthetic"], default="musk1")
    p.add_argument("--folds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--out")
    p.add_argument("--timeline", help="also keep Ray's timeline (JSON, chrome://tracing) here")
    p.add_argument("overrides", nargs="*", help="extra dpgs train overrides (key=value)")
    args = p.parse_args(argv)
    import ray

    from dpgs.cli import main as dpgs_main

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = (write_musk_like(work / "data", 92) if args.data == "synthetic"
                    else write_musk(args.data, work / "data"))
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
        try:
            code = dpgs_main(["train", *command_overrides(manifest, work, "run", args.folds, args.epochs),
                              "experiment=epoch-timeline", *ROWS["auto"][1], *args.overrides])
            if code:
                raise SystemExit(f"dpgs train failed (exit {code})")
            timeline = work / "timeline.json"
            ray.timeline(str(timeline))
            events = json.loads(timeline.read_text())
        finally:
            ray.shutdown()
    if args.timeline:
        Path(args.timeline).write_text(json.dumps(events))
    rows = epoch_phases(events)
    emit(f"{args.data.upper()}, ABMIL, DPGS P=2, {args.folds} folds x {args.epochs} epochs, B=8: "
         f"{len(rows)} epoch boundaries. {machine_line()}.\n\n{table(rows)}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
