"""The scaling model: predicted seconds per step of DPGS and DDP for P workers on a star network.

Pure arithmetic on measured inputs (``benchmarks/scaling_measure.py`` measures them; docs/scaling.md
states the maths). Every host (the master and each worker) has one full-duplex link of rate ``R`` to a
switch; ``Link.seconds(n)`` is the time ``n`` payload bytes take on one link, ``8 n / (R * goodput)``
(``goodput``: payload bytes per wire byte of TCP/IP over Ethernet frames). A step of the slowest worker
with ``n = ceil(B / P)`` bags of the step's ``B``::

    step = compute + exposed exchange,      compute = pass + n * (forward + backward of one bag)

What overlaps and what does not in dpgs today (``workers/base.py``, ``dpgs/distributed/sync/``,
``dpgs/distributed/gloo.py``): a worker computes, encodes, sends up, waits for the master's message,
applies it, and only then starts the next step; nothing of the exchange overlaps its compute. The master
posts every worker's receive at once (``gather_up``), so the P uploads share its link in parallel, and
sends its message down to the P workers one copy each (``send_down``), so its link carries P messages.
Dense, the downlink phase starts only once every upload is in and summed, so a shared link costs the sum
of the two phases. Relayed (compressed), the master forwards each upload to the P - 1 other workers piece
by piece as it arrives (``CHUNK`` bytes a piece), so the two directions of every full-duplex link are busy
at once: the exchange costs the longer of the two phases and one piece of the other, then the small
frame of the buffers. Each phase lasts as long as its busiest link:
``max(P * up / R_master, up / R_worker)``. DDP's ring all-reduce moves ``2 (P - 1) / P`` times the
gradient over every worker link and starts during the backward pass of the last bag, bucket by bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MIB = 1 << 20
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch DDP: the first bucket is capped at 1 MiB ...
DDP_BUCKET_BYTES = 25 * MIB  # ... the others at bucket_cap_mb = 25
DPGS_FRAME_HEADER = 32  # dpgs.distributed.frames.HEADER: struct "<4sBQdII3x"
DPGS_FRAME_PART = 8  # one u64 size per part
DPGS_LOSS_SUM = 8  # a message up ends with the loss sum and buffers, float64 (sync.contract.tail_bytes)
DPGS_RELAY_PIECE = 128 << 10  # dpgs.distributed.gloo.CHUNK: the relay forwards an upload in such pieces
DPGS_ONE_PIECE_LATENCIES = 2  # per step whose messages are each one gloo message, see dpgs_latency
DPGS_PIECED_LATENCIES = 6  # per step whose messages travel in pieces, see dpgs_latency
# Payload bytes per wire byte of a bulk TCP transfer, MSS 1448 (timestamps on) in a 1500-byte MTU:
# counted by tc and interface counters (1514-byte frames) and on a physical link (plus 8 bytes of
# preamble and 12 of inter-frame gap: 1538).
GOODPUT_TC = 1448 / 1514
GOODPUT_ETHERNET = 1448 / 1538


@dataclass(frozen=True)
class Link:
    """Every host's link to the switch: rate (bits/s), one-way host-to-host latency, goodput."""

    name: str
    bits_per_s: float
    latency_s: float
    goodput: float = GOODPUT_ETHERNET

    def seconds(self, nbytes: float) -> float:
        """Time for ``nbytes`` of payload through this link alone."""
        return 8.0 * nbytes / (self.bits_per_s * self.goodput)

    def wire_bytes(self, nbytes: float) -> float:
        return nbytes / self.goodput


