"""Run records (``dpgs.records``): the checkpoint format written and read back, the errors that name the
file, and ``--resume`` targets (file, run directory, MLflow run id)."""

from __future__ import annotations

import pytest
import torch

from dpgs.records import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    PARAM_OUTPUT_DIR,
    TAG_FOLD,
    CheckpointError,
    DriverProgress,
    MasterCheckpoint,
    find_resume_target,
    read_checkpoint,
    run_dir_of,
    save_checkpoint,
)
from dpgs.tracking import RunTracker

DRIVER = DriverProgress(2, 1, [{"epoch": 1, "val_auc": 0.5}], {"seed": 0}, {"keep_ratio": 0.01})


def master_part() -> MasterCheckpoint:
    return MasterCheckpoint(model={"w": torch.arange(3.0)}, optimizer={"state": {}, "param_groups": []},
                            step=7, sync={"uplink": {"residual": None}})


def test_a_checkpoint_reads_back_what_was_written(tmp_path):
    path = save_checkpoint(tmp_path / "run" / CHECKPOINT_FILE, master_part(), DRIVER, [{"r": torch.ones(2)}])
    raw = torch.load(path, weights_only=True)  # plain tensors and values: loadable without pickle code
    assert raw["format"] == CHECKPOINT_FORMAT and set(raw) == {"format", "master", "driver", "workers"}
    back = read_checkpoint(path)
    assert back.master.step == 7 and torch.equal(back.master.model["w"], torch.arange(3.0))
    assert back.driver == DRIVER and torch.equal(back.workers[0]["r"], torch.ones(2))
    assert raw["driver"] == {"epoch": 2, "step_in_epoch": 1, "history": [{"epoch": 1, "val_auc": 0.5}],
                             "config": {"seed": 0}, "keep_ratio": 0.01}  # the engine's keys beside the others
    assert not list(path.parent.glob("*.tmp*"))  # written atomically, nothing left behind


def test_unreadable_checkpoints_are_refused_naming_the_file(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match=f"checkpoint {missing} not found"):
        read_checkpoint(missing)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(CheckpointError, match=f"checkpoint {corrupt} is corrupt"):
        read_checkpoint(corrupt)
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": {}}, foreign)
    with pytest.raises(CheckpointError, match=f"{foreign} is not a dpgs checkpoint"):
        read_checkpoint(foreign)
    older = tmp_path / "older.pt"
    torch.save({"format": 2, "master": {"model": {}}, "driver": DRIVER.to_file(), "workers": []}, older)
    with pytest.raises(CheckpointError, match=f"{older} has checkpoint format 2; this dpgs reads format"):
        read_checkpoint(older)
    assert CheckpointError.exit_code == 2


def test_resume_targets(tmp_path):
    run_dir = tmp_path / "run"
    path = save_checkpoint(run_dir / CHECKPOINT_FILE, master_part(), DRIVER, [])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert find_resume_target(str(path), uri) == path
    assert find_resume_target(str(run_dir), uri) == path
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint.pt or kfold.json in .*empty"):
        find_resume_target(str(tmp_path / "empty"), uri)
    with pytest.raises(CheckpointError, match="the tracking store .* does not exist"):
        find_resume_target("0123456789abcdef0123456789abcdef", uri)
    tracker = RunTracker.start(uri, "exp")
    tracker.log_params({PARAM_OUTPUT_DIR: str(run_dir)})
    tracker.end()
    assert find_resume_target(tracker.run_id, uri) == path
    with pytest.raises(CheckpointError, match="neither a checkpoint file or run directory nor an MLflow"):
        find_resume_target("0123456789abcdef0123456789abcdef", uri)


def test_run_directory_of_a_fold_run():
    assert run_dir_of({PARAM_OUTPUT_DIR: "runs/cv"}, {TAG_FOLD: "fold_1"}).as_posix() == "runs/cv/fold_1"
    assert run_dir_of({PARAM_OUTPUT_DIR: "runs/one"}, {}).as_posix() == "runs/one"
    assert run_dir_of({}, {}) is None
