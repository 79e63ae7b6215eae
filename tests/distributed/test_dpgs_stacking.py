"""DPGS on Ray: exact gradient stacking, fault tolerance and resume (real two-node local Ray cluster)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from dpgs.distributed.engine import DpgsEngine
from dpgs.modeling import ModelSpec
from dpgs.runner import run_training
from dpgs.train.engine import LocalEngine
from tests.dpgs_helpers import experiment_data, make_config, write_bags

pytestmark = pytest.mark.ray

LENGTHS = [1, 1000, 37, 5, 260, 2, 731, 64, 9, 120, 3, 450, 17, 88, 600, 1, 42, 300, 7, 15]


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    root = tmp_path_factory.mktemp("bags")
    return write_bags(root, LENGTHS)


def engines(config, data):
    spec = ModelSpec(config.model, data.dataset.feature_dim, len(data.manifest.classes))
    torch.manual_seed(config.seed)
    model = spec.build()
    return spec, model


def local_params(config, data, batches, epochs=1):
    spec, model = engines(config, data)
    engine = LocalEngine(model, config.train, torch.device("cpu"), None, config.seed, data.dataset, 0)
    for epoch in range(1, epochs + 1):
        engine.run_epoch(batches, epoch)
    return {k: v.clone() for k, v in engine.state_dict().items()}


def dpgs_params(config, data, batches, hooks=None, epochs=1):
    spec, model = engines(config, data)
    engine = DpgsEngine(config, model, None, (data.dataset, data.splits[0].train), spec)
    engine.hooks.update(hooks or {})
    try:
        stats = [engine.run_epoch(batches, epoch) for epoch in range(1, epochs + 1)]
        return {k: v.clone() for k, v in engine.state_dict().items()}, stats
    finally:
        engine.close()


def assert_close(a: dict, b: dict, rtol: float):
    assert a.keys() == b.keys()
    for key in a:
        err = (a[key] - b[key]).norm() / b[key].norm().clamp(min=1e-12)
        assert err <= rtol, f"{key}: relative error {err:.2e} > {rtol}"


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_one_step_equals_packed_mode(ray_cluster, bags, tmp_path, workers):
    """B=7 bags of lengths 1..1000 (B not divisible by P): DPGS step == single-process packed step.

    SGD, because Adam's first step is lr * sign(g): entries whose gradient is ~0 flip with float32
    summation order, which says nothing about the stacking.
    """
    config = make_config(
        *bags,
        tmp_path / "run",
        "train.mode=dpgs",
        f"dpgs.workers={workers}",
        "train.optimizer=sgd",
        "train.lr=0.5",
        "dpgs.compression.keep_ratio=1.0",
        "dpgs.compression.value_dtype=fp32",
    )
    data = experiment_data(config)
    batch = [[0, 1, 2, 3, 4, 5, 6]]
    before = engines(config, data)[1].state_dict()
    reference = local_params(
        config.model_copy(update={"train": config.train.model_copy(update={"mode": "packed"})}), data, batch
    )
    stacked, stats = dpgs_params(config, data, batch)
    assert_close(stacked, reference, 1e-5)
    assert any((reference[k] - before[k]).abs().max() > 1e-4 for k in reference), "the step changed nothing"
    epoch = stats[0]
    assert epoch["comm_bytes_up"] > 0 and epoch["comm_bytes_down"] > 0
    assert epoch["comm_dense_bytes"] > 0


def test_compression_counts_bytes_and_shrinks_payloads(ray_cluster, bags, tmp_path):
    config = make_config(
        *bags,
        tmp_path / "run",
        "train.mode=dpgs",
        "dpgs.workers=2",
        "dpgs.compression.keep_ratio=0.01",
        "dpgs.compression.value_dtype=fp16",
    )
    data = experiment_data(config)
    _, stats = dpgs_params(config, data, [[0, 1, 2, 3], [4, 5, 6, 7]])
    epoch = stats[0]
    assert epoch["compression_ratio"] > 10
    assert epoch["comm_dense_bytes"] / (epoch["comm_bytes_up"] + epoch["comm_bytes_down"]) == pytest.approx(
        epoch["compression_ratio"]
    )


def test_killed_worker_is_restarted_and_its_bags_rerun(ray_cluster, bags, tmp_path):
    """SIGKILL a worker while it computes: the step completes, every bag counts once (exact result)."""
    config = make_config(
        *bags,
        tmp_path / "run",
        "train.mode=dpgs",
        "dpgs.workers=2",
        "dpgs.compression.keep_ratio=1.0",
        "dpgs.compression.value_dtype=fp32",
        "dpgs.call_timeout_s=60",
    )
    data = experiment_data(config)
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    clean, _ = dpgs_params(config, data, batches)

    def kill_worker_once(engine, step):
        if step == 1 and not getattr(engine, "_killed", False):
            engine._killed = True
            import ray

            pid = ray.get(engine.workers[0].ping.remote())
            os.kill(pid, signal.SIGKILL)

    faulty, stats = dpgs_params(config, data, batches, {"after_submit": kill_worker_once})
    assert stats[0]["worker_restarts"] == 1.0
    assert_close(faulty, clean, 1e-6)


def test_workers_dying_past_the_limit_stop_with_checkpoint(ray_cluster, bags, tmp_path):
    from dpgs.distributed.engine import WorkerFailure

    config = make_config(
        *bags,
        tmp_path / "run",
        "train.mode=dpgs",
        "dpgs.workers=2",
        "dpgs.max_worker_restarts=0",
        "dpgs.call_timeout_s=30",
    )
    (tmp_path / "run").mkdir()
    data = experiment_data(config)

    def kill(engine, step):
        import ray

        os.kill(ray.get(engine.workers[1].ping.remote()), signal.SIGKILL)

    with pytest.raises(WorkerFailure, match="worker 1 failed 1 times.*checkpoint written"):
        dpgs_params(config, data, [[0, 1, 2, 3]], {"before_submit": kill})
    assert (tmp_path / "run" / "checkpoint.pt").is_file()


class DriverKilled(RuntimeError):
    pass


def test_driver_killed_and_resumed_matches_uninterrupted(ray_cluster, bags, tmp_path):
    common = [
        "train.mode=dpgs",
        "dpgs.workers=2",
        "dpgs.compression.keep_ratio=1.0",
        "dpgs.compression.value_dtype=fp32",
        "train.epochs=2",
        "train.batch_size=4",
        "dpgs.checkpoint_every=1",
    ]
    full = make_config(*bags, tmp_path / "full", *common)
    run_training(full)

    interrupted = make_config(*bags, tmp_path / "cut", *common)
    import dpgs.distributed.engine as engine_module

    original = engine_module.DpgsEngine.__init__

    def init_with_crash(self, *args, **kwargs):
        original(self, *args, **kwargs)

        def crash(engine, epoch, step):
            if epoch == 2 and step == 2:
                raise DriverKilled("simulated driver crash")

        self.hooks["after_step"] = crash

    engine_module.DpgsEngine.__init__ = init_with_crash
    try:
        with pytest.raises(DriverKilled):
            run_training(interrupted)
    finally:
        engine_module.DpgsEngine.__init__ = original
    resumed = interrupted.model_copy(
        update={"dpgs": interrupted.dpgs.model_copy(update={"resume": tmp_path / "cut" / "checkpoint.pt"})}
    )
    run_training(resumed)
    a = torch.load(tmp_path / "cut" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "full" / "last.pt", weights_only=True)
    assert_close(a, b, 1e-6)
