"""ACMIL: attention-challenging MIL (Zhang et al., ECCV 2024, arXiv:2311.07125).

``h_i = ReLU(W x_i)`` (128), gated attention with ``n_token`` = 5 branches (multiple branch attention,
MBA). STKIM (training only): in every branch, ``mask_drop`` = 60% of the ``n_masked_patch`` = 10
most attended instances (chosen at random) are removed from the softmax. Branch t pools
``z_t = sum_i softmax(a_t)_i h_i`` and has its own classifier; the bag classifier acts on the pooling
with the branch-averaged attention ``mean_t softmax(a_t)``.
Loss (paper, all weights 1): ``ce`` (bag classifier) + ``branch`` (mean CE of the branch
classifiers) + ``diversity`` (mean pairwise cosine similarity of the branch attention maps); the two
auxiliary terms are training-only. Defaults follow the official configs (D_inner 128, attention 128,
dropout 0). Logits: the bag classifier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import AttentionScorer, Dropout


class ACMIL(MILHead):
    name = "acmil"
    supports_mask = True

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden: int = 128,
        attn_dim: int = 128,
        n_token: int = 5,
        n_masked_patch: int = 10,
        mask_drop: float = 0.6,
        dropout: float = 0.0,
    ):
        super().__init__(in_dim, num_classes)
        if n_token < 1 or n_masked_patch < 0 or not 0.0 <= mask_drop < 1.0:
            raise ValueError("acmil: need n_token >= 1, n_masked_patch >= 0 and 0 <= mask_drop < 1")
        self.n_token, self.n_masked_patch, self.mask_drop = (
            int(n_token),
            int(n_masked_patch),
            float(mask_drop),
        )
        self.embed = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), Dropout(dropout))
        self.attention = AttentionScorer(hidden, attn_dim, n_token, gated=True)
        self.branch_classifiers = nn.ModuleList(nn.Linear(hidden, num_classes) for _ in range(n_token))
        self.classifier = nn.Linear(hidden, num_classes)

    def _stkim(self, a: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Mask (set to -inf) a random ``mask_drop`` share of each branch's top instances; a [B, N, K]."""
        kk = min(self.n_masked_patch, a.shape[1])
        if kk == 0:
            return a
        top = torch.topk(a, kk, dim=1).indices  # [B, kk, K]; padding (at -inf) ranks last
        count = (torch.clamp(lengths, max=self.n_masked_patch).to(a.dtype) * self.mask_drop).floor()  # [B]
        keys = torch.rand(top.shape, device=a.device)
        keys = keys.masked_fill(
            torch.arange(kk, device=a.device)[None, :, None] >= lengths[:, None, None], 2.0
        )
        rank = keys.argsort(1).argsort(1)
        drop = rank < count[:, None, None]
        dropped = torch.zeros_like(a, dtype=torch.bool).scatter(1, top, drop)
        return a.masked_fill(dropped, float("-inf"))

    def _bags(self, x, mask, y):
        h = self.embed(x)
        a = self.attention(h)  # [B, N, K]
        if mask is not None:
            a = a.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        lengths = torch.full((x.shape[0],), x.shape[1], device=x.device) if mask is None else mask.sum(1)
        if self.training and self.n_masked_patch > 0:
            a = self._stkim(a, lengths)
        attn = torch.softmax(a, 1)  # [B, N, K]
        logits = self.classifier(torch.einsum("bn,bnd->bd", attn.mean(-1), h))
        if y is None:
            return logits, {}
        terms = {"ce": cross_entropy(logits, y)}
        if self.training:
            z = torch.einsum("bnk,bnd->bkd", attn, h)
            branch = torch.stack([clf(z[:, t]) for t, clf in enumerate(self.branch_classifiers)], 1)
            terms["branch"] = (
                cross_entropy(branch.flatten(0, 1), y.repeat_interleave(self.n_token))
                .view(-1, self.n_token)
                .mean(1)
            )
            terms["diversity"] = self._diversity(attn)
        return logits, terms

    def _diversity(self, attn: torch.Tensor) -> torch.Tensor:
        """[B] mean cosine similarity over the pairs of branch attention maps (0 with one branch)."""
        if self.n_token == 1:
            return attn.new_zeros(attn.shape[0])
        unit = F.normalize(attn, dim=1)
        gram = torch.einsum("bnk,bnl->bkl", unit, unit)
        i, j = torch.triu_indices(self.n_token, self.n_token, 1, device=attn.device)
        return gram[:, i, j].mean(1)

    def instance_scores(self, x):
        """Branch-averaged attention (the pooling weights of the bag classifier)."""
        return torch.softmax(self.attention(self.embed(x)), 0).mean(-1)
