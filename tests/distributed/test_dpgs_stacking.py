"""DPGS on Ray: exact gradient stacking in every synchronisation mode and transport, replicas equal to
the master, fault tolerance, resume (residuals included), accumulation, k-fold reuse of the actors
(real two-node local Ray cluster)."""

from __future__ import annotations

import csv
import os
import re
import signal
import time
from pathlib import Path

import pytest
import ray
import torch

from dpgs.distributed.failures import ClusterLost, GcsWatch, MasterFailure, WorkerFailure
from dpgs.distributed.frames import HEADER as FRAME_HEADER
from dpgs.errors import RunFailure
from dpgs.modeling import ModelSpec
from dpgs.records import CHECKPOINT_FILE
from dpgs.runner import run_training
from dpgs.train.engine import EpochEnd, EpochSoFar
from dpgs.train.local_engine import LocalEngine
from tests.distributed.test_failures import closed_address
from tests.dpgs_helpers import dpgs_engine, experiment_data, fold_setup, make_config, write_bags

pytestmark = pytest.mark.ray

LENGTHS = [1, 1000, 37, 5, 260, 2, 731, 64, 9, 120, 3, 450, 17, 88, 600, 1, 42, 300, 7, 15]
DENSE = ["dpgs.compression.keep_ratio=1.0"]
FROZEN = ["dpgs.compression.second_moment=frozen", "dpgs.compression.warmup_epochs=1"]  # dense epoch 1
LIVE = "dpgs.compression.second_moment=live"  # a fixed ratio on a head is frozen by default (dense warm-up)
# Adam's first step is lr * sign(g): see test 1's docstring; every step at train.lr, whatever its bag count
EXACT = ["train.optimizer=sgd", "train.lr=0.5", "train.lr_scaling=none"]


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    root = tmp_path_factory.mktemp("bags")
    return write_bags(root, LENGTHS)


@pytest.fixture(scope="module")
def long_bags(tmp_path_factory):
    """Nine training bags of 20 000 instances (then two validation and one test bag of 200)."""
    return write_bags(tmp_path_factory.mktemp("long-bags"), [20_000] * 9 + [200] * 3)


def start(config, data):
    spec = ModelSpec(config.model, data.dataset.feature_dim, len(data.manifest.classes))
    torch.manual_seed(config.seed)
    return spec, spec.build()


def local_run(config, data, batches, epochs=1, device="cpu"):
    """The single-process packed run's parameters (on ``device``), as CPU tensors, and its last epoch's
    metrics."""
    packed = config.model_copy(update={"train": config.train.model_copy(update={"mode": "packed"})})
    _, model = start(packed, data)
    engine = LocalEngine(model, packed.train, torch.device(device), None, config.seed, data.dataset, 0)
    stats = [engine.run_epoch(batches, epoch) for epoch in range(1, epochs + 1)]
    return {k: v.detach().cpu().clone() for k, v in engine.state_dict().items()}, stats[-1]


def local_params(config, data, batches, epochs=1, device="cpu"):
    """The single-process packed run's parameters (on ``device``), as CPU tensors."""
    return local_run(config, data, batches, epochs, device)[0]


def dpgs_run(config, data, batches, epochs=1, after_submit=None, after_chunk=None):
    """(master's parameters, epoch metrics, workers' ReplicaStates, master's ReplicaState).

    ``after_submit(group, pids)``: called once a chunk is submitted, with the workers' process ids (asked
    beforehand: during a chunk the actors are busy)."""
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        if after_submit is not None:
            pids = ray.get(engine.group.workers.call("ping"))
            engine.group.hooks.after_submit = lambda group: after_submit(group, pids)
        engine.hooks.after_chunk = after_chunk
        stats = [engine.run_epoch(batches, epoch, []) for epoch in range(1, epochs + 1)]
        workers = ray.get(engine.group.workers.call("replica_state"))
        master = ray.get(engine.group.master.replica_state.remote())
        return {k: v.clone() for k, v in engine.state_dict().items()}, stats, workers, master


def die_at_step(index: int):
    """For ``worker.__ray_call__``: the worker SIGKILLs itself as it is about to run step ``index``, after
    the steps before it in the same chunk (their reports die with it); its restarted process runs it."""

    def install(worker):
        run = worker._step

        def step(plan, following):
            if plan.index == index:
                os.kill(os.getpid(), signal.SIGKILL)
            return run(plan, following)

        worker._step = step

    return install


def assert_close(a: dict, b: dict, rtol: float):
    assert a.keys() == b.keys()
    for key in a:
        err = (a[key] - b[key]).norm() / b[key].norm().clamp(min=1e-12)
        assert err <= rtol, f"{key}: relative error {err:.2e} > {rtol}"


@pytest.mark.parametrize("workers,transport,clip", [  # the slow one: between 1 and 3 workers
    (1, "gloo", None), pytest.param(2, "gloo", None, marks=pytest.mark.slow), (3, "gloo", None),
    (2, "ray", None), (2, "gloo", 0.05)])
