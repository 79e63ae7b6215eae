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


def build_model(cfg: ModelConfig, in_dim: int | None, num_classes: int) -> torch.nn.Module:
    """The MIL head over feature bags of dimension ``in_dim``, or with ``model.encoder`` a
    :class:`~dpgs.models.tilemil.TileMIL` (encoder + head over its features; ``in_dim`` is ignored).

    Encoder weights (``model.encoder_weights``) are not loaded here: the driver loads them once
    (:func:`initial_model`) and the DPGS master and workers receive the driver's weights.
    """
    if cfg.encoder is None:
        if in_dim is None:
            raise ValueError("a head over feature bags needs the feature dimension")
        return build_head(cfg.name, in_dim=in_dim, num_classes=num_classes, **cfg.params)
    from dpgs.models.tilemil import TileMIL, build_encoder

    encoder = build_encoder(cfg.encoder, cfg.big_stages, cfg.max_elements)
    head = build_head(cfg.name, in_dim=encoder.feature_dim, num_classes=num_classes, **cfg.params)
    return TileMIL(encoder, head, freeze_encoder=cfg.freeze_encoder, embed_chunk=cfg.embed_chunk, amp=cfg.amp)


def initial_model(spec: ModelSpec) -> torch.nn.Module:
    """The model a run starts from: built from ``spec``, with ``model.encoder_weights`` loaded."""
    model = spec.build()
    if spec.cfg.encoder_weights is not None:
        from dpgs.models.tilemil import load_encoder_weights

        load_encoder_weights(model.encoder, spec.cfg.encoder_weights)
    return model


def input_to(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` moved to ``device``, unless the model streams its input from host memory itself."""
    return x if getattr(model, "host_input", False) else x.to(device, non_blocking=True)


class ModelSpec:
    """A picklable recipe for the model, so Ray actors build identical replicas."""

    def __init__(self, cfg: ModelConfig, in_dim: int | None, num_classes: int):
        self.cfg = cfg
        self.in_dim = in_dim
        self.num_classes = num_classes

    def build(self) -> torch.nn.Module:
        return build_model(self.cfg, self.in_dim, self.num_classes)
