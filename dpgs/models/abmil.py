"""ABMIL: attention-based deep MIL (Ilse, Tomczak and Welling, ICML 2018, arXiv:1802.04712).

``h_i = ReLU(W_e x_i)``, attention ``a = softmax_i(w^T (tanh(V h_i) * sigmoid(U h_i)))`` (gated; the
plain variant drops the sigmoid gate), bag embedding ``z = sum_i a_i h_i``, logits ``W_c z``.
Loss: cross-entropy. Defaults from the paper: embedding M=500, attention L=128, one branch, gated.
The paper has no dropout in the MIL part; ``dropout=0.25`` after the embedding and in the attention
is the regularisation CLAM uses for the same architecture on slide features.
"""

from __future__ import annotations

import torch
from torch import nn

from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import AttentionScorer, embedding, masked_softmax
from dpgs.models.segment import segment_ids, segment_softmax, segment_sum


class ABMIL(MILHead):
    """Gated (default) or plain attention pooling; exact under masks and packing."""

    name = "abmil"
    supports_mask = True
    packing_exact = True

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden: int = 500,
        attn_dim: int = 128,
        gated: bool = True,
        dropout: float = 0.25,
    ):
        super().__init__(in_dim, num_classes)
        self.embed = embedding(in_dim, hidden, dropout)
        self.attention = AttentionScorer(hidden, attn_dim, 1, gated, dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def _bags(self, x, mask, y):
        h = self.embed(x)
        a = masked_softmax(self.attention(h).squeeze(-1), mask, -1)
        logits = self.classifier(torch.einsum("bn,bnd->bd", a, h))
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def _packed(self, x, lengths, y):
        seg = segment_ids(lengths)
        h = self.embed(x)
        a = segment_softmax(self.attention(h), lengths, seg)
        logits = self.classifier(segment_sum(a * h, lengths, seg))
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def instance_scores(self, x):
        return torch.softmax(self.attention(self.embed(x)).squeeze(-1), 0)
