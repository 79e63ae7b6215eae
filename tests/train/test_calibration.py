"""BatchNorm at evaluation (dpgs.train.calibration): inside ``bag_statistics`` an eval-mode encoder, in
chunks of any size, gives exactly the embeddings of one training-mode pass over the bag (dense and
big-layer encoders); buffers and parameters are restored; frozen encoders are left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpgs.config.schema import ModelConfig
from dpgs.modeling import build_model
from dpgs.train.calibration import bag_statistics, statistics_subset, trained_batchnorms


def tile_model(big_stages: int, freeze: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(name="abmil", encoder="resnet18", big_stages=big_stages, max_elements=4096,
                      freeze_encoder=freeze, embed_chunk=3)
    return build_model(cfg, None, num_classes=2).eval()


def bag(n: int = 7, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=gen) * 1.5 + 0.4


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("big_stages", [-1, 1])
def test_eval_chunks_inside_the_block_equal_one_training_mode_pass(big_stages):
    model, tiles = tile_model(big_stages), bag()
    before = state(model)
    with torch.no_grad():
        model.encoder.train()
        reference = model.encoder(tiles)  # what training computes: the bag's own statistics
    model.load_state_dict(before)  # (that pass moved the running statistics)
    model.eval()
    with torch.no_grad():
        running = model.embed(tiles)  # eval mode, chunks of 3, running statistics
        with bag_statistics(model, tiles):
            chunked = model.embed(tiles)
            assert model.encoder.bn1.running_mean.abs().max() > 0.01  # the bag's, not the initial zeros
    # float32 through 20 layers (training-mode BatchNorm reduces in float32, the block in float64)
    assert float((chunked - reference).norm() / reference.norm()) < 5e-5
    assert float((chunked - reference).abs().max()) < 1e-3 * float(reference.abs().max())
    assert float((running - reference).abs().max()) > 0.1 * float(reference.abs().max())  # really different
    after = state(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # buffers (and parameters) restored
    assert not model.training and not model.encoder.training


@pytest.mark.parametrize("big_stages", [-1, 1])
def test_the_block_is_given_the_statistics_pass_embeddings(big_stages):
    """What ``bag_statistics`` yields is the training-mode pass over ``tiles``: the same embeddings as
    eval-mode chunks inside the block (so one pass serves a bag that fits a chunk), running statistics
    untouched."""
    model, tiles = tile_model(big_stages), bag()
    before = state(model)
    with torch.no_grad(), bag_statistics(model, tiles) as embedded:
        chunked = model.embed(tiles)
    assert embedded is not None and embedded.dtype == torch.float32 and embedded.shape == chunked.shape
    assert float((embedded - chunked).norm() / chunked.norm()) < 5e-5
    assert float((embedded - chunked).abs().max()) < 1e-3 * float(chunked.abs().max())
    assert all(torch.equal(state(model)[k], v) for k, v in before.items())
    with torch.no_grad(), bag_statistics(tile_model(-1, freeze=True), tiles) as frozen:
        assert frozen is None  # no trained BatchNorm: nothing measured, the caller embeds


def test_statistics_of_a_subset_normalise_the_whole_bag():
    model, tiles = tile_model(-1), bag(9, seed=1)
    subset = tiles[statistics_subset(np.arange(9), 4)]
    with torch.no_grad():
        with bag_statistics(model, subset):
            whole = model.embed(tiles)
        model.encoder.train()
        model.encoder(subset)  # running statistics after one training pass over the subset ...
        with bag_statistics(model, subset):
            again = model.embed(tiles)
    torch.testing.assert_close(whole, again, rtol=0, atol=0)  # ... do not leak into the block


def test_frozen_encoders_and_heads_keep_their_running_statistics():
    model, tiles = tile_model(-1, freeze=True), bag()
    assert trained_batchnorms(model) == [] and not model.training
    with torch.no_grad():
        plain = model.embed(tiles)
        with bag_statistics(model, tiles):
            inside = model.embed(tiles)
    assert torch.equal(plain, inside)
    assert len(trained_batchnorms(tile_model(-1))) == 20  # every BatchNorm of a ResNet-18
    assert trained_batchnorms(build_model(ModelConfig(name="abmil"), 16, num_classes=2)) == []


def test_restored_after_an_error_inside_the_block():
    model, tiles = tile_model(-1), bag()
    before = state(model)
    with pytest.raises(RuntimeError, match="boom"), bag_statistics(model, tiles):
        raise RuntimeError("boom")
    assert all(torch.equal(state(model)[k], v) for k, v in before.items())


def test_statistics_subset_is_an_even_spread():
    idx = np.arange(10, 110)
    assert np.array_equal(statistics_subset(idx, 200), idx)
    sub = statistics_subset(idx, 5)
    assert sub.tolist() == [10, 35, 60, 84, 109] and len(set(sub.tolist())) == 5


def test_a_bag_without_statistics_keeps_the_running_ones():
    """One 32 px tile: ResNet-18's last stage is 1 x 1, one value per channel (a training-mode pass
    fails); the block scores it with the running statistics instead of failing."""
    model, tile = tile_model(-1), bag(1)
    with torch.no_grad():
        model.encoder.train()
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            model.encoder(tile)
        model.eval()
        plain = model.embed(tile)
        with bag_statistics(model, tile):
            inside = model.embed(tile)
    assert torch.equal(plain, inside)
