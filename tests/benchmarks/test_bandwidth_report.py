"""The bandwidth benchmark's arithmetic on rows (benchmarks/bandwidth.py, bandwidth_report.py): time to
target, the derived fields, targets, merging rows, and the report's table. No lab, no root, no training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth import derive, merge, targets_of, time_to  # noqa: E402
from bandwidth_report import read_rows, render, render_table, summarize, write_report  # noqa: E402


def history(*points: tuple[float, float | None]) -> list[dict]:
    return [{"epoch": i + 1, "elapsed_seconds": t, "val_auc": auc} for i, (t, auc) in enumerate(points)]


def row(method: str, link: str = "100mbit", quick: bool = False, repeat: int = 0, **kw) -> dict:
    base = {"workload": "tiles-resnet18", "link": link, "method": method, "workers": 2, "repeat": repeat,
            "quick": quick, "step_s": 1.0, "compute_s": None if method.startswith("ddp") else 0.8,
            "wire_bytes_per_step": 2e6, "dpgs_bytes_per_step": None if method.startswith("ddp") else 1.9e6,
            "bags_per_step": 2, "tiles_per_bag": 16, "history": [], "test": {}}
    return base | kw


def test_time_to_is_the_first_epoch_at_or_above_the_target():
    r = {"history": history((10.0, 0.80), (20.0, None), (30.0, 0.93), (40.0, 0.97))}
    assert time_to(r, 0.93) == 30.0
    assert time_to(r, 0.90) == 30.0
    assert time_to(r, 0.97) == 40.0
    assert time_to(r, 0.98) is None
    assert time_to({"history": []}, 0.5) is None


def test_time_to_leaves_out_the_benchmarks_own_pauses_before_the_target():
    r = {"history": [{"val_auc": 0.9, "elapsed_seconds": 10.0, "benchmark_pause_s": 0.45},
                     {"val_auc": 0.95, "elapsed_seconds": 20.0, "benchmark_pause_s": 0.6}]}
    assert time_to(r, 0.93) == pytest.approx(19.4)


def test_targets_come_from_the_loopback_dense_run_unless_fixed():
    rows = [row("dpgs-dense", "loopback", history=history((1, 0.90), (2, 0.96), (3, 0.95))),
            row("dpgs-dense", "100mbit", history=history((1, 0.99))),
            row("dpgs-dense", "loopback", quick=True, workload="features-abmil", history=history((1, 0.9)))]
    assert targets_of(rows, None) == {"tiles-resnet18": 0.95}
    assert targets_of(rows, 0.9) == {"tiles-resnet18": 0.9}  # quick rows set no target


def test_derive_fills_ddp_compute_exchange_share_and_time_to_target():
    rows = [row("dpgs-dense", step_s=1.5, compute_s=1.0, history=history((5, 0.9), (9, 0.96)),
                test={"test_auc": 0.97}),
            row("dpgs-keep1", step_s=1.1, compute_s=1.2, history=history((4, 0.96)), test={"test_auc": 0.95}),
            row("dpgs-auto", step_s=1.1, compute_s=1.4, history=history((4, 0.5))),
            row("ddp", step_s=2.0, history=history((6, 0.95))),
            row("ddp", link="1gbit", step_s=0.9, history=history((6, 0.95)))]
    out = derive(rows, {"tiles-resnet18": 0.95})
    dense, keep1, auto, ddp, ddp_fast = out
    assert ddp["compute_s"] == 1.2  # median of the link's DPGS compute (1.0, 1.2, 1.4)
    assert ddp_fast["compute_s"] is None  # no DPGS row on that link
    assert dense["dense_exchange_over_compute"] == pytest.approx(0.5)
    assert ddp["dense_exchange_over_compute"] == pytest.approx(0.5)  # a property of the link
    assert ddp_fast.get("dense_exchange_over_compute") is None
    assert (dense["time_to_target_s"], keep1["time_to_target_s"], auto["time_to_target_s"]) == (9, 4, None)
    assert ddp["time_to_target_s"] == 6
    assert (dense["test_auc"], keep1["test_auc"]) == (0.97, 0.95)
    assert dense["best_val_auc"] == 0.96


def test_derive_leaves_quick_rows_without_accuracy_fields():
    rows = derive([row("dpgs-keep1", quick=True, history=history((3, 0.99)), test={"test_auc": 1.0})],
                  {"tiles-resnet18": 0.9})
    assert rows[0]["time_to_target_s"] is None and rows[0]["test_auc"] is None
    assert rows[0]["target_val_auc"] is None


def test_merge_replaces_only_the_same_row():
    rows = [row("ddp"), row("ddp", repeat=1), row("dpgs-dense")]
    new = row("ddp", step_s=3.0)
    merged = merge(rows, new)
    assert len(merged) == 3
    assert [r["step_s"] for r in merged if r["method"] == "ddp" and r["repeat"] == 0] == [3.0]
    assert len(merge(rows, row("ddp", link="1gbit"))) == 4


def quick_rows() -> list[dict]:
    return [
        row("ddp", quick=True, step_s=10.0, wire_bytes_per_step=94e6),
        row("ddp-powersgd", quick=True, step_s=8.0, wire_bytes_per_step=2e6),
        row("dpgs-dense", quick=True, step_s=12.0, compute_s=8.0, wire_bytes_per_step=96e6,
            dpgs_bytes_per_step=93e6),
        row("dpgs-keep1", quick=True, step_s=8.4, compute_s=8.0, wire_bytes_per_step=1.1e6,
            dpgs_bytes_per_step=1.0e6, idle_wire_bytes_per_step=0.1e6),
        row("dpgs-keep1", quick=True, repeat=1, step_s=9.0, compute_s=8.2, wire_bytes_per_step=1.2e6,
            dpgs_bytes_per_step=1.0e6, idle_wire_bytes_per_step=0.15e6),
        row("dpgs-keep1", quick=True, repeat=2, step_s=8.8, compute_s=7.9, wire_bytes_per_step=1.0e6,
            dpgs_bytes_per_step=1.0e6),
        row("dpgs-auto", quick=True, step_s=8.5, compute_s=8.0, auto_keep_ratio=[1.0, 0.01, 0.01],
            auto_figures={"auto_dense_exchange_share": {"2": 0.5, "1": 0.04}}),
    ]


def test_summary_takes_medians_and_ratios():
    lines = {m["method"]: m for m in summarize(derive(quick_rows(), {}))}
    keep1 = lines["dpgs-keep1"]
    assert keep1["repeats"] == 3
    assert keep1["step_s"] == 8.8 and keep1["compute_s"] == 8.0
    assert keep1["step_over_compute"] == pytest.approx(1.1)
    assert keep1["over_ddp"] == pytest.approx(0.88)
    assert keep1["over_ddp-powersgd"] == pytest.approx(1.1)
    assert keep1["wire_mb"] == pytest.approx(1.1) and keep1["wire_over_dpgs"] == pytest.approx(1.1)
    # idle traffic: measured on two of the three repeats; (wire - idle) / dpgs: 1.0 and 1.05
    assert keep1["idle_kb"] == pytest.approx(125.0) and keep1["net_over_dpgs"] == pytest.approx(1.025)
    assert lines["dpgs-dense"]["idle_kb"] is None and lines["dpgs-dense"]["net_over_dpgs"] is None
    assert lines["dpgs-dense"]["dense_exchange_over_compute"] == pytest.approx(0.5)
    assert lines["ddp"]["compute_s"] == 8.0  # the DPGS rows' median compute
    assert lines["dpgs-auto"]["auto"] == "1 → 0.01 (measured dense exchange 0.04x compute)"
    assert [m["method"] for m in summarize(quick_rows())] == [
        "ddp", "ddp-powersgd", "dpgs-dense", "dpgs-keep1", "dpgs-auto"]


def test_table_renders_the_measured_figures_and_dashes():
    text = render_table(summarize(derive(quick_rows(), {})))
    lines = text.splitlines()
    assert len(lines) == 2 + 5
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    keep1 = next(line for line in lines if "| dpgs-keep1 |" in line)
    cells = [c.strip() for c in keep1.strip("|").split("|")]
    assert cells[:8] == ["100mbit", "dpgs-keep1", "3", "8.80", "8.00", "1.10x", "0.88x", "1.10x"]
    assert cells[8:13] == ["1.10", "1.00", "1.100", "125.0", "1.025"]
    assert cells[14:16] == ["–", "–"]  # quick: no time to target, no test AUC
    dense_line = next(line for line in lines if "| dpgs-dense |" in line)
    dense = [c.strip() for c in dense_line.strip("|").split("|")]
    assert dense[11:13] == ["–", "–"]  # no idle traffic measured
    ddp = [c.strip() for c in next(line for line in lines if "| ddp |" in line).strip("|").split("|")]
    assert ddp[9] == "–" and ddp[10] == "–"  # DDP has no dpgs count
    assert ddp[4:6] == ["8.00*", "–"]  # the DPGS rows' compute, marked; no ratio of its own
    assert "1 → 0.01" in next(line for line in lines if "dpgs-auto" in line)
    small = render_table(summarize(derive([row("dpgs-keep1", step_s=0.034, compute_s=0.025)], {})))
    assert "| 0.034 | 0.025 | 1.36x |" in small  # seconds below 1: three significant digits


def test_report_of_whole_runs_shows_time_to_target_auc_and_curves(tmp_path):
    rows = [row("dpgs-dense", "loopback", step_s=1.0, compute_s=0.9, history=history((5, 0.90), (9, 0.97)),
                test={"test_auc": 0.96, "test_auc_ci_low": 0.91, "test_auc_ci_high": 0.99}),
            row("ddp", "loopback", step_s=1.2, history=history((7, 0.92), (14, 0.95)),
                test={"test_auc": 0.95, "test_auc_ci_low": 0.9, "test_auc_ci_high": 0.98})]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(derive(rows, targets_of(rows, None))))
    changed = dict(rows[1], step_s=1.5)
    second.write_text(json.dumps(derive([rows[0], changed], targets_of(rows, None))))
    assert {r["method"]: r["step_s"] for r in read_rows([first, second])}["ddp"] == 1.5  # later file wins
    out = tmp_path / "docs" / "bandwidth.md"
    text = write_report([first], out)
    assert out.read_text() == text
    assert "validation-AUC target 0.9600" in text
    dense = next(line for line in text.splitlines() if "| dpgs-dense |" in line)
    assert "| 9 |" in dense and "0.960 [0.910, 0.990]" in dense
    assert "not reached (0/1)" in next(line for line in text.splitlines() if "| ddp |" in line)
    png = tmp_path / "docs" / "bandwidth-tiles-resnet18-loopback.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert "(bandwidth-tiles-resnet18-loopback.png)" in text
    assert "--quick" not in render(rows).splitlines()[0]
