"""Optimizers and per-epoch learning-rate schedules from the ``train`` config section."""

from __future__ import annotations

import torch

from dpgs.config.schema import TrainConfig


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    raise ValueError(f"train.optimizer: unknown optimizer '{cfg.optimizer}'")


def build_scheduler(optimizer, cfg: TrainConfig):
    """A scheduler stepped once per epoch (None for ``scheduler: none``).

    cosine: lr_e = lr * (1 + cos(pi * e / epochs)) / 2; step: lr * gamma^floor(e / step_size);
    exponential: lr * gamma^e.
    """
    if cfg.scheduler == "none":
        return None
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    if cfg.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    if cfg.scheduler == "exponential":
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=cfg.gamma)
    raise ValueError(f"train.scheduler: unknown scheduler '{cfg.scheduler}'")


def class_weights_for(labels: list[int], num_classes: int) -> torch.Tensor:
    """Inverse-frequency weights w_c = n / (C_present * n_c), so the mean of w[y] over the bags is 1."""
    counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=num_classes).double()
    present = int((counts > 0).sum())
    weights = torch.where(counts > 0, len(labels) / (present * counts.clamp(min=1)), torch.zeros_like(counts))
    return weights.float()
