"""Evaluation on the DPGS workers: bags sharded by length over P workers and merged on the driver give
the driver's own predictions (feature bags and tile bags streamed from the slides; both protocols), the
validation set scored within the epoch's last chunk included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.train.engine import Validation
from dpgs.train.evaluate import ALL_INSTANCES, EvalProtocol, score_bags
from tests.dpgs_helpers import dpgs_engine, experiment_data, make_config, write_bags
from tests.tile_helpers import tile_config, write_tiled_slides

pytestmark = pytest.mark.ray

PROTOCOLS = [ALL_INSTANCES, EvalProtocol.sampled(7, 3, seed=5)]


def assert_same_predictions(workers, driver):
    assert workers.slide_ids == driver.slide_ids and np.array_equal(workers.indices, driver.indices)
    np.testing.assert_allclose(workers.probs, driver.probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(workers.losses, driver.losses, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sync", [["dpgs.compression.keep_ratio=0.1",  # workers score with their replicas
                                   "dpgs.compression.second_moment=live"],
                                  ["dpgs.compression.keep_ratio=0.1", "dpgs.compression.downlink=delta"]],
                         ids=["replicas", "delta-weights-sent"])
def test_worker_evaluation_of_feature_bags_equals_the_driver(ray_cluster, tmp_path, sync):
    """With ``downlink=gradients`` the workers score with their own (exact) replicas, with ``delta`` (whose
    replicas lag by the master's residual) with the master's weights; either way, as the driver does."""
    bags = write_bags(tmp_path / "bags", [3, 200, 17, 1, 90, 44, 6, 300, 12, 58, 2, 150, 33, 9, 71, 5, 20, 8])
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2", *sync)
    data = experiment_data(config)
    spec = ModelSpec(config.model, data.dataset.feature_dim, 2)
    torch.manual_seed(0)
    order = list(range(len(data.dataset)))[::-1]  # every bag, in an order the shards do not follow
    with dpgs_engine(config, spec, spec.build(), data.dataset, data.splits[0].train) as engine:
        engine.run_epoch([[0, 1, 2, 3], [4, 5, 6, 7]], 1, [])  # weights away from their initial values
        state = engine.state_dict()
        reference = spec.build()
        reference.load_state_dict(state)
        for protocol in PROTOCOLS:
            assert_same_predictions(engine.evaluate(order, protocol),
                                    score_bags(reference, data.dataset, order, protocol, torch.device("cpu")))
        other = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}  # explicit weights
        reference.load_state_dict(other)
        driver = score_bags(reference, data.dataset, order, ALL_INSTANCES, torch.device("cpu"))
        assert_same_predictions(engine.evaluate(order, ALL_INSTANCES, other), driver)


@pytest.mark.parametrize("sync", [[], ["dpgs.compression.keep_ratio=0.1", "dpgs.compression.downlink=delta"]],
                         ids=["exact-replicas", "delta"])
def test_the_validation_scored_with_the_last_chunk_equals_the_driver(ray_cluster, tmp_path, sync):
    """On exact replicas the workers score the fold's validation set at the end of the epoch's last chunk
    (no evaluation round of its own); with ``delta`` they cannot, and it is scored as before. Either way,
    as the driver scores it with the master's weights."""
    bags = write_bags(tmp_path / "bags", [3, 200, 17, 1, 90, 44, 6, 300, 12, 58, 2, 150, 33, 9, 71, 5, 20, 8])
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "train.checkpoint_every=1", *sync)  # three chunks an epoch: only the last scores
    data = experiment_data(config)
    spec = ModelSpec(config.model, data.dataset.feature_dim, 2)
    torch.manual_seed(0)
    validation = Validation((17, 3, 9, 12, 5), EvalProtocol.sampled(7, 3, seed=5))
    with dpgs_engine(config, spec, spec.build(), data.dataset, data.splits[0].train,
                     validation=validation) as engine:
        for epoch in (1, 2):
            engine.run_epoch([[0, 1, 2, 3], [4, 5, 6, 7], [8, 10]], epoch, [])
            assert (engine.validated is not None) == (not sync)
            scored = engine.evaluate(list(validation.indices), validation.protocol)
            assert (scored is engine.validated) == (not sync)  # no evaluation round of its own
            reference = spec.build()
            reference.load_state_dict(engine.state_dict())
            assert_same_predictions(scored, score_bags(reference, data.dataset, list(validation.indices),
                                                       validation.protocol, torch.device("cpu")))


def test_worker_evaluation_of_tile_bags_equals_the_driver(ray_cluster, tmp_path):
    """The workers hold the training dataset (6 tiles sampled per bag, augmentation on); evaluation reads
    every tile (or the protocol's K) without augmentation, like the driver's evaluation dataset."""
    slides = write_tiled_slides(tmp_path / "slides", n_slides=6)
    config = tile_config(*slides, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "train.optimizer=sgd", "train.lr=0.05", "data.augment.enabled=true",
                         "model.embed_chunk=8")
    data = load_experiment_data(config.data, seed=0)
    spec = ModelSpec(config.model, None, 2)
    torch.manual_seed(0)
    order = list(range(len(data.eval_dataset)))
    with dpgs_engine(config, spec, spec.build(), data.dataset, data.splits[0].train,
                     eval_dataset=data.eval_dataset) as engine:
        engine.run_epoch([data.splits[0].train[:3]], 1, [])  # running statistics move away from 0 and 1
        reference = spec.build()
        reference.load_state_dict(engine.state_dict())
        for protocol in PROTOCOLS:
            assert_same_predictions(
                engine.evaluate(order, protocol),
                score_bags(reference, data.eval_dataset, order, protocol, torch.device("cpu")))
