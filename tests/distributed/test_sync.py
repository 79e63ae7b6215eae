"""The step-synchronisation contract (``dpgs.distributed.sync``) in one process: the master and P workers
as threads over an in-memory channel, each rank with its own (pickled) copy of the fold's ``StepSync``,
exactly as Ray ships it. Checked against a dense single-process reference."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from dpgs.config import load_config
from dpgs.distributed.frames import HEADER as FRAME_HEADER
from dpgs.distributed.messages import StepPlan
from dpgs.distributed.replica import Replica
from dpgs.distributed.sync import build_sync
from dpgs.train.frozen_adam import floored_root, freeze
from dpgs.train.optim import build_optimizer, optimizer_step
from tests.distributed.wire import Wire


def model_and_config(*overrides: str):
    config = load_config(None, ["train.mode=dpgs", "dpgs.workers=2", "train.optimizer=adam", "train.lr=0.01",
                                "dpgs.compression.dense_min_numel=0",
                                "dpgs.compression.second_moment=live", *overrides])  # compressed from step 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 2))
    return config, model


def gradients(step: int, worker: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + worker))


def loss_sum(step: int, worker: int) -> float:
    return 0.1 + step + worker / 3  # not exact in binary: the master's sum is checked to the bit


def run(config, model, keeps: list[float], workers: int = 2, reports: list | None = None):
    """Steps at the keep ratios ``keeps``: worker w contributes ``gradients(step, w)`` for 2 bags whose
    losses sum to ``loss_sum(step, w)``, and the buffers ``w + step``. Returns (master replica, worker
    replicas, wire); the master's reports go to ``reports``."""
    sync = build_sync(config, model)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def replica(with_optimizer: bool) -> Replica:
        r = Replica(pickle.loads(pickle.dumps(model)), config.train)
        r.restart(state, with_optimizer)
        return r

    master = replica(True)
    master_sync = pickle.loads(pickle.dumps(sync))
    master_sync.restart(master)
    ranks = [(replica(sync.worker_optimizer), pickle.loads(pickle.dumps(sync))) for _ in range(workers)]
    wire = Wire(workers)
    frozen = config.dpgs.compression.second_moment == "frozen"
    plans = [StepPlan(i, 1, i, tuple(((2 * w, 2 * w + 1),) for w in range(workers)), 0.01, keep, frozen)
             for i, keep in enumerate(keeps)]
    errors = []

    def worker_loop(w: int):
        rep, rank_sync = ranks[w]
        try:
            for plan in plans:
                grad = gradients(plan.index, w, rep.numel)
                buffers = torch.full((rep.n_buffers,), float(w + plan.index), dtype=torch.float64)
                part = rank_sync.contribute(plan, 2, loss_sum(plan.index, w), grad, buffers, rep)
                rank_sync.worker(wire.worker(w), plan, part, rep)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=worker_loop, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for plan in plans:
        report = master_sync.master(wire.master(), plan, master)
        if reports is not None:
            reports.append(report)
    for t in threads:
        t.join()
    assert not errors, errors
    return master, [r for r, _ in ranks], wire


class Reference:
    """The same model in one process, stepped on the mean gradients it is given."""

    def __init__(self, config, model):
        self.params = [p for p in pickle.loads(pickle.dumps(model)).parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, config.train)
        self.numel = sum(p.numel() for p in self.params)

    def step(self, grad: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        offset = 0
        for p in self.params:
            p.grad = grad[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer_step(optimizer or self.optimizer, self.params, 0.01, 1.0)

    def dense_steps(self, steps: int, workers: int = 2) -> None:
        """Mean of the workers' gradients (2 bags each), one optimizer step each."""
        for step in range(steps):
            total = torch.zeros(self.numel)
            for w in range(workers):
                total.add_(gradients(step, w, self.numel))
            self.step(total / (2 * workers))

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])


def dense_reference(config, model, steps: int, workers: int = 2) -> torch.Tensor:
    """The same steps in one process: mean of the workers' gradients, one optimizer step each."""
    reference = Reference(config, model)
    reference.dense_steps(steps, workers)
    return reference.flat_params()


