"""Building blocks shared by several heads."""

from __future__ import annotations

import torch
from torch import nn


def embedding(in_dim: int, hidden: int, dropout: float, bias: bool = True) -> nn.Sequential:
    """Instance embedding ``Dropout(ReLU(W x + b))`` (the fc layer of CLAM / DTFD / ACMIL)."""
    return nn.Sequential(nn.Linear(in_dim, hidden, bias=bias), nn.ReLU(), nn.Dropout(dropout))


class AttentionScorer(nn.Module):
    """Attention logits of Ilse et al. 2018 for K branches.

    gated: ``a_i = W (tanh(V h_i) * sigmoid(U h_i)) + b``; plain: ``a_i = W act(V h_i) + b``
    (act = tanh in Ilse et al.). Returns [..., K] unnormalised scores.
    """

    def __init__(
        self,
        dim: int,
        attn_dim: int,
        branches: int = 1,
        gated: bool = True,
        dropout: float = 0.0,
        act: str = "tanh",
    ):
        super().__init__()
        acts = {"tanh": nn.Tanh, "relu": nn.ReLU}
        if act not in acts:
            raise ValueError(f"attention activation must be one of {sorted(acts)}, got {act!r}")
        self.v = nn.Sequential(nn.Linear(dim, attn_dim), acts[act](), nn.Dropout(dropout))
        self.u = nn.Sequential(nn.Linear(dim, attn_dim), nn.Sigmoid(), nn.Dropout(dropout)) if gated else None
        self.w = nn.Linear(attn_dim, branches)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.v(h)
        if self.u is not None:
            a = a * self.u(h)
        return self.w(a)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, dim: int) -> torch.Tensor:
    """softmax over ``dim`` with entries where ``mask`` is False excluded (mask broadcasts to scores)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=dim)
