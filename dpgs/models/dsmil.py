"""DSMIL: dual-stream MIL (Li, Li and Eliceiri, CVPR 2021, arXiv:2011.08939).

Stream 1 (max pooling): instance classifier ``s_i = W_i x_i`` [N, C], ``m_c = max_i s_ic``; the
critical instance of class c is ``k_c = argmax_i s_ic`` (first one on ties).
Stream 2 (attention to the critical instance): ``q_i = tanh(W2 relu(W1 x_i))`` (128-d, the
official non-linear query), ``A_ic = softmax_i(<q_i, q_{k_c}> / sqrt(128))``,
``b_c = sum_i A_ic v_i`` with ``v_i = Dropout(x_i)`` (identity ``passing_v=False``, the default of
the official code, or ``ReLU(W_v x_i)``), bag logits ``Conv1d(C, C, kernel=D)(b)``.
Loss (paper): ``0.5 * CE(bag logits) + 0.5 * CE(max logits)``; reported as ``ce`` and ``max_ce``.
The official code trains with BCE (multi-label) and averages the two sigmoid outputs; with
single-label classes we use cross-entropy and predict with the mean of the two logit vectors.
Both streams act on the input features directly, as in the paper.
"""

from __future__ import annotations

import torch
from torch import nn

from dpgs.models.base import MILHead, cross_entropy
from dpgs.models.layers import Dropout, masked_softmax
from dpgs.models.segment import segment_argmax, segment_ids, segment_max, segment_softmax, segment_sum


class DSMIL(MILHead):
    name = "dsmil"
    supports_mask = True
    packing_exact = True

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        q_dim: int = 128,
        passing_v: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__(in_dim, num_classes)
        self.instance = nn.Linear(in_dim, num_classes)
        self.q = nn.Sequential(nn.Linear(in_dim, q_dim), nn.ReLU(), nn.Linear(q_dim, q_dim), nn.Tanh())
        v = [Dropout(dropout)] + ([nn.Linear(in_dim, in_dim), nn.ReLU()] if passing_v else [])
        self.v = nn.Sequential(*v)
        self.fcc = nn.Conv1d(num_classes, num_classes, kernel_size=in_dim)

    def _out(self, bag_emb, max_logits, y):
        bag_logits = self.fcc(bag_emb).squeeze(-1)  # [B, C, D] -> [B, C]
        logits = (bag_logits + max_logits) / 2
        if y is None:
            return logits, {}
        return logits, {
            "ce": 0.5 * cross_entropy(bag_logits, y),
            "max_ce": 0.5 * cross_entropy(max_logits, y),
        }

    def _attention(self, x, mask):
        """Stream 2 attention [B, N, C] and instance logits [B, N, C] (padding at -inf)."""
        s = self.instance(x)
        if mask is not None:
            s = s.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        crit = s.argmax(1)  # [B, C]
        q = self.q(x)
        q_crit = torch.gather(q, 1, crit.unsqueeze(-1).expand(-1, -1, q.shape[-1]))  # [B, C, Q]
        att = torch.einsum("bnq,bcq->bnc", q, q_crit) / q.shape[-1] ** 0.5
        return masked_softmax(att, None if mask is None else mask.unsqueeze(-1), 1), s

    def _bags(self, x, mask, y):
        att, s = self._attention(x, mask)
        bag_emb = torch.einsum("bnc,bnd->bcd", att, self.v(x))
        return self._out(bag_emb, s.amax(1), y)

    def _packed(self, x, lengths, y):
        seg = segment_ids(lengths)
        s = self.instance(x)  # [M, C]
        crit = segment_argmax(s, lengths, seg)  # [B, C] global rows
        q = self.q(x)
        att = torch.einsum("mq,mcq->mc", q, q[crit][seg]) / q.shape[-1] ** 0.5
        att = segment_softmax(att, lengths, seg)
        bag_emb = segment_sum(att.unsqueeze(-1) * self.v(x).unsqueeze(1), lengths, seg)  # [B, C, D]
        return self._out(bag_emb, segment_max(s, lengths, seg), y)

    def instance_scores(self, x):
        """Stream-2 attention of every instance to the critical instance of the last class."""
        return self._attention(x[None], None)[0][0, :, -1]
