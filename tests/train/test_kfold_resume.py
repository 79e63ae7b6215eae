"""``--resume`` of a k-fold command (dpgs.train.kfold_progress): the folds that finished are kept, the
others are trained again, and the result is the uninterrupted command's."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from dpgs.cli import main
from dpgs.records import CheckpointError, find_resume_target
from dpgs.train import local_engine
from dpgs.train.resume_check import ResumeError
from dpgs.train.trainer import train_splits
from tests.dpgs_helpers import MIXED_LENGTHS as LENGTHS
from tests.dpgs_helpers import make_config, train_argv, write_bags

KFOLD = ("data.folds=3", "train.mode=packed", "train.epochs=2", "train.batch_size=4")


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    return write_bags(tmp_path_factory.mktemp("bags"), LENGTHS)


def train_args(bags, out, *overrides: str) -> list[str]:
    return train_argv(bags, out, *KFOLD, *overrides)


def interrupt_at_epoch_call(monkeypatch, call: int) -> None:
    """The ``call``-th epoch of the command (counting every fold's) is interrupted as by SIGINT."""
    original = local_engine.LocalEngine.run_epoch
    calls = []

    def run_epoch(self, batches, epoch, history=None):
        calls.append(epoch)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(self, batches, epoch, history)

    monkeypatch.setattr(local_engine.LocalEngine, "run_epoch", run_epoch)


def fold_results(out) -> dict[str, dict]:
    return {f"fold_{k}": json.loads((out / f"fold_{k}" / "fold_result.json").read_text()) for k in range(3)}


def children_of(client: MlflowClient, run) -> dict[str, str]:
    found = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    return {c.data.tags["dpgs.fold"]: c.info.status for c in found}


def test_an_interrupted_kfold_command_resumed_keeps_its_finished_folds_and_ends_as_an_uninterrupted_one(
        bags, tmp_path, monkeypatch, capsys):
    reference, cut = tmp_path / "reference", tmp_path / "cut"
    assert main(train_args(bags, reference)) == 0
    interrupt_at_epoch_call(monkeypatch, 4)  # fold_0's two epochs, then fold_1's second
    assert main(train_args(bags, cut)) == 130
    assert f"--resume {cut} keeps the folds that finished" in capsys.readouterr().err
    assert (cut / "fold_0" / "fold_result.json").is_file()
    assert not (cut / "fold_1" / "fold_result.json").exists()
    fold_0 = {name: (cut / "fold_0" / name).read_bytes() for name in ("best.pt", "metrics.csv", "run.json")}
    interrupted_parent = json.loads((cut / "kfold.json").read_text())["parent_run_id"]
    monkeypatch.undo()
    capsys.readouterr()

    assert main([*train_args(bags, cut, "tracking.run_name=resumed"), "--resume", str(cut)]) == 0
    printed = capsys.readouterr().out
    assert "[fold_0] finished before the resume" in printed and "[fold_0] epoch" not in printed
    assert "[fold_1] epoch 2/2" in printed and "[fold_2] epoch 2/2" in printed
    assert {name: (cut / "fold_0" / name).read_bytes() for name in fold_0} == fold_0  # kept, untouched
    resumed, uninterrupted = fold_results(cut), fold_results(reference)
    for name in resumed:
        tested = {k: v for k, v in resumed[name]["test_metrics"].items() if k != "time_to_best_seconds"}
        expected = {k: uninterrupted[name]["test_metrics"][k] for k in tested}
        assert len(tested) >= 10 and tested == pytest.approx(expected, abs=1e-6), name
        assert resumed[name]["split_sha256"] == uninterrupted[name]["split_sha256"]
        a = torch.load(cut / name / "best.pt", weights_only=True)
        b = torch.load(reference / name / "best.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in b), name

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent_id = json.loads((cut / "kfold.json").read_text())["parent_run_id"]
    parent, old = client.get_run(parent_id), client.get_run(interrupted_parent)
    assert parent.info.status == "FINISHED" and parent.info.run_name == "resumed"
    assert parent.data.tags["dpgs.resumed_from"] == interrupted_parent
    assert parent.data.tags["dpgs.folds_kept"] == "fold_0"
    assert children_of(client, parent) == {"fold_0": "FINISHED", "fold_1": "FINISHED", "fold_2": "FINISHED"}
    assert old.info.status == "KILLED" and children_of(client, old) == {"fold_1": "KILLED"}
    reference_parent = client.get_run(json.loads((reference / "kfold.json").read_text())["parent_run_id"])
    for key in ("cv_mean_test_auc", "cv_mean_test_acc", "cv_std_test_auc"):
        assert parent.data.metrics[key] == pytest.approx(reference_parent.data.metrics[key], abs=1e-6), key


def test_a_new_command_forgets_the_finished_folds_of_an_earlier_one(bags, tmp_path, monkeypatch, capsys):
    """A finished command run again without --resume and interrupted in its first fold: no fold of the
    earlier command is left for a resume to keep."""
    out = tmp_path / "cv"
    assert main(train_args(bags, out)) == 0
    interrupt_at_epoch_call(monkeypatch, 1)
    assert main(train_args(bags, out)) == 130
    assert not any((out / f"fold_{k}" / "fold_result.json").exists() for k in range(3))
    monkeypatch.undo()
    capsys.readouterr()
    assert main([*train_args(bags, out), "--resume", str(out)]) == 0
    assert "finished before the resume" not in capsys.readouterr().out


def finished_command(bags, out, monkeypatch):
    """A command interrupted in fold_1 (fold_0 finished); its config."""
    interrupt_at_epoch_call(monkeypatch, 3)
    assert main(train_args(bags, out)) == 130
    monkeypatch.undo()
    return make_config(*bags, out, *KFOLD)


def resume_of(config, *changes: str):
    """``config`` with ``changes`` (dotted key=value), resuming the k-fold command in its output dir."""
    manifest, feats = config.data.manifest, config.data.features_dir
    new = make_config(manifest, feats, config.train.output_dir, *KFOLD, *changes)
    target = config.train.output_dir / "kfold.json"
    return new.model_copy(update={"dpgs": new.dpgs.model_copy(update={"resume": target})})


def test_a_kfold_resume_refuses_what_the_finished_folds_were_trained_with(bags, tmp_path, monkeypatch):
    """Epochs, evaluation and the tracking store are fixed across folds (a single-split resume may change
    them); the refusal names each key and writes nothing."""
    out = tmp_path / "cv"
    config = finished_command(bags, out, monkeypatch)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(ResumeError) as err:
        train_splits(resume_of(config, "train.epochs=3", "eval.repeats=2", "train.lr=0.1",
                               f"tracking.uri=sqlite:///{tmp_path / 'other.db'}"), None)
    text = str(err.value)
    assert "changes the run in 4 key(s)" in text
    for line in ("train.epochs: 2 -> 3", "eval.repeats: 5 -> 2", "train.lr: 0.01 -> 0.1", "tracking.uri: "):
        assert f"  {line}" in text, line
    assert "A k-fold resume may change only tracking.run_name" in text
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert not (tmp_path / "other.db").exists()


def test_a_kfold_resume_refuses_a_manifest_that_changed_the_bags_of_a_finished_fold(tmp_path, monkeypatch):
    """The same manifest path with other labels: fold_0's bags are not those it was trained on."""
    own = write_bags(tmp_path / "bags", LENGTHS)
    out = tmp_path / "cv"
    config = finished_command(own, out, monkeypatch)
    with config.data.manifest.open() as fh:
        rows = list(csv.reader(fh))
    for row in rows[1:]:
        row[1] = str(1 - int(row[1]))
    with config.data.manifest.open("w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    with pytest.raises(CheckpointError, match=r"fold_0 was trained on other bags than the manifest gives"):
        train_splits(resume_of(config), None)
    assert not (out / "fold_1" / "fold_result.json").exists()


def test_resume_finds_a_kfold_command_by_directory_file_or_parent_run(bags, tmp_path, monkeypatch):
    out = tmp_path / "cv"
    config = finished_command(bags, out, monkeypatch)
    uri = config.tracking.uri
    record = out / "kfold.json"
    assert find_resume_target(str(out), uri) == record
    assert find_resume_target(str(record), uri) == record
    assert find_resume_target(json.loads(record.read_text())["parent_run_id"], uri) == record
    record.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"cannot read the k-fold record {record}"):
        train_splits(resume_of(config), None)
    record.write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match=f"{record} is not a k-fold record of format 1"):
        train_splits(resume_of(config), None)


def test_a_kept_fold_whose_mlflow_run_was_deleted_still_counts(bags, tmp_path, monkeypatch, capsys):
    """The fold's files are what a resume keeps; a run deleted from the store by hand is only warned of."""
    out = tmp_path / "cv"
    config = finished_command(bags, out, monkeypatch)
    client = MlflowClient(config.tracking.uri)
    kept_run = json.loads((out / "fold_0" / "fold_result.json").read_text())["run_id"]
    client.delete_run(kept_run)
    capsys.readouterr()
    assert main([*train_args(bags, out), "--resume", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"warning: MLflow run {kept_run} cannot be nested under" in printed.err
    assert "[fold_0] finished before the resume" in printed.out
    parent = client.get_run(json.loads((out / "kfold.json").read_text())["parent_run_id"])
    assert parent.info.status == "FINISHED" and "cv_mean_test_auc" in parent.data.metrics
    assert children_of(client, parent) == {"fold_1": "FINISHED", "fold_2": "FINISHED"}
