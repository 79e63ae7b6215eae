"""The bandwidth benchmark's report: ``docs/benchmarks/bandwidth.md`` (tables) and the PNGs beside it.

    python benchmarks/bandwidth.py --report                       # every rows file found (below)
    python benchmarks/bandwidth_report.py [ROWS.json ...] [--out docs/benchmarks/bandwidth.md]

Rows come from ``benchmarks/bandwidth.py`` (one JSON list per run: ``bandwidth.json`` of ``--quick``,
``docs/benchmarks/bandwidth-<workload>.json`` of whole runs); by default every
``docs/benchmarks/bandwidth-*.json`` and ``./bandwidth.json`` if present. Rows of the same workload,
mode (quick or whole runs), link, method and repeat are one row (the file named later wins).

One table per workload and mode, one line per link x method, medians over the repeats:
s/step, compute s (DDP rows: the DPGS rows' compute on the link, ``compute_source``), step / compute,
s/step relative to ``ddp`` and ``ddp-powersgd`` on the same link, wire MB/step (the hosts' interface
counters), dpgs MB/step (dpgs's own count) and wire / dpgs, idle MB/step (the cluster's traffic with no
job, over the same seconds, in kB) and (wire - idle) / dpgs, the link's dense exchange / compute
(``dpgs-dense``'s step - compute over compute), time to the validation target, test AUC with its
bootstrap interval, and for ``dpgs-auto`` the keep ratios it chose. Where rows have per-epoch histories
(whole runs), ``bandwidth-<workload>-<link>.png``: validation AUC against wall seconds, one curve a method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks"
METHOD_ORDER = ["ddp", "ddp-powersgd", "dpgs-dense", "dpgs-keep1", "dpgs-keep0.1", "dpgs-auto"]
LINK_ORDER = ["loopback", "100mbit", "1gbit"]
GROUP = ("workload", "quick", "link", "method", "workers")


# ------------------------------------------------------------------ reading and grouping
def default_sources() -> list[Path]:
    found = sorted(DOCS.glob("bandwidth-*.json"))
    local = Path("bandwidth.json")
    return found + ([local] if local.is_file() else [])


def read_rows(paths: list[Path]) -> list[dict]:
    """Rows of every file, later files replacing rows of the same key (workload, quick, link, method,
    workers, repeat)."""
    by_key: dict[tuple, dict] = {}
    for path in paths:
        rows = json.loads(Path(path).read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of rows")
        for r in rows:
            by_key[(*(bool(r.get(k)) if k == "quick" else r.get(k) for k in GROUP), r.get("repeat", 0))] = r
    return list(by_key.values())


def _order(values: list, order: list) -> list:
    return sorted(values, key=lambda v: (order.index(v) if v in order else len(order), str(v)))


def _link_order(link: str) -> tuple:
    return (LINK_ORDER.index(link), 0.0) if link in LINK_ORDER else (len(LINK_ORDER), link)


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _middle(rows: list[dict], key: str) -> dict | None:
    """The row whose ``key`` is the (lower) median of the rows that have it."""
    have = sorted((r for r in rows if isinstance(r.get(key), (int, float))), key=lambda r: r[key])
    return have[(len(have) - 1) // 2] if have else None


def auto_choice(rows: list[dict]) -> str | None:
    """The keep ratios ``dpgs-auto`` chose, per epoch (first repeat's sequence; repeats that differ are
    listed after a ``;``)."""
    seqs = []
    for r in rows:
        seq = r.get("auto_keep_ratio") or r.get("keep_ratios")
        if seq:
            text = " → ".join(f"{v:g}" for v in _dedupe(seq))
            share = (r.get("auto_figures") or {}).get("auto_dense_exchange_share") or {}
            if share:  # what auto measured first: dense exchange / compute
                text += f" (measured dense exchange {share[min(share, key=int)]:.2f}x compute)"
            if text not in seqs:
                seqs.append(text)
    return "; ".join(seqs) if seqs else None


def _dedupe(seq: list[float]) -> list[float]:
    out: list[float] = []
    for v in seq:
        if not out or out[-1] != v:
            out.append(v)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """One line per workload x mode x link x method x P: the medians of its repeats (module docstring)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(bool(r.get(k)) if k == "quick" else r.get(k) for k in GROUP), []).append(r)
    lines = []
    for key, rs in groups.items():
        line = dict(zip(GROUP, key, strict=True))
        step, compute = median_of(rs, "step_s"), median_of(rs, "compute_s")
        wire, own = median_of(rs, "wire_bytes_per_step"), median_of(rs, "dpgs_bytes_per_step")
        net = [(r["wire_bytes_per_step"] - r["idle_wire_bytes_per_step"]) / r["dpgs_bytes_per_step"]
               for r in rs if isinstance(r.get("idle_wire_bytes_per_step"), (int, float))
               and r.get("wire_bytes_per_step") is not None and r.get("dpgs_bytes_per_step")]
        idle = median_of(rs, "idle_wire_bytes_per_step")
        test_row = _middle(rs, "test_auc")
        test = (test_row or {}).get("test") or {}
        line.update(
            repeats=len(rs), step_s=step, compute_s=compute,
            step_over_compute=step / compute if step and compute else None,
            wire_mb=wire / 1e6 if wire is not None else None,
            dpgs_mb=own / 1e6 if own is not None else None,
            wire_over_dpgs=wire / own if wire is not None and own else None,
            idle_kb=idle / 1e3 if idle is not None else None,
            net_over_dpgs=statistics.median(net) if net else None,
            dense_exchange_over_compute=median_of(rs, "dense_exchange_over_compute"),
            time_to_target_s=median_of(rs, "time_to_target_s"),
            reached=sum(r.get("time_to_target_s") is not None for r in rs),
            target=next((r.get("target_val_auc") for r in rs if r.get("target_val_auc") is not None), None),
            test_auc=test_row["test_auc"] if test_row else None,
            test_ci=(test.get("test_auc_ci_low"), test.get("test_auc_ci_high")),
            auto=auto_choice(rs) if line["method"] == "dpgs-auto" else None,
            compute_source=next((r.get("compute_source") for r in rs if r.get("compute_source")), None),
        )
        lines.append(line)
    for line in lines:  # s/step relative to the link's DDP rows
        same = {m["method"]: m for m in lines
                if (m["workload"], m["quick"], m["link"], m["workers"]) ==
                (line["workload"], line["quick"], line["link"], line["workers"])}
        for ref in ("ddp", "ddp-powersgd"):
            other = same.get(ref, {}).get("step_s")
            line[f"over_{ref}"] = line["step_s"] / other if line["step_s"] and other else None
    return sorted(lines, key=lambda m: (m["workload"], not m["quick"], _link_order(m["link"]), m["workers"],
                                        _method_index(m["method"])))


