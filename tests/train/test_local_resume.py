"""``--resume`` of a single-split run of a single-process mode (classic, padding, sampling, packed): the
checkpoint written at each epoch's end continues the run, and the result is the uninterrupted run's."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from dpgs.cli import main
from dpgs.train import local_engine
from tests.dpgs_helpers import MIXED_LENGTHS as LENGTHS
from tests.dpgs_helpers import train_argv, write_bags

TIMES = ("train_seconds", "epoch_seconds", "elapsed_seconds")

# Each mode with what draws random numbers or carries state across epochs: dropout (torch's default
# generator), the bag sampler's generator, accumulation windows, clipping, Adam's moments and the cosine
# schedule.
MODES = {
    "classic": ("train.mode=classic", "model.params={dropout: 0.25}"),
    "sampling": ("train.mode=sampling", "train.sample_size=4", "model.params={dropout: 0.25}"),
    "packed": ("train.mode=packed", "train.accumulation_steps=2", "train.grad_clip=0.5",
               "train.scheduler=cosine", "model.params={dropout: 0.25}"),
    "padding": ("train.mode=padding", "model.params={dropout: 0.0}"),
}


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    return write_bags(tmp_path_factory.mktemp("bags"), LENGTHS)


def train_args(bags, out, *overrides: str) -> list[str]:
    return train_argv(bags, out, "train.batch_size=4", "train.epochs=4", *overrides)


def interrupt_at_epoch(monkeypatch, epoch: int) -> None:
    """Epoch ``epoch`` is interrupted as by SIGINT before its first step."""
    original = local_engine.LocalEngine.run_epoch

    def run_epoch(self, batches, at, history=None):
        if at == epoch:
            raise KeyboardInterrupt
        return original(self, batches, at, history)

    monkeypatch.setattr(local_engine.LocalEngine, "run_epoch", run_epoch)


def metrics_rows(out) -> list[dict]:
    with (out / "metrics.csv").open() as fh:
        return [{k: v for k, v in row.items() if k not in TIMES} for row in csv.DictReader(fh)]


def weights(path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_interrupted_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(
        bags, tmp_path, monkeypatch, capsys, mode):
    reference, cut = tmp_path / "reference", tmp_path / "cut"
    assert main(train_args(bags, reference, *MODES[mode])) == 0
    interrupt_at_epoch(monkeypatch, 3)
    assert main(train_args(bags, cut, *MODES[mode])) == 130
    assert f"--resume {cut} continues from its last checkpoint" in capsys.readouterr().err
    checkpoint = torch.load(cut / "checkpoint.pt", weights_only=True)
    assert checkpoint["driver"]["epoch"] == 3 and checkpoint["workers"] == []
    assert checkpoint["master"]["step"] == 2 * {"packed": 2, "classic": 14}.get(mode, 4)  # 14 train bags, B=4
    interrupted = json.loads((cut / "run.json").read_text())["run_id"]
    monkeypatch.undo()

    resume = [*train_args(bags, cut, *MODES[mode], "tracking.run_name=resumed"), "--resume", str(cut)]
    assert main(resume) == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "epoch 1/4" not in printed and "epoch 3/4" in printed
    for name in ("last.pt", "best.pt"):
        a, b = weights(cut / name), weights(reference / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
    assert metrics_rows(cut) == metrics_rows(reference)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    resumed = client.get_run(json.loads((cut / "run.json").read_text())["run_id"])
    assert resumed.info.status == "FINISHED" and resumed.data.tags["dpgs.resumed_from"] == interrupted
    assert client.get_run(interrupted).info.status == "KILLED"
    done = client.get_run(json.loads((reference / "run.json").read_text())["run_id"])
    tested = {k: v for k, v in done.data.metrics.items() if k.startswith("test_")}
    assert len(tested) >= 5
    assert {k: resumed.data.metrics[k] for k in tested} == pytest.approx(tested, abs=1e-9)


# (train.checkpoint_every, the batch of epoch 3 (0-based) interrupted, the step of epoch 3 the last
# checkpoint continues at): 14 training bags, B=4, so 14 steps an epoch in classic (the last checkpoint at
# step 35 of the run, 7 of epoch 3), 4 in sampling and padding, 2 in packed (two batches a step: a
# checkpoint after its first step skips two batches)
WITHIN = {"classic": (5, 9, 7), "sampling": (3, 3, 1), "packed": (1, 3, 1), "padding": (2, 3, 2)}
STEPS_PER_EPOCH = {"classic": 14, "sampling": 4, "packed": 2, "padding": 4}


def interrupt_within_epoch(monkeypatch, epoch: int, batch: int) -> None:
    """Epoch ``epoch`` is interrupted as by SIGINT before its batch ``batch`` (0-based)."""
    at = {"epoch": 0, "batch": 0}
    run_epoch, train_batch = local_engine.LocalEngine.run_epoch, local_engine.LocalEngine.train_batch

    def counted(self, batches, epoch_now, history=None):
        at.update(epoch=epoch_now, batch=0)
        return run_epoch(self, batches, epoch_now, history)

    def interrupted(self, bags):
        if at["epoch"] == epoch and at["batch"] == batch:
            raise KeyboardInterrupt
        at["batch"] += 1
        return train_batch(self, bags)

    monkeypatch.setattr(local_engine.LocalEngine, "run_epoch", counted)
    monkeypatch.setattr(local_engine.LocalEngine, "train_batch", interrupted)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_run_interrupted_within_an_epoch_resumes_from_its_last_step_checkpoint(
        bags, tmp_path, monkeypatch, capsys, mode):
    """``train.checkpoint_every=N``: a checkpoint after every N-th optimizer step of the run; resumed within
    epoch 3, the run skips the batches of the steps taken and ends as the uninterrupted run: weights,
    and every metric of metrics.csv (the resumed epoch's ``train_loss`` over all its bags, its step count)."""
    every, batch, step_in_epoch = WITHIN[mode]
    args = (*MODES[mode], f"train.checkpoint_every={every}")
    reference, cut = tmp_path / "reference", tmp_path / "cut"
    assert main(train_args(bags, reference, *args)) == 0
    interrupt_within_epoch(monkeypatch, 3, batch)
    assert main(train_args(bags, cut, *args)) == 130
    checkpoint = torch.load(cut / "checkpoint.pt", weights_only=True)
    assert (checkpoint["driver"]["epoch"], checkpoint["driver"]["step_in_epoch"]) == (3, step_in_epoch)
    assert checkpoint["master"]["step"] == 2 * STEPS_PER_EPOCH[mode] + step_in_epoch
    assert len(checkpoint["driver"]["history"]) == 2
    monkeypatch.undo()
    capsys.readouterr()

    assert main([*train_args(bags, cut, *args), "--resume", str(cut)]) == 0
    assert f"at epoch 3, step {step_in_epoch}" in capsys.readouterr().out
    for name in ("last.pt", "best.pt"):
        a, b = weights(cut / name), weights(reference / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
    assert metrics_rows(cut) == metrics_rows(reference)


def test_a_checkpoint_resumes_only_in_its_own_mode(bags, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(bags, out, "train.mode=packed", "train.epochs=1")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main([*train_args(bags, out, "train.mode=classic"), "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert 'train.mode: "packed" -> "classic"' in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_the_folds_of_a_kfold_command_write_no_checkpoint(bags, tmp_path):
    out = tmp_path / "cv"
    assert main(train_args(bags, out, "train.mode=packed", "train.epochs=1", "data.folds=2")) == 0
    assert (out / "kfold.json").is_file() and not list(out.rglob("checkpoint.pt"))
