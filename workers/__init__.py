"""Ray worker actors (thin wrappers; the logic lives in ``dpgs.distributed.worker_state`` and
``dpgs.distributed.group_worker_state``)."""

from dpgs.workers.actor import BagWorker
from dpgs.workers.group_actor import GroupWorker

__all__ = ["BagWorker", "GroupWorker"]
