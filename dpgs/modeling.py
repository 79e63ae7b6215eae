"""Build the trained model from the ``model`` config section."""

from __future__ import annotations

import torch

from dpgs.config.schema import ModelConfig
from dpgs.models import build_head


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; otherwise the named device (checked)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name}: CUDA is not available on this machine")
    return device


def build_model(cfg: ModelConfig, in_dim: int, num_classes: int) -> torch.nn.Module:
    """The MIL head over feature bags of dimension ``in_dim``."""
    return build_head(cfg.name, in_dim=in_dim, num_classes=num_classes, **cfg.params)


class ModelSpec:
    """A picklable recipe for the model, so Ray actors build identical replicas."""

    def __init__(self, cfg: ModelConfig, in_dim: int, num_classes: int):
        self.cfg = cfg
        self.in_dim = in_dim
        self.num_classes = num_classes

    def build(self) -> torch.nn.Module:
        return build_model(self.cfg, self.in_dim, self.num_classes)
