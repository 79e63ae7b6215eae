"""Single-process trainer: modes, outputs on disk, MLflow contract, k-fold, bad input, eval CLI."""

from __future__ import annotations

import csv
import gc
import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from dpgs.cli import main
from dpgs.data import DataValidationError
from dpgs.runner import run_training
from tests.dpgs_helpers import make_config, write_bags

LENGTHS = [3, 40, 7, 1, 90, 12, 5, 30, 2, 60, 8, 15, 4, 22, 9, 11, 6, 50, 13, 2]


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    return write_bags(tmp_path_factory.mktemp("bags"), LENGTHS)


def test_training_freezes_the_startup_heap_once(bags, tmp_path):
    """What the process holds when the first fold starts (modules, MLflow's state, the data) is moved out
    of the collector's reach, so a full collection during training does not traverse it; a second command
    in the same process freezes nothing more."""
    gc.unfreeze()
    try:
        startup = [[] for _ in range(100)]  # cyclic-collector objects alive before the command
        run_training(make_config(*bags, tmp_path / "a", "train.mode=packed", "train.epochs=1"))
        tracked = {id(o) for o in gc.get_objects()}  # the collector's generations, not the frozen objects
        assert not any(id(o) in tracked for o in startup)
        later = [[] for _ in range(100)]
        run_training(make_config(*bags, tmp_path / "b", "train.mode=packed", "train.epochs=1"))
        tracked = {id(o) for o in gc.get_objects()}
        assert all(id(o) in tracked for o in later)
    finally:
        gc.unfreeze()


def test_packed_run_writes_outputs_and_logs_contract(bags, tmp_path):
    cfg = make_config(
        *bags,
        tmp_path / "run",
        "train.mode=packed",
        "train.epochs=3",
        "train.batch_size=4",
        "train.accumulation_steps=2",
        "eval.sample_k=4",
        "eval.repeats=2",
    )
    result = run_training(cfg)
    out = tmp_path / "run"
    for name in ("config.yaml", "classes.json", "metrics.csv", "last.pt", "best.pt", "training_curves.png"):
        assert (out / name).is_file(), name
    state = torch.load(out / "best.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    run = MlflowClient(cfg.tracking.uri).get_run(result.run_id)
    assert run.data.tags["dpgs.mode"] == "packed" and run.data.tags["dpgs.model"] == "abmil"
    assert run.data.params["train.batch_size"] == "4"
    # 14 training bags in batches of 4, two batches per optimizer step: 2 steps per epoch (not 4 batches)
    assert run.data.params["steps_per_epoch"] == "2" and run.data.metrics["optimizer_steps"] == 2.0
    for key in (
        "train_loss",
        "val_loss",
        "val_acc",
        "val_bacc",
        "val_auc",
        "val_f1",
        "val_qwk",
        "epoch_seconds",
        "elapsed_seconds",
        "test_acc",
        "test_auc",
        "best_epoch",
        "time_to_best_seconds",
        "test_k4_auc",
        "test_k4_auc_std",
    ):
        assert key in run.data.metrics, key
    history = MlflowClient(cfg.tracking.uri).get_metric_history(result.run_id, "val_loss")
    assert [m.step for m in history] == [1, 2, 3]
    artifacts = {a.path for a in MlflowClient(cfg.tracking.uri).list_artifacts(result.run_id)}
    assert {"config.yaml", "metrics.csv", "training_curves.png", "best.pt"} <= artifacts


@pytest.mark.parametrize("mode", ["classic", "padding", "sampling"])
def test_baseline_modes_train(bags, tmp_path, mode):
    cfg = make_config(
        *bags,
        tmp_path / mode,
        f"train.mode={mode}",
        "train.epochs=2",
        "train.batch_size=4",
        "train.sample_size=8",
    )
    result = run_training(cfg)
    losses = [row["train_loss"] for row in result.folds[0].history]
    assert all(loss == loss for loss in losses)  # finite
    assert result.folds[0].history[0]["optimizer_steps"] == (14 if mode == "classic" else 4)


def test_gradient_accumulation_equals_larger_batch(bags, tmp_path):
    """Two accumulated batches of 2 bags == one packed batch of 4 (same bags, SGD)."""
    from dpgs.modeling import ModelSpec
    from dpgs.train.local_engine import LocalEngine
    from tests.dpgs_helpers import experiment_data

    def params(*overrides, batches):
        cfg = make_config(*bags, tmp_path / "acc", "train.optimizer=sgd", "train.momentum=0", *overrides)
        data = experiment_data(cfg)
        torch.manual_seed(0)
        model = ModelSpec(cfg.model, data.dataset.feature_dim, 2).build().double()
        data.dataset.records = data.dataset.records
        engine = LocalEngine(model, cfg.train, torch.device("cpu"), None, 0, data.dataset, 0)
        for b in batches:
            bags_ = [data.dataset[i] for i in b]
            for bag in bags_:
                bag.features = bag.features.double()
            engine.train_batch(bags_)
        engine._apply()
        return {k: v.clone() for k, v in model.state_dict().items()}

    a = params("train.mode=packed", "train.accumulation_steps=2", batches=[[0, 1], [2, 3]])
    b = params("train.mode=packed", batches=[[0, 1, 2, 3]])
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-12)


