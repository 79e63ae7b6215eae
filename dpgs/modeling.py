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


def build_encoder(cfg: ModelConfig, device: torch.device | None = None) -> torch.nn.Module:
    """The big-layer ResNet of ``model.encoder`` (pooled features), with ``model.encoder_weights``.

    Weights are a torchvision-format state_dict read with ``torch.load(weights_only=True)``.
    """
    from dpgs.biglayers import resnet18, resnet50

    factory = {"resnet18": resnet18, "resnet50": resnet50}[cfg.encoder]
    encoder = factory(big_stages=cfg.big_stages, max_elements=cfg.max_elements, num_classes=0, device=device)
    if cfg.encoder_weights is not None:
        path = cfg.encoder_weights
        if not path.is_file():
            raise FileNotFoundError(f"model.encoder_weights: {path} does not exist")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        try:
            encoder.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"model.encoder_weights: {path} is not a torchvision {cfg.encoder} state_dict: {err}")
    return encoder


def build_model(cfg: ModelConfig, in_dim: int, num_classes: int, device=None) -> torch.nn.Module:
    """The MIL head over feature bags of dimension ``in_dim``, or encoder + head for tile bags."""
    if cfg.encoder == "none":
        return build_head(cfg.name, in_dim=in_dim, num_classes=num_classes, **cfg.params)
    from dpgs.tile_model import EncoderMIL

    encoder = build_encoder(cfg, device)
    head = build_head(cfg.name, in_dim=encoder.feature_dim, num_classes=num_classes, **cfg.params)
    return EncoderMIL(encoder, head, cfg.freeze_encoder)


class ModelSpec:
    """A picklable recipe for the model, so Ray actors build identical replicas."""

    def __init__(self, cfg: ModelConfig, in_dim: int, num_classes: int):
        self.cfg = cfg
        self.in_dim = in_dim
        self.num_classes = num_classes

    def build(self, device=None) -> torch.nn.Module:
        return build_model(self.cfg, self.in_dim, self.num_classes, device)
