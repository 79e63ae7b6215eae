"""BatchNorm at evaluation: each bag normalised with its own statistics, as in training.

A trained tile encoder normalises every bag, in training, with the BatchNorm statistics of that bag's
tiles (one encoder pass per bag, :mod:`dpgs.models.tilemil`). What the head learns is therefore relative
to the bag: a tumour tile is recognised against the bag's own mean and variance. Evaluating with running
statistics instead (an exponential moving average over the last bags, or population statistics
recomputed over training bags for the current weights, "PreciseBN") changes the representation, and
measured on the tile demo it inverts the ranking: validation AUC 0.00-0.02 and accuracy 0.40-0.50 with
the moving average or with statistics recomputed on 8-60 training bags, against AUC 1.00 and accuracy
1.00 with per-bag statistics, on the same weights (docs/convergence.md).

:func:`bag_statistics` gives evaluation the training normalisation while the bag is still read in chunks:

1. every BatchNorm layer that training updates is reset and set to a cumulative average
   (``momentum=None``), and one training-mode encoder pass without gradients over ``tiles`` (the bag's
   scored tiles, or an even subset of at most ``model.embed_chunk`` of them, see
   :func:`statistics_subset`) leaves in each layer the per-channel mean of its input and the unbiased
   variance, computed by the layer itself; the variance is multiplied by ``(N - 1) / N`` (``N`` values per
   channel, counted by a forward hook) to the biased variance training-mode BatchNorm normalises with;
2. inside the ``with`` block those are the layers' running statistics, so eval-mode chunks of any size
   are normalised as one training-mode pass over ``tiles`` normalises them; the block is given that pass's
   output, the embeddings of ``tiles`` (``[n, D]``, float32), so a bag whose scored tiles are ``tiles``
   needs no second encoder pass;
3. on leaving, the layers' own buffers and momentum are restored.

When ``tiles`` are all the scored tiles, the embeddings equal those of one training-mode pass over the bag
(tested). A bag whose statistics do not exist (a layer sees one value per channel: a single tile small
enough that the last stage is 1 x 1, where a training-mode pass fails too) keeps the running statistics.
Frozen encoders (``model.freeze_encoder``) keep their running statistics in training too, and feature-bag
heads have no BatchNorm: for them the block changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpgs.models.tilemil import TileMIL


class _NoBagStatistics(Exception):
    """A BatchNorm layer of the statistics pass sees a single value per channel."""


def trained_batchnorms(model: nn.Module) -> list[_BatchNorm]:
    """BatchNorm layers that normalise with batch statistics in training and track running statistics."""
    was_training = model.training
    model.train()
    layers = [m for m in model.modules()
              if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    model.train(was_training)
    return layers


def statistics_subset(indices: np.ndarray, limit: int) -> np.ndarray:
    """``indices`` when there are at most ``limit``, else ``limit`` of them evenly spread (tiles are in
    coordinate order, so the subset covers the whole slide)."""
    if len(indices) <= limit:
        return indices
    return indices[np.linspace(0, len(indices) - 1, limit).round().astype(np.int64)]


@contextmanager
def bag_statistics(model: TileMIL, tiles: torch.Tensor) -> Iterator[torch.Tensor | None]:
    """Within the block, the encoder's trained BatchNorm layers normalise with the statistics of ``tiles``
    (one bag's tiles, [n, 3, s, s]); the block gets the embeddings of ``tiles`` with those statistics (the
    statistics pass's output), or None where there are none (no trained BatchNorm, or a bag without
    statistics: then the running ones normalise). See the module docstring."""
    layers = trained_batchnorms(model)
    if not layers:
        yield None
        return
    encoder = model.encoder
    counts: dict[_BatchNorm, int] = {}

    def count(module: _BatchNorm, args: tuple) -> None:
        counts[module] = args[0].numel() // args[0].shape[1]  # values per channel
        if counts[module] < 2:
            raise _NoBagStatistics

    saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone(), m.momentum)
             for m in layers]
    was_training = encoder.training
    hooks = [m.register_forward_pre_hook(count) for m in layers]
    try:
        for m in layers:  # after reset, a cumulative average over one pass is that pass's statistics
            m.reset_running_stats()
            m.momentum = None
        try:
            encoder.train()
            with torch.no_grad(), torch.autocast(encoder.device.type, dtype=torch.bfloat16,
                                                 enabled=model.amp):
                embedded = encoder(tiles).float()
            measured = True
        except _NoBagStatistics:
            embedded, measured = None, False
        finally:
            for h in hooks:
                h.remove()
            encoder.train(was_training)
        with torch.no_grad():
            for m, (mean, var, _, _) in zip(layers, saved, strict=True):
                if measured:  # the unbiased running variance back to the biased one training divides by
                    n = counts[m]
                    m.running_var.mul_((n - 1) / n)
                else:  # no statistics for this bag: the running ones
                    m.running_mean.copy_(mean)
                    m.running_var.copy_(var)
        yield embedded
    finally:
        with torch.no_grad():
            for m, (mean, var, tracked, momentum) in zip(layers, saved, strict=True):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(tracked)
                m.momentum = momentum
