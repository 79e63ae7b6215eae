"""The keep ratio of every DPGS step: the one place that decides how much of a gradient is sent.

``dpgs.compression.keep_ratio`` fixes the steady ratio (1 sends everything, dense). With
``dpgs.compression.warmup_epochs = W`` the ratio follows DGC's warm-up 25 %, 6.25 %, 1.5625 %, ... for the
first W epochs (never below the steady ratio). The driver writes the ratio into each
:class:`~dpgs.distributed.messages.StepPlan`; the uplink and downlink codecs take it as an argument.
"""

from __future__ import annotations

from dpgs.compression import KeepRatioSchedule
from dpgs.config.schema import CompressionConfig


class KeepSchedule:
    """Keep ratio of a step from the run's compression settings."""

    def __init__(self, cfg: CompressionConfig):
        self.cfg = cfg
        self.warmup = (
            KeepRatioSchedule.exponential(cfg.keep_ratio, epochs=cfg.warmup_epochs)
            if cfg.warmup_epochs and cfg.keep_ratio < 1.0
            else None
        )

    def ratio(self, epoch: int) -> float:
        """Keep ratio of the steps of ``epoch`` (1-based)."""
        if self.warmup is None:
            return self.cfg.keep_ratio
        return self.warmup.ratio(epoch - 1)