def test_one_dense_step_equals_packed_mode(ray_cluster, bags, tmp_path, workers, transport, clip):
    """B=7 bags of lengths 1..1000 (B not divisible by P): DPGS step == single-process packed step.

    SGD, because Adam's first step is lr * sign(g): entries whose gradient is ~0 flip with float32
    summation order, which says nothing about the stacking. Dense mode sends raw float32: exactly 4 bytes
    per parameter each way, plus the frame's header and two part sizes down. With ``train.grad_clip`` every
    rank clips the mean gradient as the single-process engine does. Up, each worker also sends the sum of its
    bags' losses (8 bytes): the epoch's ``train_loss`` is the packed step's.
    """
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", f"dpgs.workers={workers}",
                         f"dpgs.transport={transport}", f"train.grad_clip={clip or 'null'}", *EXACT, *DENSE)
    data = experiment_data(config)
    batch = [[0, 1, 2, 3, 4, 5, 6]]
    before = start(config, data)[1].state_dict()
    reference, packed = local_run(config, data, batch)
    packed_loss = packed["train_loss"]
    stacked, stats, replicas, master = dpgs_run(config, data, batch)
    assert_close(stacked, reference, 1e-5)
    assert any((reference[k] - before[k]).abs().max() > 1e-4 for k in reference), "the step changed nothing"
    numel = master.params.numel()
    epoch = stats[0]
    assert epoch["comm_bytes_up"] == (4 * numel + 8) * workers
    assert epoch["comm_bytes_down"] == (4 * numel + FRAME_HEADER.size + 2 * 8) * workers
    sent = epoch["comm_bytes_up"] + epoch["comm_bytes_down"]
    assert epoch["compression_ratio"] == (8 * numel + 8) * workers / sent
    assert epoch["train_loss"] == pytest.approx(packed_loss, rel=1e-6)
    assert all(torch.equal(r.params, master.params) and r.version == 1 for r in replicas)


@pytest.mark.parametrize("downlink,clip,transport,extra", [  # slow: each varies one thing of the first
    ("gradients", None, "gloo", []), pytest.param("gradients", 0.05, "gloo", [], marks=pytest.mark.slow),
    ("delta", None, "gloo", []), pytest.param("gradients", None, "ray", [], marks=pytest.mark.slow),
    pytest.param("gradients", None, "gloo", FROZEN, marks=pytest.mark.slow)], ids=str)
def test_compressed_steps_keep_replicas_identical_to_the_master(ray_cluster, bags, tmp_path, downlink, clip,
                                                                transport, extra):
    """Keep 10%, Adam, two epochs: with downlink=gradients every worker holds exactly the master's
    parameters and optimizer state (same decode, sum, clip factor and step), over either transport, also
    with Adam's second moment frozen after a dense first epoch; with downlink=delta exactly what the
    master's broadcast says they hold."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2", "train.lr=0.01",
                         "dpgs.compression.keep_ratio=0.1", "dpgs.compression.value_dtype=fp16", LIVE,
                         f"dpgs.compression.downlink={downlink}", f"train.grad_clip={clip or 'null'}",
                         f"dpgs.transport={transport}", *extra)
    data = experiment_data(config)
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    stacked, stats, replicas, master = dpgs_run(config, data, batches, epochs=2)
    for r in replicas:
        assert r.version == master.version == 6
        assert torch.equal(r.params, master.params)
        if downlink == "gradients":
            keys = ("exp_avg", "denom") if extra else ("exp_avg", "exp_avg_sq")
            for a, b in zip(r.optimizer["state"].values(), master.optimizer["state"].values(), strict=True):
                for key in keys:
                    assert torch.equal(a[key], b[key])
    epoch = stats[1]
    assert epoch["compression_ratio"] > 5
    total = epoch["comm_bytes_up"] + epoch["comm_bytes_down"]
    assert epoch["comm_dense_bytes"] / total == pytest.approx(epoch["compression_ratio"])
    if downlink == "gradients":  # each worker receives the other's payload (it kept its own), plus a header
        assert epoch["comm_bytes_up"] < epoch["comm_bytes_down"] < epoch["comm_bytes_up"] + 2000


def test_a_worker_error_ends_the_run_at_once_with_that_error(ray_cluster, tmp_path):
    """A bag file that became unreadable after the data was validated: its worker raises in the step, the
    master waits for that worker's gradient. The run ends with the worker's error (naming the file) within
    seconds (``rank_group.ERROR_GRACE_S``), not after ``dpgs.call_timeout_s`` (300 s here), and not as a
    master failure."""
    manifest, feats = write_bags(tmp_path / "data", LENGTHS[:8])
    config = make_config(manifest, feats, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.call_timeout_s=300", *EXACT, *DENSE)
    data = experiment_data(config)
    (feats / "s3.h5").write_bytes(b"not an HDF5 file")
    started = time.monotonic()
    with pytest.raises(RunFailure, match=r"^the worker [01] failed: .*s3\.h5") as raised:
        dpgs_run(config, data, [[0, 1, 2, 3]])
    assert not isinstance(raised.value, MasterFailure)
    assert time.monotonic() - started < 60


@pytest.mark.slow  # the worker that dies mid-chunk (next test) covers the same path in the default run
def test_killed_worker_is_restarted_and_only_its_bags_rerun(ray_cluster, bags, tmp_path):
    """SIGKILL a worker while the chunk runs: the epoch completes, every bag counts once (exact result),
    one restart is counted, and all replicas end equal to the master."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.call_timeout_s=60",
                         *EXACT, *DENSE)
    data = experiment_data(config)
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    clean, *_ = dpgs_run(config, data, batches)
    killed = []

    def kill_worker_once(group, pids):
        if not killed:
            killed.append(pids[0])
            os.kill(pids[0], signal.SIGKILL)

    faulty, stats, replicas, master = dpgs_run(config, data, batches, after_submit=kill_worker_once)
    assert stats[0]["worker_restarts"] == 1.0
    assert stats[0]["optimizer_steps"] == 3.0
    assert_close(faulty, clean, 1e-6)
    assert all(torch.equal(r.params, master.params) for r in replicas)