def _method_index(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


# ------------------------------------------------------------------ rendering
def _f(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _seconds(value: float | None, suffix: str = "") -> str:
    """Seconds: two decimals from 1 s up, three significant digits below (a features step is ~0.03 s)."""
    if value is None:
        return "–"
    return (f"{value:.2f}" if value >= 1 else f"{value:.3g}") + suffix


def _auc(line: dict) -> str:
    if line["test_auc"] is None:
        return "–"
    low, high = line["test_ci"]
    interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
    return f"{line['test_auc']:.3f}{interval}"


def _time_to(line: dict) -> str:
    if line["target"] is None:
        return "–"
    if line["time_to_target_s"] is None:
        return f"not reached (0/{line['repeats']})"
    shown = f"{line['time_to_target_s']:.0f}"
    return shown if line["reached"] == line["repeats"] else f"{shown} ({line['reached']}/{line['repeats']})"


HEADER = ("| link | method | runs | s/step | compute s | step / compute | / ddp | / ddp-powersgd "
          "| wire MB/step "
          "| dpgs MB/step | wire / dpgs | idle kB/step | (wire - idle) / dpgs | dense exchange / compute "
          "| time to target (s) | test AUC [95% CI] "
          "| auto chose |")


def render_table(lines: list[dict]) -> str:
    """The markdown table of ``lines`` (one workload and mode)."""
    out = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for m in lines:
        out.append("| " + " | ".join([
            m["link"], m["method"], str(m["repeats"]), _seconds(m["step_s"]),
            _seconds(m["compute_s"], "*" if m["compute_source"] else ""),
            "–" if m["compute_source"] else _f(m["step_over_compute"], 2, "x"),
            _f(m["over_ddp"], 2, "x"), _f(m["over_ddp-powersgd"], 2, "x"),
            _f(m["wire_mb"], 2), _f(m["dpgs_mb"], 2), _f(m["wire_over_dpgs"], 3), _f(m["idle_kb"], 1),
            _f(m["net_over_dpgs"], 3),
            _f(m["dense_exchange_over_compute"], 2), _time_to(m), _auc(m), m["auto"] or "",
        ]) + " |")
    return "\n".join(out)


def render(rows: list[dict], pngs: dict[tuple, str] | None = None) -> str:
    """The whole report: a section per workload and mode (quick / whole runs)."""
    lines = summarize(rows)
    sections = []
    for workload, quick in dict.fromkeys((m["workload"], m["quick"]) for m in lines):
        of = [m for m in lines if (m["workload"], m["quick"]) == (workload, quick)]
        sample = next(r for r in rows if r.get("workload") == workload and bool(r.get("quick")) == quick)
        title = f"## {workload}, {'--quick (step times and bytes only)' if quick else 'whole runs'}"
        facts = [f"P = {', '.join(str(p) for p in sorted({m['workers'] for m in of}))} workers",
                 f"{sample.get('bags_per_step')} bags a step"]
        if sample.get("tiles_per_bag"):
            facts.append(f"{sample['tiles_per_bag']} tiles a bag")
        shaped = sorted({r.get("shaped") for r in rows if r.get("workload") == workload and r.get("shaped")
                         and r.get("link") != "loopback"})
        if shaped:
            facts.append(f"shaped: {'; '.join(shaped)}")
        target = next((m["target"] for m in of if m["target"] is not None), None)
        if target is not None:
            facts.append(f"validation-AUC target {target:.4f}")
        loads = [v for r in rows if r.get("workload") == workload and bool(r.get("quick")) == quick
                 for v in (r.get("load1_before"), r.get("load1_after")) if isinstance(v, (int, float))]
        if loads:
            facts.append(f"1-min load average {min(loads):.2f}-{max(loads):.2f} around the rows")
        body = [title, "", "; ".join(facts) + ".", "", render_table(of)]
        for key, png in sorted((pngs or {}).items()):
            if key[:2] == (workload, quick):
                body += ["", f"![validation AUC against wall seconds, {key[2]}]({png})"]
        sections.append("\n".join(body))
    return "\n\n".join(sections) + "\n"


PREAMBLE = """# Bandwidth benchmark (issue 22): DPGS against DDP on shaped links

Written by `python benchmarks/bandwidth.py --report` from the rows files of `benchmarks/bandwidth.py`
(`benchmarks/bandwidth_report.py`; the columns are described in its docstring). Medians over the runs
(repeats) of a line. `–`: not measured (a `--quick` row measures step times and bytes only). DDP rows
have no compute time of their own (the backward overlaps the all-reduce): their `compute s` is the
median of the DPGS rows' on the same link (marked `*`; no step / compute for them). `wire MB/step`:
rx + tx of the worker hosts' interfaces during the steps (loopback: bytes sent on `lo`); a byte between
the head and a worker counts once, a byte between two workers (DDP's ring) twice. `dpgs MB/step`:
dpgs's `comm_bytes_per_step` (up + down payloads) of the same steps. `idle kB/step`: the wire bytes of
the lab's cluster with no job on it (Ray's heartbeats, resource reports, metrics; measured for 10-20 s before
a link's rows) per second, times the seconds of the same steps, per step (`–`: not measured: loopback,
or rows from before it was); `(wire - idle) / dpgs` is the median of the rows' ratios.
`dense exchange / compute`: `dpgs-dense`'s (step - compute) / compute on that link.

"""


# ------------------------------------------------------------------ curves
def plot_curves(rows: list[dict], out_dir: Path) -> dict[tuple, str]:
    """A PNG per workload x link (whole runs with histories): validation AUC against wall seconds, the
    first repeat of each method. Returns {(workload, quick, link): file name}."""
    with_history = [r for r in rows if not r.get("quick") and any(h.get("val_auc") is not None
                                                                   for h in r.get("history", []))]
    if not with_history:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = {}
    for workload, link in sorted({(r["workload"], r["link"]) for r in with_history},
                                 key=lambda k: (k[0], _link_order(k[1]))):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        of = [r for r in with_history if (r["workload"], r["link"]) == (workload, link)]
        for method in _order(sorted({r["method"] for r in of}), METHOD_ORDER):
            run = min((r for r in of if r["method"] == method), key=lambda r: r.get("repeat", 0))
            points = [(h["elapsed_seconds"], h["val_auc"]) for h in run["history"]
                      if h.get("val_auc") is not None and h.get("elapsed_seconds") is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=method)
        target = next((r.get("target_val_auc") for r in of if r.get("target_val_auc") is not None), None)
        if target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:.3f}")
        ax.set_xlabel("wall seconds (training + validation)")
        ax.set_ylabel("validation AUC")
        ax.set_title(f"{workload}, {link}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        name = f"bandwidth-{workload}-{link}.png"
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        made[(workload, False, link)] = name
    return made


def write_report(paths: list[Path], out: Path) -> str:
    rows = read_rows(paths)
    if not rows:
        raise ValueError(f"no rows in {', '.join(map(str, paths)) or 'any rows file'}")
    pngs = plot_curves(rows, out.parent)
    sources = ", ".join(f"`{_shown(p)}`" for p in paths)
    text = PREAMBLE + f"Rows: {sources}.\n\n" + render(rows, pngs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", type=Path,
                   help="rows JSON files (default: docs/benchmarks/bandwidth-*.json and ./bandwidth.json)")
    p.add_argument("--out", type=Path, default=DOCS / "bandwidth.md")
    args = p.parse_args(argv)
    paths = args.rows or default_sources()
    if not paths:
        p.error("no rows files found; run benchmarks/bandwidth.py first or name them")
    text = write_report(paths, args.out)
    print(text)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
