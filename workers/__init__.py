"""The DPGS worker roles (installed as ``dpgs.workers``): one base worker and its variants."""

from dpgs.workers.bag import BagWorker
from dpgs.workers.base import BagGradients, Worker
from dpgs.workers.sample_parallel import GroupWorker

__all__ = ["BagGradients", "BagWorker", "GroupWorker", "Worker"]