@dataclass(frozen=True)
class Compressed:
    """Measured figures of top-k compression at one keep ratio (the real codec, fp16 values, zstd).

    ``payload_bytes``: a worker's gradient payload; ``encode_s``: its top-k + error feedback + zstd;
    ``decode_add_s``: decoding one payload and adding it into a float32 sum (master, and with
    ``downlink=gradients`` every worker, once per worker payload); ``entries``: sparse entries of one
    payload (k). The union of P workers' top-k index sets holds ``entries * P ** union_exponent``
    entries (fit on real gradients); a merged payload of U entries is ``merged_intercept +
    merged_per_entry * U`` bytes and costs ``merged_encode_per_entry_s * U`` to encode.
    ``delta_bytes`` / ``delta_encode_s``: the master's top-k weight delta (``downlink=delta``).
    """

    keep: float
    payload_bytes: float
    encode_s: float
    decode_add_s: float
    entries: float
    union_exponent: float
    merged_intercept: float
    merged_per_entry: float
    merged_encode_per_entry_s: float
    delta_bytes: float
    delta_encode_s: float

    def union_entries(self, workers: int) -> float:
        return self.entries * workers**self.union_exponent

    def merged_bytes(self, workers: int) -> float:
        return self.merged_intercept + self.merged_per_entry * self.union_entries(workers)


@dataclass(frozen=True)
class PowerSgd:
    """PowerSGD (torch's ``powerSGD_hook``) at one rank: bytes all-reduced per step as the P factors,
    the Q factors and the tensors left uncompressed; ``compress_s``: the hook's arithmetic per step."""

    rank: int
    p_bytes: float
    q_bytes: float
    uncompressed_bytes: float
    compress_s: float


@dataclass(frozen=True)
class Workload:
    """Measured inputs of one model (seconds on the measuring machine, bytes exact)."""

    name: str
    numel: int  # trainable parameters
    buffer_numel: int  # floating-point buffers (BatchNorm running statistics)
    bag_forward_s: float
    bag_backward_s: float
    optimizer_s: float  # one optimizer step over numel (Adam)
    dense_add_s: float  # master: one dense float32 gradient added into the sum
    dense_pack_s: float  # worker: its dense message up built (gradient + float64 buffers)
    dense_load_s: float  # worker: the received float32 weights loaded into the model
    pass_s: float = 0.0  # fixed cost of one packed forward + backward, whatever its bags
    compressed: dict[float, Compressed] = field(default_factory=dict)
    powersgd: PowerSgd | None = None

    @property
    def bag_s(self) -> float:
        return self.bag_forward_s + self.bag_backward_s

    @property
    def dense_bytes(self) -> int:
        return 4 * self.numel


@dataclass(frozen=True)
class Scenario:
    """What is being predicted: P workers, B bags per step, links (``worker_link`` defaults to the
    master's), with or without gradient clipping (``train.grad_clip``: the master then decodes before
    its frame), on full-duplex links or on one queue for both directions (where the relay's cut-through
    gains nothing)."""

    workers: int
    bags_per_step: int
    link: Link
    worker_link: Link | None = None
    clipping: bool = False
    full_duplex: bool = True  # False: one queue carries both directions (the loopback checks' namespace)

    @property
    def worker(self) -> Link:
        return self.worker_link or self.link

    @property
    def bags_per_worker(self) -> int:
        """Bags of the slowest worker (equal bags spread longest-first: ceil(B / P))."""
        return math.ceil(self.bags_per_step / self.workers)


@dataclass(frozen=True)
class Step:
    """A predicted step: ``total = compute + cpu + comm``; ``master_bytes``: payload bytes through the
    master's link (both directions; 0 for DDP), ``worker_bytes``: through one worker's link."""

    method: str
    workers: int
    compute: float
    cpu: float  # codec, sums, optimizer steps on the critical path
    comm: float  # link time and latencies on the critical path (not hidden behind compute)
    master_bytes: float
    worker_bytes: float

    @property
    def total(self) -> float:
        return self.compute + self.cpu + self.comm

    @property
    def exchange(self) -> float:
        """Everything but compute: what the step costs over an ideal no-communication step."""
        return self.total - self.compute


def star_phase(nbytes_each: float, s: Scenario) -> float:
    """One phase of a star exchange: P messages of ``nbytes_each`` through the master's link, one
    through each worker's link, all at once; the busiest link sets the time."""
    return max(s.link.seconds(s.workers * nbytes_each), s.worker.seconds(nbytes_each))


