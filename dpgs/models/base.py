"""``MILHead``: the common interface of every MIL head (see docs/architecture.md, "MIL heads").

Shapes: one bag ``x`` [N, D] -> logits [C]; a padded batch ``x`` [B, N, D] with ``mask`` [B, N]
(True = real instance) -> [B, C]; a packed batch ``x`` [sum N_b, D] with ``lengths`` [B] -> [B, C].

A head implements ``_bags(x [B, N, D], mask | None, y | None) -> (logits [B, C], terms)`` where
``terms`` maps a loss component name to its per-bag value [B] (already multiplied by its published
weight, so that the components sum to the per-bag total; empty when ``y`` is None). ``mask`` is only
ever passed to heads with ``supports_mask``; for the others a padded batch is unpadded and run bag by
bag, so the output is still exact. Heads with ``packing_exact`` override ``_packed`` with a one-pass
segment computation (``dpgs.models.segment``); the default runs ``_bags`` once per bag.

Loss dictionaries (``loss`` / ``loss_packed``): ``per_bag`` [B] = ``class_weight[y] * sum(terms)``,
``loss`` = ``per_bag.mean()``, ``logits`` [B, C], and for every component its class-weighted mean over
bags (so the components add up to ``loss``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

Terms = dict[str, torch.Tensor]


class MILHead(nn.Module):
    """Base class of the MIL heads: subclasses set ``name`` and implement ``_bags``, ``instance_scores``."""

    name: ClassVar[str] = ""
    supports_mask: ClassVar[bool] = False
    packing_exact: ClassVar[bool] = False

    def __init__(self, in_dim: int, num_classes: int):
        super().__init__()
        if int(in_dim) < 1 or int(num_classes) < 1:
            raise ValueError(f"{self.name}: in_dim and num_classes must be >= 1, got {in_dim}, {num_classes}")
        self.in_dim = int(in_dim)
        self.num_classes = int(num_classes)

    # ------------------------------------------------------------------ to implement

    def _bags(
        self, x: torch.Tensor, mask: torch.Tensor | None, y: torch.Tensor | None
    ) -> tuple[torch.Tensor, Terms]:
        raise NotImplementedError(f"{type(self).__name__} must implement _bags")

    def instance_scores(self, x: torch.Tensor) -> torch.Tensor:
        """[N] per-instance score of one bag x [N, D] (attention weight or positive-class probability)."""
        raise NotImplementedError(f"{type(self).__name__} must implement instance_scores")

    def _packed(
        self, x: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor | None
    ) -> tuple[torch.Tensor, Terms]:
        """Per-bag loop over the packed bags (heads with ``packing_exact`` vectorise this)."""
        chunks = torch.split(x, lengths.tolist())
        outs = [self._bags(c[None], None, None if y is None else y[b : b + 1]) for b, c in enumerate(chunks)]
        return _concat(outs)

    # ------------------------------------------------------------------ public API

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [C] of one bag x [N, D], or [B, C] of a batch x [B, N, D] (optional mask [B, N])."""
        if x.dim() == 2:
            self._check_x(x, 2)
            if mask is not None:
                raise ValueError(f"{self.name}: a mask is only valid with a batch x [B, N, D]")
            return self._bags(x[None], None, None)[0][0]
        return self._batch(x, mask, None)[0]

    def forward_packed(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [B, C] of the bags packed in x [sum N_b, D] with ``lengths`` [B]."""
        self._check_packed(x, lengths)
        return self._packed(x, lengths, None)[0]

    def loss(
        self,
        x: torch.Tensor,
        y: torch.Tensor | int,
        mask: torch.Tensor | None = None,
        class_weights: torch.Tensor | None = None,
    ) -> dict:
        """Loss dictionary of one bag (x [N, D], y 0-d) or a batch (x [B, N, D], y [B], optional mask)."""
        y = torch.as_tensor(y, device=x.device)
        if x.dim() == 2:
            self._check_x(x, 2)
            if mask is not None:
                raise ValueError(f"{self.name}: a mask is only valid with a batch x [B, N, D]")
            y = self._check_y(y.reshape(-1), 1)
            logits, terms = self._bags(x[None], None, y)
        else:
            y = self._check_y(y.reshape(-1), x.shape[0])
            logits, terms = self._batch(x, mask, y)
        return self._loss_dict(logits, terms, y, class_weights)

    def loss_packed(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor,
        y: torch.Tensor,
        class_weights: torch.Tensor | None = None,
    ) -> dict:
        """Loss dictionary of the packed bags: x [sum N_b, D], lengths [B], y [B]."""
        self._check_packed(x, lengths)
        y = self._check_y(torch.as_tensor(y, device=x.device).reshape(-1), lengths.numel())
        logits, terms = self._packed(x, lengths, y)
        return self._loss_dict(logits, terms, y, class_weights)

    # ------------------------------------------------------------------ helpers

    def _batch(self, x: torch.Tensor, mask: torch.Tensor | None, y: torch.Tensor | None):
        self._check_x(x, 3)
        if mask is None:
            return self._bags(x, None, y)
        if mask.shape != x.shape[:2] or mask.dtype != torch.bool:
            raise ValueError(
                f"{self.name}: mask must be a bool tensor of shape {tuple(x.shape[:2])}, "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        if not bool(mask.any(1).all()):
            empty = torch.nonzero(~mask.any(1)).flatten().tolist()
            raise ValueError(f"{self.name}: mask leaves bag(s) {empty} without any instance")
        if self.supports_mask:
            return self._bags(x, mask, y)
        outs = [
            self._bags(x[b][mask[b]][None], None, None if y is None else y[b : b + 1]) for b in range(len(x))
        ]
        return _concat(outs)

    def _check_x(self, x: torch.Tensor, dims: int) -> None:
        if x.dim() != dims or x.shape[-1] != self.in_dim or x.shape[-2] < 1:
            want = "[N, D]" if dims == 2 else "[B, N, D]"
            raise ValueError(
                f"{self.name}: expected x {want} with D={self.in_dim} and N >= 1, got shape {tuple(x.shape)}"
            )

    def _check_packed(self, x: torch.Tensor, lengths: torch.Tensor) -> None:
        self._check_x(x, 2)
        if lengths.dim() != 1 or lengths.numel() == 0 or lengths.dtype != torch.long:
            raise ValueError(f"{self.name}: lengths must be a non-empty int64 tensor [B], got {lengths!r}")
        if bool((lengths < 1).any()) or int(lengths.sum()) != x.shape[0]:
            raise ValueError(
                f"{self.name}: lengths must be >= 1 and sum to x.shape[0]={x.shape[0]}, "
                f"got {lengths.tolist()}"
            )

    def _check_y(self, y: torch.Tensor, batch: int) -> torch.Tensor:
        if y.numel() != batch:
            raise ValueError(f"{self.name}: expected {batch} label(s), got {y.numel()}")
        if y.is_floating_point() or bool(((y < 0) | (y >= self.num_classes)).any()):
            raise ValueError(
                f"{self.name}: labels must be integers in [0, {self.num_classes}), got {y.tolist()}"
            )
        return y.long()

    def _loss_dict(self, logits: torch.Tensor, terms: Terms, y: torch.Tensor, class_weights) -> dict:
        if class_weights is not None:
            class_weights = torch.as_tensor(class_weights, dtype=logits.dtype, device=logits.device)
            if class_weights.shape != (self.num_classes,):
                raise ValueError(
                    f"{self.name}: class_weights must have shape ({self.num_classes},), "
                    f"got {tuple(class_weights.shape)}"
                )
            weight = class_weights[y]
            terms = {k: v * weight for k, v in terms.items()}
        per_bag = torch.stack(list(terms.values())).sum(0)
        out = {"loss": per_bag.mean(), "per_bag": per_bag, "logits": logits}
        out.update({k: v.mean() for k, v in terms.items()})
        return out


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B] per-bag cross-entropy."""
    return F.cross_entropy(logits, y, reduction="none")


def _concat(outs: list[tuple[torch.Tensor, Terms]]) -> tuple[torch.Tensor, Terms]:
    logits = torch.cat([o[0] for o in outs])
    terms = {k: torch.cat([o[1][k] for o in outs]) for k in outs[0][1]}
    return logits, terms
