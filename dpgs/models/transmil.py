"""TransMIL (Shao et al., NeurIPS 2021, arXiv:2106.00908): correlated MIL with a transformer.

``h = ReLU(W x)`` (512); the N tokens are completed to a square grid of side ``ceil(sqrt(N))`` by
repeating the first tokens, a class token is prepended, then
``TransLayer -> PPEG -> TransLayer -> LayerNorm``, and the class token is classified. A TransLayer is
``h + NystromAttention(LayerNorm(h))`` (8 heads, 256 landmarks, 6 pseudo-inverse iterations,
residual value convolution of kernel 33, dropout 0.1: the published settings). PPEG adds depthwise
7x7, 5x5 and 3x3 convolutions of the token grid to the grid. Loss: cross-entropy.
Instance scores: class-token attention of the second layer (duplicated grid tokens summed back).
The grid and the landmarks depend on N, so padded batches run bag by bag (no native mask).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpgs.models.attention import NystromAttention
from dpgs.models.base import MILHead, cross_entropy


class PPEG(nn.Module):
    """Pyramid position encoding generator: grid + dwconv7(grid) + dwconv5(grid) + dwconv3(grid)."""

    def __init__(self, dim: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(dim, dim, k, padding=k // 2, groups=dim) for k in (7, 5, 3))

    def forward(self, tokens: torch.Tensor, side: int) -> torch.Tensor:
        cls, grid = tokens[:, :1], tokens[:, 1:]
        b, n, d = grid.shape
        g = grid.transpose(1, 2).reshape(b, d, side, side)
        g = g + sum(conv(g) for conv in self.convs)
        return torch.cat([cls, g.flatten(2).transpose(1, 2)], 1)


class TransLayer(nn.Module):
    def __init__(self, dim: int, heads: int, landmarks: int, pinv_iterations: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = NystromAttention(dim, heads, landmarks, pinv_iterations, 33, dropout)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class TransMIL(MILHead):
    name = "transmil"

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden: int = 512,
        heads: int = 8,
        landmarks: int | None = None,
        pinv_iterations: int = 6,
        dropout: float = 0.1,
    ):
        super().__init__(in_dim, num_classes)
        landmarks = hidden // 2 if landmarks is None else landmarks
        self.embed = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden))
        self.layer1 = TransLayer(hidden, heads, landmarks, pinv_iterations, dropout)
        self.ppeg = PPEG(hidden)
        self.layer2 = TransLayer(hidden, heads, landmarks, pinv_iterations, dropout)
        self.norm = nn.LayerNorm(hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def _tokens(self, x):
        """Class token + square grid after layer 1 and PPEG: [B, 1 + side^2, hidden], side."""
        h = self.embed(x)
        n = h.shape[1]
        side = math.ceil(math.sqrt(n))
        h = torch.cat([h, h[:, : side * side - n]], 1)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1).to(h.dtype), h], 1)
        return self.ppeg(self.layer1(h), side), side

    def _bags(self, x, mask, y):
        tokens, _ = self._tokens(x)
        logits = self.classifier(self.norm(self.layer2(tokens))[:, 0])
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def instance_scores(self, x):
        tokens, _ = self._tokens(x[None])
        row = self.layer2.attn.attention_row(self.layer2.norm(tokens))[0, 1:]
        n = x.shape[0]
        scores = row[:n].clone()
        scores[: row.shape[0] - n] += row[n:]
        return scores