def test_a_worker_dying_mid_chunk_loses_nothing_of_the_epochs_metrics(ray_cluster, bags, tmp_path):
    """Worker 0 dies after it completed the chunk's first step, whose report dies with it: it is restarted,
    every bag counts once (the clean run's weights, every replica equal to the master's), and the epoch's
    loss, steps and bytes are still the clean run's (the master's reports hold them)."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.call_timeout_s=60", *EXACT, *DENSE)
    data = experiment_data(config)
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    clean, (expected,), *_ = dpgs_run(config, data, batches)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        ray.get(engine.group.workers.handles[0].__ray_call__.remote(die_at_step(1)))
        stats = engine.run_epoch(batches, 1, [])
        faulty = {k: v.clone() for k, v in engine.state_dict().items()}
        replicas = ray.get(engine.group.workers.call("replica_state"))
        master = ray.get(engine.group.master.replica_state.remote())
    assert stats["worker_restarts"] == 1.0
    assert_close(faulty, clean, 1e-6)
    assert all(torch.equal(r.params, master.params) and r.version == 3 for r in replicas)
    for key in ("optimizer_steps", "comm_bytes_up", "comm_bytes_down", "comm_dense_bytes"):
        assert stats[key] == expected[key], key
    assert stats["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-9)


def test_restarted_worker_starts_with_an_empty_residual(ray_cluster, bags, tmp_path):
    """With compression, a restarted worker's error-feedback residual is lost (documented): the survivor
    keeps its own, the restarted one's is zero until its next step, and training goes on."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.call_timeout_s=60",
                         "dpgs.compression.keep_ratio=0.05", LIVE)
    data = experiment_data(config)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        engine.run_epoch([[0, 1, 2, 3], [4, 5, 6, 7]], 1, [])
        before = [s["uplink"] for s in engine.group.sync_states()]
        assert all(s["residual"].abs().sum() > 0 for s in before)
        os.kill(ray.get(engine.group.workers.handles[1].ping.remote()), signal.SIGKILL)
        engine.group.hooks.after_submit = None
        stats = engine.run_epoch([[8], [9, 10]], 2, [])  # worker 1 has no bag in the first step
        after = [s["uplink"] for s in engine.group.sync_states()]
    assert stats["worker_restarts"] == 1.0
    assert after[1]["step"] == 1  # the restarted worker encoded once (its bag of the second step)
    assert after[0]["step"] == before[0]["step"] + 2


def test_no_rank_imports_torch_dynamo(ray_cluster, bags, tmp_path):
    """The master and the workers train (Adam, compressed) without importing ``torch._dynamo``, which
    ``torch.optim``'s first use imports: 1.4-1.8 s of CPU and ~70 MB in each process at every run's start
    (``dpgs.train.optimizers``)."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2", "train.optimizer=adam",
                         "dpgs.compression.keep_ratio=0.05", LIVE)
    data = experiment_data(config)
    spec, model = start(config, data)
    imported = lambda actor: "torch._dynamo" in __import__("sys").modules
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        engine.run_epoch([[0, 1, 2, 3]], 1, [])
        ranks = [engine.group.master, *engine.group.workers.handles]
        assert ray.get([rank.__ray_call__.remote(imported) for rank in ranks]) == [False] * 3


def test_state_asked_at_an_epochs_end_is_the_groups_until_it_runs_steps(ray_cluster, bags, tmp_path):
    """At an epoch's end the engine asks the master for its weights and the workers for their residuals
    ahead (they arrive during validation); what the group then answers is exactly what the ranks hold,
    and once the group runs steps again the early answers are dropped, not served stale."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.compression.keep_ratio=0.05", LIVE)
    data = experiment_data(config)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        group = engine.group
        engine.run_epoch([[0, 1, 2, 3], [4, 5, 6, 7]], 1, [])
        assert group.asked is not None
        held = ray.get(group.master.model_state.remote())
        residuals = [s["uplink"]["residual"] for s in ray.get(group.workers.call("sync_state"))]
        assert all(torch.equal(held[k], v) for k, v in group.model_state().items())
        assert all(torch.equal(a["uplink"]["residual"], b)
                   for a, b in zip(group.sync_states(), residuals, strict=True))
        # epoch 2 asks nothing ahead: the group must ask afresh
        group.ask_state = lambda weights, sync_states: None
        engine.run_epoch([[8, 9, 10, 11]], 2, [])
        assert group.asked is None
        after = group.model_state()
        assert any(not torch.equal(after[k], held[k]) for k in held)
        assert all(torch.equal(after[k], v) for k, v in ray.get(group.master.model_state.remote()).items())
        assert not all(torch.equal(a["uplink"]["residual"], b)
                       for a, b in zip(group.sync_states(), residuals, strict=True))


