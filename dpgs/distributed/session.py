"""The DPGS session: what ``dpgs train`` holds for all its folds when ``train.mode=dpgs``."""

from __future__ import annotations

from dpgs.config import Config
from dpgs.distributed.engine import DpgsEngine
from dpgs.train.engine import FoldSetup


class DpgsSession:
    def __init__(self, config: Config):
        self.config = config

    def engine(self, setup: FoldSetup) -> DpgsEngine:
        data = (setup.dataset, setup.train_indices)
        return DpgsEngine(setup.config, setup.model, setup.class_weights, data, setup.spec)

    def close(self) -> None:
        """Nothing held between folds yet."""
