"""MIL heads (torchmil-shaped: ``forward(x, mask=None)`` and ``loss(...)`` returning a dict) and the
segment operations of packed batches. See docs/models.md and docs/architecture.md ("MIL heads")."""

from dpgs.models.base import MILHead
from dpgs.models.registry import HEADS, build_head, head_params

__all__ = ["HEADS", "MILHead", "build_head", "head_params"]