@pytest.mark.parametrize("downlink", ["gradients", "delta"])
def test_dense_steps_equal_the_single_process_steps(downlink):
    config, model = model_and_config(f"dpgs.compression.downlink={downlink}")
    master, replicas, wire = run(config, model, [1.0, 1.0, 1.0])
    expected = dense_reference(config, model, 3)
    assert torch.equal(master.flat_params(), expected)
    numel, buffers = master.numel, master.n_buffers
    assert wire.bytes_up == 3 * 2 * (4 * numel + 8 + 8 * buffers)  # float32 gradient, float64 loss, buffers
    for r in replicas:  # exactly the master's weights and (merged) buffers, in either scheme
        assert torch.equal(r.flat_params(), expected) and r.version == 3
        assert torch.equal(r.flat_buffers(), master.flat_buffers())
    # merged buffers: the bag-weighted mean of the workers' (w + step): (0 + 1) / 2 + 2 at the last step
    assert torch.equal(master.flat_buffers(), torch.full((buffers,), 2.5, dtype=torch.float64))
    # every message was bounded, and its bound is its size (every worker had bags): 2 up, 2 down a step
    up = 4 * numel + 8 + 8 * buffers
    down = FRAME_HEADER.size + 2 * 8 + 4 * numel + 4 * buffers  # 2 part sizes
    assert sorted(wire.bounded) == sorted(6 * [("up", up, up)] + 6 * [("down", down, down)])


def test_relayed_compressed_steps_keep_every_replica_identical_to_the_master():
    config, model = model_and_config("dpgs.compression.downlink=gradients")
    master, replicas, wire = run(config, model, [0.25, 0.05, 0.01, 1.0, 0.05])  # warm-up, dense, sparse
    for r in replicas:
        assert torch.equal(r.flat_params(), master.flat_params())
        for a, b in zip(r.optimizer.state.values(), master.optimizer.state.values(), strict=True):
            assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert wire.bytes_up < 2 * 5 * 4 * master.numel  # compressed most of the time
    assert [d for d, _, _ in wire.bounded] == ["up", "up", "down", "down"]  # only the dense step's messages


def test_each_worker_is_relayed_only_the_other_workers_payloads():
    """P = 3, compressed: worker w is forwarded the two other payloads (it kept its own), then a frame of
    the buffers alone, so the master sends (P - 1) x the payloads plus each frame's header, part size and
    buffers; and every replica still takes the master's step exactly."""
    config, model = model_and_config("dpgs.compression.downlink=gradients", "dpgs.workers=3")
    master, replicas, wire = run(config, model, [0.05, 0.01, 0.05], workers=3)
    buffers = master.n_buffers
    payloads = wire.bytes_up - 3 * 3 * 8 * (1 + buffers)  # 3 steps x 3 workers, float64 loss and buffers up
    frames = 3 * 3 * (FRAME_HEADER.size + 8 + 4 * buffers)  # the buffers part alone
    assert wire.bytes_down == 2 * payloads + frames
    for r in replicas:
        assert torch.equal(r.flat_params(), master.flat_params()) and r.version == 3


@pytest.mark.parametrize("downlink,keeps,workers", [
    ("gradients", [1.0, 0.05, 0.01], 3),  # dense, relayed payloads
    ("gradients", [0.9, 0.9], 2),  # compressed, but the dense sum is smaller than the payloads: not relayed
    ("delta", [1.0, 0.05], 2),
])
def test_the_masters_reports_hold_each_steps_loss_bags_and_bytes(downlink, keeps, workers):
    """The master's report of a step (what the epoch's metrics are made of, also when a worker failed) has
    the step's bags, the sum of their losses (each worker's sum, added in worker order), the bytes every
    worker sent up and was sent down, relayed payloads included, as the wire counted them, and the dense
    size of those messages."""
    config, model = model_and_config(f"dpgs.compression.downlink={downlink}", f"dpgs.workers={workers}")
    reports = []
    master, _, wire = run(config, model, keeps, workers, reports)
    assert [r.index for r in reports] == list(range(len(keeps)))
    assert {r.n_bags for r in reports} == {2 * workers}
    for r in reports:
        expected = 0.0
        for w in range(workers):
            expected += loss_sum(r.index, w)
        assert r.loss_sum == expected
    assert sum(r.up_bytes for r in reports) == wire.bytes_up
    assert sum(r.down_bytes for r in reports) == wire.bytes_down
    numel, buffers = master.numel, master.n_buffers
    dense = workers * (4 * numel + 8 + 8 * buffers + 4 * numel + 4 * buffers)
    assert {r.dense_bytes for r in reports} == {dense}


