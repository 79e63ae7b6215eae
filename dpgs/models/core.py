"""MIL heads with exact packed (segment-wise) batches: ABMIL, mean, max, DSMIL, CLAM-SB/MB.

Shapes: one bag x [N, D] -> logits [C]; a padded batch x [B, N, D] with mask [B, N] (True = real
instance) -> [B, C]; a packed batch x [sum N_b, D] with lengths [B] -> [B, C]. Every loss dictionary
holds ``loss`` (mean over bags of the per-bag total), ``per_bag`` [B], ``logits`` [B, C] and the
components. The per-bag total is ``class_weight[y] * (bag loss + auxiliary losses)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- segment operations


def segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    """[sum N_b] bag index of every instance."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def segment_max(values: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Per-bag max of values [M, ...] -> [n, ...]."""
    shape = (n, *values.shape[1:])
    index = seg.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
    return values.new_full(shape, float("-inf")).scatter_reduce(0, index, values, "amax", include_self=True)


def segment_sum(values: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    out = values.new_zeros((n, *values.shape[1:]))
    return out.index_add(0, seg, values)


def segment_softmax(scores: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """softmax of scores [M, K] within each bag: exp(s - max_b) / sum_b exp(s - max_b)."""
    shifted = scores - segment_max(scores.detach(), seg, n)[seg]
    e = shifted.exp()
    return e / segment_sum(e, seg, n)[seg]


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, dim: int) -> torch.Tensor:
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=dim)


# ----------------------------------------------------------------------------- base class