def test_the_master_writes_an_epochs_files_while_the_next_epoch_runs(ray_cluster, bags, tmp_path):
    """``save_epoch`` returns before the files are written; the master writes them before it runs the next
    chunk, so they hold the weights of the epoch's end (not the next epoch's) and the checkpoint resumes
    there."""
    out = tmp_path / "run"
    config = make_config(*bags, out, "train.mode=dpgs", "dpgs.workers=2", "dpgs.compression.keep_ratio=0.05",
                         LIVE)
    out.mkdir()
    data = experiment_data(config)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        engine.run_epoch([[0, 1, 2, 3], [4, 5, 6, 7]], 1, [])
        epoch_1 = ray.get(engine.group.master.model_state.remote())
        residuals = [s["uplink"]["residual"] for s in ray.get(engine.group.workers.call("sync_state"))]
        engine.save_epoch(EpochEnd(1, [{"epoch": 1}], (out / "last.pt", out / "best.pt")))
        assert engine.group.saving is not None  # not waited for
        engine.run_epoch([[8, 9, 10, 11]], 2, [{"epoch": 1}])
        engine.wait_saved()
        assert engine.group.saving is None
        epoch_2 = engine.state_dict()
    for name in ("last.pt", "best.pt"):
        written = torch.load(out / name, weights_only=True)
        assert all(torch.equal(written[k], v) for k, v in epoch_1.items()), name
    assert any(not torch.equal(epoch_2[k], v) for k, v in epoch_1.items())
    checkpoint = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    assert checkpoint["driver"]["epoch"] == 2 and checkpoint["driver"]["step_in_epoch"] == 0
    assert checkpoint["driver"]["history"] == [{"epoch": 1}]
    assert checkpoint["master"]["step"] == 2
    assert all(torch.equal(w["uplink"]["residual"], r)
               for w, r in zip(checkpoint["workers"], residuals, strict=True))


