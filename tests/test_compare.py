"""dpgs compare on synthetic experiments logged with the tracking contract (docs/architecture.md)."""

import csv
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dpgs.cli import main
from dpgs.tracking import RunTracker

CLASSIC = {"train.mode": "classic", "model.name": "abmil", "train.batch_size": 16, "steps_per_epoch": 100}
DPGS = {
    "train.mode": "dpgs",
    "model.name": "abmil",
    "train.batch_size": 16,
    "dpgs.workers": 2,
    "dpgs.compression.keep_ratio": 0.01,
    "steps_per_epoch": 4,
}
PACKED = CLASSIC | {"train.mode": "packed", "steps_per_epoch": 7}


def log_run(uri, name, params, curve, extra=None, final=None, parent=None, tags=None, experiment="exp"):
    """One run: per-epoch `val_auc`, `val_loss` and `elapsed_seconds` (10 s per epoch) plus `extra`."""
    run = RunTracker.start(
        uri, experiment, name, {"dpgs.mode": params["train.mode"], **(tags or {})}, parent=parent
    )
    run.log_params(params)
    for epoch, auc in enumerate(curve, start=1):
        per_epoch = {k: v[epoch - 1] for k, v in (extra or {}).items()}
        run.log_metrics(
            {"val_auc": auc, "val_loss": 1.0 - auc, "elapsed_seconds": 10.0 * epoch, **per_epoch}, step=epoch
        )
    run.log_metrics(final or {})
    run.end()
    return run


def populate(uri, artifacts=None):
    """classic, two DPGS runs and a 2-fold parent in experiment 'exp' (artifacts under ``artifacts``)."""
    if artifacts is not None:
        MlflowClient(uri).create_experiment("exp", artifact_location=Path(artifacts).as_uri())
    log_run(uri, "classic", CLASSIC, [0.6, 0.9, 0.8], final={"test_auc": 0.85, "test_acc": 0.8})
    # DPGS without `optimizer_steps`: bytes per step uses the steps_per_epoch param (4)
    log_run(
        uri,
        "dpgs",
        DPGS,
        [0.7, 0.95, 0.97],
        {
            "comm_bytes_up": [3000.0, 3000.0, 3000.0],
            "comm_bytes_down": [1000.0, 1000.0, 1000.0],
            "comm_dense_bytes": [400000.0, 400000.0, 400000.0],
            "compression_ratio": [100.0] * 3,
        },
    )
    # DPGS with per-epoch optimizer step counts (a resumed, shorter epoch 2)
    log_run(
        uri,
        "dpgs-steps",
        DPGS,
        [0.5, 0.6],
        {"comm_bytes_up": [800.0, 400.0], "comm_bytes_down": [400.0, 200.0], "optimizer_steps": [4.0, 2.0]},
    )
    parent = RunTracker.start(uri, "exp", "cv", {"dpgs.mode": "packed", "dpgs.kfold_parent": "true"})
    parent.log_params(PACKED)
    log_run(uri, "fold_0", PACKED, [0.8, 0.9], final={"test_auc": 0.9}, parent=parent)
    log_run(uri, "fold_1", PACKED, [0.7, 0.6], final={"test_auc": 0.7}, parent=parent)
    parent.log_metrics({"cv_mean_test_auc": 0.8})
    parent.end()


@pytest.fixture(scope="module")
def template_db(tmp_path_factory):
    """The populated store, built once (creating an MLflow SQLite schema takes seconds)."""
    root = tmp_path_factory.mktemp("store")
    path = root / "template.db"
    populate(f"sqlite:///{path}", artifacts=root / "artifacts")
    return path


@pytest.fixture
def uri(template_db, tmp_path):
    """A private copy of the populated store for each test (comparisons add runs to it)."""
    shutil.copyfile(template_db, tmp_path / "m.db")
    return f"sqlite:///{tmp_path / 'm.db'}"


def read_rows(out):
    return {r["run"]: r for r in csv.DictReader((out / "comparison.csv").open())}


