"""The MLflow tracker (``dpgs.tracking``): metrics are written on the run's writer thread, in order, and the
run ends after its last metric; a write that failed surfaces at the next call and does not keep the run
from being marked FAILED."""

from __future__ import annotations

import threading

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpgs.tracking import RunTracker


@pytest.fixture()
def tracker(tmp_path):
    return RunTracker.start(f"sqlite:///{tmp_path / 'mlflow.db'}", "tracking-test")


def test_metrics_are_written_off_the_callers_thread_in_order_before_the_run_ends(tracker, monkeypatch):
    calls, release = [], threading.Event()
    log_batch, set_terminated = tracker.client.log_batch, tracker.client.set_terminated

    def held_log_batch(run_id, metrics=(), **kwargs):
        if metrics:
            assert release.wait(30)
            calls.append(("metrics", threading.current_thread().name, metrics[0].step))
        return log_batch(run_id, metrics=metrics, **kwargs)

    def recorded_set_terminated(run_id, status=None):
        calls.append(("end", threading.current_thread().name, status))
        return set_terminated(run_id, status=status)

    monkeypatch.setattr(tracker.client, "log_batch", held_log_batch)
    monkeypatch.setattr(tracker.client, "set_terminated", recorded_set_terminated)
    for epoch in (1, 2, 3):
        tracker.log_metrics({"train_loss": 1.0 / epoch, "val_auc": float("nan")}, step=epoch)
    assert calls == []  # every write is held, and the training loop went on
    release.set()
    tracker.end()
    main = threading.current_thread().name
    assert [c[0] for c in calls] == ["metrics", "metrics", "metrics", "end"]
    assert [c[2] for c in calls[:3]] == [1, 2, 3] and all(c[1] != main for c in calls[:3])
    client = MlflowClient(tracker.client.tracking_uri)
    history = client.get_metric_history(tracker.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert client.get_metric_history(tracker.run_id, "val_auc") == []  # NaN is not logged
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_a_failed_metric_write_raises_at_the_next_call_and_the_run_is_still_marked_failed(
    tracker, monkeypatch, capsys
):
    log_batch = tracker.client.log_batch

    def failing_log_batch(run_id, metrics=(), **kwargs):
        if metrics:
            raise MlflowException("the store is full")
        return log_batch(run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(tracker.client, "log_batch", failing_log_batch)
    tracker.log_metrics({"train_loss": 1.0}, step=1)
    with pytest.raises(MlflowException, match="the store is full"):
        tracker.flush()
    tracker.log_metrics({"train_loss": 0.5}, step=2)
    tracker.fail(RuntimeError("stopped"))
    assert "metrics not written: the store is full" in capsys.readouterr().err
    run = MlflowClient(tracker.client.tracking_uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["dpgs.error"] == "stopped"