def test_epoch_files_named_relative_to_the_drivers_directory_land_there(ray_cluster, bags, tmp_path,
                                                                         monkeypatch):
    """The master runs in Ray's working directory, not the driver's: a relative ``train.output_dir``
    (``runs/x``, as users write it) must still put the files the master writes under the driver's."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2", *DENSE)
    data = experiment_data(config)
    spec, model = start(config, data)
    monkeypatch.chdir(tmp_path)
    Path("relative").mkdir()
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        engine.run_epoch([[0, 1, 2, 3]], 1, [])
        engine.save_epoch(EpochEnd(1, [], (Path("relative/last.pt"),)))
        engine.wait_saved()
        held = engine.state_dict()
    written = torch.load(tmp_path / "relative" / "last.pt", weights_only=True)
    assert all(torch.equal(written[k], v) for k, v in held.items())


def test_a_failed_epoch_write_in_the_master_raises_its_oserror_and_keeps_the_previous_file(
        ray_cluster, bags, tmp_path):
    out = tmp_path / "run"
    config = make_config(*bags, out, "train.mode=dpgs", "dpgs.workers=2", *DENSE)
    out.mkdir()
    data = experiment_data(config)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        engine.run_epoch([[0, 1, 2, 3]], 1, [])
        engine.save_epoch(EpochEnd(1, [], (out / "last.pt",)))
        engine.wait_saved()
        before = (out / "last.pt").read_bytes()
        engine.run_epoch([[4, 5, 6, 7]], 2, [])
        (out / "best.pt").mkdir()  # the rename onto it fails
        engine.save_epoch(EpochEnd(2, [], (out / "last.pt", out / "best.pt")))
        with pytest.raises(OSError, match=re.escape(f"cannot write {out / 'best.pt'}")) as raised:
            engine.wait_saved()
        assert "RayTaskError" not in type(raised.value).__name__
        engine.wait_saved()  # reported once
    assert (out / "last.pt").read_bytes() != before  # written before best.pt failed
    assert torch.load(out / CHECKPOINT_FILE, weights_only=True)["driver"]["epoch"] == 2  # epoch 1's


@pytest.mark.slow  # the run stopped by a dying worker (next test) covers it, mid-chunk, in the default run
def test_workers_dying_past_the_limit_stop_with_checkpoint(ray_cluster, bags, tmp_path):
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.max_worker_restarts=0", "dpgs.call_timeout_s=30")
    (tmp_path / "run").mkdir()
    data = experiment_data(config)

    def kill(group, pids):
        os.kill(pids[1], signal.SIGKILL)

    with pytest.raises(WorkerFailure, match="worker 1 failed 1 times.*checkpoint written"):
        dpgs_run(config, data, [[0, 1, 2, 3]], after_submit=kill)
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["driver"]["step_in_epoch"] == 0 and checkpoint["master"]["step"] == 0


def test_a_run_stopped_by_a_dying_worker_resumes_with_the_steps_it_took_in_its_metrics(ray_cluster, bags,
                                                                                      tmp_path, monkeypatch):
    """Worker 0 dies at the epoch's third step and no restart is allowed: the checkpoint continues at that
    step with what the two steps the master took added to the epoch's metrics, so the resumed run logs the
    uninterrupted run's loss, steps and bytes, and ends with its weights."""
    common = ["train.mode=dpgs", "dpgs.workers=2", "train.epochs=1", "train.batch_size=4",
              "dpgs.max_worker_restarts=0", "dpgs.call_timeout_s=60", *EXACT, *DENSE]
    run_training(make_config(*bags, tmp_path / "full", *common))
    cut = make_config(*bags, tmp_path / "cut", *common)
    import dpgs.distributed.dpgs_engine as engine_module

    original = engine_module.DpgsEngine.__init__

    def init_with_a_dying_worker(self, *args, **kwargs):
        original(self, *args, **kwargs)
        ray.get(self.group.workers.handles[0].__ray_call__.remote(die_at_step(2)))

    monkeypatch.setattr(engine_module.DpgsEngine, "__init__", init_with_a_dying_worker)
    with pytest.raises(WorkerFailure, match="worker 0 failed 1 times.*checkpoint written"):
        run_training(cut)
    monkeypatch.undo()
    checkpoint = torch.load(tmp_path / "cut" / CHECKPOINT_FILE, weights_only=True)
    assert checkpoint["driver"]["step_in_epoch"] == 2 and checkpoint["master"]["step"] == 2
    run_training(cut.model_copy(update={"dpgs": cut.dpgs.model_copy(
        update={"resume": tmp_path / "cut" / CHECKPOINT_FILE})}))
    assert_close(torch.load(tmp_path / "cut" / "last.pt", weights_only=True),
                 torch.load(tmp_path / "full" / "last.pt", weights_only=True), 1e-6)
    (cut_row,), (full_row,) = (list(csv.DictReader((tmp_path / name / "metrics.csv").open()))
                               for name in ("cut", "full"))
    for key in ("optimizer_steps", "comm_bytes_up", "comm_bytes_down", "comm_dense_bytes"):
        assert cut_row[key] == full_row[key], key
    assert float(cut_row["train_loss"]) == pytest.approx(float(full_row["train_loss"]), rel=1e-9)


def test_workers_dying_past_the_limit_in_a_kfold_command_say_how_to_resume_it(ray_cluster, bags, tmp_path):
    """A fold of a k-fold command writes no checkpoint (``--resume`` continues the command fold by fold): a
    failure past the restart limit writes none either, and names the directory to resume and the fold."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2", "data.folds=2",
                         "data.val_fraction=0", "dpgs.max_worker_restarts=0", "dpgs.call_timeout_s=30")
    (tmp_path / "run").mkdir()
    data = experiment_data(config)

    def kill(group, pids):
        os.kill(pids[1], signal.SIGKILL)

    hint = f"writes no checkpoint: --resume {tmp_path} keeps the folds that finished and trains run again"
    with pytest.raises(WorkerFailure, match=f"worker 1 failed 1 times.*{hint}"):
        dpgs_run(config, data, [[0, 1, 2, 3]], after_submit=kill)
    assert not (tmp_path / "run" / CHECKPOINT_FILE).exists()


@pytest.mark.parametrize("head", ["answering", "unreachable"])
def test_a_dead_master_is_a_master_failure_or_the_lost_head(ray_cluster, bags, tmp_path, head):
    """The master actor killed mid-chunk: with the head's GCS answering, a resumable MasterFailure; with it
    unreachable (the master runs on the head: the head's Ray died), ClusterLost at once, naming the head,
    and nothing is released (every release would block inside Ray)."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.call_timeout_s=30", *EXACT, *DENSE)
    data = experiment_data(config)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        answering = engine.group.watch
        if head == "unreachable":  # what a driver on the head sees once the head's Ray is gone
            engine.group.watch = GcsWatch(closed_address())
        engine.group.hooks.after_submit = lambda group: ray.kill(group.master, no_restart=True)
        with pytest.raises(MasterFailure, match="master actor died") as raised:
            engine.run_epoch([[0, 1, 2, 3]], 1, [])
        lost = isinstance(raised.value, ClusterLost)
        assert lost == (head == "unreachable") == engine.group.watch.lost, raised.value
        if lost:
            head_lost = r"the cluster's head \(Ray GCS at 127\.0\.0\.1:\d+\) is unreachable"
            assert re.match(head_lost, str(raised.value))
        engine.group.watch = answering  # this test's cluster is there in fact: release the workers