def test_table_values_files_and_artifacts(uri, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert (
        main(["compare", "--experiment", "exp", "--tracking-uri", uri, "--target", "0.9", "--out", str(out)])
        == 0
    )
    rows = read_rows(out)
    assert set(rows) == {"classic", "dpgs", "dpgs-steps", "cv"}  # fold runs are summarised in their parent

    classic = rows["classic"]
    assert (classic["mode"], classic["model"], classic["B"], classic["workers"], classic["keep"]) == (
        "classic",
        "abmil",
        "1",
        "-",
        "-",
    )
    assert float(classic["best"]) == 0.9 and float(classic["epoch_at_best"]) == 2
    assert float(classic["time_to_best_s"]) == 20.0 and float(classic["time_to_target_s"]) == 20.0
    assert (
        classic["folds"] == "-"
        and classic["reached"] == "1/1"
        and classic["bytes_per_step"] == ""
        and classic["compression_ratio"] == ""
    )
    assert float(classic["test_auc"]) == 0.85 and float(classic["test_acc"]) == 0.8

    dpgs = rows["dpgs"]
    assert (dpgs["B"], dpgs["workers"], dpgs["keep"]) == ("16", "2", "0.01")
    assert (
        float(dpgs["best"]) == 0.97
        and float(dpgs["epoch_at_best"]) == 3
        and float(dpgs["time_to_best_s"]) == 30
    )
    assert float(dpgs["time_to_target_s"]) == 20.0
    assert float(dpgs["bytes_per_step"]) == pytest.approx(3 * 4000.0 / (3 * 4))  # (up + down) / steps
    assert float(dpgs["compression_ratio"]) == pytest.approx(1.2e6 / 12000.0)  # dense / sent over the run

    steps = rows["dpgs-steps"]
    assert float(steps["bytes_per_step"]) == pytest.approx((1200.0 + 600.0) / (4 + 2))
    assert steps["compression_ratio"] == ""  # neither dense bytes nor a ratio were logged
    assert steps["reached"] == "0/1" and steps["time_to_target_s"] == ""

    cv = rows["cv"]
    assert cv["folds"] == "2" and cv["mode"] == "packed"
    assert float(cv["best"]) == pytest.approx(0.8) and float(cv["best_std"]) == pytest.approx(
        0.1
    )  # (0.9, 0.7)
    assert float(cv["epoch_at_best"]) == pytest.approx(1.5) and float(
        cv["epoch_at_best_std"]
    ) == pytest.approx(0.5)
    assert float(cv["time_to_target_s"]) == 20.0 and cv["reached"] == "1/2"  # only fold_0 reached 0.9
    assert float(cv["test_auc"]) == pytest.approx(0.8) and float(cv["test_auc_std"]) == pytest.approx(0.1)

    markdown = (out / "comparison.md").read_text()
    assert "| best val_auc |" in markdown and "0.8 ± 0.1" in markdown
    assert markdown.splitlines()[0] in capsys.readouterr().out  # the table is printed
    png = (out / "metric_vs_time.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("exp")
    comparison = client.search_runs([exp.experiment_id], "tags.`dpgs.kind` = 'comparison'")
    assert len(comparison) == 1
    assert comparison[0].data.params["compare.metric"] == "val_auc"
    assert comparison[0].data.params["compare.target"] == "0.9"
    logged = {a.path for a in client.list_artifacts(comparison[0].info.run_id)}
    assert logged == {"comparison.csv", "comparison.md", "metric_vs_time.png"}
    downloaded = client.download_artifacts(comparison[0].info.run_id, "comparison.csv", str(tmp_path))
    assert Path(downloaded).read_text() == (out / "comparison.csv").read_text()

    # a second comparison skips the first comparison run
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "--out", str(out)]) == 0
    assert set(read_rows(out)) == {"classic", "dpgs", "dpgs-steps", "cv"}


def test_loss_metrics_are_minimised(uri, tmp_path):
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                "--experiment",
                "exp",
                "--tracking-uri",
                uri,
                "--metric",
                "val_loss",
                "--target",
                "0.2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = read_rows(out)
    assert (
        float(rows["classic"]["best"]) == pytest.approx(0.1) and float(rows["classic"]["epoch_at_best"]) == 2
    )
    assert float(rows["dpgs"]["best"]) == pytest.approx(0.03) and float(rows["dpgs"]["epoch_at_best"]) == 3
    assert float(rows["dpgs"]["time_to_target_s"]) == 20.0  # first epoch with val_loss <= 0.2 (0.05)
    assert rows["dpgs-steps"]["reached"] == "0/1"


