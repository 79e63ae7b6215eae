"""Running a training command: the session of the config's mode, then every fold with it.

``run_training(config)`` opens an in-process session (classic, padding, sampling, packed) or the DPGS
session (Ray master and workers, kept for all folds of the command), trains, and closes the session. It
sits above ``dpgs.train``, ``dpgs.distributed`` and the roles (``dpgs.master``, ``dpgs.workers``): it picks
the role classes and hands them to the DPGS driver, which never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpgs.config import Config
from dpgs.train.engine import Session
from dpgs.train.local_engine import LocalSession

if TYPE_CHECKING:
    from dpgs.train.trainer import TrainingResult


def dpgs_roles(config: Config):
    """The master and worker classes of a DPGS run: bag workers, or sample-parallel group workers."""
    from dpgs.distributed.roles import Roles
    from dpgs.master import Master
    from dpgs.workers import BagWorker, GroupWorker

    return Roles(master=Master, worker=GroupWorker if config.dpgs.sample_parallel > 1 else BagWorker)


def open_session(config: Config) -> Session:
    """The session that trains ``config``'s mode."""
    if config.train.mode == "dpgs":
        from dpgs.distributed.session import DpgsSession

        return DpgsSession(config, dpgs_roles(config))
    return LocalSession()


def run_training(config: Config) -> TrainingResult:
    """Validate inputs, train every fold, close the session; returns the (parent) run's results.

    The trainer (and with it MLflow) is imported here, not with the module: picking the roles and opening
    a session need no tracking (a GPU machine with torch and Ray alone runs the DPGS engine)."""
    from dpgs.train.trainer import train_splits

    session = open_session(config)
    try:
        return train_splits(config, session)
    finally:
        session.close()