def test_a_relative_output_dir_is_the_drivers_also_for_the_master(ray_cluster, bags, tmp_path, monkeypatch):
    """The master actor writes the checkpoint; a relative ``train.output_dir`` is the driver's (Ray starts
    actors in another working directory: found on a cluster, where --resume then found no checkpoint)."""
    monkeypatch.chdir(tmp_path)
    config = make_config(*bags, Path("run"), "train.mode=dpgs", "dpgs.workers=2", *DENSE)
    data = experiment_data(config)
    spec, model = start(config, data)
    with dpgs_engine(config, spec, model, data.dataset, data.splits[0].train) as engine:
        written = engine.checkpoint(1, 0, [], EpochSoFar())
    assert written == tmp_path / "run" / CHECKPOINT_FILE and written.is_file()


def test_accumulation_equals_the_larger_batch(ray_cluster, bags, tmp_path):
    """accumulation_steps=2 over batches of 3 bags == one step over the 6 bags (packed, SGD)."""
    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "train.accumulation_steps=2", *EXACT, *DENSE)
    data = experiment_data(config)
    stacked, stats, *_ = dpgs_run(config, data, [[0, 1, 2], [3, 4, 5]])
    reference = local_params(config.model_copy(update={"train": config.train.model_copy(
        update={"accumulation_steps": 1})}), data, [[0, 1, 2, 3, 4, 5]])
    assert stats[0]["optimizer_steps"] == 1.0
    assert_close(stacked, reference, 1e-5)


class DriverKilled(RuntimeError):
    pass


@pytest.mark.parametrize("compression", [  # slow: no residual to carry (dense); FrozenAdam's state on top
    pytest.param(DENSE, id="dense", marks=pytest.mark.slow),
    pytest.param(["dpgs.compression.keep_ratio=0.05", LIVE], id="keep5pct"),
    pytest.param(["dpgs.compression.keep_ratio=0.05", *FROZEN], id="keep5pct-frozen",
                 marks=pytest.mark.slow)])
def test_driver_killed_and_resumed_matches_uninterrupted(ray_cluster, bags, tmp_path, compression):
    """Checkpoints hold the workers' residuals (and, frozen, the master's FrozenAdam), so a resumed
    compressed run equals the uninterrupted one; and what the epoch's steps before the crash added to its
    metrics, so the resumed epoch logs the uninterrupted one's ``train_loss``, ``optimizer_steps`` and
    bytes (compressed payloads: within a few bytes, their values equal to 1e-6 only)."""
    common = ["train.mode=dpgs", "dpgs.workers=2", "train.epochs=2", "train.batch_size=4",
              "train.checkpoint_every=1", *compression]
    full = make_config(*bags, tmp_path / "full", *common)
    run_training(full)

    interrupted = make_config(*bags, tmp_path / "cut", *common)
    import dpgs.distributed.dpgs_engine as engine_module

    original = engine_module.DpgsEngine.__init__

    def init_with_crash(self, *args, **kwargs):
        original(self, *args, **kwargs)

        def crash(engine, epoch, step):
            if epoch == 2 and step == 2:
                raise DriverKilled("simulated driver crash")

        self.hooks.after_chunk = crash

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
    rows = {name: list(csv.DictReader((tmp_path / name / "metrics.csv").open())) for name in ("cut", "full")}
    assert [r["optimizer_steps"] for r in rows["cut"]] == [r["optimizer_steps"] for r in rows["full"]]
    for cut, full in zip(rows["cut"], rows["full"], strict=True):
        assert float(cut["train_loss"]) == pytest.approx(float(full["train_loss"]), rel=1e-6)
        assert cut["comm_dense_bytes"] == full["comm_dense_bytes"]
        for key in ("comm_bytes_up", "comm_bytes_down", "comm_bytes_per_step"):
            assert float(cut[key]) == pytest.approx(float(full[key]), rel=1e-3), key


