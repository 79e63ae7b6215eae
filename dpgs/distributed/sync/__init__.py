"""The exchange at the end of each DPGS step: the :class:`StepSync` contract and its schemes.

``build_sync(config, model)`` builds the run's scheme once per fold, from ``dpgs.compression.downlink``:

* ``gradients`` (:class:`RelaySync`): every worker takes the master's optimizer step itself, from the
  relayed payloads or the dense sum; replicas are exact.
* ``delta`` (:class:`DeltaSync`): only the master steps; workers receive top-k weight deltas (the DMGC
  paper's scheme) or, at keep ratio 1, the weights.

A new scheme is a class with the :class:`StepSync` methods, registered in :data:`SCHEMES`.
"""

from __future__ import annotations

import torch

from dpgs.compression import ParamLayout
from dpgs.config.schema import Config
from dpgs.distributed.sync.contract import (
    Contribution,
    Received,
    StepSync,
    UpdateNotSent,
    contribution,
    step_bounds,
)
from dpgs.distributed.sync.delta import DeltaSync
from dpgs.distributed.sync.relay import RelaySync

SCHEMES: dict[str, type] = {"gradients": RelaySync, "delta": DeltaSync}


def build_sync(config: Config, model: torch.nn.Module) -> StepSync:
    """The step synchronisation of ``config`` for ``model``'s trainable parameters."""
    compression = config.dpgs.compression
    layout = ParamLayout.from_module(model, dense_min_numel=compression.dense_min_numel)
    return SCHEMES[compression.downlink](compression, config.train, layout)


__all__ = ["SCHEMES", "Contribution", "DeltaSync", "Received", "RelaySync", "StepSync", "UpdateNotSent",
           "build_sync", "contribution", "step_bounds"]
