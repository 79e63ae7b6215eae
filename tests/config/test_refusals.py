"""Combinations the runtime cannot honour are refused when the config is loaded, naming the keys."""

import pytest

from dpgs.config import ConfigError, load_config


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


def test_momentum_correction_with_plain_sgd_is_accepted():
    config = load_config(None, ["dpgs.compression.momentum_correction=0.9", "train.optimizer=sgd",
                                "train.momentum=0"])
    assert config.dpgs.compression.momentum_correction == 0.9