def test_kfold_reuses_the_actors_and_each_fold_starts_afresh(ray_cluster, bags, tmp_path, monkeypatch):
    """Two folds in one command: the same worker processes serve both (started once), and the second fold
    ends exactly as a command that trains only that split (state reset between folds). A k-fold command's
    folds write their weights files and no checkpoint (``--resume`` continues it fold by fold)."""
    from dpgs.distributed.rank_group import RankGroup
    from dpgs.train import trainer

    overrides = ["train.mode=dpgs", "dpgs.workers=2", "data.folds=2", "data.val_fraction=0", "train.epochs=1",
                 "train.batch_size=4", "dpgs.compression.keep_ratio=0.1", LIVE]
    pids = []
    original = RankGroup.run

    def run_and_record(self, plan, reports):
        pids.append(tuple(ray.get(self.workers.call("ping"))))
        original(self, plan, reports)

    monkeypatch.setattr(RankGroup, "run", run_and_record)
    result = run_training(make_config(*bags, tmp_path / "kfold", *overrides))
    monkeypatch.setattr(RankGroup, "run", original)
    assert len(result.folds) == 2 and len(set(pids)) == 1, f"workers were restarted between folds: {pids}"
    for fold in result.folds:
        assert (fold.output_dir / "last.pt").is_file() and (fold.output_dir / "best.pt").is_file()
        assert not (fold.output_dir / CHECKPOINT_FILE).exists()

    load = trainer.load_experiment_data

    def second_split_only(*args, **kwargs):
        data = load(*args, **kwargs)
        data.splits = data.splits[1:]
        return data

    monkeypatch.setattr(trainer, "load_experiment_data", second_split_only)
    run_training(make_config(*bags, tmp_path / "alone", *overrides))
    alone = torch.load(tmp_path / "alone" / "last.pt", weights_only=True)
    second = torch.load(result.folds[1].output_dir / "last.pt", weights_only=True)
    # fresh worker processes vs reused ones: float32 kernels may round differently with buffer alignment
    # (seen at 1.1e-6); state left over from fold 0 (weights, Adam moments, residuals) is orders larger
    assert_close(second, alone, 1e-5)


@pytest.mark.parametrize("mbps,compressed", [(None, False), (2.0, True)], ids=["loopback", "2mbps"])
def test_auto_keep_ratio_measures_the_link_and_chooses(ray_cluster, long_bags, tmp_path, mbps, compressed):
    """keep_ratio=auto: on loopback the dense exchange costs next to nothing: dense; behind 2 Mbit/s
    links (emulated in the workers) the dense exchange costs far more than the compute: compressed. Every
    epoch logs the choice with its figures, and the run ends at the same step count either way.
    Bags of 20 000 instances (a whole slide's tiles at 20x), one per worker a step: ~0.4 s of compute
    against a loopback exchange of a few ms to a few tens of ms on a loaded machine. With the short bags
    of the other tests a step computed for a few ms, and a loopback exchange slowed by a busy core tipped
    the choice (2 runs in about 30 under load, 2026-11-27). ``auto_share=0.5`` leaves room for a loaded
    CI machine on top; at 2 Mbit/s a dense step's exchange (0.54 MB each way, 2.1 s) is about ten
    times the compute either way.

    Auto decides before the first step, whose gradients the workers computed for that (and timed their
    codec on, on a copy of its state): the compressed run's weights are bit for bit those of a run at the
    ratio it chose, fixed (on loopback: the emulated link changes no number). A first step computed twice,
    or a residual touched by the codec's timing, would differ."""
    auto = ["dpgs.compression.keep_ratio=auto", "dpgs.compression.auto_ratios=[1.0,0.1]",
            "dpgs.compression.auto_share=0.5"]
    config = make_config(*long_bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.compression.warmup_epochs=0", *auto,
                         f"dpgs.emulate_bandwidth_mbps={mbps or 'null'}")
    data = experiment_data(config)
    # four steps an epoch: auto judges a ratio by the median of its steps, so one step slowed by a loaded
    # machine does not decide (with two steps an epoch, one slow dense step once chose 0.3 on loopback)
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    params, stats, replicas, master = dpgs_run(config, data, batches, epochs=2)
    for epoch in stats:
        assert epoch["auto_keep_ratio"] == (0.1 if compressed else 1.0), epoch
        # on loopback a dense step's exchange, measured as the master's step time beyond the slowest worker's
        # compute, can be nothing (clipped at 0: the next step's compute overlaps the master's optimizer step)
        assert epoch["auto_compute_seconds"] > 0 and epoch["auto_dense_exchange_seconds"] >= 0
        assert epoch["auto_dense_exchange_seconds"] > 0 or not compressed
        assert {"link_mbps_worker_0", "link_mbps_worker_1"} <= epoch.keys() or mbps is None
        assert epoch["optimizer_steps"] == 4.0
    assert all(torch.equal(r.params, master.params) for r in replicas)
    if mbps:
        assert all(epoch["link_mbps_worker_0"] == pytest.approx(mbps, rel=0.5) for epoch in stats)
        assert stats[1]["compression_ratio"] > 5
        fixed = make_config(*long_bags, tmp_path / "fixed", "train.mode=dpgs", "dpgs.workers=2",
                            "dpgs.compression.warmup_epochs=0", "dpgs.compression.keep_ratio=0.1")
        same, fixed_stats, _, _ = dpgs_run(fixed, data, batches, epochs=2)
        assert [e["train_loss"] for e in stats] == [e["train_loss"] for e in fixed_stats]
        assert all(torch.equal(params[k], same[k]) for k in params)


