"""Running a training command: the session of the config's mode, then every fold with it.

``run_training(config)`` opens an in-process session (classic, padding, sampling, packed) or the DPGS
session (Ray master and workers, kept for all folds of the command), trains, and closes the session. It
sits above ``dpgs.train`` and ``dpgs.distributed``, so neither imports the other's driver side.
"""

from __future__ import annotations

from dpgs.config import Config
from dpgs.train.engine import LocalSession, Session
from dpgs.train.trainer import TrainingResult
from dpgs.train.trainer import run_training as train_with


def open_session(config: Config) -> Session:
    """The session that trains ``config``'s mode."""
    if config.train.mode == "dpgs":
        from dpgs.distributed.session import DpgsSession

        return DpgsSession(config)
    return LocalSession()


def run_training(config: Config) -> TrainingResult:
    """Validate inputs, train every fold, close the session; returns the (parent) run's results."""
    session = open_session(config)
    try:
        return train_with(config, session)
    finally:
        session.close()
