"""Segment operations over packed bags.

A packed batch concatenates B bags along the instance axis: ``values`` is [M, ...] with
M = sum(lengths) and bag b owning rows ``offsets[b] : offsets[b] + lengths[b]``. Every function here
is vectorised over bags (scatter/index operations, no Python loop over bags) and differentiable, and
reduces to the ordinary dense operation when B = 1. ``seg`` (the bag index of every row, see
``segment_ids``) may be passed to avoid recomputing it. Lengths must be >= 1.
"""

from __future__ import annotations

import torch


def segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    """[M] bag index of every row: ``repeat_interleave(arange(B), lengths)``."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def segment_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """[B] first row of every bag (exclusive cumulative sum of ``lengths``)."""
    return torch.cumsum(lengths, 0) - lengths


def _seg(lengths: torch.Tensor, seg: torch.Tensor | None) -> torch.Tensor:
    return segment_ids(lengths) if seg is None else seg


def _expand(seg: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return seg.view(-1, *([1] * (values.dim() - 1))).expand_as(values)


def segment_sum(values: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
    """[B, ...] with out[b] = sum of the rows of bag b."""
    seg = _seg(lengths, seg)
    return values.new_zeros((lengths.numel(), *values.shape[1:])).index_add(0, seg, values)


def segment_mean(
    values: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, ...] with out[b] = mean of the rows of bag b."""
    total = segment_sum(values, lengths, seg)
    return total / lengths.to(values.dtype).view(-1, *([1] * (values.dim() - 1)))


def segment_max(values: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
    """[B, ...] with out[b] = element-wise max over the rows of bag b (gradient split over ties)."""
    seg = _seg(lengths, seg)
    out = values.new_full((lengths.numel(), *values.shape[1:]), float("-inf"))
    return out.scatter_reduce(0, _expand(seg, values), values, "amax", include_self=True)


def segment_argmax(
    values: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, K] global row index of the first maximum of every column of values [M, K] within each bag."""
    seg = _seg(lengths, seg)
    best = segment_max(values.detach(), lengths, seg)
    m = values.shape[0]
    row = torch.arange(m, device=values.device).unsqueeze(-1).expand_as(values)
    # the first maximal row has the largest key m - row among the maximal rows of its bag
    key = torch.where(values.detach() == best[seg], m - row, torch.zeros_like(row))
    first = torch.zeros(best.shape, dtype=torch.long, device=values.device)
    return m - first.scatter_reduce(0, _expand(seg, key), key, "amax", include_self=True)


def segment_softmax(
    scores: torch.Tensor, lengths: torch.Tensor, seg: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax of every column of scores [M, ...] within each bag.

    ``exp(s_i - max_b) / sum_{j in b} exp(s_j - max_b)``; the shift by the (detached) bag maximum
    does not change the value or the gradient, it only keeps ``exp`` finite. Rows at ``-inf`` get 0.
    """
    seg = _seg(lengths, seg)
    shift = segment_max(scores.detach(), lengths, seg)[seg]
    e = (scores - shift.masked_fill(torch.isinf(shift), 0.0)).exp()
    return e / segment_sum(e, lengths, seg)[seg]


def segment_topk(
    values: torch.Tensor, lengths: torch.Tensor, k: int | torch.Tensor, seg: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest rows of values [M] within each bag.

    Returns ``(index [B, kmax], valid [B, kmax])``: ``index[b, r]`` is the global row of rank r
    (descending value, ties broken by lower row first) and ``valid[b, r]`` says whether
    r < k_b = min(k, lengths[b]) (``k`` may be an int or a [B] tensor of per-bag counts); invalid
    entries point at the bag's first row so that the index is always safe to gather with.
    """
    seg = _seg(lengths, seg)
    if values.dim() != 1:
        raise ValueError(f"segment_topk: values must be 1-D [M], got shape {tuple(values.shape)}")
    k_b = torch.minimum(torch.as_tensor(k, device=lengths.device).expand_as(lengths), lengths)
    kmax = int(k_b.max()) if k_b.numel() else 0
    order = torch.sort(values.detach(), descending=True, stable=True).indices
    order = order[torch.sort(seg[order], stable=True).indices]  # grouped by bag, descending within
    offsets = segment_offsets(lengths)
    rank = torch.arange(kmax, device=lengths.device)
    valid = rank.unsqueeze(0) < k_b.unsqueeze(1)
    pos = offsets.unsqueeze(1) + torch.where(valid, rank.unsqueeze(0), torch.zeros_like(rank).unsqueeze(0))
    return order[pos], valid
