"""Head registry: ``HEADS`` (name -> class), ``build_head`` with parameter validation, ``head_params``."""

from __future__ import annotations

import inspect

from dpgs.models.abmil import ABMIL
from dpgs.models.acmil import ACMIL
from dpgs.models.base import MILHead
from dpgs.models.clam import CLAMMB, CLAMSB
from dpgs.models.dsmil import DSMIL
from dpgs.models.dtfd import DTFD
from dpgs.models.maxmil import MaxMIL
from dpgs.models.meanmil import MeanMIL
from dpgs.models.rrtmil import RRTMIL
from dpgs.models.transmil import TransMIL

HEADS: dict[str, type[MILHead]] = {
    h.name: h for h in (ABMIL, MeanMIL, MaxMIL, CLAMSB, CLAMMB, TransMIL, DTFD, ACMIL, RRTMIL, DSMIL)
}


def _head_class(name: str) -> type[MILHead]:
    if name not in HEADS:
        raise ValueError(f"model.name: unknown head '{name}' (available: {', '.join(sorted(HEADS))})")
    return HEADS[name]


def head_params(name: str) -> dict:
    """The hyper-parameters of head ``name`` with their defaults (constructor keywords after
    ``in_dim`` and ``num_classes``)."""
    sig = inspect.signature(_head_class(name).__init__)
    return {k: p.default for k, p in sig.parameters.items() if k not in ("self", "in_dim", "num_classes")}


def build_head(name: str, in_dim: int, num_classes: int, **params) -> MILHead:
    """Instantiate head ``name``; an unknown name or parameter raises ValueError naming it and listing
    the valid ones."""
    valid = head_params(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"model.params: unknown parameter(s) {', '.join(unknown)} for head '{name}' "
            f"(valid: {', '.join(valid)})"
        )
    return _head_class(name)(in_dim, num_classes, **params)
