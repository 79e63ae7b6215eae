"""The loss of one optimizer step in each training mode.

Every mode returns the head's loss dictionary, whose ``loss`` is the mean of the per-bag losses of the
step's bags, so that back-propagating it gives the mini-batch gradient (DPGS workers back-propagate
``per_bag.sum()`` instead and the master divides by the step's bag count).
"""

from __future__ import annotations

import torch

from dpgs.train.batching import pack_batch, pad_batch, sample_batch

MODES = ("classic", "padding", "sampling", "packed", "dpgs")


def check_mode_supported(model, mode: str) -> None:
    """Raise a clear error when a head cannot run a mode (padding needs mask support)."""
    if mode == "padding" and not getattr(model, "supports_mask", False):
        name = getattr(model, "name", type(model).__name__)
        raise ValueError(
            f"train.mode=padding needs a head that supports masks; '{name}' does not "
            "(use packed, sampling or classic)"
        )


def batch_loss(
    model,
    features: list[torch.Tensor],
    labels: torch.Tensor,
    mode: str,
    class_weights: torch.Tensor | None = None,
    sample_size: int = 64,
    generator: torch.Generator | None = None,
) -> dict:
    """Loss dictionary of ``model`` on the bags ``features`` (each [N_b, ...]) with labels [B]."""
    if mode == "classic" or (mode in ("packed", "dpgs") and len(features) == 1):
        if len(features) != 1:
            raise ValueError(f"classic mode takes one bag per step, got {len(features)}")
        return model.loss(features[0], labels[0], class_weights=class_weights)
    if mode in ("packed", "dpgs"):
        x, lengths = pack_batch(features)
        return model.loss_packed(x, lengths, labels, class_weights=class_weights)
    if mode == "padding":
        x, mask = pad_batch(features)
        return model.loss(x, labels, mask=mask, class_weights=class_weights)
    if mode == "sampling":
        if generator is None:
            raise ValueError("sampling mode needs a torch.Generator")
        x = sample_batch(features, sample_size, generator)
        return model.loss(x, labels, class_weights=class_weights)
    raise ValueError(f"unknown train.mode '{mode}' (expected one of {', '.join(MODES)})")