def test_auto_starts_a_later_fold_from_what_the_folds_before_it_measured(ray_cluster, long_bags, tmp_path,
                                                                        monkeypatch):
    """keep_ratio=auto in a k-fold command: the second fold's engine, on the same session, neither rehearses
    its first step nor probes the links: the first fold's dense steps settled dense, and the same workers on
    the same links train the same model. A fresh session (no earlier fold) rehearses and probes. Probed
    afresh at each fold's start on a loaded machine, a loopback link once looked slow enough to compress
    the first epochs of 4 of 10 MUSK1 folds."""
    from dpgs.distributed.rank_group import RankGroup
    from dpgs.distributed.session import DpgsSession
    from dpgs.runner import dpgs_roles

    calls = []

    def counted(name):
        original = getattr(RankGroup, name)

        def call(self, *args):
            calls.append(name)
            return original(self, *args)

        return call

    for name in ("rehearse", "probe_links"):
        monkeypatch.setattr(RankGroup, name, counted(name))
    config = make_config(*long_bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2",
                         "dpgs.compression.warmup_epochs=0", "dpgs.compression.keep_ratio=auto",
                         "dpgs.compression.auto_ratios=[1.0,0.1]", "dpgs.compression.auto_share=0.5")
    data = experiment_data(config)
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]  # four steps: auto judges a ratio by their median

    def fold(session, name):
        spec, model = start(config, data)
        setup = fold_setup(config, spec, model, data.dataset, data.splits[0].train,
                           output_dir=tmp_path / name)
        return session.engine(setup).run_epoch(batches, 1, [])

    session = DpgsSession(config, dpgs_roles(config))
    try:
        first = fold(session, "fold_0")
        assert calls == ["rehearse", "probe_links"] and first["auto_links_probed"] == 1.0
        assert first["auto_keep_ratio"] == 1.0
        calls.clear()
        second = fold(session, "fold_1")
        assert calls == [] and second["auto_links_probed"] == 0.0
        assert second["auto_keep_ratio"] == 1.0 and second["optimizer_steps"] == 4.0
        assert session.measured.ratio == 1.0 and session.measured.compute_seconds > 0
    finally:
        session.close()


def test_auto_freezes_the_second_moment_after_a_dense_warm_up(ray_cluster, bags, tmp_path):
    """keep_ratio=auto and second_moment=auto on a head: behind 20 Mbit/s links (a dense exchange of 0.2 s
    each way, against milliseconds of compute on these short bags) auto compresses; where it runs the
    warm-up epoch dense (``auto_warmup_share`` high), every rank freezes Adam's second moment at the first
    compressed step, and the run is bit for bit the fixed ratio's with second_moment=frozen (whose warm-up
    is dense too). Deciding live there, or freezing a step early or late, would differ."""
    auto = make_config(*bags, tmp_path / "auto", "train.mode=dpgs", "dpgs.workers=2",
                       "dpgs.compression.warmup_epochs=1", "dpgs.compression.keep_ratio=auto",
                       "dpgs.compression.auto_ratios=[1.0,0.1]", "dpgs.compression.auto_share=0.01",
                       "dpgs.compression.auto_min_saving=0.01", "dpgs.compression.auto_warmup_share=1000",
                       "dpgs.emulate_bandwidth_mbps=20")
    assert auto.dpgs.compression.second_moment == "auto"  # left to the run: keep_ratio=auto
    data = experiment_data(auto)
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    params, stats, replicas, master = dpgs_run(auto, data, batches, epochs=2)
    assert [e["auto_keep_ratio"] for e in stats] == [0.1, 0.1]
    assert stats[0]["compression_ratio"] < 1.1 < 5 < stats[1]["compression_ratio"]  # a dense warm-up epoch
    assert [e["second_moment_frozen"] for e in stats] == [0.0, 1.0]  # logged with the epoch's metrics
    assert all("denom" in state for state in master.optimizer["state"].values())  # FrozenAdam's
    assert all(torch.equal(r.params, master.params) for r in replicas)
    fixed = make_config(*bags, tmp_path / "fixed", "train.mode=dpgs", "dpgs.workers=2",
                        "dpgs.compression.warmup_epochs=1", "dpgs.compression.keep_ratio=0.1",
                        "dpgs.compression.second_moment=frozen")
    same, fixed_stats, _, _ = dpgs_run(fixed, data, batches, epochs=2)
    assert [e["train_loss"] for e in stats] == [e["train_loss"] for e in fixed_stats]
    assert all(torch.equal(params[k], same[k]) for k in params)


class SpecThatCannotImport(ModelSpec):
    """What a worker on a node with a broken install meets when it builds its replica."""

    def build(self):
        raise ModuleNotFoundError("No module named 'dpgs.workers'")


def test_workers_that_cannot_start_are_one_error_line_and_leave_nothing(ray_cluster, bags, tmp_path):
    from ray.util.placement_group import placement_group_table

    from dpgs.errors import RunFailure

    config = make_config(*bags, tmp_path / "run", "train.mode=dpgs", "dpgs.workers=2")
    data = experiment_data(config)
    spec, model = start(config, data)
    broken = SpecThatCannotImport(spec.cfg, spec.in_dim, spec.num_classes)
    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(RunFailure) as failure:
        with dpgs_engine(config, broken, model, data.dataset, data.splits[0].train):
            pass
    message = str(failure.value)
    assert message.startswith("the DPGS workers could not start")
    assert "ModuleNotFoundError: No module named 'dpgs.workers' (node " in message
    assert "\n" not in message
    assert {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"} <= before
