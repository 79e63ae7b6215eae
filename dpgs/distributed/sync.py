"""The exchange at the end of each DPGS step, both sides of it: what workers send, what the master does,
what comes back. One class per way of synchronising, chosen once per run (:func:`step_sync`):

* :class:`DenseSync` (``keep_ratio = 1``): an all-reduce in disguise. Workers send their raw float32
  gradient sums, the master adds them up in worker order, divides by the step's bag count B, steps, and
  sends its new parameters (and merged buffers) back as raw float32. No top-k, no zstd, no rounding.
* :class:`GradientsSync` (``keep_ratio < 1``, ``downlink=gradients``): workers send compressed payloads;
  the master sums them into one buffer, and broadcasts the payloads themselves with the clip factor in one
  frame; every rank (master and workers) decodes and sums them in worker order and takes the same
  optimizer step. Workers hold exactly the master's weights; the downlink costs the uplink's bytes.
* :class:`DeltaSync` (``keep_ratio < 1``, ``downlink=delta``): the DMGC paper's scheme: the master steps
  and broadcasts a top-k weight delta with its own residual (workers hold the master's weights minus that
  residual).

In every mode the step's gradient is ``(1 / B) sum_w g_w`` with ``g_w`` worker w's sum of per-bag loss
gradients, the gradient of the mean per-bag loss over the B bags. Floating-point buffers (BatchNorm
running statistics) are merged as the bag-weighted mean ``sum_w n_w s_w / B`` (summed in float64): each
worker's message up ends with its ``n_w s_w`` as float64.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from dpgs.compression import PayloadError
from dpgs.config.schema import CompressionConfig, TrainConfig
from dpgs.distributed.channel import Channel, ChannelBroken, as_bytes
from dpgs.distributed.codec import DeltaEncoder, GradientDecoder, apply_delta
from dpgs.distributed.frames import KIND_DELTA, KIND_GRADIENTS, buffers_bytes, decode_frame, encode_frame
from dpgs.distributed.messages import MasterStep, StepPlan
from dpgs.distributed.replica import Replica
from dpgs.train.optim import clip_coefficient


@dataclass
class Contribution:
    """A worker's part of one step, kept until the step's exchange completes (re-sent after a failure,
    never recomputed, so every bag counts exactly once and the error-feedback residual stays right).

    ``body``: the message up (the gradient: raw float32 in dense mode, else the compressed payload;
    then the float64 buffers times ``n_bags`` when the model has floating-point buffers).
    """

    step: int
    n_bags: int
    body: torch.Tensor
    payload_bytes: int  # the gradient's share of ``body``

    @property
    def up_bytes(self) -> int:
        return self.body.numel()


def contribution(
    step: int, n_bags: int, gradient: bytes | torch.Tensor, buffers: torch.Tensor | None
) -> Contribution:
    """The message up of a worker: ``gradient`` (payload bytes or raw float32 tensor) and ``buffers``."""
    grad = (
        as_bytes(gradient)
        if isinstance(gradient, torch.Tensor)
        else torch.frombuffer(bytearray(gradient), dtype=torch.uint8)
        if gradient
        else torch.empty(0, dtype=torch.uint8)
    )
    parts = [grad] if buffers is None else [grad, as_bytes(buffers.to(torch.float64) * n_bags)]
    return Contribution(step, n_bags, torch.cat(parts) if len(parts) > 1 else grad.clone(), grad.numel())


@dataclass(frozen=True)
class Received:
    """What the worker side of an exchange reports."""

    down_bytes: int
    exchange_seconds: float
    apply_seconds: float


class StepSync(Protocol):
    dense: bool  # workers contribute raw float32 gradients (no codec)
    worker_optimizer: bool  # workers step a replica of the master's optimizer
    exact_replicas: bool  # after each step every in-sync worker holds exactly the master's weights

    def worker(self, channel: Channel, step: StepPlan, part: Contribution, replica: Replica) -> Received:
        """Send ``part``, receive the step's update, apply it to ``replica`` (version ``step.index + 1``)."""

    def master(self, channel: Channel, step: StepPlan, replica: Replica) -> MasterStep:
        """Receive the workers' parts, step ``replica``, send the update."""


