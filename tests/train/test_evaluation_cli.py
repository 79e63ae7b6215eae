"""``dpgs eval`` on feature-bag runs: every fold of a k-fold parent (by run id and by directory), MLflow
links read back, an external cohort against one-pass scores, and usage errors."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from dpgs.cli import main
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.runner import run_training
from tests.dpgs_helpers import make_config, write_bags

LENGTHS = [4, 9, 2, 12, 6, 11, 3, 8, 5, 10, 7, 4, 10, 6, 3, 9, 13, 5, 8, 2, 6, 7]


@pytest.fixture(scope="module")
def kfold_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("kfold")
    manifest, feats = write_bags(root / "bags", LENGTHS)
    config = make_config(manifest, feats, root / "cv", "data.folds=2", "train.epochs=1", "train.batch_size=4",
                         "eval.bootstrap=100", "eval.sample_k=3", "eval.repeats=2")
    return root, config, run_training(config)


def child_runs(client, run):
    return client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")


def test_kfold_parent_by_run_id_evaluates_every_fold_and_links_the_runs(kfold_run, capsys):
    _, config, result = kfold_run
    uri = config.tracking.uri
    assert main(["eval", result.run_id, "--tracking-uri", uri]) == 0
    assert "over 2 folds (mean ± std)" in capsys.readouterr().out
    client = MlflowClient(uri)
    training = client.get_run(result.run_id)
    evals = client.search_runs([training.info.experiment_id], f"tags.`dpgs.evaluates` = '{result.run_id}'")
    assert len(evals) == 1
    parent = evals[0]
    assert parent.data.tags["dpgs.kind"] == "evaluation" and parent.data.tags["dpgs.kfold_parent"] == "true"
    for key in ("cv_mean_test_auc", "cv_std_test_acc"):
        assert parent.data.metrics[key] == pytest.approx(training.data.metrics[key], rel=1e-9)
    trained_folds = {r.data.tags["dpgs.fold"]: r for r in child_runs(client, training)}
    eval_folds = {r.data.tags["dpgs.fold"]: r for r in child_runs(client, parent)}
    assert set(eval_folds) == set(trained_folds) == {"fold_0", "fold_1"}
    for name, run in eval_folds.items():
        trained = trained_folds[name]
        assert run.data.tags["dpgs.evaluates"] == trained.info.run_id
        assert run.data.tags["dpgs.kind"] == "evaluation" and run.data.params["eval.split"] == "test"
        logged = {k: v for k, v in trained.data.metrics.items() if k.startswith("test_")}
        assert {"test_auc_ci_high", "test_k3_bacc_std"} <= set(logged)
        for key, value in logged.items():
            assert run.data.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["predictions_test.csv"]


def test_kfold_directory_and_a_fold_directory(kfold_run, tmp_path, capsys):
    root, config, _ = kfold_run
    out = tmp_path / "preds"
    assert main(["eval", str(root / "cv"), "--split", "val", "--bootstrap", "0", "--sample-k", "0",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fold_0:" in text and "fold_1:" in text and "CI" in text
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.csv")) == [
        "fold_0/predictions_val.csv", "fold_1/predictions_val.csv"]
    header = next(csv.reader((out / "fold_0" / "predictions_val.csv").open()))
    assert header == ["slide_id", "label", "prediction", "p_0", "p_1", "loss"]
    assert main(["eval", str(root / "cv" / "fold_1"), "--sample-k", "0"]) == 0
    assert "fold_1:" in capsys.readouterr().out
    assert (root / "cv" / "fold_1" / "predictions_test.csv").is_file()


def test_external_cohort_is_scored_whole_with_the_runs_model(kfold_run, tmp_path):
    root, config, _ = kfold_run
    other_manifest, other_feats = write_bags(tmp_path / "other", [5, 7, 3, 9, 4, 6, 8, 2], seed=7)
    fold = root / "cv" / "fold_0"
    assert main(["eval", str(fold), "--manifest", str(other_manifest), "--features-dir", str(other_feats),
                 "--bootstrap", "50"]) == 0
    rows = list(csv.DictReader((fold / "predictions_manifest_all.csv").open()))
    other = make_config(other_manifest, other_feats, tmp_path / "unused")
    data = load_experiment_data(other.data, seed=0)
    model = ModelSpec(config.model, data.dataset.feature_dim, 2).build()
    model.load_state_dict(torch.load(fold / "best.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        probs = [torch.softmax(model(data.dataset[i].features).double(), -1).numpy() for i in range(8)]
    assert [r["slide_id"] for r in rows] == [f"s{i}" for i in range(8)]
    np.testing.assert_allclose([[float(r["p_0"]), float(r["p_1"])] for r in rows], probs, atol=2e-6)
    assert {r["k3_prediction"] for r in rows} <= {"0", "1"}  # the run's eval.sample_k applies too
    client = MlflowClient(config.tracking.uri)
    found = client.search_runs([client.get_experiment_by_name(config.experiment).experiment_id],
                               "params.`eval.external` = 'true'")
    assert len(found) == 1 and found[0].data.params["eval.n_bags"] == "8"


def test_usage_errors_name_the_problem(kfold_run, tmp_path, capsys):
    root, _, _ = kfold_run
    fold = str(root / "cv" / "fold_0")
    assert main(["eval", fold, "--slides-dir", str(tmp_path)]) == 2
    assert "--slides-dir: the run was trained on feature bags" in capsys.readouterr().err
    assert main(["eval", str(root / "cv"), "--checkpoint", f"{fold}/best.pt"]) == 2
    assert "has 2 folds" in capsys.readouterr().err
    assert main(["eval", fold, "--split", "holdout"]) == 2
    assert "--split holdout: expected one of train, val, test, all" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert f"run directory {tmp_path / 'missing'} not found" in capsys.readouterr().err
    assert main(["eval", fold, "--repeats", "0", "--sample-k", "2"]) == 2
    assert "--repeats: Input should be greater than or equal to 1" in capsys.readouterr().err
