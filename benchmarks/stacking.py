"""Gradient stacking against the baselines a user would pick, side by side in one run (DPGS paper, Table 2).

    python benchmarks/stacking.py [--bags 400] [--epochs 8] [--batch-size 16] [--repeats 3] [--out FILE]

Rows: packed (one process), DDP with P=2 gloo processes (``benchmarks/ddp_baseline.py``: per-bag loop
with ``no_sync`` and one all-reduce per step, and one packed pass per rank), and DPGS with P=2 workers at
keep 100% (dense float32), 1% and 0.1% (``downlink=gradients``). Every row trains the same ABMIL on the
same bags with the same step composition and learning rate. Figures are medians over ``--repeats`` runs
of the mean training seconds per epoch (first epoch excluded), with the ratio to the DDP loop baseline;
for DPGS also the per-step phase table (ms, from the actors' own timers) and the non-compute time per step
(``step_overhead_seconds``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import ray
from _common import demo_manifest, emit, fmt, machine_line, markdown, run
from ddp_baseline import run_ddp

PHASES = [
    ("worker forward/backward (slowest worker)", "time_compute_seconds"),
    ("worker waiting for bag reads", "time_read_wait_seconds"),
    ("worker encode", "time_encode_seconds"),
    ("worker exchange (send up, wait for the update)", "time_exchange_seconds"),
    ("worker apply (decode + optimizer step / load weights)", "time_apply_seconds"),
    ("master waiting for the workers", "time_master_wait_seconds"),
    ("master decode + sum", "time_master_decode_seconds"),
    ("master optimizer step", "time_master_optimizer_seconds"),
    ("master encode + send down", "time_master_encode_seconds"),
    ("step (master, end to end)", "step_seconds"),
    ("non-compute time per step (step - slowest forward/backward)", "step_overhead_seconds"),
]


def dpgs_row(keep: float, batch_lr: str, downlink: str = "gradients") -> list[str]:
    compressed = keep < 1.0
    return ["train.mode=dpgs", "dpgs.workers=2", batch_lr, f"dpgs.compression.keep_ratio={keep}",
            f"dpgs.compression.value_dtype={'fp16' if compressed else 'fp32'}",
            "dpgs.compression.dense_min_numel=1024", f"dpgs.compression.downlink={downlink}",
            "dpgs.compression.warmup_epochs=0"]  # every epoch at the row's keep ratio


def steady(history: list[dict], key: str) -> float:
    rows = history[1:] if len(history) > 1 else history
    return sum(r[key] for r in rows) / len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    batch_lr = f"train.lr={args.lr}"
    common = [f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", "eval.sample_k=null",
              "train.lr_scaling=none"]  # every row steps at --lr
    dpgs_runs = [(f"DPGS P=2 keep {keep:.1%}", keep, "gradients") for keep in (1.0, 0.01, 0.001)]
    dpgs_runs.append(("DPGS P=2 keep 1.0%, downlink=delta", 0.01, "delta"))
    names = ["packed (1 process)", "DDP P=2, per-bag loop", "DDP P=2, packed per rank"]
    names += [n for n, *_ in dpgs_runs]
    epoch_s: dict[str, list[float]] = {n: [] for n in names}
    test_auc: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, dict[str, list[float]]] = {n: {k: [] for _, k in PHASES} for n, *_ in dpgs_runs}
    kib: dict[str, list[float]] = {n: [] for n, *_ in dpgs_runs}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest = demo_manifest(work, args.bags)
        data = [f"data.manifest={manifest}", f"data.features_dir={manifest.parent / 'features'}"]
        for repeat in range(args.repeats):
            r = run(manifest, work, f"packed-{repeat}", *common, "train.mode=packed", batch_lr)
            epoch_s[names[0]].append(r["train_s"])
            test_auc[names[0]].append(r["test"].get("test_auc", float("nan")))
            for name, style in ((names[1], "loop"), (names[2], "packed")):
                d = run_ddp([*data, *common, batch_lr], workers=2, style=style)
                epoch_s[name].append(steady(d["history"], "train_seconds"))
                test_auc[name].append(d["test"].get("test_auc", float("nan")))
            for name, keep, downlink in dpgs_runs:
                r = run(manifest, work, f"{name}-{repeat}", *common, *dpgs_row(keep, batch_lr, downlink))
                epoch_s[name].append(r["train_s"])
                test_auc[name].append(r["test"].get("test_auc", float("nan")))
                for _, key in PHASES:
                    phases[name][key].append(r["mean"](key))
                kib[name].append(r["mean"]("comm_bytes_per_step") / 1024)
    if ray.is_initialized():
        ray.shutdown()
    med = {n: statistics.median(v) for n, v in epoch_s.items()}
    ddp = med[names[1]]
    rows = [[n, fmt(med[n]), fmt(med[n] / ddp, ".2f") + "x", fmt(med[n] / med[names[2]], ".2f") + "x",
             fmt(statistics.median(test_auc[n])), fmt(statistics.median(kib[n]), ".1f") if n in kib else "-"]
            for n in names]
    table = markdown(["run", "train s/epoch (median)", "vs DDP loop", "vs DDP packed", "test AUC",
                      "KiB per step (up+down)"], rows)
    phase_rows = [[label] + [fmt(1e3 * statistics.median(phases[n][key]), ".2f") for n, *_ in dpgs_runs]
                  for label, key in PHASES]
    header = ["phase (ms per step, median of run means)"] + [n for n, *_ in dpgs_runs]
    phase_table = markdown(header, phase_rows)
    emit(
        f"Demo bags: {args.bags}, ABMIL, {args.epochs} epochs, B={args.batch_size}, lr {args.lr}, "
        f"{args.repeats} repeats (medians; first epoch of each run excluded). {machine_line()}."
        f"\n\n{table}\n\n"
        f"Where a DPGS step goes:\n\n{phase_table}",
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
