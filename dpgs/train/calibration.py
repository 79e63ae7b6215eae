"""BatchNorm calibration: eval-mode statistics that match how training normalised the bags.

A trained tile encoder normalises every bag, in training, with that bag's own BatchNorm statistics (one
encoder pass per bag, :mod:`dpgs.models.tilemil`). Evaluation uses the running statistics instead, an
exponential moving average (momentum 0.1) of the statistics of the last bags *taken with the weights of
their steps*: after a few optimizer steps from random weights, or while the weights still move fast, they
are far from the statistics the current weights produce, the embeddings shift, and accuracy collapses to
the majority class while AUC may survive.

:class:`BatchNormCalibrator` recomputes them for the current weights (PreciseBN, Wu and Johnson 2021):

1. every BatchNorm layer that training updates is reset and switched to a cumulative average
   (``momentum=None``);
2. the encoder runs in training mode, without gradients, once per calibration bag, on ``K`` tiles of the
   bag (``data.tiles_per_bag``, the count training normalised with; all tiles when null), a sorted sample
   drawn from ``numpy.random.default_rng([seed, 0, bag])``, read from the evaluation dataset (no
   augmentation, as in evaluation);
3. each layer's running mean is then the mean over the ``n`` bags of the per-bag channel means, and its
   running variance the mean of the per-bag unbiased channel variances, each layer's input being the
   previous layers' output under per-bag normalisation, exactly as in training:

   ``running_mean = (1/n) sum_b mean_b(x)``,  ``running_var = (1/n) sum_b var_b(x) * N_b / (N_b - 1)``

   with ``N_b`` the values per channel of bag ``b`` at that layer.

The calibration bags are the first ``eval.bn_calibration_bags`` of a seeded shuffle of the fold's training
bags (the same bags every epoch). Parameters are untouched; only the running statistics (and
``num_batches_tracked``) of the returned state differ from the input state. Only models with such layers
are calibrated: a :class:`~dpgs.models.tilemil.TileMIL` whose encoder is trained (a frozen encoder keeps
its statistics in training too, so training and evaluation already agree), never feature-bag heads.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpgs.models.tilemil import TileMIL
from dpgs.wsi.tiles import sample_indices


def trained_batchnorms(model: nn.Module) -> list[_BatchNorm]:
    """BatchNorm layers that normalise with batch statistics in training and track running statistics."""
    was_training = model.training
    model.train()
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    model.train(was_training)
    return layers


def calibration_bags(train_indices: Sequence[int], count: int, seed: int) -> list[int]:
    """The first ``count`` of a shuffle of ``train_indices`` seeded by ``seed`` (all when fewer)."""
    order = np.random.default_rng([seed, 0xBC]).permutation(len(train_indices))
    return [int(train_indices[i]) for i in order[:count]]


class BatchNormCalibrator:
    """``calibrator(state) -> state`` with calibrated running statistics (see the module docstring).

    Holds its own copy of the model, so neither the training model nor the engine's state is touched.
    """

    def __init__(self, model: TileMIL, source, bags: Sequence[int], tiles: int | None, seed: int,
                 device: torch.device):
        if not trained_batchnorms(model):
            raise ValueError("the model has no BatchNorm layer updated in training: nothing to calibrate")
        if not bags:
            raise ValueError("BatchNorm calibration needs at least one bag")
        self.model = copy.deepcopy(model).to(device)
        self.layers = trained_batchnorms(self.model)
        self.source = source
        self.bags = [int(i) for i in bags]
        self.tiles = tiles
        self.seed = seed
        self.device = device

    @classmethod
    def for_fold(cls, config, model: nn.Module, source, train_indices: Sequence[int],
                 device: torch.device) -> BatchNormCalibrator | None:
        """The fold's calibrator, or None when ``eval.bn_calibration_bags`` is 0, there are no training
        bags, or the model has nothing to calibrate."""
        count = config.eval.bn_calibration_bags
        if not count or not train_indices or not isinstance(model, TileMIL) or not trained_batchnorms(model):
            return None
        bags = calibration_bags(train_indices, count, config.seed)
        return cls(model, source, bags, config.data.tiles_per_bag, config.seed, device)

    def _tiles(self, index: int) -> torch.Tensor:
        with self.source.open_stream(index) as stream:
            return stream.read(sample_indices(len(stream), self.tiles, self.seed, 0, index))

    @torch.no_grad()
    def __call__(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        model = self.model
        model.load_state_dict(state)
        momenta = [m.momentum for m in self.layers]
        for m in self.layers:
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the bags
        model.eval()
        encoder = model.encoder
        encoder.train()
        try:
            with torch.autocast(encoder.device.type, dtype=torch.bfloat16, enabled=model.amp):
                for index in self.bags:
                    encoder(self._tiles(index))  # one pass per bag: the bag's own statistics
        finally:
            for m, momentum in zip(self.layers, momenta, strict=True):
                m.momentum = momentum
            model.eval()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
