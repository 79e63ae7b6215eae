"""One row of the bandwidth benchmark: a method trained on a workload at a site, and what it measured.

A DPGS row is ``dpgs train`` (``benchmarks/bandwidth_driver.py``: the command with a record of its chunks)
on the site's driver host; a DDP row is one ``benchmarks/bandwidth_ddp.py`` rank per worker. From the
run's own records and the site's interface counters (:class:`~bandwidth_sites.CounterSampler`):

* ``step_s``: median over the run's steps after the first (DPGS: those at the run's last keep ratio,
  so not ``dpgs-auto``'s steps at the cheapest ratio before its first decision; DDP + PowerSGD: after its
  plain all-reduce steps) of a step's wall time (DPGS: the master's ``step_seconds``; DDP: from the
  previous step's end);
* ``compute_s``: median over the same steps of the slowest worker's forward + backward (DPGS reports it;
  DDP's backward overlaps its all-reduce, so a DDP row takes the median of the DPGS rows' compute on the
  same link, the same bags and model: ``compute_source``);
* ``wire_bytes_per_step``: the site's wire bytes (``site.wire``) in the windows of the last epoch's
  steps (DPGS: its chunks; DDP: its measured steps), over the number of steps, and beside it for DPGS
  ``dpgs_bytes_per_step``, MLflow's ``comm_bytes_per_step`` of the same epoch (the same steps), and
  ``idle_wire_bytes_per_step``: the site's idle wire traffic (bytes/s of the cluster with no job, measured
  before the link's rows; None on loopback) times the same windows' seconds, over their steps; and
  ``chunk_edge_gap_s``, the longest span between the counter samples around a chunk's start or end
  (traffic that near an edge may be counted on the wrong side of it);
* per epoch ``val_auc`` and ``elapsed_seconds`` (for the time to target), and the test AUC with its
  bootstrap interval; for ``dpgs-auto`` the keep ratio it chose and the figures behind it.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bandwidth_sites import DDP_PORT, CounterSampler
from bandwidth_workloads import DDP_METHODS, Workload, method_overrides

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
EPOCH_KEYS = ("val_auc", "val_loss", "train_loss", "elapsed_seconds", "epoch_seconds", "train_seconds",
              "step_seconds", "time_compute_seconds", "comm_bytes_per_step", "optimizer_steps",
              "auto_keep_ratio", "auto_compute_seconds", "auto_dense_exchange_seconds",
              "auto_exchange_seconds", "auto_dense_exchange_share")
TEST_KEYS = ("test_auc", "test_auc_ci_low", "test_auc_ci_high", "test_acc", "best_epoch")
STOP_GRACE_S = 60.0


class RowFailed(RuntimeError):
    """A row's processes failed; the message ends with their output."""


