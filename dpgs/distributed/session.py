"""The DPGS session: one worker pool for every fold of a ``dpgs train`` command (``train.mode=dpgs``)."""

from __future__ import annotations

from dpgs.config import Config
from dpgs.distributed.engine import DpgsEngine
from dpgs.distributed.pool import WorkerPool
from dpgs.train.engine import FoldSetup


class DpgsSession:
    """Starts Ray and the actors with the first fold; later folds only reset the actors' state."""

    def __init__(self, config: Config):
        self.config = config
        self.pool: WorkerPool | None = None

    def engine(self, setup: FoldSetup) -> DpgsEngine:
        if self.pool is None:
            self.pool = WorkerPool(setup.config, setup.spec, setup.dataset)
        return DpgsEngine(self.pool, setup)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