def test_kfold_parent_and_nested_runs(bags, tmp_path):
    cfg = make_config(*bags, tmp_path / "cv", "data.folds=3", "train.epochs=1", "train.batch_size=4")
    result = run_training(cfg)
    client = MlflowClient(cfg.tracking.uri)
    parent = client.get_run(result.run_id)
    for key in (
        "cv_mean_test_acc",
        "cv_std_test_acc",
        "cv_mean_test_auc",
        "cv_std_test_auc",
        "total_seconds",
    ):
        assert key in parent.data.metrics, key
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result.run_id}'"
    )
    assert len(children) == 3
    assert {(tmp_path / "cv" / f"fold_{k}" / "best.pt").is_file() for k in range(3)} == {True}


def test_bad_input_writes_nothing(bags, tmp_path):
    manifest, feats = bags
    bad = tmp_path / "bad.csv"
    bad.write_text(manifest.read_text() + "missing_slide,1,train\n")
    cfg = make_config(bad, feats, tmp_path / "out")
    with pytest.raises(DataValidationError, match="missing_slide"):
        run_training(cfg)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "mlflow.db").exists()


def test_cli_train_then_eval(bags, tmp_path, capsys):
    manifest, feats = bags
    out = tmp_path / "cli"
    rc = main(
        [
            "train",
            f"data.manifest={manifest}",
            f"data.features_dir={feats}",
            f"train.output_dir={out}",
            f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
            "train.epochs=2",
            "train.batch_size=4",
        ]
    )
    assert rc == 0
    assert "MLflow run id:" in capsys.readouterr().out
    rc = main(["eval", str(out), "--split", "test"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "auc" in text and "confusion matrix" in text
    rows = list(csv.DictReader((out / "predictions_test.csv").open()))
    assert len(rows) == sum(1 for r in csv.DictReader(manifest.open()) if r["split"] == "test")
    assert json.loads((out / "classes.json").read_text()) == ["0", "1"]


def test_cli_rejects_unknown_key(capsys):
    assert main(["train", "train.batch_sz=4"]) == 2
    assert "train.batch_sz: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["abmil", "meanmil", "maxmil", "clam_sb", "clam_mb", "dsmil", "transmil",
                                  "dtfd", "acmil", "rrtmil"])
def test_every_head_trains_through_every_applicable_mode(bags, tmp_path, name):
    """One epoch of every applicable mode in the single-process engine (the whole command, outputs and
    MLflow included, is trained once per mode by the tests above): finite losses, moved weights."""
    from dpgs.modeling import ModelSpec
    from dpgs.models import HEADS
    from dpgs.train.batching import epoch_batches
    from dpgs.train.local_engine import LocalEngine
    from tests.dpgs_helpers import experiment_data

    modes = ["classic", "sampling", "packed"] + (["padding"] if HEADS[name].supports_mask else [])
    data = None
    for mode in modes:
        cfg = make_config(*bags, tmp_path / f"{name}-{mode}", f"train.mode={mode}", f"model.name={name}",
                          "train.batch_size=4", "train.sample_size=8")
        data = data or experiment_data(cfg)
        torch.manual_seed(0)
        model = ModelSpec(cfg.model, data.dataset.feature_dim, 2).build()
        before = [p.detach().clone() for p in model.parameters()]
        engine = LocalEngine(model, cfg.train, torch.device("cpu"), None, 0, data.dataset, 0)
        train = data.splits[0].train
        stats = engine.run_epoch(epoch_batches(train, 1 if mode == "classic" else 4, 0, 1), 1)
        assert stats["train_loss"] == stats["train_loss"], (name, mode)  # not NaN
        assert stats["optimizer_steps"] == (len(train) if mode == "classic" else -(-len(train) // 4))
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), mode
