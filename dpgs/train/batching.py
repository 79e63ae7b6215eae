"""Turning bags into optimizer steps, one function per training mode.

* ``epoch_batches``: the epoch's data order, a seeded shuffle cut into batches of B bag indices.
* ``pad_batch``: B bags zero-padded to the longest with a boolean mask (``padding`` mode).
* ``sample_batch``: K instances per bag so B bags stack into [B, K, D] (``sampling`` mode); bags
  shorter than K are drawn with replacement.
* ``pack_batch``: B bags concatenated along the instance axis with their lengths (``packed`` mode).
"""

from __future__ import annotations

import torch


def epoch_batches(indices: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffle ``indices`` with a generator seeded by (seed, epoch) and cut into batches."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(indices), generator=gen).tolist()
    shuffled = [indices[i] for i in order]
    return [shuffled[i : i + batch_size] for i in range(0, len(shuffled), batch_size)]


def pad_batch(features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack bags [N_b, D] into x [B, N_max, D] (zeros beyond each bag) and mask [B, N_max]."""
    lengths = [f.shape[0] for f in features]
    n_max = max(lengths)
    x = features[0].new_zeros((len(features), n_max, *features[0].shape[1:]))
    mask = torch.zeros(len(features), n_max, dtype=torch.bool, device=features[0].device)
    for b, f in enumerate(features):
        x[b, : f.shape[0]] = f
        mask[b, : f.shape[0]] = True
    return x, mask


def sample_indices(length: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """K instance indices of a bag: without replacement when the bag has >= K instances."""
    if length >= k:
        return torch.randperm(length, generator=generator)[:k]
    return torch.randint(length, (k,), generator=generator)


def sample_batch(features: list[torch.Tensor], k: int, generator: torch.Generator) -> torch.Tensor:
    """x [B, K, D] with K instances sampled per bag."""
    picks = [f[sample_indices(f.shape[0], k, generator).to(f.device)] for f in features]
    return torch.stack(picks)


def pack_batch(features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [sum N_b, D] and lengths [B] (int64)."""
    lengths = torch.tensor([f.shape[0] for f in features], dtype=torch.long, device=features[0].device)
    return torch.cat(features, dim=0), lengths
