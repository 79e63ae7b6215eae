"""MLflow logging for dpgs runs (the tracking contract is in docs/architecture.md).

Only the driver process logs. Metrics and params go through ``MlflowClient.log_batch`` so an epoch is
one round trip to the tracking store, which matters for SQLite and for remote tracking servers.

Metrics are written by one thread per run, in the order they were logged, while training goes on (an
epoch's batch was a ~15 ms SQLite transaction on the training loop's path: 5.8 s of a 10-fold x 40-epoch
DPGS command). Every other write (params, tags, artifacts, the run's end) first waits for the metrics
logged before it (:meth:`RunTracker.flush`), so the store sees a run's writes in order and a run ends after
its last metric. A metric write that failed raises its error from the tracker's next call.

A run that does not finish is ended by :meth:`RunTracker.fail`: KILLED when it was interrupted (SIGINT,
SIGTERM), FAILED on any error, with the reason in the ``dpgs.error`` tag. Every write is one transaction
that a signal never cuts in the middle (:func:`dpgs.interrupts.interrupts_deferred`): an interrupted
SQLite transaction would leave the store locked for the writes that end the run.
"""

from __future__ import annotations

import math
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpgs.errors import RunFailure
from dpgs.interrupts import interrupts_deferred
from dpgs.records import TAG_ERROR, TAG_PARENT
from dpgs.runwatch import WATCHER

PARAM_VALUE_LIMIT = 6000
BATCH_LIMIT = 100
ERROR_TAG_LIMIT = 5000


class TrackingError(RunFailure):
    """The MLflow tracking store cannot be used (wrong URI, unreachable server); nothing was logged."""

    exit_code = 2


class RunTracker:
    """One MLflow run (optionally nested under a parent run)."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client = client
        self.run_id = run_id
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpgs-mlflow-metrics")
        self._writes: list[Future] = []  # metric batches submitted to the writer, not yet known written

    @classmethod
    def start(
        cls,
        uri: str,
        experiment: str,
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        parent: RunTracker | None = None,
    ) -> RunTracker:
        all_tags = dict(tags or {})
        if parent is not None:
            all_tags[TAG_PARENT] = parent.run_id
        try:
            with interrupts_deferred():
                client = MlflowClient(tracking_uri=uri)
                found = client.get_experiment_by_name(experiment)
                experiment_id = found.experiment_id if found else client.create_experiment(experiment)
                run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
                WATCHER.watch_run(uri, run.info.run_id)  # ended FAILED if this process dies without ending it
        except MlflowException as err:
            reason = err.message.strip()
            raise TrackingError(f"tracking.uri={uri}: cannot start an MLflow run ({reason})") from None
        return cls(client, run.info.run_id)

    def flush(self) -> None:
        """Wait for every metric logged so far to be written; a failed write raises its error."""
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()

    def _settle(self) -> None:
        """Forget the metric writes that are done; the first that failed raises its error."""
        pending = []
        for write in self._writes:
            if write.done():
                write.result()
            else:
                pending.append(write)
        self._writes = pending

    def log_params(self, params: dict[str, Any]) -> None:
        self.flush()
        items = [Param(k, str(v)[:PARAM_VALUE_LIMIT]) for k, v in sorted(params.items())]
        for i in range(0, len(items), BATCH_LIMIT):
            with interrupts_deferred():
                self.client.log_batch(self.run_id, params=items[i : i + BATCH_LIMIT])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.flush()
        with interrupts_deferred():
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def adopt(self, run_id: str) -> None:
        """Nest the run ``run_id`` of the same store and experiment under this one (MLflow's parent tag):
        a resumed k-fold command's parent takes the fold runs that finished before. A store without that
        run (deleted by hand) gets a warning: the fold's results still count, from its files."""
        self.flush()
        try:
            with interrupts_deferred():
                self.client.set_tag(run_id, TAG_PARENT, self.run_id)
        except MlflowException as err:
            print(f"[dpgs] warning: MLflow run {run_id} cannot be nested under {self.run_id}: "
                  f"{err.message.strip()}", file=sys.stderr)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log finite metrics (NaN, e.g. AUC of a one-class set, is skipped) in one batch, written by the
        run's writer thread (the module docstring); timestamped now."""
        self._settle()
        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step or 0)
            for k, v in metrics.items()
            if v is not None and math.isfinite(float(v))
        ]
        if items:
            self._writes.append(self._writer.submit(self._write_metrics, items))

    def _write_metrics(self, items: list[Metric]) -> None:
        """The writer thread: ``items`` in batches (signals go to the main thread, never to this one, so no
        transaction here is cut in the middle)."""
        for i in range(0, len(items), BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=items[i : i + BATCH_LIMIT])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.flush()
        with interrupts_deferred():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        """End the run after its last metric is written; the writer thread ends with it."""
        try:
            self.flush()
            with interrupts_deferred():
                self.client.set_terminated(self.run_id, status=status)
                WATCHER.run_ended(self.run_id)  # ended here: nothing for the watcher to check
        finally:
            self._writer.shutdown(wait=True)

    def fail(self, error: BaseException) -> None:
        """End the run as KILLED (``error`` is an interrupt: SIGINT, SIGTERM) or FAILED (anything else),
        with the reason in the ``dpgs.error`` tag. Never raises: the error that ended the run is the one to
        report, so a tracking store that cannot be reached only prints a warning."""
        status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        reason = str(error) or type(error).__name__
        try:
            self.flush()
        except Exception as err:  # the run is still to be ended
            print(f"[dpgs] warning: MLflow run {self.run_id}: metrics not written: {err}", file=sys.stderr)
        try:
            self.set_tags({TAG_ERROR: reason[:ERROR_TAG_LIMIT]})
            self.end(status)
        except Exception as err:  # the store itself failed; the run's own error matters more
            print(f"[dpgs] warning: could not mark MLflow run {self.run_id} {status}: {err}", file=sys.stderr)
