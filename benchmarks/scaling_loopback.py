"""Check the scaling model's exchange terms with real processes: P workers and a master exchanging the real
message sizes over dpgs's own ``GlooChannel`` (``dpgs.distributed.gloo``) on 127.0.0.1.

Each check runs in a private network namespace (``scaling_netns``) whose loopback has the lab's MTU
(1500) and, for the shaped checks, a tc ``tbf`` qdisc at 100 Mbit/s or 1 Gbit/s. All P + 1 processes
share that one queue, which carries both directions: as dpgs's uplink and downlink phases never
overlap, it behaves as the master's link of the star model. Per round the workers send their
message up (``send_up``) and wait for the master's (``recv_down``); the master takes every message
(``gather_up``) and sends its own down (``send_down``), exactly as ``dpgs.distributed.sync`` does, but
without compute or codec, so a round is the model's communication term ``comm`` alone. The measured
round is the master's time between successive ``gather_up`` calls (the first round is not timed); each
case runs enough rounds for about ``ROUND_SECONDS`` of predicted exchange (3 to 30 rounds).

The model is fed what the namespace's link is: the payload rate of one bulk transfer measured in the same
kind of namespace unshaped (``stack``: on a busy 2-core machine the kernel copies slower than 1 Gbit/s),
the tbf rate times the TCP goodput of 1500-byte frames, the smaller of the two, and the one-way latency
from tiny-message rounds (``6`` one-way latencies per round in the model).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _common import loopback_channel
from scaling_model import (
    DPGS_ONE_PIECE_LATENCIES,
    GOODPUT_TC,
    Link,
    Scenario,
    Workload,
    dpgs_messages,
    predict,
)
from scaling_netns import MTU, main_inside, run_in_namespace, setup_namespace

SHAPES = {"100mbit": 100e6, "1gbit": 1e9}
JOIN_TIMEOUT_S = 120
ROUND_SECONDS = 4.0


def _rank(rank: int, world: int, ports, up: int, down: int, rounds: int, results) -> None:
    """One process of the exchange (rank 0 the master)."""
    import torch

    torch.set_num_threads(1)
    channel = loopback_channel(rank, world, ports, timeout_s=600.0)
    if rank == 0:
        body = torch.zeros(down, dtype=torch.uint8)
        starts = []
        for _ in range(rounds + 2):
            starts.append(time.perf_counter())
            channel.gather_up()
            channel.send_down(body)
        results.put([b - a for a, b in zip(starts[1:-1], starts[2:], strict=True)])
    else:
        body = torch.zeros(up, dtype=torch.uint8)
        for _ in range(rounds + 2):
            channel.send_up(body)
            channel.recv_down()
    channel.close()


def exchange_rounds(workers: int, up: int, down: int, rounds: int) -> list[float]:
    """Seconds of ``rounds`` exchange rounds of ``workers`` workers and a master (spawned processes)."""
    ctx = mp.get_context("spawn")
    results, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, workers + 1, ports, up, down, rounds, results), daemon=True)
             for r in range(workers + 1)]
    for p in procs:
        p.start()
    try:
        times = results.get(timeout=JOIN_TIMEOUT_S + 600)
        for p in procs:
            p.join(timeout=60)
        return times
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def inside(spec: dict) -> dict:
    """Run in the namespace: calibration rounds, then every case of ``spec``."""
    setup_namespace(spec["rate_bps"])
    tiny = exchange_rounds(1, 1, 1, 20)
    out = {"latency_round_s": statistics.median(tiny), "cases": []}
    if spec.get("calibrate_bytes"):
        n = spec["calibrate_bytes"]
        rounds = exchange_rounds(1, n, n, 3)
        out["stack_payload_bps"] = 8 * 2 * n / statistics.median(rounds)
        out["stack_rounds_s"] = rounds
    for case in spec["cases"]:
        times = exchange_rounds(case["workers"], case["up"], case["down"], case["rounds"])
        out["cases"].append({**case, "rounds_s": times, "measured_s": statistics.median(times),
                             "load1": os.getloadavg()[0]})
    return out


def cases(workloads: list[Workload], workers: list[int], methods: list[str]) -> list[dict]:
    return [{"workload": w.name, "method": m, "workers": p,
             "up": int(round(dpgs_messages(w, m, p)[0])), "down": int(round(dpgs_messages(w, m, p)[1]))}
            for w in workloads for m in methods for p in workers]


def predicted(w: Workload, case: dict, link: Link) -> float:
    scenario = Scenario(case["workers"], case["workers"], link, full_duplex=False)  # one queue, both ways
    return predict(w, case["method"], scenario).comm


def with_rounds(todo: list[dict], by_name: dict[str, Workload], link: Link, quick: bool) -> list[dict]:
    """``todo`` with enough rounds each for about :data:`ROUND_SECONDS` of predicted exchange."""
    target, most = (ROUND_SECONDS / 2, 15) if quick else (ROUND_SECONDS, 30)
    return [{**c, "rounds": max(3, min(most, math.ceil(target / predicted(by_name[c["workload"]], c, link))))}
            for c in todo]


def run_checks(workloads: list[Workload], quick: bool, progress: Callable[[str], None]) -> dict:
    """Unshaped, 100 Mbit/s and 1 Gbit/s namespaces, P = 2 and 3, dense and keep 1 %, every workload:
    measured round seconds against the model's ``comm`` (JSON-able dict, with a markdown table)."""
    script = Path(__file__).resolve()
    todo = cases(workloads, [2, 3], ["dpgs-dense", "dpgs-keep0.01"])
    largest = max(w.dense_bytes for w in workloads)
    by_name = {w.name: w for w in workloads}
    results = {"mtu": MTU, "namespaces": {}}
    progress("loopback: unshaped namespace (calibration: stack rate and latency)")
    guess = Link("loopback", 2e9, 1e-3, 1.0)  # only to choose round counts
    plain = run_in_namespace(script, {"rate_bps": None, "calibrate_bytes": largest,
                                      "cases": with_rounds(todo, by_name, guess, quick)})
    results["namespaces"]["unshaped"] = plain
    stack = plain["stack_payload_bps"]
    latency = plain["latency_round_s"] / DPGS_ONE_PIECE_LATENCIES  # a round of 1-byte messages
    for name, rate in SHAPES.items():
        progress(f"loopback: tbf {name}")
        link = Link(name, min(rate * GOODPUT_TC, stack), latency, 1.0)
        results["namespaces"][name] = run_in_namespace(
            script, {"rate_bps": rate, "cases": with_rounds(todo, by_name, link, quick)})
    rows = []
    for name, ns in results["namespaces"].items():
        nominal = SHAPES.get(name)
        links = {"stack": Link("stack", stack, latency, 1.0)} if nominal is None else {
            "tc": Link(name, nominal, latency, GOODPUT_TC),
            "tc+stack": Link(name, min(nominal * GOODPUT_TC, stack), latency, 1.0)}
        for case in ns["cases"]:
            w = by_name[case["workload"]]
            preds = {k: predicted(w, case, link) for k, link in links.items()}
            model = preds.get("tc+stack", preds.get("stack"))
            case["predicted"] = preds
            case["error"] = model / case["measured_s"] - 1  # the prediction's error
            keys = ("workload", "method", "workers", "rounds")
            rows.append({"namespace": name, **{k: case[k] for k in keys},
                         "up": case["up"], "down": case["down"], "measured_s": case["measured_s"],
                         "predicted": preds, "error": case["error"], "load1": case["load1"]})
    results["stack_payload_bps"] = stack
    results["latency_s"] = latency
    results["rows"] = rows
    results["table"] = table(rows)
    progress(results["table"])
    return results


def table(rows: list[dict]) -> str:
    header = ["namespace", "workload", "method", "P", "up / down per worker", "rounds", "measured s/round",
              "predicted (tc rate only)", "predicted (model link)", "error", "load1"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        p = r["predicted"]
        lines.append("| " + " | ".join([
            r["namespace"], r["workload"], r["method"], str(r["workers"]),
            f"{r['up'] / 1e6:.3g} / {r['down'] / 1e6:.3g} MB", str(r["rounds"]), f"{r['measured_s']:.3f}",
            f"{p['tc']:.3f}" if "tc" in p else "-", f"{p.get('tc+stack', p.get('stack')):.3f}",
            f"{100 * r['error']:+.0f} %", f"{r['load1']:.1f}"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main_inside(inside)
