"""Compression that pays? DPGS against DDP on slow links, measured on the multi-host lab (issue 22).

    python benchmarks/bandwidth.py --quick                 # tiles: s/step and bytes at 100 Mbps and 1 Gbps,
                                                           # every method, a few steps (bandwidth.json)
    python benchmarks/bandwidth.py --workload features     # ABMIL on feature bags: loopback, 100 Mbps,
                                                           # 1 Gbps,
                                                           # whole runs (time to target, test AUC)
    python benchmarks/bandwidth.py --workload tiles        # the same for the ResNet-18 tile encoder
    python benchmarks/bandwidth.py --report                # docs/benchmarks/bandwidth.md tables + PNGs
                                                           # (--out ROWS.json: that file's rows only)

Every row trains the same data, model, seed, batch and epochs (``bandwidth_workloads``) with one method:
``ddp`` (torch DDP, gloo all-reduce, dense), ``ddp-powersgd`` (DDP with torch's PowerSGD hook, rank 4),
``dpgs-dense`` (keep_ratio 1), ``dpgs-keep1`` (0.01), ``dpgs-keep0.1`` (0.001) and ``dpgs-auto`` (the
default, ``keep_ratio=auto``), with P workers (``--workers``, default 2) on one link:

* ``loopback``: one host, no lab: every process on this machine in a private network namespace (its
  loopback's counters hold only the row's traffic);
* ``100mbit``, ``1gbit``: the lab (``tests/lab/netlab.py``): a head host (Ray head, the dpgs driver and
  master) and P worker hosts (one Ray node with 1 CPU each: one DPGS worker, or one DDP rank, per host),
  each host's link shaped with tc tbf to the rate, the head's too (``--unshaped-head``: the workers'
  only). Undelayed, a link's latency is the veth's (~0.05 ms round trip); ``100mbit+1ms`` also delays
  each worker host's link 1 ms each way (this kernel has no netem: the lab's delay line does it,
  ``tests/lab/delay.py``; measured: a 1 ms + 1 ms round trip takes 2.25 ms).

What a row measures is described in ``bandwidth_rows``; rows are written after each run to ``--out``
(a JSON list; rows of other workloads, links or methods already there are kept), so an interrupted run
keeps what it measured and ``--report`` renders whatever is there. All hosts of the lab share this
machine's cores: compute is slower than on separate machines and noisy when the machine is loaded
(each row records the 1-minute load average before and after it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bandwidth_rows import STOP_GRACE_S, stop_process
from bandwidth_sites import Link, LoopbackSite
from bandwidth_workloads import METHODS, prepare, workload

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "runs" / "bandwidth"
QUICK_LINKS = ["100mbit", "1gbit"]
FULL_LINKS = ["loopback", "100mbit", "1gbit"]
ROW_TIMEOUT_S = 4 * 3600
KEY = ("workload", "link", "method", "workers", "repeat")


def log(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


# ------------------------------------------------------------------ the results file
def load_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SystemExit(f"{path}: not JSON ({err}); move it away or pass another --out") from None
    if not isinstance(rows, list):
        raise SystemExit(f"{path}: expected a JSON list of rows")
    return rows


def best_val_auc(row: dict) -> float | None:
    values = [h["val_auc"] for h in row.get("history", []) if h.get("val_auc") is not None]
    return max(values) if values else None


def time_to(row: dict, target: float) -> float | None:
    """``elapsed_seconds`` of the first epoch whose validation AUC reaches ``target``, less the benchmark
    driver's own pauses before it (``benchmark_pause_s``, recorded since 2026-11-27) (None: never)."""
    for h in row.get("history", []):
        if h.get("val_auc") is not None and h["val_auc"] >= target - 1e-12:
            return h["elapsed_seconds"] - h.get("benchmark_pause_s", 0.0)
    return None