def dpgs_latency(s: Scenario, one_piece: bool) -> float:
    """One-way latencies on a DPGS step's critical path (``dpgs.distributed.gloo``). A gloo send waits for
    the receiver's ready notice. ``one_piece``: every message is one gloo message whose receive was posted
    before it is sent (a dense step's bounded exchange; a compressed step whose messages up fit one piece,
    whose route then carries the message down): one latency up, one down, 2 in all. Otherwise a message
    up is a first piece, then the route down, then the rest of the message (a notice, then the data), and
    the message down follows: 6 (the first notice of each direction is posted while the peer computes)."""
    return (DPGS_ONE_PIECE_LATENCIES if one_piece else DPGS_PIECED_LATENCIES) * s.link.latency_s


def one_piece(message_up_bytes: float) -> bool:
    """Whether a compressed step's messages up each fit a first piece (``gloo.FIRST`` bytes)."""
    return message_up_bytes <= DPGS_RELAY_PIECE - 8


def compute(w: Workload, s: Scenario) -> float:
    """The slowest worker's packed forward + backward over its bags."""
    return w.pass_s + s.bags_per_worker * w.bag_s


def dpgs_dense(w: Workload, s: Scenario) -> Step:
    """``keep_ratio = 1`` (DenseSync): raw float32 gradient + float64 buffers up; the master sums the P
    gradients, steps, and sends raw float32 weights + buffers down; workers load them."""
    up, down = dpgs_messages(w, "dpgs-dense", s.workers)
    cpu = w.dense_pack_s + s.workers * w.dense_add_s + w.optimizer_s + w.dense_load_s
    comm = star_phase(up, s) + star_phase(down, s) + dpgs_latency(s, one_piece=True)  # bounded
    return Step("dpgs-dense", s.workers, compute(w, s), cpu, comm, s.workers * (up + down), up + down)


def up_tail_bytes(w: Workload) -> float:
    """What follows the gradient in a worker's message up: its loss sum and buffers, float64."""
    return DPGS_LOSS_SUM + 8 * w.buffer_numel


def relay_frame_bytes(w: Workload) -> float:
    """The master's frame to every worker with ``downlink=gradients`` once the payloads were relayed: the
    float32 buffers, one size, header."""
    return DPGS_FRAME_HEADER + DPGS_FRAME_PART + 4 * w.buffer_numel


def dpgs_messages(w: Workload, method: str, workers: int) -> tuple[float, float]:
    """Bytes of one worker's message up and of what the master sends one worker down, for ``dpgs-dense``
    (float32 gradient + float64 loss sum and buffers up; float32 weights + buffers down) and the relayed
    ``dpgs-keep{r}`` (payload + float64 loss sum and buffers up; the P - 1 other payloads and the frame
    down)."""
    if method == "dpgs-dense":
        return w.dense_bytes + up_tail_bytes(w), 4 * (w.numel + w.buffer_numel)
    c = w.compressed[float(method.removeprefix("dpgs-keep"))]
    return c.payload_bytes + up_tail_bytes(w), (workers - 1) * c.payload_bytes + relay_frame_bytes(w)


def dpgs_relay(w: Workload, s: Scenario, keep: float) -> Step:
    """``keep_ratio < 1, downlink=gradients`` (RelaySync, dpgs's default): payloads up; the master
    forwards each worker the other P - 1 payloads while they arrive (cut-through: the longer of the up
    and down phases, plus one piece of the other), then sends the frame of the buffers, before decoding
    (after, with clipping); every worker decodes the P payloads (its own kept) and takes the optimizer
    step itself. The master's own decode and step run while the workers apply theirs."""
    c = w.compressed[keep]
    up, down = dpgs_messages(w, f"dpgs-keep{keep:g}", s.workers)
    relayed = down - relay_frame_bytes(w)
    piece = min(DPGS_RELAY_PIECE, c.payload_bytes)
    # the busier direction carries all its bytes; the other adds its first (down: last) piece
    relay = max(star_phase(piece, s) + star_phase(relayed, s),
                star_phase(up, s) + star_phase((s.workers - 1) * piece, s))
    if not s.full_duplex:
        relay = star_phase(up, s) + star_phase(relayed, s)
    apply = s.workers * c.decode_add_s + w.optimizer_s
    cpu = c.encode_s + apply + (s.workers * c.decode_add_s if s.clipping else 0.0)
    comm = relay + star_phase(relay_frame_bytes(w), s) + dpgs_latency(s, one_piece(up))
    return Step(f"dpgs-keep{keep:g}", s.workers, compute(w, s), cpu, comm, s.workers * (up + down),
                up + down)


