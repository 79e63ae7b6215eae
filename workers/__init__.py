"""Ray worker actors (thin wrappers; the logic lives in ``dpgs.distributed.worker_state``)."""

from workers.actor import BagWorker

__all__ = ["BagWorker"]
