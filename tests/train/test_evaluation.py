"""Scoring shards of bags (dpgs.train.evaluate): one-pass references, merging, the sampled protocol,
streamed tile bags (counted reads, bounded encoder input), and validation on sampled instances."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.runner import run_training
from dpgs.train.calibration import bag_statistics, statistics_subset
from dpgs.train.evaluate import ALL_INSTANCES, EvalProtocol, Predictions, score_bags, slide_key
from dpgs.wsi.tiles import TileBagDataset, TileReader
from tests.dpgs_helpers import make_config, write_bags
from tests.tile_helpers import tile_config, write_tiled_slides

LENGTHS = [3, 9, 1, 14, 6, 11, 2, 8, 5, 12, 7, 4, 10, 6, 3, 9, 13, 5, 8, 2]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    return write_bags(tmp_path_factory.mktemp("bags"), LENGTHS)


@pytest.fixture(scope="module")
def feature_setup(bags, tmp_path_factory):
    config = make_config(*bags, tmp_path_factory.mktemp("run") / "run")
    data = load_experiment_data(config.data, seed=0)
    torch.manual_seed(1)
    model = ModelSpec(config.model, data.dataset.feature_dim, 2).build().eval()
    return data.dataset, model


def reference_scores(model, bag_tensors, labels):
    """(probs [n, C], losses [n]) of each bag in one pass through the model."""
    probs, losses = [], []
    with torch.no_grad():
        for x, y in zip(bag_tensors, labels, strict=True):
            out = model.loss(x, torch.tensor(y))
            probs.append(torch.softmax(model(x).double(), -1).numpy())
            losses.append(float(out["loss"]))
    return np.array(probs), np.array(losses)


def documented_sample(n, k, seed, repeat, slide_id):
    """The sampled protocol's instances as docs/evaluation.md states them."""
    if n <= k:
        return np.arange(n)
    rng = np.random.default_rng([seed, repeat, slide_key(slide_id)])
    return np.sort(rng.choice(n, size=k, replace=False))


