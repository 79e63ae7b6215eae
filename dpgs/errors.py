"""Errors that end a training run with a message instead of a traceback.

``dpgs train`` prints ``dpgs train: error: <message>`` for any :class:`RunFailure` and exits with its
``exit_code`` (documented in docs/reliability.md); the MLflow run is marked FAILED.
"""

from __future__ import annotations


class RunFailure(RuntimeError):
    """The run cannot go on (cluster, workers, master, disk); the message says what to do."""

    exit_code = 3
