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
