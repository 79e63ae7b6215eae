"""MIL heads (torchmil-shaped: ``forward(x, mask=None)`` and ``loss(...)`` returning a dict).

``build_head(name, in_dim, num_classes, **params)`` checks ``params`` against the head's constructor.
"""

from __future__ import annotations

import inspect

from dpgs.models.core import ABMIL, CLAMMB, CLAMSB, DSMIL, MaxMIL, MeanMIL, MILHead

HEADS: dict[str, type[MILHead]] = {h.name: h for h in (ABMIL, MeanMIL, MaxMIL, CLAMSB, CLAMMB, DSMIL)}


def head_params(name: str) -> dict:
    """Hyper-parameters of head ``name`` with their defaults."""
    if name not in HEADS:
        raise ValueError(f"model.name: unknown head '{name}' (available: {', '.join(sorted(HEADS))})")
    sig = inspect.signature(HEADS[name].__init__)
    return {k: p.default for k, p in sig.parameters.items() if k not in ("self", "in_dim", "num_classes")}


def build_head(name: str, in_dim: int, num_classes: int, **params) -> MILHead:
    valid = head_params(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"model.params: unknown parameter(s) {', '.join(unknown)} for head '{name}' "
            f"(valid: {', '.join(valid)})"
        )
    return HEADS[name](in_dim, num_classes, **params)


__all__ = ["HEADS", "MILHead", "build_head", "head_params"]