def derive(rows: list[dict], targets: dict[str, float]) -> list[dict]:
    """Fill the fields computed across rows: DDP's compute (the DPGS rows' on the same link), the dense
    exchange / compute of the link, the validation target and the time to reach it, test AUC."""
    for r in rows:
        where = (r["workload"], r["link"], r["workers"])
        same = [o for o in rows if (o["workload"], o["link"], o["workers"]) == where]
        dpgs_compute = sorted(o["compute_s"] for o in same
                              if o["method"].startswith("dpgs") and o.get("compute_s"))
        if r["method"].startswith("ddp"):
            r["compute_s"] = dpgs_compute[len(dpgs_compute) // 2] if dpgs_compute else None
            r["compute_source"] = "median of the DPGS rows' compute on this link" if dpgs_compute else None
        dense = [o for o in same if o["method"] == "dpgs-dense" and o.get("compute_s") and o.get("step_s")]
        if dense:
            d = dense[0]
            r["dense_exchange_over_compute"] = (d["step_s"] - d["compute_s"]) / d["compute_s"]
        target = targets.get(r["workload"])
        quick = not r.get("history") or r.get("quick")
        r["target_val_auc"] = None if quick else target
        r["time_to_target_s"] = None if quick or target is None else time_to(r, target)
        r["best_val_auc"] = None if quick else best_val_auc(r)
        r["test_auc"] = None if quick else r.get("test", {}).get("test_auc")
    return rows


def targets_of(rows: list[dict], fixed: float | None) -> dict[str, float]:
    """Per workload: ``fixed``, else the loopback dpgs-dense run's best validation AUC - 0.01."""
    out = {}
    for r in rows:
        if r.get("quick"):
            continue
        if fixed is not None:
            out[r["workload"]] = fixed
        elif r["link"] == "loopback" and r["method"] == "dpgs-dense" and best_val_auc(r) is not None:
            out[r["workload"]] = round(best_val_auc(r) - 0.01, 4)
    return out


def save_rows(path: Path, rows: list[dict], target: float | None) -> None:
    rows = derive(rows, targets_of(rows, target))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, path)


def merge(rows: list[dict], new: dict) -> list[dict]:
    key = tuple(new.get(k) for k in KEY)
    return [r for r in rows if tuple(r.get(k) for k in KEY) != key] + [new]


