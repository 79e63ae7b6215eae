"""The master's side of a step when the channel breaks, with a scripted channel (no Ray): a failure before
the update leaves the step untaken; a failure while sending it leaves the step taken (live workers got
it), and the master then takes the live workers' next message (bounded as the next step is) before aborting
them. And its epoch files,
written on a thread while the next steps run."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from dpgs.config import load_config
from dpgs.distributed.fold import FoldStart
from dpgs.distributed.messages import ChunkPlan, EpochCheckpoint, StepPlan
from dpgs.distributed.sync import build_sync
from dpgs.distributed.transport import ChannelBroken
from dpgs.master import Master
from dpgs.modeling import ModelSpec
from dpgs.records import DriverProgress


class ScriptedChannel:
    """Gathers the given bodies; ``fail_on`` names the operation that raises ChannelBroken once."""

    rank, world = 0, 3

    def __init__(self, bodies, fail_on: str):
        self.bodies, self.fail_on = bodies, fail_on
        self.calls: list[str] = []

    def _maybe_fail(self, op: str) -> None:
        self.calls.append(op)
        if op == self.fail_on:
            self.fail_on = ""
            raise ChannelBroken(f"scripted failure in {op}")

    def gather_up(self, timed: bool = False, forward=None, bound=None):
        self._maybe_fail("gather_up")
        return [b.clone() for b in self.bodies]

    def send_down(self, body, bound=None):
        self._maybe_fail("send_down")

    def abort(self, drain: bool, bound=None):
        self.calls.append(f"abort(drain={drain})")
        self.drain_bound = bound


def master_and_bodies(keep: float):
    config = load_config(None, ["train.mode=dpgs", "dpgs.workers=2", f"dpgs.compression.keep_ratio={keep}",
                                "dpgs.compression.second_moment=live",  # compressed from step 0
                                "model.params={dropout: 0.0}"])
    spec = ModelSpec(config.model, 8, 2)
    torch.manual_seed(0)
    model = spec.build()
    master = Master(spec, config)
    master.start_fold(FoldStart("f", model.state_dict(), None, build_sync(config, model)))
    n = sum(p.numel() for p in model.parameters())
    steps = tuple(StepPlan(i, 1, i, (((2 * i,),), ((2 * i + 1,),)), 0.01, keep) for i in range(2))
    bodies = []
    for w in range(2):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(w))
        bodies.append(build_sync(config, model).contribute(steps[0], 1, 0.5, grad, None, master.replica).body)
    return master, bodies, ChunkPlan(steps)


@pytest.mark.parametrize("keep", [1.0, 0.1])
def test_failure_before_the_update_leaves_the_step_untaken(keep):
    master, bodies, plan = master_and_bodies(keep)
    before = master.replica.flat_params()
    master.channel = ScriptedChannel(bodies, fail_on="gather_up")
    result = master.run_chunk(plan)
    assert result.interrupted_at == 0 and master.version() == 0 and not result.steps
    assert torch.equal(master.replica.flat_params(), before)
    assert master.channel.calls == ["gather_up", "abort(drain=False)"]


@pytest.mark.parametrize("keep", [1.0, 0.1])
def test_failure_while_sending_the_update_keeps_the_step_and_drains_the_next_message(keep):
    master, bodies, plan = master_and_bodies(keep)
    before = master.replica.flat_params()
    master.channel = ScriptedChannel(bodies, fail_on="send_down")
    result = master.run_chunk(plan)
    assert master.version() == 1 and result.interrupted_at == 1
    assert not torch.equal(master.replica.flat_params(), before)
    assert master.channel.calls == ["gather_up", "send_down", "abort(drain=True)"]
    # the step taken is reported: its bags and the workers' loss sums (0.5 each) count in the metrics
    assert [(s.index, s.n_bags, s.loss_sum) for s in result.steps] == [(0, 2, 1.0)]
    # the drained messages are the next step's: a dense one's are bounded (raw float32, the loss sum)
    assert master.channel.drain_bound == (4 * master.replica.numel + 8 if keep == 1.0 else None)


def test_failure_while_sending_the_last_update_of_a_chunk_completes_it():
    master, bodies, plan = master_and_bodies(1.0)
    master.channel = ScriptedChannel(bodies, fail_on="send_down")
    result = master.run_chunk(ChunkPlan(plan.steps[:1]))
    assert master.version() == 1 and result.interrupted_at is None
    assert master.channel.calls == ["gather_up", "send_down"]  # the live workers finished the chunk
    assert [s.index for s in result.steps] == [0]


def hold_back_writes(monkeypatch) -> threading.Event:
    """Every state written on a thread (this small one too), each file held back until the returned event
    is set."""
    module = sys.modules[Master.__module__]
    gate, write = threading.Event(), module.save_torch_atomically

    def held_back(obj, path):
        assert gate.wait(30)
        return write(obj, path)

    monkeypatch.setattr(module, "save_torch_atomically", held_back)
    monkeypatch.setattr(module, "BACKGROUND_WRITE_BYTES", 0)
    return gate


def test_epoch_files_hold_the_state_save_epoch_was_called_at_though_the_master_stepped_first(
        tmp_path, monkeypatch):
    """``save_epoch`` returns once the state is copied; the next step runs while the files are written
    (held back here until after it), and the files hold the epoch's end, not the step after it."""
    master, bodies, plan = master_and_bodies(0.1)
    gate = hold_back_writes(monkeypatch)
    at_end = {k: v.clone() for k, v in master.model_state().items()}
    driver = DriverProgress(2, 0, [], {})
    epoch_checkpoint = EpochCheckpoint(str(tmp_path / "checkpoint.pt"), driver)
    master.save_epoch([str(tmp_path / "last.pt")], epoch_checkpoint, [])
    assert not (tmp_path / "last.pt").exists()  # returned before writing
    master.channel = ScriptedChannel(bodies, fail_on="")
    assert master.run_chunk(ChunkPlan(plan.steps[:1])).interrupted_at is None
    assert any(not torch.equal(v, at_end[k]) for k, v in master.model_state().items())
    gate.set()
    assert master.saved() == str(tmp_path / "checkpoint.pt")
    assert master.saved() is None  # waited for once
    weights = torch.load(tmp_path / "last.pt", weights_only=True)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(weights[k], v) and torch.equal(checkpoint["master"]["model"][k], v)
               for k, v in at_end.items())
    assert checkpoint["master"]["step"] == 0 and checkpoint["workers"] == []


