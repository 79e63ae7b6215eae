"""DTFD-MIL: double-tier feature distillation (Zhang et al., CVPR 2022, arXiv:2203.12081).

Tier 1: the bag is split into G pseudo-bags (random split in training, as the paper; contiguous
split of the instance order in eval mode so that predictions are deterministic), every pseudo-bag
is pooled by gated attention over ``h_i = ReLU(W x_i)`` (no bias, 512) and classified with the bag's
label. AFS distillation: the attention-weighted feature sum of each pseudo-bag is its distilled
feature. Tier 2: gated attention over the G distilled features and a classifier give the bag logits.

Loss: ``ce`` (tier 2) + ``tier1`` (mean CE of the pseudo-bags, training only). As in the official
code, where the two tiers have separate optimisers and tier 1 is stepped before the tier-2
backward pass, tier 2 does not back-propagate into tier 1 (the distilled features are detached).
Defaults (official implementation): G = numGroup = 4, mDim 512, attention 128, dropout 0.
A bag with N < G instances uses N pseudo-bags of one instance.
"""

from __future__ import annotations

import torch
from torch import nn

from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import AttentionScorer, Dropout


def pseudo_bag_ids(n: int, groups: int, order: torch.Tensor) -> torch.Tensor:
    """[B, n] pseudo-bag of every instance: ``np.array_split`` of the permutation ``order`` [B, n]
    into ``groups`` chunks (the first ``n % groups`` chunks one longer)."""
    q, r = divmod(n, groups)
    pos = torch.arange(n, device=order.device)
    chunk = torch.where(pos < r * (q + 1), pos // (q + 1), r + (pos - r * (q + 1)) // max(q, 1))
    return torch.empty_like(order).scatter_(1, order, chunk.expand_as(order))


class DTFD(MILHead):
    name = "dtfd"

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden: int = 512,
        attn_dim: int = 128,
        num_groups: int = 4,
        dropout: float = 0.0,
    ):
        super().__init__(in_dim, num_classes)
        if num_groups < 1:
            raise ValueError(f"dtfd: num_groups must be >= 1, got {num_groups}")
        self.num_groups = int(num_groups)
        self.reduce = nn.Sequential(nn.Linear(in_dim, hidden, bias=False), nn.ReLU())
        self.attention = AttentionScorer(hidden, attn_dim, 1, gated=True)
        self.classifier = nn.Sequential(Dropout(dropout), nn.Linear(hidden, num_classes))
        self.attention2 = AttentionScorer(hidden, attn_dim, 1, gated=True)
        self.classifier2 = nn.Sequential(Dropout(dropout), nn.Linear(hidden, num_classes))

    def _bags(self, x, mask, y):
        b, n, _ = x.shape
        groups = min(self.num_groups, n)
        if self.training:
            order = torch.argsort(torch.rand(b, n, device=x.device), dim=1)
        else:
            order = torch.arange(n, device=x.device).expand(b, n)
        member = (
            pseudo_bag_ids(n, groups, order)[:, None, :] == torch.arange(groups, device=x.device)[:, None]
        )
        h = self.reduce(x)
        scores = self.attention(h).squeeze(-1)[:, None, :].masked_fill(~member, float("-inf"))
        pseudo = torch.einsum("bgn,bnd->bgd", torch.softmax(scores, -1), h)  # AFS features [B, G, D]
        a2 = torch.softmax(self.attention2(pseudo.detach()).squeeze(-1), -1)
        logits = self.classifier2(torch.einsum("bg,bgd->bd", a2, pseudo.detach()))
        if y is None:
            return logits, {}
        terms = {"ce": cross_entropy(logits, y)}
        if self.training:
            tier1 = self.classifier(pseudo)  # [B, G, C]
            terms["tier1"] = (
                cross_entropy(tier1.flatten(0, 1), y.repeat_interleave(groups)).view(b, groups).mean(1)
            )
        return logits, terms

    def instance_scores(self, x):
        """Tier-1 attention over the whole bag."""
        return torch.softmax(self.attention(self.reduce(x)).squeeze(-1), 0)