def test_keep_ratio_changes_mid_run_lose_nothing_with_sgd():
    """With SGD (linear in the gradient) and error feedback, what top-k held back arrives at the next
    dense step: after sparse steps then a dense one, the weights are the dense run's (up to rounding)."""
    config, model = model_and_config("train.optimizer=sgd", "train.momentum=0", "train.weight_decay=0",
                                     "dpgs.compression.value_dtype=fp32")
    sparse, _, _ = run(config, model, [0.01, 0.05, 1.0])
    dense, _, _ = run(config, model, [1.0, 1.0, 1.0])
    torch.testing.assert_close(sparse.flat_params(), dense.flat_params(), rtol=0, atol=1e-6)


def test_delta_downlink_workers_hold_what_the_master_says():
    config, model = model_and_config("dpgs.compression.downlink=delta")
    master, replicas, _ = run(config, model, [0.05, 0.05, 0.05])
    held = replicas[0].flat_params()
    assert all(r.version == 3 and torch.equal(r.flat_params(), held) for r in replicas)
    assert not torch.equal(held, master.flat_params())  # they lag by the master's residual


def test_a_shipped_copy_decodes_what_another_copy_encoded():
    """Every rank unpickles its own copy of the sync object (Ray ships it): the codecs' settings, value
    dtype included, must survive the trip."""
    config, model = model_and_config()
    sync = build_sync(config, model)
    a, b = pickle.loads(pickle.dumps(sync)), pickle.loads(pickle.dumps(sync))
    plan = StepPlan(0, 1, 0, (((0,),),), 0.01, 0.1)
    numel = sum(p.numel() for p in model.parameters())
    replica = Replica(model, config.train)
    replica.restart(model.state_dict(), with_optimizer=True)
    part = a.contribute(plan, 1, 0.5, torch.randn(numel), None, replica)
    total = b.uplink.sum_into(torch.zeros(numel), [part.body[: part.payload_bytes]], [1], 0.1)
    assert torch.count_nonzero(total) == round(0.1 * numel)


def test_a_frozen_second_moment_is_frozen_by_every_rank_at_the_first_compressed_step():
    """second_moment=frozen: two dense Adam steps, then every rank turns the same Adam into the same
    FrozenAdam (its denominators are the floored root of Adam's bias-corrected v after those two steps),
    the workers send g / d, and every replica stays bit-identical to the master, dense step included."""
    config, model = model_and_config("dpgs.compression.second_moment=frozen")
    master, replicas, _ = run(config, model, [1.0, 1.0, 0.05, 0.01, 1.0])
    assert master.frozen and all(r.frozen for r in replicas)
    # the reference's own Adam state after the same two dense steps gives the same denominators
    reference = Reference(config, model)
    reference.dense_steps(2)
    d = torch.cat([floored_root(state["exp_avg_sq"] / (1 - 0.999**2), 1.0).add_(1e-8).reshape(-1)
                   for state in (reference.optimizer.state[p] for p in reference.params)])
    assert torch.equal(master.preconditioner(), d)
    for r in replicas:
        assert torch.equal(r.flat_params(), master.flat_params()) and r.version == 5
        for a, b in zip(r.optimizer.state.values(), master.optimizer.state.values(), strict=True):
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["denom"], b["denom"])
    assert not torch.equal(master.flat_params(), dense_reference(config, model, 5))


def test_after_the_freeze_the_workers_send_gradients_divided_by_the_frozen_root():
    """A compressed step that keeps every entry (fp32 values) after two dense steps is exactly the
    FrozenAdam step on the mean of g_w / d: the workers divide their sums by the master's frozen d."""
    config, model = model_and_config("dpgs.compression.second_moment=frozen",
                                     "dpgs.compression.value_dtype=fp32")
    master, _, _ = run(config, model, [1.0, 1.0, 0.99999])
    reference = Reference(config, model)
    reference.dense_steps(2)
    frozen = freeze(reference.optimizer, 1.0)
    d = frozen.denominators(reference.params)
    n = reference.numel
    reference.step((gradients(2, 0, n) / d + gradients(2, 1, n) / d) / 4, frozen)
    torch.testing.assert_close(master.flat_params(), reference.flat_params(), rtol=1e-6, atol=1e-7)
