"""A model's trainable parameters as one flat float32 vector (the unit DPGS sends and steps)."""

from __future__ import annotations

import torch


def trainable(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in trainable(model)])


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """Concatenated gradients (zeros for parameters that received none)."""
    parts = [
        (p.grad.detach().reshape(-1).float().cpu() if p.grad is not None else torch.zeros(p.numel()))
        for p in trainable(model)
    ]
    return torch.cat(parts)


def load_flat_params(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the trainable parameters, in order."""
    params = trainable(model)
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} elements, the model has {total} trainable")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p).to(p.dtype))
            offset += p.numel()


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Floating-point buffers (BatchNorm running statistics); integer counters are excluded."""
    return [b for b in model.buffers() if b.is_floating_point()]
