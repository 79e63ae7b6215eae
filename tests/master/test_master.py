"""The master's side of a step when the channel breaks, with a scripted channel (no Ray): a failure before
the update leaves the step untaken; a failure while sending it leaves the step taken (live workers got
it), and the master then takes the live workers' next message before aborting them."""

from __future__ import annotations

import pytest
import torch

from dpgs.config import load_config
from dpgs.distributed.fold import FoldStart
from dpgs.distributed.messages import ChunkPlan, StepPlan
from dpgs.distributed.sync import build_sync
from dpgs.distributed.transport import ChannelBroken
from dpgs.master import Master
from dpgs.modeling import ModelSpec


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

    def gather_up(self, timed: bool = False, forward=None):
        self._maybe_fail("gather_up")
        return [b.clone() for b in self.bodies]

    def send_down(self, body):
        self._maybe_fail("send_down")

    def abort(self, drain: bool):
        self.calls.append(f"abort(drain={drain})")


def master_and_bodies(keep: float):
    config = load_config(None, ["train.mode=dpgs", "dpgs.workers=2", f"dpgs.compression.keep_ratio={keep}",
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
        bodies.append(build_sync(config, model).contribute(steps[0], 1, grad, None).body)
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


def test_failure_while_sending_the_last_update_of_a_chunk_completes_it():
    master, bodies, plan = master_and_bodies(1.0)
    master.channel = ScriptedChannel(bodies, fail_on="send_down")
    result = master.run_chunk(ChunkPlan(plan.steps[:1]))
    assert master.version() == 1 and result.interrupted_at is None
    assert master.channel.calls == ["gather_up", "send_down"]  # the live workers finished the chunk
