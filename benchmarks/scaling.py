"""How DPGS and DDP scale past one machine, predicted from measured inputs (docs/scaling.md).

    python benchmarks/scaling.py                      # predict from docs/benchmarks/scaling-inputs.json
    python benchmarks/scaling.py --measure [--quick]  # measure the inputs on this machine first
    python benchmarks/scaling.py --loopback [--quick] # check the exchange terms with real processes
    python benchmarks/scaling.py --train-check        # check whole steps of real `dpgs train` runs
    python benchmarks/scaling.py --lab bandwidth.json --lab-workers 2   # predicted vs measured lab rows

Prediction: s/step for P = 1..64 workers, B bags per step (``--batch``), at 100 Mbps and 1 Gbps (the
lab's rates: 1 ms one-way latency, tc-counted frames) and 10/25/100 Gbps (50 us), for dense DPGS,
DPGS keep 1 % and 0.1 % (relayed downlink, dpgs's default; the weight-delta downlink; a merged
downlink dpgs does not have), DDP and DDP + PowerSGD rank 4. Printed as markdown tables (s/step, where
the master's link saturates, what to pick) and drawn as a PNG. ``--loopback`` runs P + 1 processes
exchanging the real message sizes over dpgs's own ``GlooChannel`` on 127.0.0.1 in private network
namespaces (``scaling_netns``: unshaped, and tc tbf at 100 Mbit/s and 1 Gbit/s) and compares the
measured exchange with the model's. ``--train-check`` runs ``dpgs train`` (ABMIL head, P = 2 and 3) in
such namespaces and compares its step times with the model's. Measured inputs and checks are JSON
files, so a quiet machine can regenerate everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from scaling_model import (
    GOODPUT_ETHERNET,
    GOODPUT_TC,
    Compressed,
    Link,
    PowerSgd,
    Scenario,
    Workload,
    exchange_limit_workers,
    fastest_workers,
    predict,
)

ROOT = Path(__file__).resolve().parent.parent
INPUTS = ROOT / "docs" / "benchmarks" / "scaling-inputs.json"
LOOPBACK = ROOT / "docs" / "benchmarks" / "scaling-loopback.json"
TRAIN_CHECK = ROOT / "docs" / "benchmarks" / "scaling-train-check.json"
LAB_LATENCY_S = 1e-3  # the lab's tc delay per link (issue 22)
DATACENTRE_LATENCY_S = 50e-6  # an assumption (one switch, kernel TCP); the terms it enters are tiny
LINKS = [
    Link("100 Mbps", 100e6, LAB_LATENCY_S, GOODPUT_TC),
    Link("1 Gbps", 1e9, LAB_LATENCY_S, GOODPUT_TC),
    Link("10 Gbps", 10e9, DATACENTRE_LATENCY_S, GOODPUT_ETHERNET),
    Link("25 Gbps", 25e9, DATACENTRE_LATENCY_S, GOODPUT_ETHERNET),
    Link("100 Gbps", 100e9, DATACENTRE_LATENCY_S, GOODPUT_ETHERNET),
]
METHODS = ["dpgs-dense", "dpgs-keep0.01", "dpgs-keep0.001", "dpgs-keep0.01-delta", "dpgs-keep0.01-merged",
           "ddp", "ddp-powersgd"]
TABLE_WORKERS = [2, 3, 4, 8, 16, 32, 64]
ALL_WORKERS = list(range(1, 65))
PLOT_WORKERS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
LABELS = {"dpgs-dense": "DPGS dense", "dpgs-keep0.01": "DPGS keep 1 %", "dpgs-keep0.001": "DPGS keep 0.1 %",
          "dpgs-keep0.01-delta": "DPGS keep 1 %, delta downlink",
          "dpgs-keep0.01-merged": "DPGS keep 1 %, merged downlink (not in dpgs)", "ddp": "DDP",
          "ddp-powersgd": "DDP + PowerSGD r4"}
# What a user can pick today, in order of preference when their predicted times are within 5 %:
# exact methods first (dense DPGS and DDP give the full-batch gradient; keep 1 % learns less per step in
# short runs, issue 22 point 3).
PICKABLE = ["dpgs-dense", "ddp", "dpgs-keep0.01", "ddp-powersgd"]
PICK_TOLERANCE = 0.05


def workload_from(data: dict) -> Workload:
    """A :class:`Workload` from one entry of the inputs JSON (``scaling_measure.measure_workload``)."""
    try:
        c, d, ps = data["compute"], data["dense"], data["powersgd"]
        compressed = {
            float(v["keep"]): Compressed(**{k: float(v[k]) for k in Compressed.__dataclass_fields__})
            for v in data["compressed"].values()
        }
        return Workload(
            name=data["name"], numel=int(d["numel"]), buffer_numel=int(d["buffer_numel"]),
            bag_forward_s=c["bag_forward_s"], bag_backward_s=c["bag_backward_s"], pass_s=c["pass_s"],
            optimizer_s=d["optimizer_s"], dense_add_s=d["dense_add_s"], dense_pack_s=d["dense_pack_s"],
            dense_load_s=d["dense_load_s"], compressed=compressed,
            powersgd=PowerSgd(int(ps["rank"]), ps["p_bytes"], ps["q_bytes"], ps["uncompressed_bytes"],
                              ps["compress_s"]),
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"inputs: workload {data.get('name', '?')}: missing or bad field {err}") from None


def with_bag_seconds(w: Workload, seconds: float) -> Workload:
    """A what-if copy of ``w`` (named so) with one bag's forward + backward set to ``seconds`` (split as
    measured, no pass cost), for compute measured elsewhere; every other input stays as measured."""
    share = w.bag_forward_s / w.bag_s
    return dataclasses.replace(w, name=f"{w.name}, what-if {seconds:g} s/bag", bag_forward_s=seconds * share,
                               bag_backward_s=seconds * (1 - share), pass_s=0.0)


def parse_overrides(items: list[str], workloads: list[Workload]) -> dict[str, float]:
    """``NAME=SECONDS`` pairs of ``--bag-seconds``, checked against the measured workloads."""
    out = {}
    names = {w.name for w in workloads}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise SystemExit(f"--bag-seconds {item}: expected NAME=SECONDS with NAME one of "
                             f"{', '.join(sorted(names))}")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"--bag-seconds {item}: {value!r} is not a number of seconds") from None
        if not out[name] > 0:
            raise SystemExit(f"--bag-seconds {item}: seconds must be positive")
    return out


def load_inputs(path: Path) -> tuple[dict, list[Workload]]:
    if not path.is_file():
        raise SystemExit(f"{path}: no measured inputs; run with --measure first")
    try:
        raw = json.loads(path.read_text())
        workloads = [workload_from(w) for w in raw["workloads"].values()]
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise SystemExit(f"{path}: {err}") from None
    return raw, workloads


def fmt_s(seconds: float) -> str:
    if seconds >= 100:
        return f"{seconds:.0f}"
    if seconds >= 10:
        return f"{seconds:.1f}"
    if seconds >= 0.1:
        return f"{seconds:.2f}"
    return f"{seconds:.3f}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def inputs_table(raw: dict, workloads: list[Workload]) -> str:
    rows = []
    for w in workloads:
        c1 = w.compressed.get(0.01)
        c01 = w.compressed.get(0.001)
        load = raw["workloads"][w.name]["compute"]["passes"][0]["forward"]
        rows.append([
            w.name, f"{w.numel:,}", fmt_bytes(w.dense_bytes),
            fmt_s(w.bag_s) + " s",
            f"{min(s['load1'] for s in load):.1f}-{max(s['load1'] for s in load):.1f}",
            f"{w.optimizer_s * 1e3:.1f} ms", f"{w.dense_add_s * 1e3:.2f} ms",
            fmt_bytes(c1.payload_bytes) if c1 else "-", fmt_bytes(c01.payload_bytes) if c01 else "-",
            f"{c1.encode_s * 1e3:.1f} / {c1.decode_add_s * 1e3:.1f} ms" if c1 else "-",
            f"{c1.union_exponent:.2f}" if c1 else "-",
            fmt_bytes(w.powersgd.p_bytes + w.powersgd.q_bytes + w.powersgd.uncompressed_bytes)
            if w.powersgd else "-",
        ])
    return markdown(["workload", "parameters", "dense gradient", "fwd+bwd per bag", "load1 while timed",
                     "Adam step", "dense add", "payload keep 1 %", "payload keep 0.1 %",
                     "encode / decode+add (1 %)", "union exponent (1 %)", "PowerSGD r4 bytes"], rows)


def step_table(w: Workload, batch: int, methods: list[str]) -> str:
    rows = []
    for link in LINKS:
        comp = predict(w, "dpgs-dense", Scenario(1, batch, link)).compute
        rows.append([link.name, "compute only"] + [
            fmt_s(predict(w, "dpgs-dense", Scenario(p, batch, link)).compute) for p in TABLE_WORKERS])
        del comp
        for m in methods:
            rows.append(["", LABELS[m]] + [fmt_s(predict(w, m, Scenario(p, batch, link)).total)
                                            for p in TABLE_WORKERS])
    return markdown(["link", "method"] + [f"P={p}" for p in TABLE_WORKERS], rows)


SUMMARY_METHODS = ["dpgs-dense", "dpgs-keep0.01", "ddp"]


def summary_table(workloads: list[Workload], batch: int) -> str:
    """One row per workload and link: s/step of dense DPGS / DPGS keep 1 % / DDP for each P."""
    rows = []
    for w in workloads:
        for link in LINKS:
            rows.append([w.name, link.name] + [
                " / ".join(fmt_s(predict(w, m, Scenario(p, batch, link)).total) for m in SUMMARY_METHODS)
                for p in TABLE_WORKERS])
    return markdown(["workload", "link"] + [f"P={p}" for p in TABLE_WORKERS], rows)


def saturation_table(workloads: list[Workload], batch: int, methods: list[str]) -> str:
    rows = []
    for w in workloads:
        for link in LINKS:
            s = Scenario(1, batch, link)
            cells = []
            for m in methods:
                net = exchange_limit_workers(w, m, s, ALL_WORKERS, part="comm")
                limit = exchange_limit_workers(w, m, s, ALL_WORKERS)
                best = fastest_workers(w, m, s, ALL_WORKERS)
                t = predict(w, m, Scenario(best, batch, link)).total
                dash = lambda p: "-" if p is None else str(p)  # noqa: E731
                cells.append(f"{dash(net)} / {dash(limit)} / {best} ({fmt_s(t)} s)")
            rows.append([w.name, link.name] + cells)
    return markdown(["workload", "link"] + [LABELS[m] for m in methods], rows)


def pick(w: Workload, p: int, batch: int, link: Link) -> str:
    """The method to use at P workers: the fastest predicted among :data:`PICKABLE`, preferring the
    earlier ones within :data:`PICK_TOLERANCE`."""
    times = {m: predict(w, m, Scenario(p, batch, link)).total for m in PICKABLE}
    best = min(times.values())
    return next(m for m in PICKABLE if times[m] <= best * (1 + PICK_TOLERANCE))


def pick_table(workloads: list[Workload], batch: int) -> str:
    rows = []
    for w in workloads:
        for link in LINKS:
            cells = []
            for p in TABLE_WORKERS:
                m = pick(w, p, batch, link)
                cells.append(LABELS[m].removeprefix("DPGS ").replace("keep ", "") if m != "dpgs-dense"
                             else "dense")
            rows.append([w.name, link.name] + cells)
    return markdown(["workload", "link"] + [f"P={p}" for p in TABLE_WORKERS], rows)


def plot(workloads: list[Workload], batch: int, methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = 3.2 * len(workloads) + 0.8
    fig, axes = plt.subplots(len(workloads), len(LINKS), figsize=(3.6 * len(LINKS), height), squeeze=False)
    ps = PLOT_WORKERS
    for row, w in zip(axes, workloads, strict=True):
        for ax, link in zip(row, LINKS, strict=True):
            comp = [predict(w, "dpgs-dense", Scenario(p, batch, link)).compute for p in ps]
            ax.plot(ps, comp, color="0.5", ls=":", lw=2, label="compute only")
            for m in methods:
                ax.plot(ps, [predict(w, m, Scenario(p, batch, link)).total for p in ps], marker=".",
                        label=LABELS[m], ls="--" if m.endswith("merged") or m.endswith("delta") else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{w.name}\n{link.name}", fontsize=8)
            ax.set_xlabel("workers P", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
        row[0].set_ylabel(f"predicted s/step (B={batch})", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / height, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(raw: dict, measured: list[Workload], whatifs: list[Workload], batch: int,
           methods: list[str]) -> str:
    workloads = measured + whatifs
    parts = ["# Scaling model: every predicted figure (`benchmarks/scaling.py`, the maths in "
             "[../scaling.md](../scaling.md))", "",
             f"Inputs measured {raw['measured_at']} on {raw['machine']}"
             f"{' (--quick)' if raw.get('quick') else ''}.", "", inputs_table(raw, measured), ""]
    if whatifs:
        parts += ["**What-if rows are not measurements:** their forward + backward per bag is set by "
                  "--bag-seconds; every other input is as measured.", ""]
    for w in workloads:
        parts += [f"### {w.name}: predicted s/step, B = {batch} bags per step", "",
                  step_table(w, batch, methods), ""]
    parts += [f"### Summary: predicted s/step of DPGS dense / DPGS keep 1 % / DDP (B = {batch})", "",
              summary_table(workloads, batch), ""]
    parts += [f"### Where the master's link saturates (B = {batch})", "",
              "Each cell: smallest P whose network time (the master's link for DPGS, the workers' for DDP) "
              "exceeds 10 % of compute / smallest P whose whole exchange (network, codec, sums, optimizer) "
              "does / P with the smallest s/step (that s/step); '-': none within P <= 64.", "",
              saturation_table(workloads, batch, methods), "",
              f"### What to pick (B = {batch})", "", pick_table(workloads, batch)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=Path, default=INPUTS, help="measured inputs JSON")
    ap.add_argument("--measure", action="store_true", help="measure the inputs into --inputs first")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, workers and steps")
    ap.add_argument("--tiles-per-bag", type=int, default=32)
    ap.add_argument("--tile-px", type=int, default=224)
    ap.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    ap.add_argument("--batch", type=int, default=64, help="bags per optimizer step")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--bag-seconds", nargs="*", default=[], metavar="NAME=SECONDS",
                    help="what-if: a workload's forward + backward per bag (e.g. measured on a GPU)")
    ap.add_argument("--out", type=Path, help="write the markdown report here too")
    ap.add_argument("--plot", type=Path, help="PNG of predicted s/step against P")
    ap.add_argument("--loopback", action="store_true", help="check the exchange terms with real processes")
    ap.add_argument("--loopback-out", type=Path, default=LOOPBACK)
    ap.add_argument("--train-check", action="store_true", help="check whole steps of dpgs train runs")
    ap.add_argument("--train-check-out", type=Path, default=TRAIN_CHECK)
    ap.add_argument("--lab", type=Path, help="bandwidth benchmark rows (JSON list) to compare with")
    ap.add_argument("--lab-workers", type=int, default=2, help="P of lab rows without a 'workers' field")
    ap.add_argument("--lab-batch", type=int, default=16, help="bags per step of lab rows without one")
    ap.add_argument("--lab-latency-ms", type=float, default=LAB_LATENCY_S * 1e3, help="one-way, per link")
    ap.add_argument("--lab-master-unshaped", action="store_true", help="only the workers' links are shaped")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if args.measure:
        from scaling_measure import measure_all

        raw = measure_all(args.quick, args.tiles_per_bag, args.tile_px, args.threads,
                          lambda line: print(line, flush=True))
        args.inputs.parent.mkdir(parents=True, exist_ok=True)
        args.inputs.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"wrote {args.inputs}")
    raw, workloads = load_inputs(args.inputs)
    overrides = parse_overrides(args.bag_seconds, workloads)
    whatifs = [with_bag_seconds(w, overrides[w.name]) for w in workloads if w.name in overrides]
    for w in workloads:
        for m in methods:
            predict(w, m, Scenario(2, args.batch, LINKS[0]))  # unknown methods fail before any output
    text = report(raw, workloads, whatifs, args.batch, methods)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.plot:
        plot(workloads + whatifs, args.batch, methods, args.plot)
        print(f"wrote {args.plot}")
    if args.loopback:
        from scaling_loopback import run_checks

        checks = run_checks(workloads, args.quick, lambda line: print(line, flush=True))
        args.loopback_out.parent.mkdir(parents=True, exist_ok=True)
        args.loopback_out.write_text(json.dumps(checks, indent=1) + "\n")
        print(f"wrote {args.loopback_out}")
    if args.train_check:
        from scaling_train import run_checks as train_checks

        latency = (json.loads(args.loopback_out.read_text())["latency_s"] if args.loopback_out.is_file()
                   else LAB_LATENCY_S)
        checks = train_checks(workloads, latency, args.quick, lambda line: print(line, flush=True))
        args.train_check_out.parent.mkdir(parents=True, exist_ok=True)
        args.train_check_out.write_text(json.dumps(checks, indent=1) + "\n")
        print(f"wrote {args.train_check_out}")
    if args.lab:
        from scaling_lab import compare_lab

        print(compare_lab(args.lab, workloads, args.lab_workers, args.lab_batch, args.lab_latency_ms / 1e3,
                          not args.lab_master_unshaped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
