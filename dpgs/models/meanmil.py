"""Mean-pooling MIL baseline: ``logits = W_c mean_i ReLU(W_e x_i)``.

The embedding (512, dropout 0.25) follows the mean-pooling baselines of CLAM (Lu et al. 2021) and
DTFD-MIL (Zhang et al. 2022). Loss: cross-entropy. Instance score: positive-class probability of
the classifier applied to one instance's embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import embedding
from dpgs.models.segment import segment_mean


class MeanMIL(MILHead):
    name = "meanmil"
    supports_mask = True
    packing_exact = True

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 512, dropout: float = 0.25):
        super().__init__(in_dim, num_classes)
        self.embed = embedding(in_dim, hidden, dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def _bags(self, x, mask, y):
        h = self.embed(x)
        if mask is None:
            pooled = h.mean(1)
        else:
            m = mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1)
        logits = self.classifier(pooled)
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def _packed(self, x, lengths, y):
        logits = self.classifier(segment_mean(self.embed(x), lengths))
        return logits, ({} if y is None else {"ce": cross_entropy(logits, y)})

    def instance_scores(self, x):
        return torch.softmax(self.classifier(self.embed(x)), -1)[:, -1]