def dpgs_delta(w: Workload, s: Scenario, keep: float) -> Step:
    """``keep_ratio < 1, downlink=delta`` (DeltaSync): payloads up; the master decodes the P payloads,
    steps, and sends one top-k weight delta (+ buffers) to every worker, which adds it to its weights."""
    c = w.compressed[keep]
    up = c.payload_bytes + up_tail_bytes(w)
    down = DPGS_FRAME_HEADER + 2 * DPGS_FRAME_PART + c.delta_bytes + 4 * w.buffer_numel
    cpu = c.encode_s + s.workers * c.decode_add_s + w.optimizer_s + c.delta_encode_s + c.decode_add_s
    comm = star_phase(up, s) + star_phase(down, s) + dpgs_latency(s, one_piece(up))
    return Step(f"dpgs-keep{keep:g}-delta", s.workers, compute(w, s), cpu, comm, s.workers * (up + down),
                up + down)


def dpgs_merged(w: Workload, s: Scenario, keep: float) -> Step:
    """Not in dpgs today: ``downlink=gradients`` with the master sending the *sum* of the P payloads as
    one payload (the union of their index sets) instead of relaying them; workers decode that one
    payload and step. Exact as the relay is (every replica adds the same float32 sum)."""
    c = w.compressed[keep]
    up = c.payload_bytes + up_tail_bytes(w)
    union = c.union_entries(s.workers)
    down = DPGS_FRAME_HEADER + 2 * DPGS_FRAME_PART + c.merged_bytes(s.workers) + 4 * w.buffer_numel
    decode_merged = c.decode_add_s * union / c.entries
    cpu = (c.encode_s + s.workers * c.decode_add_s + c.merged_encode_per_entry_s * union + decode_merged
           + w.optimizer_s)
    comm = star_phase(up, s) + star_phase(down, s) + dpgs_latency(s, one_piece(up))
    return Step(f"dpgs-keep{keep:g}-merged", s.workers, compute(w, s), cpu, comm, s.workers * (up + down),
                up + down)


def ddp_buckets(nbytes: float) -> int:
    """Gradient buckets of torch DDP for ``nbytes`` of gradients (a 1 MiB first bucket, then 25 MiB)."""
    rest = max(0.0, nbytes - DDP_FIRST_BUCKET_BYTES)
    return 1 + math.ceil(rest / DDP_BUCKET_BYTES)


def ddp_last_bucket_share(nbytes: float) -> float:
    """Share of the gradient in DDP's last bucket: the first layers, whose gradients are ready only when
    the backward pass ends, so their all-reduce cannot overlap it."""
    buckets = ddp_buckets(nbytes)
    if buckets == 1:
        return 1.0
    return (nbytes - DDP_FIRST_BUCKET_BYTES - DDP_BUCKET_BYTES * (buckets - 2)) / nbytes


def ddp_exposed(comm: float, w: Workload) -> float:
    """What of a DDP all-reduce lasting ``comm`` the step waits for: it starts bucket by bucket during the
    backward of the step's last bag (the earlier bags run under ``no_sync``), so at most that backward
    hides it, and never its last bucket's share."""
    return max(comm - w.bag_backward_s, comm * ddp_last_bucket_share(w.dense_bytes))