def stop_process(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (a dpgs driver then shuts its Ray down; the loopback child stops its row), SIGKILL after
    ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Output:
    """Reads a process's output lines in a thread into a log file and a list."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.lines = proc, []
        self._file = log.open("a")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._file.write(line)
            self._file.flush()

    def wait(self, deadline: float) -> int | None:
        """The exit code, or None when ``deadline`` (monotonic) passed first. Interrupted (SIGINT, or the
        benchmark's SIGTERM: ``bandwidth.exit_on_termination``), it stops the process first."""
        try:
            while self.proc.poll() is None:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self._thread.join(timeout=30)
        self._file.close()
        return self.proc.returncode

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        stop_process(self.proc, grace_s)

    def tail(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])


def mlflow_run(db: Path, run_name: str) -> tuple[str, dict[str, dict[int, float]]]:
    """(status, {metric: {step: value}}) of the latest MLflow run called ``run_name`` in ``db``."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "mlflow.db"
        shutil.copyfile(db, copy)
        con = sqlite3.connect(copy)
        try:
            found = con.execute("SELECT run_uuid, status FROM runs WHERE name = ? ORDER BY start_time DESC "
                                "LIMIT 1", (run_name,)).fetchone()
            if found is None:
                raise RowFailed(f"{db}: no MLflow run named {run_name}")
            metrics: dict[str, dict[int, float]] = {}
            for key, value, step in con.execute("SELECT key, value, step FROM metrics WHERE run_uuid = ? "
                                                "ORDER BY timestamp", (found[0],)):
                metrics.setdefault(key, {})[int(step)] = float(value)
        finally:
            con.close()
    return found[1], metrics


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _kill_site_processes(site, pattern: str) -> None:
    """End the row's processes on the site that are still running (by id: lab hosts or this machine)."""
    lab = getattr(site, "lab", None)
    if lab is None:
        return
    for host in ["head", *site.workers]:
        pids = {pid for pid, cmd in lab.processes(host).items() if pattern in cmd}
        if pids:
            lab.kill(host, pids)


def run_dpgs_row(site, w: Workload, method: str, row_id: str, sampler: CounterSampler, workers: int,
                 timeout_s: float, log, idle_bps: float | None) -> dict:
    """Train ``method`` (a DPGS method) on ``w`` at ``site``; the row (module docstring)."""
    local, remote = site.local_root, site.site_root
    record_local, record_site = local / "records" / f"{row_id}.json", f"{remote}/records/{row_id}.json"
    record_local.parent.mkdir(parents=True, exist_ok=True)
    (local / "logs").mkdir(exist_ok=True)
    overrides = [*w.overrides, *w.data_overrides(f"{remote}/{w.data_dir}"),
                 *method_overrides(method, w.quick),
                 f"dpgs.workers={workers}", "dpgs.cpus_per_worker=1", "seed=0",
                 f"experiment=bandwidth-{w.key}", f"tracking.run_name={row_id}",
                 f"tracking.uri=sqlite:///{remote}/mlflow.db", f"train.output_dir={remote}/runs/{row_id}",
                 *site.dpgs_overrides()]
    argv = [sys.executable, str(BENCH / "bandwidth_driver.py"), record_site, "train", *overrides]
    load_before, started = _load(), time.time()
    log(f"[{row_id}] $ {' '.join(argv)}")
    proc = site.start_driver(argv)
    out = Output(proc, local / "logs" / f"{row_id}.log")
    code = out.wait(time.monotonic() + timeout_s)
    if code is None:
        _kill_site_processes(site, "bandwidth_driver.py")
        raise RowFailed(f"{row_id}: no end within {timeout_s:.0f} s:\n{out.tail()}")
    if code != 0:
        raise RowFailed(f"{row_id}: dpgs train exited with {code}:\n{out.tail()}")
    record = json.loads(record_local.read_text())
    status, metrics = mlflow_run(local / "mlflow.db", row_id)
    chunks = record["chunks"]
    master = sorted((m for c in chunks for m in c["master"]), key=lambda m: m["index"])
    compute: dict[int, float] = {}
    for c in chunks:
        for r in c["workers"]:
            compute[r["index"]] = max(compute.get(r["index"], 0.0), r["compute_seconds"])
    measured = measured_steps(chunks)
    epochs = sorted({c["epoch"] for c in chunks})
    bytes_check = []
    for epoch in epochs:
        mine = [c for c in chunks if c["epoch"] == epoch]
        wire = sum(site.wire(sampler.between(c["start"], c["end"])) for c in mine)
        steps = sum(len(c["steps"]) for c in mine)
        own = metrics.get("comm_bytes_per_step", {}).get(epoch)
        seconds = sum(c["end"] - c["start"] for c in mine)
        bytes_check.append({"epoch": epoch, "steps": steps, "wire_bytes_per_step": wire / steps,
                            "idle_wire_bytes_per_step": idle_per_step(idle_bps, seconds, steps),
                            "dpgs_bytes_per_step": own,
                            "keep_ratios": sorted({k for c in mine for k in c["keep_ratios"]})})
    last = bytes_check[-1]
    history = [{k: metrics[k][e] for k in EPOCH_KEYS if e in metrics.get(k, {})} | {"epoch": e}
               for e in sorted(metrics.get("elapsed_seconds", {}))]
    for h, paused in zip(history, paused_by_epoch(record.get("pauses", []), len(history)), strict=True):
        h["benchmark_pause_s"] = paused
    links = {k: v for k, v in metrics.items()
             if k.startswith(("link_mbps_worker_", "link_latency_ms_worker_"))}
    row = {
        "method": method, "run_status": status, "started": started, "load1_before": load_before,
        "load1_after": _load(), "wall_s": time.time() - started,
        "step_s": _median([m["step_seconds"] for m in master if m["index"] in measured]),
        "compute_s": _median([compute[i] for i in measured if i in compute]),
        "steps_measured": len(measured),
        "step_seconds_all": [m["step_seconds"] for m in master],
        "wire_bytes_per_step": last["wire_bytes_per_step"],
        "idle_wire_bytes_per_step": last["idle_wire_bytes_per_step"],
        "dpgs_bytes_per_step": last["dpgs_bytes_per_step"],
        "bytes_per_epoch": bytes_check,
        "chunk_edge_gap_s": max(sampler.gap_at(t) for c in chunks for t in (c["start"], c["end"])),
        "history": history,
        "test": {k: metrics[k][min(metrics[k])] for k in TEST_KEYS if k in metrics},
        "worker_ips": worker_ips("".join(out.lines)),
        "keep_ratios": sorted({k for c in chunks for k in c["keep_ratios"]}),
        "probes": record["probes"],
    }
    if method == "dpgs-auto":
        chosen = metrics.get("auto_keep_ratio", {})
        row["auto_keep_ratio"] = [chosen[e] for e in sorted(chosen)]
        row["auto_figures"] = {k: metrics[k] for k in ("auto_compute_seconds", "auto_dense_exchange_seconds",
                                                       "auto_exchange_seconds", "auto_dense_exchange_share")
                               if k in metrics} | links
    return row


def measured_steps(chunks: list[dict]) -> list[int]:
    """The steps a DPGS row measures: after the first, at the run's last keep ratio (a ``dpgs-auto`` run's
    warm-up epochs may run at another ratio than its steady choice, dense where that is cheap enough)."""
    keep_of = {i: k for c in chunks for i, k in zip(c["steps"], c["keep_ratios"], strict=True)}
    final = keep_of[max(keep_of)]
    return sorted(i for i, k in keep_of.items() if i >= 1 and k == final)


def paused_by_epoch(pauses: list[dict], epochs: int) -> list[float]:
    """Seconds the benchmark's driver paused (``bandwidth_driver.PAUSE_S``, around probes, before the
    states asked at each epoch's end and until they arrived) before each epoch's
    validation: those up to the epoch's own pause
    before ``ask_state``, which comes once per epoch right after its last chunk. A user's run has none, so
    a row's time to its target leaves them out."""
    ends = [p["end"] for p in pauses if p["before"] == "ask_state"]
    return [sum(p["seconds"] for p in pauses if e >= len(ends) or p["end"] <= ends[e]) for e in range(epochs)]


def idle_per_step(idle_bps: float | None, seconds: float, steps: int) -> float | None:
    """The idle traffic of ``steps`` steps that took ``seconds`` in all, per step (None: not measured)."""
    return None if idle_bps is None else idle_bps * seconds / steps


def worker_ips(output: str) -> list[str]:
    """The node address of each DPGS worker, from the ``[dpgs] worker w: ... ip=...`` start-up lines."""
    found = {}
    for line in output.splitlines():
        if line.startswith("[dpgs] worker ") and " ip=" in line:
            w = int(line.split()[2].rstrip(":"))
            found[w] = line.split(" ip=")[1].split()[0]
    return [found[w] for w in sorted(found)]


def run_ddp_row(site, w: Workload, method: str, row_id: str, sampler: CounterSampler, workers: int,
                timeout_s: float, log, idle_bps: float | None) -> dict:
    """Train ``method`` (ddp or ddp-powersgd) on ``w`` at ``site``; the row (module docstring)."""
    local, remote = site.local_root, site.site_root
    out_site, out_local = f"{remote}/ddp/{row_id}", local / "ddp" / row_id
    (local / "logs").mkdir(parents=True, exist_ok=True)
    if out_local.exists():
        shutil.rmtree(out_local)
    overrides = [*w.overrides, *w.data_overrides(f"{remote}/{w.data_dir}"), "seed=0"]
    rank = DDP_METHODS[method]
    load_before, started = _load(), time.time()
    outs = []
    for r in range(workers):
        argv = [sys.executable, str(BENCH / "bandwidth_ddp.py"), "--rank", str(r), "--world", str(workers),
                "--master", site.ddp_master(), "--port", str(DDP_PORT), "--out", out_site,
                "--powersgd-rank", str(rank or 0), "--threads", "1", "--", *overrides]
        if r == 0:
            log(f"[{row_id}] $ {' '.join(argv)}  (rank 1.. the same)")
        outs.append(Output(site.start_ddp_rank(r, argv), local / "logs" / f"{row_id}.rank{r}.log"))
    deadline = time.monotonic() + timeout_s
    try:
        codes = [o.wait(deadline) for o in outs]
    except BaseException:
        for o in outs:
            o.stop()
        raise
    if any(c is None for c in codes):
        _kill_site_processes(site, "bandwidth_ddp.py")
        for o in outs:
            if o.proc.poll() is None:
                o.proc.kill()
        raise RowFailed(f"{row_id}: no end within {timeout_s:.0f} s:\n{outs[0].tail()}")
    if any(codes):
        bad = next(i for i, c in enumerate(codes) if c)
        raise RowFailed(f"{row_id}: DDP rank {bad} exited with {codes[bad]}:\n{outs[bad].tail()}")
    result = json.loads((out_local / "ddp.json").read_text())
    steps = result["steps"]
    skip = max(1, result["powersgd_start"])
    seconds, windows = [], {}
    for i, s in enumerate(steps):
        if i < skip:
            continue
        previous = steps[i - 1] if i and steps[i - 1]["epoch"] == s["epoch"] else None
        seconds.append(s["end"] - (previous["end"] if previous else s["start"]))
        window = windows.setdefault(s["epoch"], [s["start"], s["end"], 0])
        window[1], window[2] = s["end"], window[2] + 1
    bytes_check = [{"epoch": e, "steps": n, "wire_bytes_per_step": site.wire(sampler.between(a, b)) / n,
                    "idle_wire_bytes_per_step": idle_per_step(idle_bps, b - a, n)}
                   for e, (a, b, n) in sorted(windows.items())]
    return {
        "method": method, "run_status": "FINISHED", "started": started, "load1_before": load_before,
        "load1_after": _load(), "wall_s": time.time() - started,
        "step_s": _median(seconds), "compute_s": None, "steps_measured": len(seconds),
        "step_seconds_all": [s["end"] - s["start"] for s in steps],
        "wire_bytes_per_step": bytes_check[-1]["wire_bytes_per_step"] if bytes_check else None,
        "idle_wire_bytes_per_step": bytes_check[-1]["idle_wire_bytes_per_step"] if bytes_check else None,
        "dpgs_bytes_per_step": None, "bytes_per_epoch": bytes_check,
        "history": result["history"], "test": {k: v for k, v in result["test"].items() if k in TEST_KEYS},
        "worker_ips": site.worker_addresses(), "powersgd_rank": rank,
    }


def run_row(site, w: Workload, method: str, row_id: str, sampler: CounterSampler, workers: int,
            timeout_s: float, log, idle_bps: float | None) -> dict:
    """One row; ``idle_bps``: the site's idle wire bytes per second (None: not measured)."""
    run = run_ddp_row if method in DDP_METHODS else run_dpgs_row
    row = run(site, w, method, row_id, sampler, workers, timeout_s, log, idle_bps)
    return {"workload": w.name, "link": site.link.name, "shaped": site.shaped, "workers": workers,
            "bags_per_step": w.batch, "tiles_per_bag": w.tiles_per_bag, "row_id": row_id, **row}


if __name__ == "__main__":
    sys.exit("bandwidth_rows.py is a module of benchmarks/bandwidth.py")