def test_unknown_experiment_is_named(uri, capsys):
    assert main(["compare", "--experiment", "nope", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert "experiment 'nope' not found" in err and "experiments there: Default, exp" in err


def test_experiment_without_runs_and_unknown_metric(uri, tmp_path, capsys):
    MlflowClient(uri).create_experiment("empty", artifact_location=(tmp_path / "empty").as_uri())
    assert main(["compare", "--experiment", "empty", "--tracking-uri", uri, "--out", str(tmp_path)]) == 2
    assert f"experiment 'empty' at {uri} has no runs to compare" in capsys.readouterr().err
    assert (
        main(
            [
                "compare",
                "--experiment",
                "exp",
                "--tracking-uri",
                uri,
                "--metric",
                "val_aucc",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "per-epoch metric 'val_aucc'" in err and "val_auc" in err
    assert not (tmp_path / "comparison.csv").exists()


def test_intervals_flag_differences_within_the_noise_and_evaluation_runs_are_skipped(uri, tmp_path):
    def ci(auc, low, high, acc=0.8):
        return {"test_auc": auc, "test_auc_ci_low": low, "test_auc_ci_high": high, "test_acc": acc,
                "test_acc_ci_low": acc - 0.05, "test_acc_ci_high": acc + 0.05}

    log_run(uri, "best", CLASSIC, [0.9], final=ci(0.9, 0.85, 0.95), experiment="ci")
    log_run(uri, "close", CLASSIC, [0.8], final=ci(0.88, 0.80, 0.93, acc=0.7), experiment="ci")
    log_run(uri, "worse", CLASSIC, [0.7], final=ci(0.70, 0.60, 0.78, acc=0.95), experiment="ci")
    log_run(uri, "no-ci", CLASSIC, [0.6], final={"test_auc": 0.95}, experiment="ci")
    log_run(uri, "eval-best", CLASSIC, [0.99], final=ci(0.99, 0.98, 1.0), experiment="ci",
            tags={"dpgs.kind": "evaluation"})
    out = tmp_path / "cmp"
    assert main(["compare", "--experiment", "ci", "--tracking-uri", uri, "--out", str(out)]) == 0
    rows = read_rows(out)
    assert set(rows) == {"best", "close", "worse", "no-ci"}  # the evaluation run is not a row
    flags = {name: (r["test_auc_vs_best"], r["test_acc_vs_best"]) for name, r in rows.items()}
    assert flags == {"best": ("best", "separated"), "close": ("overlaps", "separated"),
                     "worse": ("separated", "best"), "no-ci": ("-", "-")}
    assert rows["close"]["test_auc_ci"] == "[0.8, 0.93]" and float(rows["close"]["test_auc_ci_low"]) == 0.8
    markdown = (out / "comparison.md").read_text()
    assert "| test_auc CI | test_auc vs best |" in markdown and "within the sampling noise" in markdown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tracking_server(tmp_path):
    """The same comparison against an `mlflow server` (SQL backend, proxied artifacts) over HTTP."""
    port = free_port()
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    server = subprocess.Popen(
        [
            mlflow,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ.copy(),
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("mlflow server did not start") from None
                time.sleep(0.5)
        populate(uri)
        out = tmp_path / "cmp"
        assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "--out", str(out)]) == 0
        assert float(read_rows(out)["dpgs"]["bytes_per_step"]) == pytest.approx(1000.0)
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("exp")
        comparison = client.search_runs([exp.experiment_id], "tags.`dpgs.kind` = 'comparison'")
        assert {a.path for a in client.list_artifacts(comparison[0].info.run_id)} == {
            "comparison.csv",
            "comparison.md",
            "metric_vs_time.png",
        }
        assert list((tmp_path / "artifacts").rglob("metric_vs_time.png"))  # stored by the server
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_latest_keeps_the_newest_run_of_each_name(uri, tmp_path):
    """A command run again (``make demo`` twice) logs a second run of the same name; ``--latest`` compares
    only the newest one, and the k-fold parent with its folds stays one row."""
    log_run(uri, "classic", CLASSIC, [0.5, 0.99], final={"test_auc": 0.95, "test_acc": 0.9})
    everything, newest = tmp_path / "all", tmp_path / "newest"
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "--out", str(everything)]) == 0
    args = ["compare", "--experiment", "exp", "--tracking-uri", uri]
    assert main([*args, "--latest", "--out", str(newest)]) == 0
    names = [r["run"] for r in csv.DictReader((everything / "comparison.csv").open())]
    assert names.count("classic") == 2
    rows = list(csv.DictReader((newest / "comparison.csv").open()))
    assert [r["run"] for r in rows] == ["dpgs", "dpgs-steps", "cv", "classic"]
    assert float(rows[-1]["best"]) == pytest.approx(0.99)
