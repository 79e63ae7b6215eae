"""Check the scaling model on whole steps of real ``dpgs train`` runs over a shaped link.

``dpgs train`` (Ray, the master and P worker actors, gloo) trains the ABMIL head on the demo feature bags
inside a private network namespace whose loopback is shaped by tc to 100 Mbit/s or 1 Gbit/s
(``scaling_netns``), dense and keep 1 % (``downlink=gradients``, no keep warm-up), P = 2 and 3, B = 16.
Each run logs per epoch the master's mean step time (``step_seconds``) and the slowest worker's compute
(``time_compute_seconds``, its reads ``time_read_wait_seconds``); its first epoch is a warm-up. All
processes share this machine's cores, so the compute comes from the run itself and the model adds what
it predicts beyond compute:

    predicted step = measured (compute + read wait) + model cpu + model comm,

with the model's CPU terms (measured in one process by ``scaling_measure``) and its communication over
a link of the tbf rate (TCP goodput of 1500-byte frames) and the one-way latency of the loopback checks.
On a loaded machine the run's own codec, sums and optimizer steps take longer than the model's
one-process figures, so the check also gives ``measured (compute + read wait + cpu phases) + model
comm``, which checks the communication model alone (cpu phases: the worker's encode and apply, and in
dense mode the master's sum, optimizer step and weights, which the workers wait for). A run that fails
(a Ray node lost on a loaded machine) is tried once more, then recorded with its error.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from scaling_model import GOODPUT_TC, Link, Scenario, Workload, predict
from scaling_netns import main_inside, run_in_namespace, setup_namespace

RATES = {"100mbit": 100e6, "1gbit": 1e9}
BATCH = 16
METHODS = {"dpgs-dense": "1.0", "dpgs-keep0.01": "0.01"}
KEYS = ("step_seconds", "time_compute_seconds", "time_read_wait_seconds", "time_encode_seconds",
        "time_exchange_seconds", "time_apply_seconds", "time_master_decode_seconds",
        "time_master_optimizer_seconds", "time_master_encode_seconds", "comm_bytes_per_step")
ATTEMPTS = 2


def inside(spec: dict) -> dict:
    """In the namespace: one ``dpgs train`` per (method, P); the epochs after the first, per run."""
    setup_namespace(spec["rate_bps"])
    from _common import demo_manifest, run

    out = []
    with tempfile.TemporaryDirectory(prefix="dpgs-scaling-train-") as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, 200)
        for method, keep in METHODS.items():
            for p in spec["workers"]:
                errors = []
                for attempt in range(ATTEMPTS):
                    try:
                        r = run(manifest, work, f"{method}-P{p}-{attempt}", "train.mode=dpgs",
                                f"dpgs.workers={p}", f"train.epochs={spec['epochs']}",
                                f"train.batch_size={BATCH}", f"dpgs.compression.keep_ratio={keep}",
                                "dpgs.compression.warmup_epochs=0", "dpgs.compression.downlink=gradients")
                    except Exception as err:  # a lost Ray node or actor on a loaded machine: try once more
                        errors.append(f"{type(err).__name__}: {err}"[:500])
                        continue
                    rows = r["history"][1:]
                    out.append({"method": method, "workers": p, "failed_attempts": errors,
                                "epochs": [{k: row.get(k) for k in KEYS} for row in rows]})
                    break
                else:
                    out.append({"method": method, "workers": p, "failed_attempts": errors, "epochs": []})
    return {"runs": out}


def run_checks(workloads: list[Workload], latency_s: float, quick: bool,
               progress: Callable[[str], None]) -> dict:
    """Runs at both rates, predicted against measured step seconds (JSON-able, with a markdown table)."""
    w = next((w for w in workloads if w.name == "features-abmil"), None)
    if w is None:
        raise ValueError("the dpgs train check needs the features-abmil inputs")
    results = {"batch": BATCH, "latency_s": latency_s, "rates": {}}
    rows = []
    for name, rate in RATES.items():
        progress(f"dpgs train: {name} namespace, P = 2 and 3, dense and keep 1 %")
        got = run_in_namespace(Path(__file__).resolve(),
                               {"rate_bps": rate, "workers": [2, 3], "epochs": 2 if quick else 3})
        results["rates"][name] = got
        link = Link(name, rate, latency_s, GOODPUT_TC)
        for run in got["runs"]:
            if not run["epochs"]:
                progress(f"  {run['method']} P={run['workers']} failed: {run['failed_attempts']}")
                continue
            med = {k: statistics.median(e[k] for e in run["epochs"]) for k in KEYS}
            step = predict(w, run["method"], Scenario(run["workers"], BATCH, link, full_duplex=False))
            compute = med["time_compute_seconds"] + med["time_read_wait_seconds"]
            run_cpu = med["time_encode_seconds"] + med["time_apply_seconds"]
            if run["method"] == "dpgs-dense":
                run_cpu += sum(med[f"time_master_{k}_seconds"] for k in ("decode", "optimizer", "encode"))
            pred = compute + step.cpu + step.comm
            pred_run = compute + run_cpu + step.comm
            rows.append({"rate": name, "method": run["method"], "workers": run["workers"],
                         "measured_s": med["step_seconds"], "compute_s": compute, "cpu_s": step.cpu,
                         "run_cpu_s": run_cpu, "comm_s": step.comm, "predicted_s": pred,
                         "error": pred / med["step_seconds"] - 1, "predicted_run_cpu_s": pred_run,
                         "error_run_cpu": pred_run / med["step_seconds"] - 1,
                         "bytes_per_step": med["comm_bytes_per_step"], "predicted_bytes": step.master_bytes})
    results["rows"] = rows
    results["table"] = table(rows)
    progress(results["table"])
    return results


def table(rows: list[dict]) -> str:
    header = ["link", "method", "P", "measured s/step", "run's compute", "model cpu", "run's cpu",
              "model comm", "predicted (model cpu)", "error", "predicted (run's cpu)", "error",
              "dpgs bytes/step", "model bytes/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["rate"], r["method"], str(r["workers"]), f"{r['measured_s']:.3f}", f"{r['compute_s']:.3f}",
            f"{r['cpu_s']:.3f}", f"{r['run_cpu_s']:.3f}", f"{r['comm_s']:.3f}", f"{r['predicted_s']:.3f}",
            f"{100 * r['error']:+.0f} %", f"{r['predicted_run_cpu_s']:.3f}",
            f"{100 * r['error_run_cpu']:+.0f} %",
            f"{r['bytes_per_step'] / 1e6:.3g} MB", f"{r['predicted_bytes'] / 1e6:.3g} MB"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main_inside(inside)
