"""The learning-rate schedule (dpgs.train.optim.learning_rate): scaling with the bags per optimizer step,
per-epoch decay and the per-step linear warm-up, each checked against the formula written out by hand,
and the rate the engines actually step with."""

from __future__ import annotations

import math

import pytest
import torch

from dpgs.config import load_config
from dpgs.train.optim import bags_per_step, batch_lr, learning_rate


def train_cfg(*overrides: str):
    return load_config(None, list(overrides)).train


@pytest.mark.parametrize(
    "mode, batch, accumulation, scaling, reference, expected",
    [
        ("packed", 16, 1, "none", 1, 1e-3),
        ("packed", 16, 1, "linear", 1, 16e-3),
        ("packed", 16, 1, "sqrt", 1, 4e-3),
        ("dpgs", 16, 2, "sqrt", 1, math.sqrt(32) * 1e-3),
        ("dpgs", 16, 2, "linear", 8, 4e-3),
        ("dpgs", 4, 1, "sqrt", 16, 0.5e-3),
        ("classic", 16, 1, "linear", 1, 1e-3),  # one bag per step whatever batch_size says
        ("classic", 16, 1, "sqrt", 4, 0.5e-3),
    ],
)
def test_lr_scales_with_the_bags_per_optimizer_step(mode, batch, accumulation, scaling, reference, expected):
    cfg = train_cfg(f"train.mode={mode}", f"train.batch_size={batch}",
                    f"train.accumulation_steps={accumulation}", f"train.lr_scaling={scaling}",
                    f"train.lr_reference_batch={reference}", "train.lr=1e-3")
    assert bags_per_step(cfg) == (1 if mode == "classic" else batch * accumulation)
    assert batch_lr(cfg) == pytest.approx(expected, rel=1e-12)


def test_cosine_decay_per_epoch_without_warmup():
    cfg = train_cfg("train.lr=2e-3", "train.lr_scaling=none", "train.scheduler=cosine", "train.epochs=4",
                    "train.warmup_epochs=0")
    for epoch in range(1, 5):
        expected = 2e-3 * (1 + math.cos(math.pi * (epoch - 1) / 4)) / 2
        for step in (0, 3, 9):  # constant within an epoch
            assert learning_rate(cfg, epoch, step, 10) == pytest.approx(expected, rel=1e-12)


def test_linear_warmup_per_step_then_the_schedule():
    cfg = train_cfg("train.lr=1e-3", "train.lr_scaling=sqrt", "train.batch_size=16", "train.mode=dpgs",
                    "train.scheduler=none", "train.warmup_epochs=1.5", "train.epochs=5")
    steps = 10  # warm-up spans 15 steps: rate (t + 1) / 15 of 4e-3 at global step t
    rates = [learning_rate(cfg, e, s, steps) for e in range(1, 4) for s in range(steps)]
    for t, rate in enumerate(rates):
        assert rate == pytest.approx(4e-3 * min(1.0, (t + 1) / 15), rel=1e-12)
    assert rates[14] == pytest.approx(4e-3) and rates[13] < 4e-3


def test_warmup_multiplies_the_decayed_rate():
    cfg = train_cfg("train.lr=1e-3", "train.scheduler=step", "train.step_size=1", "train.gamma=0.5",
                    "train.warmup_epochs=2", "train.epochs=3", "train.lr_scaling=none")
    # epoch 2, step 1 of 4: global step 5 of an 8-step warm-up, decayed once
    assert learning_rate(cfg, 2, 1, 4) == pytest.approx(1e-3 * 0.5 * 6 / 8, rel=1e-12)


def test_the_local_engine_steps_with_the_scheduled_rate(monkeypatch):
    from dpgs.data.dataset import Bag
    from dpgs.models import build_head
    from dpgs.train import local_engine as engine_module

    cfg = train_cfg("train.mode=packed", "train.batch_size=2", "train.lr=1e-3", "train.lr_scaling=linear",
                    "train.warmup_epochs=0.5", "train.scheduler=cosine", "train.epochs=2")
    seen: list[float] = []
    real_step = engine_module.optimizer_step
    monkeypatch.setattr(engine_module, "optimizer_step",
                        lambda opt, params, lr, clip=1.0: (seen.append(lr), real_step(opt, params, lr, clip)))
    gen = torch.Generator().manual_seed(0)
    bags = [Bag(f"b{i}", torch.randn(3 + i, 8, generator=gen), i % 2, None) for i in range(8)]

    class Source:
        def get(self, i, epoch):
            return bags[i]

    torch.manual_seed(0)
    engine = engine_module.LocalEngine(build_head("meanmil", in_dim=8, num_classes=2), cfg,
                                       torch.device("cpu"), None, 0, Source(), prefetch=0)
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    for epoch in (1, 2):
        engine.run_epoch(batches, epoch)
    expected = [2e-3 * (1 + math.cos(math.pi * (e - 1) / 2)) / 2 * min(1.0, ((e - 1) * 4 + s + 1) / 2)
                for e in (1, 2) for s in range(4)]
    assert seen == pytest.approx(expected, rel=1e-12)
