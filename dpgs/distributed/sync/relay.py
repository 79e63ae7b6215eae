"""``downlink=gradients`` (the default): every rank takes the master's optimizer step itself.

Workers send their gradient sums (raw float32 at keep ratio 1, top-k payloads below). When the other
P - 1 workers' payloads are smaller than the dense sum, the master relays them: it forwards each worker's
payload to every other worker while it gathers them (``Channel.gather_up``'s ``forward``: over gloo piece by
piece as they arrive, so its link carries the step's bytes up and down at once), and then sends one frame
(``dpgs.distributed.frames``, ``KIND_GRADIENTS``) with the clip factor and the merged buffers; a worker's
own payload is not sent back to it, it kept it. Otherwise the frame holds the dense sum of the workers'
gradients (``KIND_SUM``). Every rank then forms the same sum in worker
order, divides by the step's bag count B and takes the same optimizer step
(``dpgs.train.optim.optimizer_step``; the same thread count on every rank keeps it bit for bit), so the
workers hold exactly the master's weights and optimizer state after every step, compressed or not.

Where the step plans say so (``StepPlan.frozen_second_moment``: ``second_moment=frozen``, or ``auto``
after dense steps) every rank freezes its Adam's second moment at the first compressed step
(:class:`dpgs.train.frozen_adam.FrozenAdam`); from then on the workers send ``g_w / d`` through the
error-feedback codec (its residual is empty at the switch: every step before it was dense) and the same
sum, divided by B, is the frozen optimizer's input.

Without gradient clipping the frame goes before the master decodes the payloads (the workers decode
meanwhile), and the dense sum is sent as soon as it is formed; with clipping the master first forms the
mean gradient, whose norm sets the clip factor.
"""

from __future__ import annotations

import time

import torch

from dpgs.compression import ParamLayout, PayloadError
from dpgs.config.schema import CompressionConfig, TrainConfig
from dpgs.distributed.codec import Uplink
from dpgs.distributed.frames import (
    KIND_GRADIENTS,
    KIND_SUM,
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
    tail_bytes,
)
from dpgs.distributed.transport import Channel, ChannelBroken, worker_of
from dpgs.train.optim import clip_coefficient, l2_norm


def norm_and_clip(total: torch.Tensor, n_bags: int, grad_clip: float | None) -> tuple[float, float]:
    """``(||total / n_bags||_2, the clip factor)`` of a step's gradient sum ``total``, which is left as it
    is (the mean is then taken in place: ``total.div_(n_bags)``)."""
    norm = l2_norm(total) / n_bags
    return norm, clip_coefficient(norm, grad_clip)


