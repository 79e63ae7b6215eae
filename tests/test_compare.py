"""dpgs compare on a synthetic experiment logged with the tracking contract."""

import csv

import pytest
from mlflow.tracking import MlflowClient

from dpgs.cli import main
from dpgs.tracking import RunTracker


def log_run(uri, name, params, aucs, extra=None, parent=None):
    run = RunTracker.start(uri, "exp", name, {"dpgs.mode": params["train.mode"]}, parent=parent)
    run.log_params(params)
    for epoch, auc in enumerate(aucs, start=1):
        run.log_metrics({"val_auc": auc, "elapsed_seconds": 10.0 * epoch, **(extra or {})}, step=epoch)
    run.end()
    return run


@pytest.fixture
def uri(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    classic = {"train.mode": "classic", "model.name": "abmil", "train.batch_size": 16}
    dpgs = {
        "train.mode": "dpgs",
        "model.name": "abmil",
        "train.batch_size": 16,
        "dpgs.workers": 2,
        "dpgs.compression.keep_ratio": 0.01,
    }
    log_run(uri, "classic", classic, [0.6, 0.9, 0.8])
    log_run(uri, "dpgs", dpgs, [0.7, 0.95, 0.97], {"comm_bytes_per_step": 1000.0, "compression_ratio": 150.0})
    parent = RunTracker.start(uri, "exp", "cv", {"dpgs.kfold_parent": "true"})
    parent.log_params(classic | {"train.mode": "packed"})
    log_run(uri, "fold_0", classic | {"train.mode": "packed"}, [0.8, 0.9], parent=parent)
    log_run(uri, "fold_1", classic | {"train.mode": "packed"}, [0.7, 0.6], parent=parent)
    parent.end()
    return uri


def test_table_files_and_artifacts(uri, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert (
        main(["compare", "--experiment", "exp", "--tracking-uri", uri, "--target", "0.9", "--out", str(out)])
        == 0
    )
    rows = {r["run"]: r for r in csv.DictReader((out / "comparison.csv").open())}
    assert set(rows) == {"classic", "dpgs", "cv"}  # fold runs are summarised in their parent
    assert float(rows["classic"]["best"]) == 0.9 and float(rows["classic"]["epoch_at_best"]) == 2
    assert float(rows["classic"]["time_to_target_s"]) == 20.0
    assert float(rows["dpgs"]["best"]) == 0.97 and float(rows["dpgs"]["time_to_best_s"]) == 30.0
    assert (
        float(rows["dpgs"]["bytes_per_step"]) == 1000.0 and float(rows["dpgs"]["compression_ratio"]) == 150.0
    )
    assert float(rows["cv"]["best"]) == pytest.approx(0.8)  # mean of the folds' best (0.9, 0.7)
    assert "0.8 ± 0.1" in (out / "comparison.md").read_text()
    assert (out / "metric_vs_time.png").stat().st_size > 1000
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("exp")
    comparison = client.search_runs([exp.experiment_id], "tags.`dpgs.kind` = 'comparison'")
    assert len(comparison) == 1
    logged = {a.path for a in client.list_artifacts(comparison[0].info.run_id)}
    assert logged == {"comparison.csv", "comparison.md", "metric_vs_time.png"}
    # a second comparison ignores the first comparison run
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "--out", str(out)]) == 0
    assert len(list(csv.DictReader((out / "comparison.csv").open()))) == 3


def test_unknown_experiment_is_named(uri, capsys):
    assert main(["compare", "--experiment", "nope", "--tracking-uri", uri]) == 2
    assert "experiment 'nope' not found" in capsys.readouterr().err
