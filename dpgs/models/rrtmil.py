"""RRT-MIL: re-embedded regional transformer + attention pooling (Tang et al., CVPR 2023,
arXiv:2402.17228, "Feature Re-Embedding: Towards Foundation Model-Level Performance in
Computational Pathology").

``h = Dropout(ReLU(W x))`` (512, dropout 0.25). The N instances are laid on a square grid whose side
``ceil(sqrt(N))`` is rounded up to a multiple of ``region_num`` and zero-padded; the grid is cut into
``region_num x region_num`` regions. Re-embedding (RRT encoder):

* R-MSA: ``h + MSA_region(LN(h))``, multi-head self-attention inside every region (8 heads), with
  EPEG: a depthwise (epeg_k=15, 1) convolution of the attention logits added to them;
* CR-MSA: ``h + CRMSA(LN(h))``: every region is summarised into ``crmsa_k`` = 3 tokens by a learned
  softmax over its instances (dispatch), the summaries of all regions attend to each other, and each
  instance receives a softmax combination of its region's updated summaries (combine);
* LayerNorm, then attention pooling ``softmax(w^T ReLU(V h_i))`` (non-gated, 128) and a linear
  classifier. Loss: cross-entropy.

Padding tokens of the grid are excluded from the attention keys and from the dispatch softmax (the
official code lets zero tokens take part); results are identical for any bag whose grid is full.
Settings (official defaults): region_num 8, epeg_k 15, crmsa_k 3, 8 heads, attention dropout 0.1.
The grid depends on N, so padded batches run bag by bag.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpgs.models.attention import MultiHeadAttention
from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import AttentionScorer, embedding


def region_partition(h: torch.Tensor, region_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [B, N, D] -> regions [B * R, P, D] (R = region_num^2 regions of P tokens) and valid [B * R, P].

    Token i sits at row-major position i of a zero-padded square grid of side
    ``s = ceil(sqrt(N))`` rounded up to a multiple of region_num.
    """
    b, n, d = h.shape
    side = math.ceil(math.sqrt(n))
    side += -side % region_num
    size = side // region_num
    grid = torch.cat([h, h.new_zeros(b, side * side - n, d)], 1)
    valid = (torch.arange(side * side, device=h.device) < n).expand(b, -1)

    def cut(t):
        t = t.reshape(b, region_num, size, region_num, size, *t.shape[2:])
        return t.transpose(2, 3).reshape(b * region_num * region_num, size * size, *t.shape[5:])

    return cut(grid), cut(valid)


def region_merge(regions: torch.Tensor, b: int, n: int, region_num: int) -> torch.Tensor:
    """Inverse of ``region_partition``: regions [B * R, P, D] -> [B, N, D] (padding dropped)."""
    size = math.isqrt(regions.shape[1])
    d = regions.shape[-1]
    t = regions.reshape(b, region_num, region_num, size, size, d).transpose(2, 3)
    return t.reshape(b, -1, d)[:, :n]


class CrossRegionAttention(nn.Module):
    """CR-MSA: dispatch each region to k summary tokens, self-attention across all regions' summaries
    of one bag, and combine back to the instances."""

    def __init__(self, dim: int, heads: int, k: int, dropout: float):
        super().__init__()
        self.phi = nn.Linear(dim, k, bias=False)
        self.attn = MultiHeadAttention(dim, heads, dropout)

    def forward(self, regions: torch.Tensor, valid: torch.Tensor, b: int) -> torch.Tensor:
        logits = self.phi(regions)  # [G, P, k]
        empty = ~valid.any(1)  # regions made only of grid padding
        dispatch_logits = logits.masked_fill(~valid.unsqueeze(-1) & ~empty[:, None, None], float("-inf"))
        dispatch = torch.softmax(dispatch_logits, 1)
        summary = torch.einsum("gpc,gpk->gkc", regions, dispatch)  # [G, k, D]
        g, k, d = summary.shape
        key_mask = (~empty).repeat_interleave(k).view(b, -1)
        mixed = self.attn(summary.reshape(b, -1, d), key_mask).reshape(g, k, d)
        return torch.einsum("gkc,gpk->gpc", mixed, torch.softmax(logits, -1))


class RRTMIL(MILHead):
    name = "rrtmil"

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden: int = 512,
        heads: int = 8,
        region_num: int = 8,
        epeg_k: int = 15,
        crmsa_k: int = 3,
        attn_dim: int = 128,
        dropout: float = 0.25,
        attn_dropout: float = 0.1,
    ):
        super().__init__(in_dim, num_classes)
        if region_num < 1 or crmsa_k < 1:
            raise ValueError("rrtmil: region_num and crmsa_k must be >= 1")
        self.region_num = int(region_num)
        self.embed = embedding(in_dim, hidden, dropout)
        self.norm1 = nn.LayerNorm(hidden)
        self.rmsa = MultiHeadAttention(hidden, heads, attn_dropout, epeg_k)
        self.norm2 = nn.LayerNorm(hidden)
        self.crmsa = CrossRegionAttention(hidden, heads, crmsa_k, attn_dropout)
        self.norm = nn.LayerNorm(hidden)
        self.pool = AttentionScorer(hidden, attn_dim, 1, gated=False, act="relu")
        self.classifier = nn.Linear(hidden, num_classes)

    def _reembed(self, x: torch.Tensor) -> torch.Tensor:
        """The RRT encoder: [B, N, in_dim] -> re-embedded instances [B, N, hidden]."""
        h = self.embed(x)
        b, n, _ = h.shape
        regions, valid = region_partition(self.norm1(h), self.region_num)
        keys = valid | ~valid.any(1, keepdim=True)  # regions of pure padding attend among themselves
        h = h + region_merge(self.rmsa(regions, keys), b, n, self.region_num)
        regions, valid = region_partition(self.norm2(h), self.region_num)
        h = h + region_merge(self.crmsa(regions, valid, b), b, n, self.region_num)
        return self.norm(h)

    def _bags(self, x, mask, y):
        h = self._reembed(x)
        a = torch.softmax(self.pool(h).squeeze(-1), -1)
        logits = self.classifier(torch.einsum("bn,bnd->bd", a, h))
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def instance_scores(self, x):
        return torch.softmax(self.pool(self._reembed(x[None])).squeeze(-1), -1)[0]
