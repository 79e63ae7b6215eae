"""End-to-end training on tile bags (data.kind=tiles): single process and DPGS on Ray."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dpgs.config import ConfigError
from dpgs.data import DataValidationError
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.runner import run_training
from dpgs.train.local_engine import LocalEngine
from tests.dpgs_helpers import dpgs_engine
from tests.tile_helpers import tile_config, write_tiled_slides


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    return write_tiled_slides(tmp_path_factory.mktemp("tiles"))


def initial_state(config, num_classes=2) -> dict[str, torch.Tensor]:
    """The weights a run starts from (the trainer seeds with ``config.seed`` before building)."""
    torch.manual_seed(config.seed)
    return {k: v.clone() for k, v in ModelSpec(config.model, None, num_classes).build().state_dict().items()}


def changed(a: dict, b: dict, prefix: str) -> list[str]:
    return [k for k in a if k.startswith(prefix) and a[k].is_floating_point() and not torch.equal(a[k], b[k])]


def test_tile_data_trains_with_sampled_bags_and_evaluates_on_all_tiles(slides, tmp_path):
    config = tile_config(*slides, tmp_path / "run", "data.tiles_per_bag=4")
    data = load_experiment_data(config.data, seed=0)
    counts = data.dataset.tile_counts()
    assert data.dataset.lengths() == [min(n, 4) for n in counts]
    assert [data.eval_dataset[i].features.shape[0] for i in range(len(counts))] == counts
    bag = data.dataset.get(2, epoch=1)
    assert bag.features.shape == (4, 3, 32, 32) and bag.features.dtype == torch.float32
    assert not torch.equal(bag.features, data.dataset.get(2, epoch=2).features)  # a new sample per epoch


@pytest.mark.ray
def test_dpgs_training_changes_the_encoder_and_the_frozen_baseline_does_not(ray_cluster, slides, tmp_path):
    results = {}
    for frozen in (False, True):
        out = tmp_path / f"frozen-{frozen}"
        config = tile_config(*slides, out, "train.mode=dpgs", "dpgs.workers=2", "train.lr=0.01",
                             f"model.freeze_encoder={str(frozen).lower()}",
                             "dpgs.compression.keep_ratio=0.05")
        result = run_training(config)
        assert result.folds[0].history[0]["train_loss"] > 0
        assert json.loads((out / "run.json").read_text())["run_id"] == result.run_id
        results[frozen] = torch.load(out / "last.pt", weights_only=True)
        before = initial_state(config)
        assert changed(results[frozen], before, "head."), "the head did not train"
        encoder_changes = changed(results[frozen], before, "encoder.")
        if frozen:
            assert encoder_changes == []  # weights and BatchNorm statistics untouched
        else:
            assert any(k.endswith("conv1.weight") for k in encoder_changes)
            assert any(k.endswith("running_mean") for k in encoder_changes)
    assert (tmp_path / "frozen-False" / "best.pt").is_file()


def test_bad_tile_inputs_are_all_reported_before_anything_is_written(slides, tmp_path):
    manifest, slide_dir, tiles = slides
    broken_tiles = tmp_path / "tiles"
    shutil.copytree(tiles, broken_tiles)
    (broken_tiles / "patches" / "slide_001.h5").unlink()
    (broken_tiles / "patches" / "slide_002.h5").write_bytes(b"not hdf5")
    out = tmp_path / "run"
    config = tile_config(manifest, slide_dir, broken_tiles, out)
    with pytest.raises(DataValidationError) as err:
        run_training(config)
    message = str(err.value)
    assert "slide 'slide_001': no coords file slide_001.h5" in message
    assert "slide_002.h5: cannot read tile coords" in message
    assert not out.exists()


def test_config_names_what_tile_training_needs(slides, tmp_path):
    manifest, slide_dir, tiles = slides
    with pytest.raises(ConfigError, match="needs a tile encoder: set model.encoder"):
        tile_config(manifest, slide_dir, tiles, tmp_path / "r", "model.encoder=null")
    with pytest.raises(ConfigError, match="data.slides_dir and data.tiles_dir are required"):
        tile_config(manifest, slide_dir, tiles, tmp_path / "r", "data.slides_dir=null")
    with pytest.raises(ConfigError, match="model.encoder=resnet18 needs data.kind=tiles"):
        tile_config(manifest, slide_dir, tiles, tmp_path / "r", "data.kind=features",
                    f"data.features_dir={tmp_path}")


@pytest.mark.ray
def test_one_dpgs_step_equals_the_single_process_step_on_the_same_tiles(ray_cluster, slides, tmp_path):
    """Encoder + head gradients stacked over 2 workers (compression off) == one packed step (fp32)."""
    config = tile_config(
        *slides, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2", "train.optimizer=sgd", "train.lr=0.1",
        "dpgs.compression.keep_ratio=1.0", "dpgs.compression.value_dtype=fp32",
    )
    data = load_experiment_data(config.data, seed=0)
    batch = [data.splits[0].train + data.splits[0].val]  # 4 bags of different lengths
    spec = ModelSpec(config.model, None, 2)
    before = initial_state(config)

    torch.manual_seed(config.seed)
    local = LocalEngine(spec.build(), config.train.model_copy(update={"mode": "packed"}), torch.device("cpu"),
                        None, config.seed, data.dataset, 0)
    local.run_epoch(batch, 1)
    reference = local.state_dict()

    torch.manual_seed(config.seed)
    with dpgs_engine(config, spec, spec.build(), data.dataset, data.splits[0].train) as engine:
        stats = engine.run_epoch(batch, 1, [])
        stacked = engine.state_dict()
    assert stats["optimizer_steps"] == 1 and stats["comm_bytes_up"] > 0
    for key, ref in reference.items():
        if not ref.is_floating_point() or "running" in key:
            continue  # running statistics are averaged over workers, not stacked
        err = (stacked[key] - ref).norm() / ref.norm().clamp(min=1e-12)
        assert err <= 1e-4, f"{key}: relative error {err:.2e}"
    assert changed(reference, before, "encoder.") and changed(reference, before, "head.")