def ring_allreduce(nbytes: float, s: Scenario, rounds: int) -> float:
    """A ring all-reduce of ``nbytes`` over the workers' links (gloo): each link carries
    ``2 (P - 1) / P * nbytes`` each way, in ``rounds`` all-reduces of ``2 (P - 1)`` sequential steps that
    each cost one one-way latency."""
    p = s.workers
    if p == 1:
        return 0.0
    return s.worker.seconds(2 * (p - 1) / p * nbytes) + rounds * 2 * (p - 1) * s.worker.latency_s


def ddp(w: Workload, s: Scenario) -> Step:
    """DDP (dense, gloo ring all-reduce), hidden behind the backward as :func:`ddp_exposed` says; then
    every worker takes the optimizer step."""
    nbytes = w.dense_bytes
    exposed = ddp_exposed(ring_allreduce(nbytes, s, ddp_buckets(nbytes)), w)
    per_link = 2 * (s.workers - 1) / s.workers * nbytes
    return Step("ddp", s.workers, compute(w, s), w.optimizer_s, exposed, 0.0, 2 * per_link)


def ddp_powersgd(w: Workload, s: Scenario) -> Step:
    """DDP with the PowerSGD hook: per bucket three all-reduces (uncompressed tensors, P factors, Q
    factors); the hook's arithmetic is counted in full, the communication hidden as :func:`ddp_exposed`
    says."""
    ps = w.powersgd
    if ps is None:
        raise ValueError(f"workload {w.name}: no PowerSGD figures measured")
    nbytes = ps.p_bytes + ps.q_bytes + ps.uncompressed_bytes
    exposed = ddp_exposed(ring_allreduce(nbytes, s, 3 * ddp_buckets(w.dense_bytes)), w)
    per_link = 2 * (s.workers - 1) / s.workers * nbytes
    return Step("ddp-powersgd", s.workers, compute(w, s), ps.compress_s + w.optimizer_s, exposed, 0.0,
                2 * per_link)


def predict(w: Workload, method: str, s: Scenario) -> Step:
    """``method``: ``dpgs-dense``, ``dpgs-keep{r}`` (relay), ``dpgs-keep{r}-delta``,
    ``dpgs-keep{r}-merged``, ``ddp``, ``ddp-powersgd``."""
    if method == "dpgs-dense":
        return dpgs_dense(w, s)
    if method == "ddp":
        return ddp(w, s)
    if method == "ddp-powersgd":
        return ddp_powersgd(w, s)
    if method.startswith("dpgs-keep"):
        name, _, variant = method.removeprefix("dpgs-keep").partition("-")
        keep = float(name)
        if keep not in w.compressed:
            raise ValueError(f"workload {w.name}: keep ratio {keep:g} not measured "
                             f"(measured: {', '.join(f'{k:g}' for k in sorted(w.compressed))})")
        fn = {"": dpgs_relay, "delta": dpgs_delta, "merged": dpgs_merged}.get(variant)
        if fn is not None:
            return fn(w, s, keep)
    raise ValueError(f"unknown method '{method}'")


def exchange_limit_workers(w: Workload, method: str, scenario: Scenario, ps: list[int],
                           share: float = 0.10, part: str = "exchange") -> int | None:
    """The smallest P of ``ps`` whose ``part`` of the step exceeds ``share`` of its compute (None: none
    does). ``part``: ``exchange`` (everything but compute) or ``comm`` (the network alone: the master's
    link for DPGS, the workers' links for DDP)."""
    if part not in ("exchange", "comm"):
        raise ValueError(f"part must be exchange or comm, got {part!r}")
    for p in ps:
        step = predict(w, method, _with_workers(scenario, p))
        if getattr(step, part) > share * step.compute:
            return p
    return None


def fastest_workers(w: Workload, method: str, scenario: Scenario, ps: list[int]) -> int:
    """The P of ``ps`` with the smallest predicted s/step (the smallest such P on ties): adding workers
    beyond it no longer makes steps faster."""
    return min(ps, key=lambda p: (predict(w, method, _with_workers(scenario, p)).total, p))


def _with_workers(s: Scenario, workers: int) -> Scenario:
    return replace(s, workers=workers)
