"""Combinations the runtime cannot honour are refused when the config is loaded, naming the keys."""

import pytest

from dpgs.config import Config, ConfigError, config_to_dict, load_config


@pytest.mark.parametrize("optimizer, momentum", [("adam", 0.0), ("adamw", 0.0), ("sgd", 0.9)])
def test_momentum_correction_needs_a_plain_sgd_master_and_names_the_keys(optimizer, momentum):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["dpgs.compression.momentum_correction=0.9", f"train.optimizer={optimizer}",
                           f"train.momentum={momentum}"])
    text = str(err.value)
    for key in ("dpgs.compression.momentum_correction=0.9", f"train.optimizer={optimizer}",
                f"train.momentum={momentum:g}"):
        assert key in text
    assert "momentum twice" in text


@pytest.mark.parametrize("override,named", [
    ("train.optimizer=sgd", "train.optimizer=sgd"),
    ("dpgs.compression.downlink=delta", "dpgs.compression.downlink=delta"),
    ("train.grad_clip=1.0", "train.grad_clip=1.0"),
    ("dpgs.compression.warmup_epochs=0", "dpgs.compression.warmup_epochs=0"),
])
def test_a_frozen_second_moment_names_what_it_cannot_work_with(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["dpgs.compression.second_moment=frozen", override])
    assert named in str(err.value) and "dense warm-up" in str(err.value)
    accepted = load_config(None, ["dpgs.compression.second_moment=frozen"])
    assert accepted.dpgs.compression.second_moment == "frozen"


def test_a_frozen_second_moment_is_refused_for_a_trained_tile_encoder():
    tiles = ["data.kind=tiles", "model.encoder=resnet18", "dpgs.compression.second_moment=frozen"]
    with pytest.raises(ConfigError) as err:
        load_config(None, tiles)
    assert "model.encoder=resnet18 trained end to end" in str(err.value)
    assert load_config(None, [*tiles, "model.freeze_encoder=true"]).model.freeze_encoder


FIXED = "dpgs.compression.keep_ratio=0.01"


def second_moment(*overrides: str) -> str:
    return load_config(None, list(overrides)).dpgs.compression.second_moment


def test_second_moment_auto_is_frozen_for_a_head_and_live_for_a_trained_encoder():
    """With a fixed keep ratio auto resolves when the config is loaded: frozen wherever frozen is allowed,
    live elsewhere. With keep_ratio=auto it is left to the keep schedule, for a head only."""
    assert second_moment(FIXED) == "frozen"  # feature bags, Adam
    assert second_moment(FIXED, "train.optimizer=adamw") == "frozen"
    tiles = ["data.kind=tiles", "model.encoder=resnet18"]
    assert second_moment(FIXED, *tiles) == "live"
    assert second_moment(FIXED, *tiles, "model.freeze_encoder=true") == "frozen"
    assert second_moment() == "auto"  # keep_ratio=auto
    assert second_moment(*tiles) == "live"


@pytest.mark.parametrize("override", ["train.optimizer=sgd", "dpgs.compression.downlink=delta",
                                      "train.grad_clip=1.0", "dpgs.compression.clip_norm=1.0",
                                      "dpgs.compression.warmup_epochs=0"])
def test_second_moment_auto_is_live_where_frozen_would_be_refused(override):
    assert second_moment(FIXED, override) == second_moment(override) == "live"


def test_an_explicit_second_moment_is_kept_and_the_resolved_one_survives_a_reload():
    assert second_moment(FIXED, "dpgs.compression.second_moment=live") == "live"
    assert second_moment("dpgs.compression.second_moment=live") == "live"
    resolved = config_to_dict(load_config(None, [FIXED]))
    assert resolved["dpgs"]["compression"]["second_moment"] == "frozen"
    assert Config.model_validate(resolved).dpgs.compression.second_moment == "frozen"


def test_momentum_correction_with_plain_sgd_is_accepted():
    config = load_config(None, ["dpgs.compression.momentum_correction=0.9", "train.optimizer=sgd",
                                "train.momentum=0"])
    assert config.dpgs.compression.momentum_correction == 0.9


def test_checkpoints_within_epochs_are_refused_for_a_kfold_command():
    """A k-fold command writes no checkpoint (``--resume`` continues it fold by fold): asking it for some
    every N steps is refused, naming both keys; a single split keeps them."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.folds=5", "train.checkpoint_every=10"])
    text = str(err.value)
    assert "train.checkpoint_every=10" in text and "data.folds=5" in text and "single-split" in text
    assert not load_config(None, ["data.folds=5"]).writes_checkpoints
    single = load_config(None, ["train.checkpoint_every=10"])
    assert single.writes_checkpoints and single.train.checkpoint_every == 10


def test_the_key_checkpoint_every_had_in_the_dpgs_section_names_its_new_place(tmp_path):
    """``dpgs.checkpoint_every`` (DPGS's alone until every mode wrote checkpoints within an epoch) is refused
    with the key to set instead, on the command line as in a config file (named)."""
    moved = r"dpgs.checkpoint_every is now train.checkpoint_every.*set train.checkpoint_every=4"
    with pytest.raises(ConfigError, match=moved):
        load_config(None, ["dpgs.checkpoint_every=4"])
    path = tmp_path / "old.yaml"
    path.write_text("dpgs:\n  checkpoint_every: 4\n")
    with pytest.raises(ConfigError, match=moved + r" \(.*old\.yaml\)"):
        load_config(path, [])
