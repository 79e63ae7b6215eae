"""Config loading: YAML + dotted overrides, and errors that name the key."""

import pytest

from dpgs.config import ConfigError, flatten, load_config, save_config
from dpgs.config.loader import config_to_dict


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("experiment: x\ndata:\n  manifest: m.csv\n  features_dir: f\ntrain:\n  batch_size: 4\n")
    cfg = load_config(path, ["train.batch_size=16", "model.name=transmil", "model.params.dropout=0.25"])
    assert cfg.experiment == "x"
    assert cfg.train.batch_size == 16
    assert cfg.model.name == "transmil"
    assert cfg.model.params == {"dropout": 0.25}


def test_override_value_types_are_parsed_as_yaml():
    cfg = load_config(None, ["train.lr=1e-3", "train.grad_clip=null", "train.class_weighted_loss=true"])
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.train.grad_clip is None
    assert cfg.train.class_weighted_loss is True


def test_unknown_keys_and_wrong_types_named_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.batch_sz=3", "train.lr=fast", "dpgs.compression.keep_ratio=2"])
    text = str(err.value)
    assert "train.batch_sz: unknown key" in text
    assert "train.lr" in text
    assert "dpgs.compression.keep_ratio" in text


def test_unknown_section_in_file_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trian:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"trian: unknown key.*bad.yaml"):
        load_config(path)


def test_override_into_a_value_is_rejected():
    with pytest.raises(ConfigError, match="'train.epochs' is a value"):
        load_config(None, ["train.epochs=3", "train.epochs.x=1"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["train.epochs"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_round_trip_and_flatten(tmp_path):
    cfg = load_config(
        None, ["train.mode=dpgs", "dpgs.workers=3", "data.manifest=a.csv", "data.features_dir=b"]
    )
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg
    flat = flatten(config_to_dict(cfg))
    assert flat["dpgs.workers"] == 3
    assert flat["train.mode"] == "dpgs"
    assert flat["dpgs.compression.keep_ratio"] == "auto"


@pytest.mark.parametrize("name", ["demo.yaml", "demo-dpgs.yaml", "tiles-demo.yaml", "clam-features.yaml",
                                  "trident-kfold.yaml"])
def test_shipped_configs_validate(name):
    from pathlib import Path

    load_config(Path(__file__).parents[2] / "configs" / name)


@pytest.mark.parametrize(
    "override, key, message",
    [
        ("train.batch_size=true", "train.batch_size", "expected int, got the boolean true"),
        ("dpgs.workers=yes", "dpgs.workers", "expected int, got the boolean true"),
        ("train.lr=true", "train.lr", "expected float, got the boolean true"),
        ("train.lr=inf", "train.lr", "Input should be a finite number"),
        ("train.lr=.nan", "train.lr", "Input should be a finite number"),
        ("dpgs.call_timeout_s=.inf", "dpgs.call_timeout_s", "Input should be a finite number"),
    ],
)
def test_booleans_and_non_finite_numbers_are_not_numbers(override, key, message):
    with pytest.raises(ConfigError, match=rf"{key}: .*{message}"):
        load_config(None, [override])


def test_booleans_stay_booleans_and_numbers_stay_numbers():
    cfg = load_config(None, ["train.class_weighted_loss=yes", "train.epochs=2.0", "train.lr=1e-3"])
    assert cfg.train.class_weighted_loss is True and cfg.train.epochs == 2 and cfg.train.lr == 1e-3


def test_saved_config_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    save_config(load_config(None, ["train.epochs=3"]), path)
    before = path.read_text()

    def dump_then_fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pathlib.Path.write_text", dump_then_fail)
    with pytest.raises(OSError, match=f"cannot write {path}: No space left on device"):
        save_config(load_config(None, ["train.epochs=5"]), path)
    monkeypatch.undo()
    assert path.read_text() == before and list(tmp_path.iterdir()) == [path]
