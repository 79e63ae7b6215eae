"""The ``dpgs`` command line: options and ``KEY=VALUE`` overrides in any order."""

from __future__ import annotations

import pytest

import dpgs.runner
from dpgs.cli import build_parser, main


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "c.yaml", "train.epochs=2", "--tracking-uri", "sqlite:///x.db", "train.lr=1e-3"],
        ["train.epochs=2", "--config", "c.yaml", "train.lr=1e-3", "--tracking-uri", "sqlite:///x.db"],
        ["--tracking-uri", "sqlite:///x.db", "train.epochs=2", "train.lr=1e-3", "--config", "c.yaml"],
    ],
)
def test_train_overrides_may_stand_before_between_and_after_options(argv):
    args = build_parser().parse_args(["train", *argv])
    assert args.overrides == ["train.epochs=2", "train.lr=1e-3"]
    assert (args.config, args.tracking_uri) == ("c.yaml", "sqlite:///x.db")


def test_later_overrides_win_in_command_line_order(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(dpgs.runner, "run_training", lambda config: seen.append(config) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the config reached training: stop there
        main(["train", "train.epochs=2", "data.manifest=m.csv", "--address", "auto", "train.epochs=7",
              "data.features_dir=f", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "train.lr=1e-3"])
    (config,) = seen
    assert config.train.epochs == 7 and config.train.lr == 1e-3
    assert config.dpgs.address == "auto" and config.tracking.uri == f"sqlite:///{tmp_path / 'm.db'}"


def test_unknown_options_are_still_rejected(capsys):
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(["train", "--config", "c.yaml", "train.epochs=2", "--bogus", "train.lr=1"])
    assert err.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