def test_all_instances_equal_one_pass_scores_and_shards_merge_in_order(feature_setup):
    dataset, model = feature_setup
    order = [7, 2, 15, 0, 11, 4, 19, 3]
    whole = score_bags(model, dataset, order, ALL_INSTANCES, CPU)
    probs, losses = reference_scores(model, [dataset[i].features for i in order],
                                     [dataset.records[i].label for i in order])
    np.testing.assert_allclose(whole.probs[0], probs, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(whole.losses[0], losses, rtol=1e-6, atol=1e-7)
    assert whole.slide_ids == tuple(dataset.records[i].slide_id for i in order)
    assert whole.indices.tolist() == order

    shards = [score_bags(model, dataset, [4, 7, 3], ALL_INSTANCES, CPU),
              score_bags(model, dataset, [], ALL_INSTANCES, CPU),
              score_bags(model, dataset, [19, 0, 2, 15, 11], ALL_INSTANCES, CPU)]
    merged = Predictions.merge(shards, order)
    for field in ("indices", "labels", "probs", "losses"):
        np.testing.assert_array_equal(getattr(merged, field), getattr(whole, field))
    assert merged.slide_ids == whole.slide_ids
    metrics = merged.metrics("val_")
    assert metrics["val_auc"] == pytest.approx(roc_auc_score(merged.labels, probs[:, 1]))
    assert metrics["val_loss"] == pytest.approx(losses.mean())
    assert not any(k.endswith("_std") for k in metrics)


def test_merge_rejects_missing_duplicated_and_mixed_shards(feature_setup):
    dataset, model = feature_setup
    a = score_bags(model, dataset, [0, 1], ALL_INSTANCES, CPU)
    b = score_bags(model, dataset, [1, 2], ALL_INSTANCES, CPU)
    with pytest.raises(ValueError, match="exactly once"):
        Predictions.merge([a, b], [0, 1, 2])
    with pytest.raises(ValueError, match="exactly once"):
        Predictions.merge([a], [0, 1, 2])
    sampled = score_bags(model, dataset, [2], EvalProtocol(2, 2, 0), CPU)
    with pytest.raises(ValueError, match="different protocols"):
        Predictions.merge([a, sampled], [0, 1, 2])


def test_sampled_protocol_is_per_slide_and_independent_of_order_and_shards(feature_setup):
    dataset, model = feature_setup
    protocol = EvalProtocol(sample_k=4, repeats=3, seed=5)
    order = list(range(12))
    whole = score_bags(model, dataset, order, protocol, CPU)
    reversed_shards = [score_bags(model, dataset, order[6:][::-1], protocol, CPU),
                       score_bags(model, dataset, order[:6][::-1], protocol, CPU)]
    np.testing.assert_array_equal(Predictions.merge(reversed_shards, order).probs, whole.probs)
    assert whole.probs.shape == (3, 12, 2)
    for r in range(3):
        picked = [dataset[i].features[documented_sample(LENGTHS[i], 4, 5, r, dataset.records[i].slide_id)]
                  for i in order]
        probs, losses = reference_scores(model, picked, [dataset.records[i].label for i in order])
        np.testing.assert_allclose(whole.probs[r], probs, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(whole.losses[r], losses, rtol=1e-6, atol=1e-7)
    short = [k for k, i in enumerate(order) if LENGTHS[i] <= 4]
    np.testing.assert_array_equal(whole.probs[0, short], whole.probs[2, short])  # whole bag every repeat
    metrics = whole.metrics("test_k4_")
    aucs = [roc_auc_score(whole.labels, whole.probs[r, :, 1]) for r in range(3)]
    assert metrics["test_k4_auc"] == pytest.approx(np.mean(aucs))
    assert metrics["test_k4_auc_std"] == pytest.approx(np.std(aucs))


def test_validation_on_sampled_instances_selects_with_their_mean(bags, tmp_path):
    cfg = make_config(*bags, tmp_path / "run", "train.mode=packed", "train.epochs=1", "train.batch_size=4",
                      "eval.val_sample_k=3", "eval.val_repeats=2", "eval.bootstrap=200")
    fold = run_training(cfg).folds[0]
    row = fold.history[0]
    data = load_experiment_data(cfg.data, seed=cfg.seed)
    model = ModelSpec(cfg.model, data.dataset.feature_dim, 2).build()
    model.load_state_dict(torch.load(tmp_path / "run" / "last.pt", weights_only=True))
    model.eval()
    val = data.splits[0].val
    labels = [data.dataset.records[i].label for i in val]
    aucs = []
    for r in range(2):
        picked = [data.dataset[i].features[documented_sample(LENGTHS[i], 3, cfg.seed, r,
                                                              data.dataset.records[i].slide_id)] for i in val]
        aucs.append(roc_auc_score(labels, reference_scores(model, picked, labels)[0][:, 1]))
    assert row["val_auc"] == pytest.approx(np.mean(aucs))
    assert row["val_auc_std"] == pytest.approx(np.std(aucs))
    test = fold.test_metrics
    assert test["test_auc_ci_low"] <= test["test_auc"] <= test["test_auc_ci_high"]
    for name in ("acc", "bacc"):
        assert test[f"test_{name}_ci_low"] <= test[f"test_{name}"] <= test[f"test_{name}_ci_high"]


# ---------------------------------------------------------------------- tile bags, streamed


@pytest.fixture(scope="module")
def tile_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiles")
    manifest, slides, tiles = write_tiled_slides(root, n_slides=3)
    config = tile_config(manifest, slides, tiles, root / "run", "model.embed_chunk=4")
    data = load_experiment_data(config.data, seed=0)
    torch.manual_seed(0)
    model = ModelSpec(config.model, None, 2).build()
    with torch.no_grad():  # non-trivial BatchNorm running statistics
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    return data.eval_dataset, model.eval()


class ReadCounter:
    """Records the tile indices every ``TileReader.read`` call asks for, and the encoder's input sizes."""

    def __init__(self, monkeypatch, model):
        self.reads: list[list[int]] = []
        self.encoder_inputs: list[int] = []
        original = TileReader.read

        def read(reader, indices=None):
            self.reads.append(list(range(len(reader.layout))) if indices is None else list(map(int, indices)))
            return original(reader, indices)

        forward = model.encoder.forward

        def encode(x):
            self.encoder_inputs.append(x.shape[0])
            return forward(x)

        monkeypatch.setattr(TileReader, "read", read)
        monkeypatch.setattr(model.encoder, "forward", encode)


def training_mode_scores(model, bag_tensors, labels):
    """(probs [n, C], losses [n]) of each bag with one training-mode encoder pass (BatchNorm with the bag's
    own statistics, as training computes it) and the head in eval mode."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    probs, losses = [], []
    with torch.no_grad():
        for x, y in zip(bag_tensors, labels, strict=True):
            model.encoder.train()
            feats = model.encoder(x)
            model.encoder.eval()
            out = model.head.loss(feats, torch.tensor(y))
            probs.append(torch.softmax(out["logits"].reshape(-1).double(), -1).numpy())
            losses.append(float(out["loss"]))
    model.load_state_dict(state)
    return np.array(probs), np.array(losses)


def bag_statistics_scores(model, bag_tensors, labels):
    """(probs [n, C], losses [n]) of each whole bag in one eval-mode pass, BatchNorm holding the statistics
    of an even subset of ``model.embed_chunk`` of its tiles (all of them for a bag that fits in a chunk)."""
    chunk, probs, losses = model.embed_chunk, [], []
    for x, y in zip(bag_tensors, labels, strict=True):
        with torch.no_grad(), bag_statistics(model, x[statistics_subset(np.arange(len(x)), chunk)]):
            model.embed_chunk = len(x)  # one pass
            p, loss = reference_scores(model, [x], [y])
            model.embed_chunk = chunk
        probs.append(p[0])
        losses.append(loss[0])
    return np.array(probs), np.array(losses)


def test_streamed_tiles_equal_the_one_pass_score_and_never_form_a_whole_bag(tile_setup, monkeypatch):
    """Chunks normalised with the statistics of an even subset of embed_chunk tiles (the bag's own, as in
    training) score as one pass over the bag with those statistics does; no read or encoder input is
    larger than a chunk; apart from the subset, every tile is read once."""
    dataset, model = tile_setup
    counts = dataset.tile_counts()
    assert max(counts) > model.embed_chunk  # bags are really chunked
    chunk = model.embed_chunk
    wholes = [dataset.read(i) for i in range(len(counts))]  # every tile, no augmentation
    probs, losses = bag_statistics_scores(model, [b.tiles for b in wholes], [b.label for b in wholes])
    counter = ReadCounter(monkeypatch, model)
    preds = score_bags(model, dataset, range(len(counts)), ALL_INSTANCES, CPU)
    np.testing.assert_allclose(preds.probs[0], probs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(preds.losses[0], losses, rtol=1e-6, atol=1e-6)
    assert max(counter.encoder_inputs) <= chunk
    assert max(len(r) for r in counter.reads) <= chunk
    subsets = [statistics_subset(np.arange(n), chunk).tolist() for n in counts if n > chunk]
    scored = [r for r in counter.reads if r not in subsets]
    assert sorted(t for r in scored for t in r) == sorted(t for n in counts for t in range(n))


def test_sampled_tiles_read_only_the_k_tiles_of_each_repeat(tile_setup, monkeypatch):
    dataset, model = tile_setup
    counts = dataset.tile_counts()
    k, repeats = 3, 2
    counter = ReadCounter(monkeypatch, model)
    preds = score_bags(model, dataset, range(len(counts)), EvalProtocol(k, repeats, 11), CPU)
    expected = [documented_sample(n, k, 11, r, dataset.records[i].slide_id).tolist()
                for i, n in enumerate(counts) for r in range(repeats) if n > k or r == 0]
    assert counter.reads == expected  # K tiles per repeat, one read each (K <= embed_chunk)
    # and one encoder pass each: the bag-statistics pass over the K tiles is their embedding
    assert counter.encoder_inputs == [len(r) for r in expected]
    for i, n in enumerate(counts):
        for r in range(repeats):
            bag = dataset.read(i, documented_sample(n, k, 11, r, dataset.records[i].slide_id))
            probs, _ = training_mode_scores(model, [bag.tiles], [bag.label])
            np.testing.assert_allclose(preds.probs[r, i], probs[0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- dpgs eval on a tile run


@pytest.fixture(scope="module")
def tile_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tile-run")
    manifest, slides, tiles = write_tiled_slides(root, n_slides=6)
    out = root / "run"
    config = tile_config(manifest, slides, tiles, out, "train.mode=packed", "data.augment.enabled=true",
                         "data.tiles_per_bag=3", "eval.sample_k=2", "eval.repeats=2", "eval.bootstrap=100",
                         "model.embed_chunk=5")
    return config, run_training(config)


def test_dpgs_eval_reproduces_a_tile_runs_test_metrics_without_augmentation(tile_run):
    from mlflow.tracking import MlflowClient

    from dpgs.cli import main

    config, result = tile_run
    out = config.train.output_dir
    assert main(["eval", str(out)]) == 0
    client = MlflowClient(config.tracking.uri)
    training = client.get_run(result.run_id)
    evals = client.search_runs([training.info.experiment_id], f"tags.`dpgs.evaluates` = '{result.run_id}'")
    assert len(evals) == 1 and evals[0].data.tags["dpgs.kind"] == "evaluation"
    logged = {k: v for k, v in training.data.metrics.items() if k.startswith("test_")}
    assert {"test_auc", "test_k2_auc", "test_k2_auc_std", "test_acc_ci_low"} <= set(logged)
    for key, value in logged.items():
        assert evals[0].data.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key

    data = load_experiment_data(config.data, seed=config.seed)
    test = data.splits[0].test
    plain = TileBagDataset([data.eval_dataset.items[i] for i in test], tiles_per_bag=None, augment=None)
    model = ModelSpec(config.model, None, 2).build()
    model.load_state_dict(torch.load(out / "best.pt", weights_only=True))
    probs, _ = bag_statistics_scores(model.eval(), [plain.read(j).tiles for j in range(len(test))],
                                     [plain.items[j].label for j in range(len(test))])
    rows = list(csv.DictReader((out / "predictions_test.csv").open()))
    assert [r["slide_id"] for r in rows] == [plain.items[j].slide_id for j in range(len(test))]
    np.testing.assert_allclose([[float(r["p_0"]), float(r["p_1"])] for r in rows], probs, atol=2e-6)
    assert {"k2_prediction", "k2_p_0", "k2_p_1", "k2_loss"} <= set(rows[0])
