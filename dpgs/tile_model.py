"""Tile encoder + MIL head trained end to end on bags of tile images.

A bag is a tensor of tiles [N, 3, h, w]. The encoder (a big-layer ResNet, ``dpgs.biglayers``) maps it
to embeddings [N, D] that feed any MIL head. Each bag is encoded on its own, so training-mode
BatchNorm statistics are those of the bag (as in the Big-Layers paper) and a bag's gradient does not
depend on which other bags share its step or its worker: DPGS over P workers then equals the
single-process step exactly.

With ``freeze_encoder`` the encoder stays in eval mode (running statistics), its parameters do not
require gradients and embeddings are computed under ``no_grad``: the frozen-encoder baseline.
"""

from __future__ import annotations

import torch
from torch import nn


class EncoderMIL(nn.Module):
    def __init__(self, encoder: nn.Module, head: nn.Module, freeze_encoder: bool = False):
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.freeze_encoder = freeze_encoder
        self.name = getattr(head, "name", type(head).__name__)
        self.packing_exact = getattr(head, "packing_exact", False)
        self.supports_mask = False
        if freeze_encoder:
            self.encoder.requires_grad_(False)
            self.encoder.eval()

    def train(self, mode: bool = True) -> EncoderMIL:
        super().train(mode)
        if self.freeze_encoder:
            self.encoder.eval()
        return self

    def embed(self, tiles: torch.Tensor) -> torch.Tensor:
        """[N, 3, h, w] -> [N, D] on the head's device."""
        head_device = next(self.head.parameters()).device
        if self.freeze_encoder:
            with torch.no_grad():
                return self.encoder(tiles).to(head_device)
        return self.encoder(tiles).to(head_device)

    def _check_mask(self, mask) -> None:
        if mask is not None:
            raise ValueError("tile bags are not padded: EncoderMIL takes one bag [N, 3, h, w] without a mask")

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self._check_mask(mask)
        return self.head(self.embed(x))

    def loss(self, x, y, mask=None, class_weights=None) -> dict:
        self._check_mask(mask)
        return self.head.loss(self.embed(x), y, class_weights=class_weights)

    def loss_packed(self, x, lengths, y, class_weights=None) -> dict:
        """Bags concatenated along the tile axis; each bag is encoded separately."""
        feats = torch.cat([self.embed(bag) for bag in torch.split(x, lengths.tolist())])
        return self.head.loss_packed(feats, lengths.to(feats.device), y, class_weights=class_weights)

    def instance_scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.instance_scores(self.embed(x))