def test_a_checkpoint_waits_for_the_epoch_files_being_written(tmp_path, monkeypatch):
    """A checkpoint written while an epoch's files are pending (a failure, ``checkpoint_every``) comes
    after them: the older epoch checkpoint never replaces it."""
    master, bodies, plan = master_and_bodies(0.1)
    gate = hold_back_writes(monkeypatch)
    path = str(tmp_path / "checkpoint.pt")
    driver = DriverProgress(2, 0, [], {})
    master.save_epoch([str(tmp_path / "last.pt")], EpochCheckpoint(path, driver), [])
    master.channel = ScriptedChannel(bodies, fail_on="")
    master.run_chunk(ChunkPlan(plan.steps[:1]))
    threading.Timer(0.2, gate.set).start()
    master.save_checkpoint(path, DriverProgress(2, 1, [], {}), [])
    assert torch.load(path, weights_only=True)["master"]["step"] == 1


def test_a_small_state_writes_its_epoch_files_before_save_epoch_returns(tmp_path):
    """Below ``BACKGROUND_WRITE_BYTES`` no thread: the files are on disk when ``save_epoch`` returns."""
    master, _, _ = master_and_bodies(0.1)
    module = sys.modules[Master.__module__]
    assert module.tensor_bytes(master.state_dict()) < module.BACKGROUND_WRITE_BYTES
    driver = DriverProgress(2, 0, [], {})
    epoch_checkpoint = EpochCheckpoint(str(tmp_path / "checkpoint.pt"), driver)
    master.save_epoch([str(tmp_path / "last.pt")], epoch_checkpoint, [])
    assert (tmp_path / "last.pt").is_file() and (tmp_path / "checkpoint.pt").is_file()
    assert master.saved() is None


@pytest.mark.parametrize("background", [False, True], ids=["small", "on-the-thread"])
def test_without_a_checkpoint_path_an_epoch_writes_its_weights_files_alone(tmp_path, monkeypatch, background):
    """A fold of a k-fold command writes no checkpoint: no checkpoint writes the weights files and nothing
    else, before ``save_epoch`` returns or on the thread, holding the epoch's end though the master
    stepped right after."""
    master, bodies, plan = master_and_bodies(0.1)
    if background:
        monkeypatch.setattr(sys.modules[Master.__module__], "BACKGROUND_WRITE_BYTES", 0)
    at_end = {k: v.clone() for k, v in master.model_state().items()}
    master.save_epoch([str(tmp_path / "last.pt"), str(tmp_path / "best.pt")], None, [])
    master.channel = ScriptedChannel(bodies, fail_on="")
    assert master.run_chunk(ChunkPlan(plan.steps[:1])).interrupted_at is None
    assert master.saved() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]
    for name in ("last.pt", "best.pt"):
        weights = torch.load(tmp_path / name, weights_only=True)
        assert weights.keys() == at_end.keys() and all(torch.equal(weights[k], v) for k, v in at_end.items())


def test_tensor_bytes_counts_every_tensor_of_a_nested_state():
    master, _, _ = master_and_bodies(0.1)
    module = sys.modules[Master.__module__]
    state = master.state_dict()
    params = sum(p.numel() * 4 for p in master.replica.model.parameters())
    assert module.tensor_bytes(state.model) == params
    assert module.tensor_bytes({"a": [torch.zeros(3, dtype=torch.float64)], "b": (torch.zeros(2),)}) == 32