class RelaySync:
    scheme = "gradients"
    worker_optimizer = True
    exact_replicas = True

    def __init__(self, compression: CompressionConfig, train: TrainConfig, layout: ParamLayout):
        self.grad_clip = train.grad_clip
        self.uplink = Uplink(compression, layout)
        self.floor = compression.second_moment_floor

    def _freeze_at(self, step: StepPlan, replica: Replica) -> None:
        """Every rank freezes its Adam at the first compressed step whose plan says
        ``frozen_second_moment`` (the same step, the same state: the same FrozenAdam)."""
        if step.frozen_second_moment and step.keep_ratio < 1.0:
            replica.freeze_second_moment(self.floor)

    # ---------------------------------------------------------------- worker
    def contribute(self, step, n_bags, loss_sum, grad, buffers, replica) -> Contribution:
        self._freeze_at(step, replica)  # the residual is empty then: every step before it was dense
        if n_bags and replica.frozen:
            grad = grad / replica.preconditioner()
        gradient = self.uplink.encode(grad, step.keep_ratio) if n_bags else b""
        return contribution(step.index, n_bags, loss_sum, gradient, buffers)

    def codec_seconds(self, grad, keep_ratio, workers) -> float:
        return self.uplink.codec_seconds(grad, keep_ratio, decodes=workers)  # each worker sums P payloads

    def worker(self, channel: Channel, step: StepPlan, part: Contribution, replica: Replica) -> Received:
        start = time.perf_counter()
        bounds = step_bounds(step, replica)
        channel.send_up(part.body, bounds.up)
        me = worker_of(channel.rank)  # its own payload is not relayed to it: it kept it
        own = part.body[: part.payload_bytes]
        # decoded while the other workers' payloads are still arriving (summed in worker order all the same)
        decoded = ({me: self.uplink.decode_part(me, own, part.n_bags, step.keep_ratio)}
                   if step.keep_ratio < 1.0 else {})
        relayed = channel.recv_relayed()
        data = channel.recv_down(bounds.down)
        received = time.perf_counter()
        frame = decode_frame(data, parts_of={KIND_GRADIENTS: 1, KIND_SUM: 2}, version=step.index + 1)
        grad = replica.gradient_buffer()
        if frame.kind == KIND_SUM:
            torch.div(frame.floats(0, replica.numel, "gradient sum"), step.n_bags, out=grad)
        else:
            if len(relayed) != len(step.bags) - 1:
                raise PayloadError(f"a gradients frame after {len(relayed)} relayed payloads, expected "
                                   f"{len(step.bags) - 1}")
            payloads = [*relayed[:me], own, *relayed[me:]]
            self.uplink.sum_into(grad.zero_(), payloads, step.counts(), step.keep_ratio, decoded)
            grad.div_(step.n_bags)
        replica.step(grad, step.lr, frame.clip)
        replica.load_buffers(frame.buffers(replica.n_buffers))
        replica.version = step.index + 1
        down = data.numel() + sum(r.numel() for r in relayed)
        return Received(down, received - start, time.perf_counter() - received)

    # ---------------------------------------------------------------- master
    def master(self, channel: Channel, step: StepPlan, replica: Replica) -> MasterStep:
        start = time.perf_counter()
        self._freeze_at(step, replica)
        tail = tail_bytes(replica.n_buffers)  # each message up ends with the worker's loss sum and buffers

        def forward(sizes: list[int]) -> list[int] | None:
            """Relay the payloads when the other P - 1 are smaller than the dense sum."""
            payloads = [s - tail for s in sizes]
            small = sum(payloads) - min(payloads) < 4 * replica.numel
            return payloads if step.keep_ratio < 1.0 and min(payloads) >= 0 and small else None

        bounds = step_bounds(step, replica)
        bodies = (channel.gather_up(forward=forward) if bounds.up is None  # a dense step is never relayed
                  else channel.gather_up(bound=bounds.up))
        relay = forward([b.numel() for b in bodies]) is not None
        up = split_up(bodies, replica)
        merged = None if up.buffers is None else up.buffers / step.n_bags
        waited = time.perf_counter()
        broken: list[ChannelBroken] = []
        sending = 0.0

        def send(kind: int, clip: float, parts: list[torch.Tensor]) -> int:
            """Send the frame; a failure is raised only once the master has taken the step too (the live
            workers take it whatever happens to another one). Returns the frame's bytes."""
            nonlocal sending
            begun = time.perf_counter()
            frame = encode_frame(kind, step.index + 1, clip, [*parts, buffers_part(merged)])
            try:
                channel.send_down(frame, bounds.down)
            except ChannelBroken as err:
                broken.append(err)
            sending += time.perf_counter() - begun
            return frame.numel()

        # Without clipping the frame does not wait for the mean gradient and its norm: the relay's goes before
        # the master decodes the payloads, the dense sum as soon as it is formed (the workers decode and step
        # meanwhile); with clipping the mean gradient's norm sets the clip factor first.
        clip_first = self.grad_clip is not None
        frame_size = 0
        if relay and not clip_first:
            frame_size = send(KIND_GRADIENTS, 1.0, [])
        total = self.uplink.sum_into(replica.gradient_buffer().zero_(), up.grads, step.counts(),
                                     step.keep_ratio)
        if not relay and not clip_first:
            frame_size = send(KIND_SUM, 1.0, [as_part(total)])  # the frame holds a copy
        norm, clip = norm_and_clip(total, step.n_bags, self.grad_clip)
        decoded = time.perf_counter()
        before_decoded = sending
        if clip_first:
            frame_size = send(KIND_GRADIENTS, clip, []) if relay else send(KIND_SUM, clip, [as_part(total)])
        workers = len(step.bags)
        down = frame_size * workers
        if relay:  # during the gather every worker got the others' payloads
            down += (workers - 1) * sum(up.payload_sizes())
        relayed = time.perf_counter()
        replica.step(total.div_(step.n_bags), step.lr, clip)  # the workers take the same step meanwhile
        replica.load_buffers(merged)
        replica.version = step.index + 1
        done = time.perf_counter()
        report = MasterStep(
            index=step.index,
            n_bags=step.n_bags,
            loss_sum=up.loss_sum,
            grad_norm=norm,
            wait_seconds=waited - start,
            decode_seconds=decoded - waited - before_decoded,
            optimizer_seconds=done - relayed,
            encode_seconds=sending,
            up_bytes=up.up_bytes,
            down_bytes=down,
            dense_bytes=dense_step_bytes(replica, workers),
            step_seconds=done - start,
        )
        if broken:
            raise UpdateNotSent(broken[0], report)
        return report

    def restart(self, replica: Replica) -> None:
        """Nothing to restart: workers take the master's own steps."""

    def held(self, replica: Replica) -> torch.Tensor:
        return replica.flat_params()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"uplink": self.uplink.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.uplink.load_state_dict(state["uplink"])
