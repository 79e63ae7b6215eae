"""The worker base (``workers/base.py``) with a scripted channel, no Ray: a step's contribution is kept
until its exchange completes and sent again unchanged, never recomputed; a resynchronisation drops it only
when the master already took that step; evaluation refuses replicas that are not the master's model."""

from __future__ import annotations

import pytest
import torch

from dpgs.distributed.fold import FoldStart
from dpgs.distributed.messages import ChunkPlan, StepPlan
from dpgs.distributed.sync import build_sync
from dpgs.distributed.transport import ChannelBroken
from dpgs.master import Master
from dpgs.modeling import ModelSpec
from dpgs.train.evaluate import EvalProtocol
from dpgs.workers import BagWorker
from tests.dpgs_helpers import experiment_data, make_config, write_bags


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bags = write_bags(tmp_path_factory.mktemp("bags"), [3, 8, 5, 2, 7, 4, 6, 9, 3, 5])
    config = make_config(*bags, tmp_path_factory.mktemp("run") / "out", "train.mode=dpgs", "dpgs.workers=1",
                         "dpgs.compression.keep_ratio=0.1",
                         "dpgs.compression.second_moment=live")  # compressed from step 0
    data = experiment_data(config)
    spec = ModelSpec(config.model, data.dataset.feature_dim, len(data.manifest.classes))
    return config, data, spec


class CountingDataset:
    """The dataset, counting reads per bag (a recomputed contribution would read its bags again)."""

    def __init__(self, dataset):
        self.dataset, self.reads = dataset, []

    def get(self, index, epoch):
        self.reads.append(index)
        return self.dataset.get(index, epoch)

    def __getattr__(self, name):  # records, lengths, ...: the dataset's own
        return getattr(self.dataset, name)


class OneMasterChannel:
    """The worker's channel to an in-process master (``Master`` with its own channel below): a message up is
    handed to the master's step at once; ``fail_next_up`` loses the next message up (the master never
    steps), ``fail_next_down`` the next message down (the master stepped)."""

    def __init__(self, master: Master):
        self.master, self.up, self.down = master, [], []
        self.fail_next_up = self.fail_next_down = False
        self.rank, self.world = 1, 2
        master.channel = self

    # master side
    def gather_up(self, timed: bool = False, forward=None, bound=None):
        return [self.up[-1]]  # one worker: nothing to forward to another

    def send_down(self, body, bound=None):
        self.down.append(body)

    # worker side
    def send_up(self, body, bound=None):
        self.up.append(body.clone())
        if self.fail_next_up:
            self.fail_next_up = False
            raise ChannelBroken("scripted: the worker's message did not arrive")
        self.master_step()

    def recv_relayed(self):
        return []

    def recv_down(self, bound=None):
        if self.fail_next_down:
            self.fail_next_down = False
            raise ChannelBroken("scripted: the master's message did not arrive")
        return self.down.pop()

    def master_step(self):
        step = self.steps[self.master.version()]
        self.master.sync.master(self, step, self.master.replica)


def start(setup, downlink: str = "gradients"):
    config, data, spec = setup
    config = config.model_copy(update={"dpgs": config.dpgs.model_copy(update={
        "compression": config.dpgs.compression.model_copy(update={"downlink": downlink})})})
    torch.manual_seed(0)
    model = spec.build()
    dataset = CountingDataset(data.dataset)
    worker = BagWorker(0, spec, config)
    worker.read_from(dataset)
    master = Master(spec, config)
    sync = build_sync(config, model)
    for rank in (master, worker):
        rank.start_fold(FoldStart("f", model.state_dict(), None, sync))
    channel = OneMasterChannel(master)
    worker.channel = channel
    channel.steps = [StepPlan(i, 1, i, (((2 * i, 2 * i + 1),),), 0.01, 0.1) for i in range(3)]
    return worker, master, channel, dataset


def test_a_step_the_master_did_not_take_is_sent_again_unchanged_not_recomputed(setup):
    worker, master, channel, dataset = start(setup)
    channel.fail_next_up = True
    result = worker.run_chunk(ChunkPlan(tuple(channel.steps[:2])))
    assert result.interrupted_at == 0 and not result.steps and master.version() == 0
    lost = channel.up[-1]
    worker.resync(master.replica_state())  # version 0: the contribution to step 0 is kept
    assert worker.pending is not None and worker.pending.part.step == 0
    result = worker.run_chunk(ChunkPlan(tuple(channel.steps[:2])))
    assert [s.index for s in result.steps] == [0, 1] and master.version() == 2
    assert torch.equal(channel.up[-2], lost)  # the same message, not a recomputed one
    assert dataset.reads.count(0) == dataset.reads.count(1) == 1  # step 0's bags were read once


def test_a_step_the_master_took_is_dropped_at_resynchronisation(setup):
    worker, master, channel, _ = start(setup)
    channel.fail_next_down = True
    result = worker.run_chunk(ChunkPlan(tuple(channel.steps[:2])))
    assert result.interrupted_at == 0 and master.version() == 1
    worker.resync(master.replica_state())
    assert worker.pending is None and worker.replica.version == 1
    assert torch.equal(worker.replica.flat_params(), master.replica.flat_params())
    result = worker.run_chunk(ChunkPlan(tuple(channel.steps[1:])))
    assert [s.index for s in result.steps] == [1, 2] and master.version() == 3


def test_replicas_equal_the_master_after_every_step(setup):
    worker, master, channel, _ = start(setup)
    result = worker.run_chunk(ChunkPlan(tuple(channel.steps)))
    assert [s.index for s in result.steps] == [0, 1, 2] and master.version() == worker.replica.version == 3
    assert torch.equal(worker.replica.flat_params(), master.replica.flat_params())


def test_evaluation_needs_weights_where_replicas_lag(setup):
    worker, master, channel, _ = start(setup, downlink="delta")
    worker.run_chunk(ChunkPlan(tuple(channel.steps)))
    with pytest.raises(ValueError, match="not the master's model"):
        worker.evaluate(None, [0, 1], EvalProtocol(None, 1, 0))
    scored = worker.evaluate(master.model_state(), [0, 1], EvalProtocol(None, 1, 0))
    assert len(scored.indices) == 2
