"""Max-pooling MIL baseline (mi-Net style): an instance classifier, bag logits = per-class max.

``s_i = W_c ReLU(W_e x_i)`` [N, C], ``logits_c = max_i s_ic``. Embedding 512 with dropout 0.25 as the
max-pooling baselines of CLAM and DTFD-MIL. Loss: cross-entropy on the pooled logits (the gradient
reaches the maximal instance of each class only).
"""

from __future__ import annotations

import torch
from torch import nn

from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import embedding
from dpgs.models.segment import segment_max


class MaxMIL(MILHead):
    name = "maxmil"
    supports_mask = True
    packing_exact = True

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 512, dropout: float = 0.25):
        super().__init__(in_dim, num_classes)
        self.embed = embedding(in_dim, hidden, dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def _bags(self, x, mask, y):
        s = self.classifier(self.embed(x))
        if mask is not None:
            s = s.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        logits = s.amax(1)
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def _packed(self, x, lengths, y):
        logits = segment_max(self.classifier(self.embed(x)), lengths)
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def instance_scores(self, x):
        return torch.softmax(self.classifier(self.embed(x)), -1)[:, -1]