def step_sync_class(compression: CompressionConfig) -> type[DenseSync | GradientsSync | DeltaSync]:
    """The synchronisation a run's compression settings select (see the module docstring)."""
    if compression.keep_ratio >= 1.0:
        return DenseSync
    return DeltaSync if compression.downlink == "delta" else GradientsSync


def step_sync(compression: CompressionConfig, train: TrainConfig, numel: int) -> StepSync:
    """The synchronisation of a run, built."""
    chosen = step_sync_class(compression)
    return DenseSync(train) if chosen is DenseSync else chosen(compression, train, numel)


def split_up(
    bodies: list[torch.Tensor], replica: Replica, gradient_bytes: int | None
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Master: each worker's gradient part, and the sum of their buffer parts (float64, None without
    buffers). ``gradient_bytes``: the exact size of a gradient part (dense mode), None for payloads."""
    tail = 8 * replica.n_buffers
    grads, buffers = [], None
    for worker, body in enumerate(bodies):
        if body.numel() < tail or (gradient_bytes is not None and body.numel() != gradient_bytes + tail):
            grad = "a payload" if gradient_bytes is None else f"{gradient_bytes} bytes of gradient"
            raise PayloadError(
                f"worker {worker} sent {body.numel()} bytes; expected {grad} plus {tail} bytes of buffers"
            )
        grads.append(body[: body.numel() - tail])
        if tail:
            part = body[body.numel() - tail :].clone().view(torch.float64)  # (any byte alignment)
            buffers = part.clone() if buffers is None else buffers.add_(part)
    return grads, buffers


def _mean_gradient_step(
    replica: Replica, total: torch.Tensor, step: StepPlan, train: TrainConfig
) -> tuple[float, float]:
    """Master: ``total / B``, its norm, the clip factor, the optimizer step. Returns (norm, clip)."""
    grad = total.div_(step.n_bags)
    norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
    clip = clip_coefficient(norm, train.grad_clip)
    replica.step(grad, step.lr, clip)
    return norm, clip


class DenseSync:
    dense, worker_optimizer, exact_replicas = True, False, True

    def __init__(self, train: TrainConfig):
        self.train = train

    def worker(self, channel, step, part, replica) -> Received:
        start = time.perf_counter()
        channel.send_up(part.body)
        state = channel.recv_down()
        received = time.perf_counter()
        if state.numel() != 4 * (replica.numel + replica.n_buffers):
            raise PayloadError(
                f"the master sent {state.numel()} bytes of weights, expected "
                f"{4 * (replica.numel + replica.n_buffers)}"
            )
        values = state.view(torch.float32)
        replica.load_params(values[: replica.numel])
        replica.load_buffers(values[replica.numel :] if replica.n_buffers else None)
        replica.version = step.index + 1
        return Received(state.numel(), received - start, time.perf_counter() - received)

    def master(self, channel, step, replica) -> MasterStep:
        start = time.perf_counter()
        grads, buffers = split_up(channel.gather_up(), replica, 4 * replica.numel)
        waited = time.perf_counter()
        total = grads[0].view(torch.float32).clone()
        for grad in grads[1:]:  # worker order: the same sum on every run
            total.add_(grad.view(torch.float32))
        norm, _ = _mean_gradient_step(replica, total, step, self.train)
        if buffers is not None:
            replica.load_buffers(buffers / step.n_bags)
        stepped = time.perf_counter()
        state = replica.flat_params()
        if buffers is not None:
            state = torch.cat([state, replica.flat_buffers().float()])
        replica.version = step.index + 1  # taken, even if sending fails: live workers may have it
        channel.send_down(as_bytes(state))
        done = time.perf_counter()
        return MasterStep(
            step.index,
            step.n_bags,
            norm,
            waited - start,
            0.0,
            stepped - waited,
            done - stepped,
            4 * state.numel(),
            4 * state.numel(),
            done - start,
        )


def _payloads(grads: list[torch.Tensor]) -> list[bytes]:
    return [g.numpy().tobytes() for g in grads]


class GradientsSync:
    dense, worker_optimizer, exact_replicas = False, True, True

    def __init__(self, compression: CompressionConfig, train: TrainConfig, numel: int):
        self.train = train
        self.decoder = GradientDecoder(compression, numel)

    def worker(self, channel, step, part, replica) -> Received:
        start = time.perf_counter()
        channel.send_up(part.body)
        data = channel.recv_down().numpy().tobytes()
        received = time.perf_counter()
        frame = decode_frame(data, kind=KIND_GRADIENTS, version=step.index + 1, n_parts=len(step.bags) + 1)
        total = self.decoder.sum_into(torch.zeros(replica.numel), frame.parts[:-1], step.counts())
        replica.step(total.div_(step.n_bags), step.lr, frame.clip)
        replica.load_buffers(frame.buffers(replica.n_buffers))
        replica.version = step.index + 1
        return Received(len(data), received - start, time.perf_counter() - received)

    def master(self, channel, step, replica) -> MasterStep:
        start = time.perf_counter()
        grads, buffers = split_up(channel.gather_up(), replica, None)
        payloads = _payloads(grads)
        merged = None if buffers is None else buffers / step.n_bags
        waited = time.perf_counter()

        broken: list[ChannelBroken] = []

        def relay(clip: float) -> int:
            """Send the frame; a failure is raised only once the master has taken the step too (the live
            workers take it whatever happens to another one)."""
            frame = encode_frame(KIND_GRADIENTS, step.index + 1, clip, [*payloads, buffers_bytes(merged)])
            try:
                channel.send_down(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
            except ChannelBroken as err:
                broken.append(err)
            return len(frame)

        clipping = self.train.grad_clip is not None
        down = 0 if clipping else relay(1.0)  # nothing to compute first: the workers decode meanwhile
        sent = time.perf_counter()
        total = self.decoder.sum_into(torch.zeros(replica.numel), payloads, step.counts())
        grad = total.div_(step.n_bags)
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
        clip = clip_coefficient(norm, self.train.grad_clip)
        decoded = time.perf_counter()
        if clipping:
            down = relay(clip)
        relayed = time.perf_counter()
        replica.step(grad, step.lr, clip)  # the workers take the same step meanwhile
        replica.load_buffers(merged)
        replica.version = step.index + 1
        if broken:
            raise broken[0]
        done = time.perf_counter()
        dense = 4 * (replica.numel + replica.n_buffers)
        return MasterStep(step.index, step.n_bags, norm, waited - start, decoded - sent, done - relayed,
                          (sent - waited) + (relayed - decoded), down, dense, done - start)


class DeltaSync:
    dense, worker_optimizer, exact_replicas = False, False, False  # workers lag by the master's residual

    def __init__(self, compression: CompressionConfig, train: TrainConfig, numel: int):
        self.train = train
        self.value_dtype = compression.value_dtype
        self.decoder = GradientDecoder(compression, numel)
        self.encoder = DeltaEncoder(compression)

    def worker(self, channel, step, part, replica) -> Received:
        start = time.perf_counter()
        channel.send_up(part.body)
        data = channel.recv_down().numpy().tobytes()
        received = time.perf_counter()
        frame = decode_frame(data, kind=KIND_DELTA, version=step.index + 1, n_parts=2)
        flat = replica.flat_params()
        replica.version = apply_delta(flat, replica.version, frame.parts[0], self.value_dtype)
        replica.load_params(flat)
        replica.load_buffers(frame.buffers(replica.n_buffers))
        return Received(len(data), received - start, time.perf_counter() - received)

    def master(self, channel, step, replica) -> MasterStep:
        start = time.perf_counter()
        grads, buffers = split_up(channel.gather_up(), replica, None)
        waited = time.perf_counter()
        total = self.decoder.sum_into(torch.zeros(replica.numel), _payloads(grads), step.counts())
        decoded = time.perf_counter()
        norm, _ = _mean_gradient_step(replica, total, step, self.train)
        merged = None if buffers is None else buffers / step.n_bags
        replica.load_buffers(merged)
        stepped = time.perf_counter()
        delta = self.encoder.update(replica.flat_params(), step.keep_ratio)
        frame = encode_frame(KIND_DELTA, step.index + 1, 1.0, [delta, buffers_bytes(merged)])
        replica.version = step.index + 1  # taken, even if sending fails: live workers may have it
        channel.send_down(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
        done = time.perf_counter()
        dense = 4 * (replica.numel + replica.n_buffers)
        return MasterStep(
            step.index,
            step.n_bags,
            norm,
            waited - start,
            decoded - waited,
            stepped - decoded,
            done - stepped,
            len(frame),
            dense,
            done - start,
        )
