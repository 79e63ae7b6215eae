"""CLAM-SB and CLAM-MB (Lu et al., Nature Biomedical Engineering 2021, arXiv:2004.09666).

Embedding ``h_i = Dropout(ReLU(W x_i))`` (512), gated attention (256) with one branch (SB) or one
branch per class (MB), ``z_k = sum_i softmax_i(a_ik) h_i``; SB classifies ``z`` with one linear layer,
MB scores class c with its own linear layer on ``z_c``.

Instance-level clustering (training only): for the bag's class y, the ``k`` instances with the highest
attention (branch y for MB, the single branch for SB) are pseudo-labelled 1 and the ``k`` lowest 0,
and the class-y instance classifier (``Linear(512, 2)``) is trained on them. With ``subtyping`` the
``k`` highest instances of every other class c's branch are labelled 0 for classifier c, and the
instance loss is the mean over classes (as CLAM). Per-bag total in training:
``bag_weight * CE + (1 - bag_weight) * instance`` (components ``ce`` and ``instance``); in eval
mode the loss is the bag cross-entropy alone (what CLAM reports as validation loss).

Published defaults: k_sample=8, bag_weight=0.7, dropout 0.25, sizes 512/256, smooth top-1 SVM
instance loss (Berrada et al. 2018, tau=1, alpha=1; ``instance_loss="ce"`` for cross-entropy).
A bag with N < 2k instances uses k_b = N // 2 (disjoint top and bottom sets; the original code
fails on such bags); a single-instance bag has no instance term.
The instance loss is computed for all bags at once with ``segment_topk``, so packing is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import AttentionScorer, embedding, masked_softmax
from dpgs.models.segment import segment_ids, segment_softmax, segment_sum, segment_topk

INSTANCE_LOSSES = ("svm", "ce")


def smooth_top1_svm(logits: torch.Tensor, target: torch.Tensor, tau: float = 1.0, alpha: float = 1.0):
    """Smooth top-1 SVM loss (Berrada et al. 2018), elementwise:
    ``tau * logsumexp((s + alpha * [j != y]) / tau) - s_y``."""
    margin = alpha * (1.0 - F.one_hot(target, logits.shape[-1]).to(logits.dtype))
    return tau * torch.logsumexp((logits + margin) / tau, dim=-1) - logits.gather(-1, target[:, None])[:, 0]


class CLAM(MILHead):
    """Shared implementation; use ``CLAMSB`` or ``CLAMMB``."""

    supports_mask = True
    packing_exact = True
    multi_branch = False

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden: int = 512,
        attn_dim: int = 256,
        k_sample: int = 8,
        bag_weight: float = 0.7,
        instance_loss: str = "svm",
        subtyping: bool = False,
        dropout: float = 0.25,
    ):
        super().__init__(in_dim, num_classes)
        if instance_loss not in INSTANCE_LOSSES:
            raise ValueError(
                f"{self.name}: instance_loss must be one of {INSTANCE_LOSSES}, got {instance_loss!r}"
            )
        if k_sample < 1 or not 0.0 <= bag_weight <= 1.0:
            raise ValueError(f"{self.name}: need k_sample >= 1 and 0 <= bag_weight <= 1")
        self.k_sample, self.bag_weight = int(k_sample), float(bag_weight)
        self.instance_loss, self.subtyping = instance_loss, bool(subtyping)
        self.branches = num_classes if self.multi_branch else 1
        self.embed = embedding(in_dim, hidden, dropout)
        self.attention = AttentionScorer(hidden, attn_dim, self.branches, True, dropout)
        if self.multi_branch:
            self.classifiers = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(num_classes))
        else:
            self.classifier = nn.Linear(hidden, num_classes)
        self.instance_classifiers = nn.ModuleList(nn.Linear(hidden, 2) for _ in range(num_classes))

    def _classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [B, branches, D] -> logits [B, C]."""
        if self.multi_branch:
            return torch.cat([clf(pooled[:, c]) for c, clf in enumerate(self.classifiers)], dim=1)
        return self.classifier(pooled[:, 0])

    def _element_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        flat, t = logits.reshape(-1, 2), target.reshape(-1)
        out = (
            smooth_top1_svm(flat, t)
            if self.instance_loss == "svm"
            else F.cross_entropy(flat, t, reduction="none")
        )
        return out.view(target.shape)

    def _instance_terms(self, h, raw, lengths, y) -> torch.Tensor:
        """[B] instance clustering loss of packed bags: h [M, D], attention logits raw [M, branches]."""
        seg = segment_ids(lengths)
        k_b = torch.clamp(lengths // 2, max=self.k_sample)
        denom = k_b.clamp(min=1).to(h.dtype)
        weight = torch.stack([c.weight for c in self.instance_classifiers])  # [C, 2, D]
        bias = torch.stack([c.bias for c in self.instance_classifiers])  # [C, 2]
        branch = y if self.multi_branch else torch.zeros_like(y)
        s_in = raw.gather(1, branch[seg].unsqueeze(1)).squeeze(1)
        top, valid = segment_topk(s_in, lengths, k_b, seg)
        bottom, _ = segment_topk(-s_in, lengths, k_b, seg)
        idx = torch.cat([top, bottom], 1)  # [B, 2k]
        target = torch.cat([torch.ones_like(top), torch.zeros_like(bottom)], 1)
        logits = torch.einsum("bkd,bod->bko", h[idx], weight[y]) + bias[y].unsqueeze(1)
        loss_el = self._element_loss(logits, target) * torch.cat([valid, valid], 1)
        total = loss_el.sum(1) / (2 * denom)
        if not self.subtyping:
            return total
        for c in range(self.num_classes):
            top_c, valid_c = segment_topk(raw[:, c if self.multi_branch else 0], lengths, k_b, seg)
            logits_c = h[top_c] @ weight[c].T + bias[c]
            out_c = (self._element_loss(logits_c, torch.zeros_like(top_c)) * valid_c).sum(1) / denom
            total = total + out_c * (y != c).to(h.dtype)
        return total / self.num_classes

    def _terms(self, logits, y, h, raw, lengths):
        if y is None:
            return {}
        ce = cross_entropy(logits, y)
        if not self.training:
            return {"ce": ce}
        inst = self._instance_terms(h, raw, lengths, y)
        return {"ce": self.bag_weight * ce, "instance": (1.0 - self.bag_weight) * inst}

    def _bags(self, x, mask, y):
        h = self.embed(x)
        raw = self.attention(h)  # [B, N, branches]
        a = masked_softmax(raw, None if mask is None else mask.unsqueeze(-1), 1)
        logits = self._classify(torch.einsum("bnk,bnd->bkd", a, h))
        if mask is None:
            lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
            flat_h, flat_raw = h.reshape(-1, h.shape[-1]), raw.reshape(-1, raw.shape[-1])
        else:
            lengths, flat_h, flat_raw = mask.sum(1), h[mask], raw[mask]
        return logits, self._terms(logits, y, flat_h, flat_raw, lengths)

    def _packed(self, x, lengths, y):
        seg = segment_ids(lengths)
        h = self.embed(x)
        raw = self.attention(h)
        a = segment_softmax(raw, lengths, seg)
        logits = self._classify(segment_sum(a.unsqueeze(-1) * h.unsqueeze(1), lengths, seg))
        return logits, self._terms(logits, y, h, raw, lengths)

    def instance_scores(self, x):
        """Attention of the (last class's, for MB) branch."""
        return torch.softmax(self.attention(self.embed(x))[:, -1], 0)


class CLAMSB(CLAM):
    """CLAM single-branch."""

    name = "clam_sb"


class CLAMMB(CLAM):
    """CLAM multi-branch: one attention branch and one bag classifier per class."""

    name = "clam_mb"
    multi_branch = True
