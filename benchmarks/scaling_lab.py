"""Predicted against measured: the rows of the bandwidth benchmark on the multi-host lab (issue 22).

A row is ``{"workload", "link", "method", "step_s", "wire_bytes_per_step", ...}`` (``benchmarks/
bandwidth.py``), optionally with ``"workers"`` (P), ``"bags_per_step"`` and ``"compute_s"`` (the
slowest worker's forward + backward per step). The lab's hosts share one machine's cores, so its compute
is not the compute measured for the model; each row is predicted from the lab's own figures:

* with ``compute_s``: ``compute_s + cpu + comm`` (cpu: the model's codec, sums and optimizer terms), plus,
  for a DPGS row on a shaped link, the runtime's own cost per step where the rows hold loopback rows of
  the same workload, method and P with their ``compute_s`` (:func:`loop_cost`; a DDP row's ``compute_s``
  is a DPGS row's, so its loopback step holds more than a loop);
* else from the loopback row of the same workload, method and P: ``step_s(loopback) + comm(link)``
  (the loopback row is the step without a link: compute and cpu as the lab runs them);
* else the model alone (compute measured on this machine: expect the lab to be slower).

Links are ``loopback`` or a rate (``100mbit``, ``1 Gbps``, ...), every host's link shaped to it (tc counts
1500-byte frames) with ``latency_s`` one way, or the delay the name adds (``1gbit+1ms``: the lab's delay
line, 1 ms one way between a worker and the master); ``master_shaped=False`` when only the workers' links
are.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from scaling_model import GOODPUT_TC, Link, Scenario, Workload, predict

UNITS = {"k": 1e3, "m": 1e6, "g": 1e9}
METHODS = {"dpgs-dense": "dpgs-dense", "dpgs-keep1": "dpgs-keep0.01", "dpgs-keep0.1": "dpgs-keep0.001",
           "ddp": "ddp", "ddp-powersgd": "ddp-powersgd"}
UNLIMITED = 1e15  # bits/s: a link that is not shaped
LOOPBACK_LATENCY_S = 54e-6  # one way in an unshaped namespace, measured by --loopback (docs/scaling.md)


LINK = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg])\s*(?:bit|bps|b/s|bit/s|bits/s)?"
                  r"(?:\s*\+\s*(\d+(?:\.\d+)?)\s*ms)?")  # rate, then the delay a lab link adds


def _link(text: str) -> re.Match | None:
    t = text.strip().lower()
    if t in ("loopback", "lo", "none", "unshaped"):
        return None
    m = LINK.fullmatch(t)
    if not m:
        raise ValueError(f"link '{text}': expected loopback or a rate such as 100mbit, 1 Gbps or 1gbit+1ms")
    return m


def link_rate(text: str) -> float | None:
    """Bits/s of ``100mbit``, ``1 Gbps``, ``1gbit+1ms``...; None for ``loopback``."""
    m = _link(text)
    return None if m is None else float(m.group(1)) * UNITS[m.group(2)]


def link_delay(text: str) -> float | None:
    """The one-way delay a link's name gives (``1gbit+1ms``: each worker host's link delayed 1 ms, so
    1 ms between a worker and the master), in seconds; None when it names none."""
    m = _link(text)
    return None if m is None or m.group(3) is None else float(m.group(3)) / 1e3


def workload_for(name: str, workloads: dict[str, Workload]) -> Workload:
    if name in workloads:
        return workloads[name]
    low = name.lower()
    key = ("tiles-resnet18" if "tile" in low
           else "features-abmil" if ("feature" in low or "abmil" in low) else None)
    if key is None or key not in workloads:
        raise ValueError(f"workload '{name}': no measured inputs match (have {', '.join(workloads)})")
    return workloads[key]


def loop_cost(loopbacks: list[dict], w: Workload, method: str, workers: int, bags: int) -> float:
    """What a step of the runtime costs beyond the model's terms, from the loopback rows of the same
    workload, method and P (the median of each row's step - its compute - the model's cpu and network
    there, at least 0): Python, thread wake-ups and scheduling on the lab's shared cores, a few
    milliseconds a step, which a millisecond-scale step cannot leave out."""
    step = predict(w, method, scenario(None, workers, bags, LOOPBACK_LATENCY_S, True))
    return max(0.0, statistics.median(float(b["step_s"]) - float(b["compute_s"]) - step.cpu - step.comm
                                      for b in loopbacks))


def scenario(rate: float | None, workers: int, bags: int, latency_s: float, master_shaped: bool) -> Scenario:
    worker = Link("lab", rate or UNLIMITED, latency_s, GOODPUT_TC)
    master = worker if master_shaped else Link("lab master", UNLIMITED, latency_s, GOODPUT_TC)
    return Scenario(workers, bags, master, worker)


def compare_lab(path: Path, workloads: list[Workload], default_workers: int, default_bags: int = 16,
                latency_s: float = 1e-3, master_shaped: bool = True) -> str:
    """A markdown table of predicted against measured s/step (and master-link wire bytes) per row."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"{path}: {err}") from None
    if not isinstance(rows, list):
        raise SystemExit(f"{path}: expected a list of rows")
    by_name = {w.name: w for w in workloads}
    loop: dict[tuple, list[dict]] = {}
    for r in rows:
        if link_rate(str(r.get("link", ""))) is None:
            key = (r.get("workload"), r.get("method"), int(r.get("workers", default_workers)))
            loop.setdefault(key, []).append(r)
    out = []
    for i, r in enumerate(rows):
        missing = [k for k in ("workload", "link", "method", "step_s") if k not in r]
        if missing:
            raise SystemExit(f"{path}: row {i} lacks {', '.join(missing)}")
        method = METHODS.get(r["method"])
        if method is None or r["step_s"] is None:
            continue
        w = workload_for(r["workload"], by_name)
        p = int(r.get("workers", default_workers))
        rate = link_rate(str(r["link"]))
        delay = link_delay(str(r["link"]))
        bags = int(r.get("bags_per_step", default_bags))
        s = scenario(rate, p, bags, latency_s if delay is None else delay, master_shaped)
        step = predict(w, method, s)
        loops = loop.get((r["workload"], r["method"], p), [])
        base = loops[-1] if loops else None
        timed = [b for b in loops if b.get("compute_s") is not None]
        if r.get("compute_s") is not None and rate is not None and timed and method.startswith("dpgs"):
            how, pred = ("lab compute + model + loop", float(r["compute_s"]) + step.cpu + step.comm
                         + loop_cost(timed, w, method, p, bags))
        elif r.get("compute_s") is not None:
            how, pred = "lab compute + model", float(r["compute_s"]) + step.cpu + step.comm
        elif base is not None and base is not r:
            how, pred = "lab loopback + model comm", float(base["step_s"]) + step.comm
        else:
            how, pred = "model", step.total
        wire = r.get("wire_bytes_per_step")
        out.append([r["workload"], str(r["link"]), r["method"], str(p), f"{r['step_s']:.3f}", f"{pred:.3f}",
                    f"{100 * (pred / r['step_s'] - 1):+.0f} %", how,
                    "-" if wire is None else f"{wire / 1e6:.3g}",
                    f"{step.master_bytes / GOODPUT_TC / 1e6:.3g}"])
    header = ["workload", "link", "method", "P", "measured s/step", "predicted s/step", "error", "from",
              "measured wire MB/step", "predicted master-link wire MB/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in out])