# ------------------------------------------------------------------ running rows at a site
def run_rows(site, w, methods: list[str], workers: int, repeats: list[int], out: Path, target: float | None,
             timeout_s: float) -> int:
    """Every method x repeat (``repeats``: their numbers) at ``site`` (its link already set); rows merged
    into ``out``. Returns the number of failed rows (each logged)."""
    from bandwidth_rows import RowFailed, run_row

    failed = 0
    with site.sampler() as sampler:
        idle = site.idle_bytes_per_second(sampler)
        if idle is not None:
            log(f"[{site.link.name}] idle cluster: {idle / 1e3:.1f} kB/s on the wire")
        for repeat in repeats:
            for method in methods:
                mode = "-quick" if w.quick else ""
                row_id = f"{w.key}{mode}-{site.link.name}-{method}-P{workers}-r{repeat}"
                try:
                    row = run_row(site, w, method, row_id, sampler, workers, timeout_s, log, idle)
                except RowFailed as err:
                    log(f"[{row_id}] FAILED: {err}")
                    failed += 1
                    if hasattr(site, "after_failure"):
                        site.after_failure(row_id, log)
                    continue
                row.update(repeat=repeat, quick=w.quick)
                rows = merge(load_rows(out), row)
                save_rows(out, rows, target)
                nan = float("nan")
                own, wire = row.get("dpgs_bytes_per_step"), row.get("wire_bytes_per_step")
                log(f"[{row_id}] step {row['step_s'] or nan:.3f} s "
                    f"(compute {row['compute_s'] or nan:.3f} s), "
                    f"wire {(wire or nan) / 1e6:.3f} MB/step"
                    + (f", dpgs {own / 1e6:.3f} MB/step" if own else "")
                    + f", load {row['load1_before']}->{row['load1_after']}, workers on {row['worker_ips']}")
    return failed


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP end the benchmark as an exception does (SystemExit), so the lab goes down and the
    running row's processes are stopped (Python's default would end the process where it stands, leaving
    the lab up)."""

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, terminate)


def run_loopback(args, w) -> int:
    """The loopback rows, in a child process in a private network namespace (``--loopback-child``); an
    interrupted benchmark stops the child (SIGTERM: it stops its row's processes first)."""
    spec = {"workload": w.key, "quick": w.quick, "epochs": args.epochs, "methods": args.methods,
            "workers": args.workers, "repeats": args.repeats, "out": str(args.out.resolve()),
            "target": args.target, "cache": str(args.cache.resolve()), "timeout": args.timeout}
    cmd = ["unshare", "--net", "--", sys.executable, str(Path(__file__).resolve()), "--loopback-child",
           json.dumps(spec)]
    child = subprocess.Popen(cmd, cwd=Path(__file__).parent)
    try:
        return child.wait()
    except BaseException:
        stop_process(child, 2 * STOP_GRACE_S)
        raise


def loopback_child(spec: dict) -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    w = workload(spec["workload"], spec["quick"], spec["epochs"], spec["workers"])
    site = LoopbackSite(Path(spec["cache"]), spec["workers"])
    failed = run_rows(site, w, spec["methods"], spec["workers"], spec["repeats"], Path(spec["out"]),
                      spec["target"], spec["timeout"])
    return 1 if failed else 0


def wait_for_free_lab() -> None:
    """Only one lab can exist on this machine: wait (polling every minute) while another one is up."""
    from tests.lab.netlab import lab_namespaces

    while names := lab_namespaces():
        log(f"a lab is up ({', '.join(names)}), not ours: waiting for it to go")
        time.sleep(60)


def run_lab(args, w, links: list[Link]) -> int:
    from bandwidth_sites import LabSite

    from tests.lab.netlab import Lab

    wait_for_free_lab()
    failed = 0
    log(f"[lab] up: head + {args.workers} worker hosts")
    with Lab.up(workers=args.workers) as lab:
        site = LabSite(lab, args.workers, shape_head=not args.unshaped_head, keep_dir=args.cache / "lab-logs")
        shutil.copytree(args.cache / w.data_dir, site.local_root / w.data_dir, dirs_exist_ok=True)
        site.start_ray(log)
        try:
            for link in links:
                site.shape(link)
                log(f"[lab] links: {link.name} on {site.shaped}")
                failed += run_rows(site, w, args.methods, args.workers, args.repeats, args.out, args.target,
                                   args.timeout)
        finally:
            site.stop_ray()
            log("[lab] down")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiles, 100 Mbps and 1 Gbps, a few steps per method")
    p.add_argument("--workload", choices=["tiles", "features"], default="tiles")
    p.add_argument("--links", help=f"comma-separated (default {','.join(FULL_LINKS)}; --quick "
                                   f"{','.join(QUICK_LINKS)})")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: all six)")
    p.add_argument("--workers", type=int, default=2, help="P: worker hosts / DPGS workers / DDP ranks")
    p.add_argument("--epochs", type=int, help="epochs of a whole run (default: the workload's)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--first-repeat", type=int, default=0,
                   help="number of the first repeat (rows of other repeats already in --out are kept)")
    p.add_argument("--target", type=float, help="validation-AUC target (default: loopback dpgs-dense's "
                                                "best - 0.01)")
    p.add_argument("--unshaped-head", action="store_true", help="shape only the worker hosts' links")
    p.add_argument("--out", type=Path, help="rows JSON (default: bandwidth.json with --quick, else "
                                            "docs/benchmarks/bandwidth-<workload>.json)")
    p.add_argument("--cache", type=Path, default=CACHE, help="data and run records (default %(default)s)")
    p.add_argument("--timeout", type=float, default=ROW_TIMEOUT_S, help="seconds a row may take")
    p.add_argument("--report", action="store_true", help="write the docs tables and PNGs from the rows")
    p.add_argument("--loopback-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    exit_on_termination()
    if args.loopback_child:
        return loopback_child(json.loads(args.loopback_child))
    if args.report:
        from bandwidth_report import main as report

        return report([str(args.out)] if args.out else [])
    if args.quick:
        args.workload = "tiles"
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {', '.join(unknown)} (have {', '.join(METHODS)})")
    names = args.links or ",".join(QUICK_LINKS if args.quick else FULL_LINKS)
    links = [Link.parse(x) for x in names.split(",")]
    args.out = args.out or (Path("bandwidth.json") if args.quick else
                            ROOT / "docs" / "benchmarks" / f"bandwidth-{args.workload}.json")
    if os.geteuid() != 0:
        p.error("the benchmark needs root (network namespaces, tc)")
    if args.repeats < 1 or args.first_repeat < 0:
        p.error("--repeats must be at least 1 and --first-repeat at least 0")
    args.repeats = list(range(args.first_repeat, args.first_repeat + args.repeats))
    w = workload(args.workload, args.quick, args.epochs, args.workers)
    start = time.monotonic()
    prepare(w, args.cache, log)
    failed = 0
    if any(link.rate_mbit is None for link in links):
        failed += run_loopback(args, w) != 0
    shaped = [link for link in links if link.rate_mbit is not None]
    if shaped:
        failed += run_lab(args, w, shaped)
    log(f"done in {time.monotonic() - start:.0f} s; rows in {args.out}"
        + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