class MILHead(nn.Module):
    """Base: subclasses implement ``_bag`` (padded [B, N, D] + mask) and ``_packed``."""

    name = "mil"
    supports_mask = True
    packing_exact = True

    def __init__(self, in_dim: int, num_classes: int):
        super().__init__()
        self.in_dim = in_dim
        self.num_classes = num_classes

    # subclasses: return (logits [B, C], aux dict of per-bag tensors [B])
    def _padded(self, x, mask, y=None):
        raise NotImplementedError

    def _packed(self, x, lengths, y=None):
        raise NotImplementedError

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2:
            return self._padded(x[None], None)[0][0]
        return self._padded(x, mask)[0]

    def forward_packed(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._packed(x, lengths)[0]

    def _finish(self, logits, aux, y, class_weights) -> dict:
        y = y.reshape(-1).to(logits.device)
        ce = F.cross_entropy(logits, y, reduction="none")
        total = self.bag_weight * ce + sum(aux.values()) if aux else ce
        if class_weights is not None:
            total = total * class_weights.to(logits.device)[y]
        out = {"loss": total.mean(), "per_bag": total, "logits": logits, "ce": ce.mean()}
        out.update({k: v.mean() for k, v in aux.items()})
        return out

    bag_weight = 1.0

    def loss(self, x, y, mask=None, class_weights=None) -> dict:
        y = torch.as_tensor(y)
        if x.dim() == 2:
            logits, aux = self._padded(x[None], None, y.reshape(1))
        else:
            logits, aux = self._padded(x, mask, y.reshape(-1))
        return self._finish(logits, aux, y, class_weights)

    def loss_packed(self, x, lengths, y, class_weights=None) -> dict:
        logits, aux = self._packed(x, lengths, y.reshape(-1))
        return self._finish(logits, aux, y, class_weights)

    def instance_scores(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def embedding(in_dim: int, hidden: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout))


# ----------------------------------------------------------------------------- heads


class GatedAttention(nn.Module):
    """Ilse et al. 2018: a_i = w^T (tanh(V h_i) * sigmoid(U h_i)); plain attention drops the gate."""

    def __init__(self, dim: int, attn_dim: int, branches: int = 1, gated: bool = True, dropout: float = 0.0):
        super().__init__()
        self.v = nn.Sequential(nn.Linear(dim, attn_dim), nn.Tanh(), nn.Dropout(dropout))
        self.u = nn.Sequential(nn.Linear(dim, attn_dim), nn.Sigmoid(), nn.Dropout(dropout)) if gated else None
        self.w = nn.Linear(attn_dim, branches)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.v(h)
        if self.u is not None:
            a = a * self.u(h)
        return self.w(a)  # [..., branches]


class ABMIL(MILHead):
    """Attention-based deep MIL (Ilse et al. 2018): gated attention pooling of embedded instances.

    Defaults: embedding 512 -> attention 128 -> 1 branch, dropout 0.25 (CLAM's ABMIL baseline).
    """

    name = "abmil"

    def __init__(
        self,
        in_dim,
        num_classes,
        hidden: int = 512,
        attn_dim: int = 128,
        gated: bool = True,
        dropout: float = 0.25,
    ):
        super().__init__(in_dim, num_classes)
        self.embed = embedding(in_dim, hidden, dropout)
        self.attention = GatedAttention(hidden, attn_dim, 1, gated, dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def _padded(self, x, mask, y=None):
        h = self.embed(x)
        a = masked_softmax(self.attention(h).squeeze(-1), mask, -1)
        return self.classifier(torch.einsum("bn,bnd->bd", a, h)), {}

    def _packed(self, x, lengths, y=None):
        seg, n = segment_ids(lengths), lengths.numel()
        h = self.embed(x)
        a = segment_softmax(self.attention(h), seg, n)
        return self.classifier(segment_sum(a * h, seg, n)), {}

    def instance_scores(self, x):
        return torch.softmax(self.attention(self.embed(x)).squeeze(-1), 0)


class MeanMIL(MILHead):
    """Mean pooling of embedded instances, then a linear classifier."""

    name = "meanmil"

    def __init__(self, in_dim, num_classes, hidden: int = 512, dropout: float = 0.25):
        super().__init__(in_dim, num_classes)
        self.embed = embedding(in_dim, hidden, dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def _padded(self, x, mask, y=None):
        h = self.embed(x)
        if mask is None:
            return self.classifier(h.mean(1)), {}
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.classifier((h * m).sum(1) / m.sum(1).clamp(min=1)), {}

    def _packed(self, x, lengths, y=None):
        seg, n = segment_ids(lengths), lengths.numel()
        pooled = segment_sum(self.embed(x), seg, n) / lengths.unsqueeze(-1).to(x.dtype)
        return self.classifier(pooled), {}

    def instance_scores(self, x):
        return self.classifier(self.embed(x)).softmax(-1)[:, -1]


class MaxMIL(MILHead):
    """Instance classifier followed by max pooling of the instance logits (per class)."""

    name = "maxmil"

    def __init__(self, in_dim, num_classes, hidden: int = 512, dropout: float = 0.25):
        super().__init__(in_dim, num_classes)
        self.embed = embedding(in_dim, hidden, dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def _padded(self, x, mask, y=None):
        s = self.classifier(self.embed(x))
        if mask is not None:
            s = s.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        return s.amax(1), {}

    def _packed(self, x, lengths, y=None):
        return segment_max(self.classifier(self.embed(x)), segment_ids(lengths), lengths.numel()), {}

    def instance_scores(self, x):
        return self.classifier(self.embed(x)).softmax(-1)[:, -1]


class DSMIL(MILHead):
    """Dual-stream MIL (Li et al. 2021): max-instance stream + attention to the critical instance.

    Stream 1: instance classifier, bag score = max over instances. Stream 2: attention
    softmax(<q_i, q_crit> / sqrt(d)) over instances, bag embedding -> Conv1d classifier.
    Bag logits = (stream1 + stream2) / 2 and the loss is the mean of both streams' CE (as the paper).
    """

    name = "dsmil"
    bag_weight = 0.5

    def __init__(self, in_dim, num_classes, hidden: int = 256, q_dim: int = 128, dropout: float = 0.0):
        super().__init__(in_dim, num_classes)
        self.embed = embedding(in_dim, hidden, dropout)
        self.instance = nn.Linear(hidden, num_classes)
        self.q = nn.Sequential(nn.Linear(hidden, q_dim), nn.Tanh())
        self.v = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden, hidden))
        self.fcc = nn.Conv1d(num_classes, num_classes, kernel_size=hidden)

    def _combine(self, max_logits, bag_emb):
        bag_logits = self.fcc(bag_emb).squeeze(-1)  # [B, C]
        return bag_logits, max_logits

    def _padded(self, x, mask, y=None):
        h = self.embed(x)
        s = self.instance(h)  # [B, N, C]
        s_masked = s if mask is None else s.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        crit = s_masked.argmax(1)  # [B, C]
        q = self.q(h)  # [B, N, Q]
        q_crit = torch.gather(q, 1, crit.unsqueeze(-1).expand(-1, -1, q.shape[-1]))  # [B, C, Q]
        att = torch.einsum("bnq,bcq->bnc", q, q_crit) / q.shape[-1] ** 0.5
        att = masked_softmax(att, None if mask is None else mask.unsqueeze(-1), 1)
        bag_emb = torch.einsum("bnc,bnd->bcd", att, self.v(h))
        bag_logits, max_logits = self._combine(s_masked.amax(1), bag_emb)
        return self._out(bag_logits, max_logits, y)

    def _packed(self, x, lengths, y=None):
        seg, n = segment_ids(lengths), lengths.numel()
        h = self.embed(x)
        s = self.instance(h)  # [M, C]
        max_logits = segment_max(s, seg, n)
        m = s.shape[0]
        position = torch.arange(m, device=s.device).unsqueeze(-1).expand_as(s)
        key = torch.where(s == max_logits[seg], m - position, torch.zeros_like(position))
        best = torch.zeros(n, s.shape[1], dtype=torch.long, device=s.device)
        crit = m - best.scatter_reduce(0, seg.unsqueeze(-1).expand_as(key), key, "amax")  # first max row
        q = self.q(h)
        q_crit = q[crit]  # [B, C, Q]
        att = torch.einsum("mq,mcq->mc", q, q_crit[seg]) / q.shape[-1] ** 0.5
        att = segment_softmax(att, seg, n)
        bag_emb = segment_sum(att.unsqueeze(-1) * self.v(h).unsqueeze(1), seg, n)  # [B, C, D]
        bag_logits, max_logits = self._combine(max_logits, bag_emb)
        return self._out(bag_logits, max_logits, y)

    def _out(self, bag_logits, max_logits, y):
        logits = (bag_logits + max_logits) / 2
        if y is None:
            return logits, {}
        return logits, {"_bag": bag_logits, "_max": max_logits}

    def _finish(self, logits, aux, y, class_weights) -> dict:
        y = y.reshape(-1).to(logits.device)
        ce_bag = F.cross_entropy(aux["_bag"], y, reduction="none")
        ce_max = F.cross_entropy(aux["_max"], y, reduction="none")
        total = 0.5 * ce_bag + 0.5 * ce_max
        if class_weights is not None:
            total = total * class_weights.to(logits.device)[y]
        return {
            "loss": total.mean(),
            "per_bag": total,
            "logits": logits,
            "ce": ce_bag.mean(),
            "max_ce": ce_max.mean(),
        }

    def instance_scores(self, x):
        return self.instance(self.embed(x)).softmax(-1)[:, -1]


class CLAM(MILHead):
    """CLAM (Lu et al. 2021): gated attention + instance-level clustering on top/bottom-k instances.

    Single branch (``clam_sb``) or one attention branch per class (``clam_mb``). Total per bag:
    bag_weight * CE + (1 - bag_weight) * instance loss, with k_sample=8, bag_weight=0.7 (published).
    The instance loss trains, for the bag's class, a binary classifier: the k most attended instances
    are positive and the k least attended negative (in-class); with ``subtyping`` the k most attended
    instances of the other classes' branches are negatives too. Bags shorter than 2k use k = N // 2.
    """

    def __init__(
        self,
        in_dim,
        num_classes,
        hidden: int = 512,
        attn_dim: int = 256,
        k_sample: int = 8,
        bag_weight: float = 0.7,
        dropout: float = 0.25,
        multi_branch: bool = False,
        subtyping: bool = False,
    ):
        super().__init__(in_dim, num_classes)
        self.multi_branch = multi_branch
        self.branches = num_classes if multi_branch else 1
        self.embed = embedding(in_dim, hidden, dropout)
        self.attention = GatedAttention(hidden, attn_dim, self.branches, True, dropout)
        if multi_branch:
            self.classifiers = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(num_classes))
        else:
            self.classifier = nn.Linear(hidden, num_classes)
        self.instance_classifiers = nn.ModuleList(nn.Linear(hidden, 2) for _ in range(num_classes))
        self.k_sample = k_sample
        self.bag_weight = bag_weight
        self.subtyping = subtyping

    def _classify(self, pooled):  # pooled [B, branches, D]
        if self.multi_branch:
            return torch.cat([clf(pooled[:, c]) for c, clf in enumerate(self.classifiers)], dim=1)
        return self.classifier(pooled[:, 0])

    def _instance_loss(self, h, scores, y):
        """Per-bag instance loss for one bag: h [N, D], attention logits [N, branches], label y."""
        n = h.shape[0]
        k = min(self.k_sample, n // 2)
        if k == 0:
            return h.new_zeros(())
        losses = []
        for c in range(self.num_classes):
            branch = scores[:, c if self.multi_branch else 0]
            if c == int(y):
                top, bottom = torch.topk(branch, k).indices, torch.topk(-branch, k).indices
                feats = torch.cat([h[top], h[bottom]])
                target = torch.cat([torch.ones(k), torch.zeros(k)]).long().to(h.device)
            elif self.subtyping:
                feats = h[torch.topk(branch, k).indices]
                target = torch.zeros(k, dtype=torch.long, device=h.device)
            else:
                continue
            losses.append(F.cross_entropy(self.instance_classifiers[c](feats), target))
        return torch.stack(losses).mean()

    def _padded(self, x, mask, y=None):
        h = self.embed(x)
        raw = self.attention(h)  # [B, N, branches]
        a = masked_softmax(raw, None if mask is None else mask.unsqueeze(-1), 1)
        logits = self._classify(torch.einsum("bnk,bnd->bkd", a, h))
        if y is None or not self.training:
            return logits, {}
        inst = []
        for b in range(x.shape[0]):
            keep = slice(None) if mask is None else mask[b]
            inst.append(self._instance_loss(h[b][keep], raw[b][keep], y[b]))
        return logits, {"instance": (1 - self.bag_weight) * torch.stack(inst)}

    def _packed(self, x, lengths, y=None):
        seg, n = segment_ids(lengths), lengths.numel()
        h = self.embed(x)
        raw = self.attention(h)
        a = segment_softmax(raw, seg, n)
        logits = self._classify(segment_sum(a.unsqueeze(-1) * h.unsqueeze(1), seg, n))
        if y is None or not self.training:
            return logits, {}
        inst = [
            self._instance_loss(hb, rb, yb)
            for hb, rb, yb in zip(
                torch.split(h, lengths.tolist()), torch.split(raw, lengths.tolist()), y, strict=True
            )
        ]
        return logits, {"instance": (1 - self.bag_weight) * torch.stack(inst)}

    def instance_scores(self, x):
        return torch.softmax(self.attention(self.embed(x))[:, -1], 0)


class CLAMSB(CLAM):
    name = "clam_sb"

    def __init__(
        self,
        in_dim,
        num_classes,
        hidden: int = 512,
        attn_dim: int = 256,
        k_sample: int = 8,
        bag_weight: float = 0.7,
        dropout: float = 0.25,
        subtyping: bool = False,
    ):
        super().__init__(
            in_dim, num_classes, hidden, attn_dim, k_sample, bag_weight, dropout, False, subtyping
        )


class CLAMMB(CLAM):
    name = "clam_mb"

    def __init__(
        self,
        in_dim,
        num_classes,
        hidden: int = 512,
        attn_dim: int = 256,
        k_sample: int = 8,
        bag_weight: float = 0.7,
        dropout: float = 0.25,
        subtyping: bool = False,
    ):
        super().__init__(
            in_dim, num_classes, hidden, attn_dim, k_sample, bag_weight, dropout, True, subtyping
        )
