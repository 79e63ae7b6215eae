"""``downlink=delta``: the DMGC paper's scheme. Only the master steps; workers receive weights.

Workers send their gradient sums as in every scheme. The master sums them in worker order, divides by the
step's bag count, steps, and sends every worker one frame (``dpgs.distributed.frames``): below keep ratio
1 a top-k delta of its new weights against what the workers hold, with the master's own residual
(``KIND_DELTA``; workers then hold the master's weights minus that residual), at keep ratio 1 the weights
themselves as raw float32 (``KIND_WEIGHTS``; workers then hold exactly the master's weights).
"""

from __future__ import annotations

import time

import torch

from dpgs.compression import ParamLayout
from dpgs.config.schema import CompressionConfig, TrainConfig
from dpgs.distributed.codec import DeltaDownlink, Uplink, apply_delta
from dpgs.distributed.frames import (
    KIND_DELTA,
    KIND_WEIGHTS,
    as_part,
    buffers_part,
    decode_frame,
    encode_frame,
)
from dpgs.distributed.messages import MasterStep, StepPlan
from dpgs.distributed.replica import Replica
from dpgs.distributed.sync.contract import (
    Contribution,
    Received,
    UpdateNotSent,
    contribution,
    dense_step_bytes,
    split_up,
    step_bounds,
)
from dpgs.distributed.sync.relay import norm_and_clip
from dpgs.distributed.transport import Channel, ChannelBroken


class DeltaSync:
    scheme = "delta"
    worker_optimizer = False
    exact_replicas = False  # workers lag by the master's residual after a compressed step

    def __init__(self, compression: CompressionConfig, train: TrainConfig, layout: ParamLayout):
        self.grad_clip = train.grad_clip
        self.value_dtype = compression.value_dtype
        self.uplink = Uplink(compression, layout)
        self.downlink = DeltaDownlink(compression)

    # ---------------------------------------------------------------- worker
    def contribute(self, step, n_bags, loss_sum, grad, buffers, replica) -> Contribution:
        gradient = self.uplink.encode(grad, step.keep_ratio) if n_bags else b""
        return contribution(step.index, n_bags, loss_sum, gradient, buffers)

    def codec_seconds(self, grad, keep_ratio, workers) -> float:
        return self.uplink.codec_seconds(grad, keep_ratio, decodes=workers)  # the master sums the P payloads

    def worker(self, channel: Channel, step: StepPlan, part: Contribution, replica: Replica) -> Received:
        start = time.perf_counter()
        bounds = step_bounds(step, replica)
        channel.send_up(part.body, bounds.up)
        data = channel.recv_down(bounds.down)
        received = time.perf_counter()
        frame = decode_frame(data, parts_of={KIND_DELTA: 2, KIND_WEIGHTS: 2}, version=step.index + 1)
        if frame.kind == KIND_WEIGHTS:
            replica.load_params(frame.floats(0, replica.numel, "weights"))
            replica.version = step.index + 1
        else:
            flat = replica.flat_params()
            replica.version = apply_delta(flat, replica.version, frame.parts[0], self.value_dtype)
            replica.load_params(flat)
        replica.load_buffers(frame.buffers(replica.n_buffers))
        return Received(data.numel(), received - start, time.perf_counter() - received)

    # ---------------------------------------------------------------- master
    def master(self, channel: Channel, step: StepPlan, replica: Replica) -> MasterStep:
        start = time.perf_counter()
        bounds = step_bounds(step, replica)
        up = split_up(channel.gather_up(bound=bounds.up), replica)
        waited = time.perf_counter()
        total = self.uplink.sum_into(replica.gradient_buffer().zero_(), up.grads, step.counts(),
                                     step.keep_ratio)
        norm, clip = norm_and_clip(total, step.n_bags, self.grad_clip)
        decoded = time.perf_counter()
        replica.step(total.div_(step.n_bags), step.lr, clip)
        merged = None if up.buffers is None else up.buffers / step.n_bags
        replica.load_buffers(merged)
        stepped = time.perf_counter()
        params = replica.flat_params()
        if step.keep_ratio >= 1.0:
            self.downlink.restart(params, step.index + 1)
            frame = encode_frame(KIND_WEIGHTS, step.index + 1, 1.0, [as_part(params), buffers_part(merged)])
        else:
            delta = self.downlink.update(params, step.keep_ratio)
            frame = encode_frame(KIND_DELTA, step.index + 1, 1.0, [as_part(delta), buffers_part(merged)])
        replica.version = step.index + 1  # taken, even if sending fails: live workers may have it
        broken = None
        try:
            channel.send_down(frame, bounds.down)
        except ChannelBroken as err:
            broken = err
        done = time.perf_counter()
        report = MasterStep(
            index=step.index,
            n_bags=step.n_bags,
            loss_sum=up.loss_sum,
            grad_norm=norm,
            wait_seconds=waited - start,
            decode_seconds=decoded - waited,
            optimizer_seconds=stepped - decoded,
            encode_seconds=done - stepped,
            up_bytes=up.up_bytes,
            down_bytes=frame.numel() * len(step.bags),
            dense_bytes=dense_step_bytes(replica, len(step.bags)),
            step_seconds=done - start,
        )
        if broken is not None:
            raise UpdateNotSent(broken, report)
        return report

    def restart(self, replica: Replica) -> None:
        self.downlink.restart(replica.flat_params(), replica.version)

    def held(self, replica: Replica) -> torch.Tensor:
        return self.downlink.held.clone()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"uplink": self.uplink.state_dict(), "downlink": self.downlink.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.uplink.load_state_dict(state["uplink"])
        self.downlink.load_state_dict(state["downlink"])
