"""A sample-parallel group as ONE logical DPGS worker (``workers.GroupWorker`` wraps this in an actor).

With ``dpgs.sample_parallel = G > 1`` (``data.kind=tiles``) each of the P DPGS workers is a coordinator
that owns a :class:`~dpgs.spatial.group.SampleParallelGroup` of G ranks. The coordinator keeps what a
``WorkerState`` keeps, except the model replica: the weight version and the flat trainable parameters
(float32, ``dpgs.distributed.flat.trainable`` order of the ``TileMIL`` model), the uplink
``GradientEncoder`` (its error-feedback residual over the ``TileMIL`` layout) and the dataset. Per step it

1. applies the master's update to its flat parameters exactly as ``WorkerState.receive`` does
   (``apply_update``; a delta that does not continue its version answers ``needs_resync``), then loads
   the parameters and the master's averaged floating-point buffers into the ranks (one push);
2. for each assigned bag b (tiles ``X_b`` [N_b, 3, s, s], label ``y_b``, read with
   ``dataset.get(index, epoch)``) runs ``group.compute(X_b, [y_b])``: every tile is cut into the same
   grid (row bands by default), the ranks run the partitioned stages with halo exchange and exact
   distributed BatchNorm over the bag's N_b tiles, rank 0 pools each tile's feature map and computes the
   head's loss of the bag (``SpatialModelSpec(instances="images")``), so the flat gradient is
   ``d TileMIL.loss(X_b, y_b) / d theta``;
3. sums them, ``g = sum_b d loss_b / d theta`` (the DPGS worker contract: the master divides by the
   step's bag count B), compresses ``g`` and returns the payload, the ranks' float64 buffers after the
   last bag and the statistics ``WorkerState.compute`` returns plus the group's traffic
   (``halo_bytes``, ``gather_bytes``, ``stats_bytes``, ``grad_bytes``, summed over the step's bags and
   the ranks) and ``group_restarts`` (rebuilds during the step).

The replica of every rank is a ``SampleParallelResNet`` (a ``BigResNet``) with the head registered after
it; its trainable parameters and floating-point buffers are those of ``TileMIL(encoder, head)`` by name
(less the ``encoder.`` prefix), shape and order, which :func:`check_layout` verifies at start-up, so the
master's flat vectors and the group's line up without any permutation.

Randomness: bag b of step s runs with the seed ``seed * 1_000_003 + s * 8191 + b`` (the rank seeds from
``spec.seed * 1_000_003 + key`` with ``key = s * 8191 + b``): a re-run step computes the same gradient.
Rank failures are handled inside the group (rebuild and re-run of the bag); a group that exceeds its
restart budget raises ``GroupFailure``, which the actor turns into its own death so that the engine
restarts it and re-runs its bags like any failed worker.
"""

from __future__ import annotations

import time

import torch

from dpgs.config.schema import CompressionConfig
from dpgs.distributed.bag_reader import BagReader
from dpgs.distributed.codec import GradientEncoder, apply_update
from dpgs.distributed.flat import flat_params, float_buffers, trainable
from dpgs.distributed.runtime import release_named
from dpgs.distributed.worker_state import emulate_link, receive_update
from dpgs.spatial.group import SampleParallelGroup
from dpgs.spatial.rank import SpatialModelSpec

TRAFFIC = ("halo_bytes", "gather_bytes", "stats_bytes", "grad_bytes")


def spatial_spec(model_spec, seed: int = 0, class_weights: torch.Tensor | None = None) -> SpatialModelSpec:
    """The rank replica of the ``TileMIL`` that ``model_spec`` (``dpgs.modeling.ModelSpec``) builds.

    Encoder ``model.encoder`` with ``model.big_stages`` partitioned stages (``-1``, the dense encoder,
    partitions the stem only), the head ``model.name`` with ``model.params``, float32, each input image one
    instance of a single bag.
    """
    cfg = model_spec.cfg
    if cfg.encoder is None:
        raise ValueError("dpgs.sample_parallel > 1 needs a tile encoder (model.encoder, data.kind=tiles)")
    if cfg.freeze_encoder:
        raise ValueError("dpgs.sample_parallel > 1 cannot be combined with model.freeze_encoder=true")
    if getattr(cfg, "amp", False):
        raise ValueError("dpgs.sample_parallel > 1 runs the ranks in float32; model.amp=true is unsupported")
    return SpatialModelSpec(
        arch=cfg.encoder,
        partitioned_stages=max(int(cfg.big_stages), 0),
        num_classes=int(model_spec.num_classes),
        head=cfg.name,
        head_params=dict(cfg.params),
        dtype="float32",
        max_elements=int(cfg.max_elements),
        seed=int(seed),
        instances="images",
        class_weights=None if class_weights is None else tuple(float(w) for w in class_weights),
    )


def replica_names(spec: SpatialModelSpec) -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
    """(trainable parameters, floating-point buffers) of the rank replica as ``(name, shape)`` in order."""
    replica = spec.build("cpu")
    params = [(n, tuple(p.shape)) for n, p in replica.named_parameters() if p.requires_grad]
    buffers = [(n, tuple(b.shape)) for n, b in replica.named_buffers() if b.is_floating_point()]
    return params, buffers


def tilemil_names(model: torch.nn.Module) -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
    """The same lists for a ``TileMIL`` model, with ``encoder.`` removed from the encoder's names."""
    params = [(n.removeprefix("encoder."), tuple(p.shape)) for n, p in model.named_parameters()
              if p.requires_grad]
    buffers = [(n.removeprefix("encoder."), tuple(b.shape)) for n, b in model.named_buffers()
               if b.is_floating_point()]
    return params, buffers


def check_layout(model: torch.nn.Module, spec: SpatialModelSpec) -> None:
    """Raise ValueError unless the replica's flat parameter and buffer layouts equal ``model``'s."""
    for what, ours, theirs in zip(("trainable parameters", "floating-point buffers"), replica_names(spec),
                                  tilemil_names(model), strict=True):
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                         min(len(ours), len(theirs)))
            raise ValueError(
                f"sample-parallel replica and {type(model).__name__} disagree on their {what} at position "
                f"{first}: {ours[first:first + 1]} vs {theirs[first:first + 1]} "
                f"({len(ours)} vs {len(theirs)} tensors)")


class GroupWorkerState:
    """One logical DPGS worker backed by a sample-parallel group (see module docstring).

    Args:
        rank: this worker's DPGS rank (0 .. P-1).
        model_spec: the ``ModelSpec`` of the master's ``TileMIL``.
        dataset: the tile-bag dataset (``TileBagDataset``).
        compression: ``dpgs.compression`` (uplink encoder).
        class_weights: per-class loss weights or None.
        seed: the run's seed.
        ranks, grid: G and the (rows, cols) grid of the group (``dpgs.sample_parallel``/``sample_grid``).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, one whole GPU per rank).
        cpus_per_rank, gpus_per_rank, threads: each rank's placement-group bundle and torch threads.
        call_timeout_s: the group's deadline for every remote call and process-group operation.
        max_group_restarts: group rebuilds per bag before ``GroupFailure``.
        emulate_bandwidth_mbps: as ``WorkerState`` (the coordinator's link to the master).
        name: placement-group name prefix, unique to this worker; what a previous incarnation of this
            worker reserved under it is released first.
    """

    def __init__(self, rank: int, model_spec, dataset, compression: CompressionConfig,
                 class_weights: torch.Tensor | None, seed: int, ranks: int,
                 grid: tuple[int, int] | None = None, device: str = "cpu", cpus_per_rank: float = 1.0,
                 gpus_per_rank: float | None = None, threads: int = 1, call_timeout_s: float = 600.0,
                 max_group_restarts: int = 3, emulate_bandwidth_mbps: float | None = None,
                 name: str = ""):
        self.rank = rank
        self.seed = seed
        self.device = device
        model = model_spec.build()
        self.spec = spatial_spec(model_spec, seed, class_weights)
        check_layout(model, self.spec)
        self.encoder = GradientEncoder(compression, model)
        self.flat = flat_params(model)
        self.n_buffers = sum(b.numel() for b in float_buffers(model))
        self.n_params = sum(p.numel() for p in trainable(model))
        del model  # only its layout was needed
        self.version: int | None = None
        self.reader = BagReader(dataset)
        self.mbps = emulate_bandwidth_mbps
        self.name = name
        self.leftovers = release_named(name) if name else 0
        self.group = SampleParallelGroup(
            self.spec, ranks, grid, device=device, cpus_per_rank=cpus_per_rank, gpus_per_rank=gpus_per_rank,
            threads=threads, call_timeout_s=call_timeout_s, max_restarts=max_group_restarts, name=name)

    def receive(self, update: bytes) -> None:
        """Apply a delta or snapshot payload to the flat parameters; raises VersionMismatch."""
        self.flat, self.version = apply_update(self.flat, self.version, update)

    def compute(
        self,
        update: bytes | None,
        buffers: torch.Tensor | None,
        indices: list[int],
        step: int,
        keep_ratio: float,
        epoch: int = 0,
        prefetch: list[int] | tuple[int, ...] = (),
    ) -> tuple[bytes, torch.Tensor | None, dict]:
        """Apply ``update`` and ``buffers``; return (gradient payload, buffers, stats) for ``indices``.

        Same contract as ``WorkerState.compute``; the payload encodes the sum over the bags of the
        gradient of each bag's loss.
        """
        start = time.perf_counter()
        down_link_seconds, resync = receive_update(self, update)
        if resync is not None:
            return b"", None, resync
        self.group.set_state(params=None if update is None else self.flat, buffers=buffers)
        stats: dict = {"rank": self.rank, "needs_resync": False, "version": self.version,
                       "n_bags": len(indices), "ranks": self.group.grid.size, "group_restarts": 0,
                       **dict.fromkeys(TRAFFIC, 0)}
        if not indices:
            self.reader.read_ahead(list(prefetch), epoch)
            stats.update(compute_seconds=0.0, payload_bytes=0, dense_bytes=0, losses=[], slide_ids=[])
            return b"", None, stats
        load_start = time.perf_counter()
        bags = [self.reader.take(i, epoch) for i in indices]
        self.reader.read_ahead(list(prefetch), epoch)
        compute_start = time.perf_counter()
        total: torch.Tensor | None = None
        losses = []
        for index, bag in zip(indices, bags, strict=True):
            tiles = torch.as_tensor(bag.features)
            grad, out = self.group.compute(tiles, torch.tensor([int(bag.label)]), step=step * 8191 + index)
            total = grad.to(torch.float32, copy=True) if total is None else total.add_(grad)
            losses.append(float(out["losses"].reshape(-1)[0]))
            stats["group_restarts"] += out["restarts"]
            for kind in TRAFFIC:
                stats[kind] += out[kind]
        compute_seconds = time.perf_counter() - compute_start
        payload, enc = self.encoder.encode(total, keep_ratio)
        link_seconds = emulate_link(len(payload), self.mbps)
        stats.update(
            losses=losses,
            slide_ids=[b.slide_id for b in bags],
            instances=sum(int(b.features.shape[0]) for b in bags),
            load_seconds=compute_start - load_start,
            compute_seconds=compute_seconds,
            encode_seconds=enc["encode_seconds"],
            link_seconds=link_seconds + down_link_seconds,
            payload_bytes=len(payload),
            dense_bytes=enc["dense_bytes"],
            sent=enc["count"],
            total_seconds=time.perf_counter() - start,
        )
        return payload, self.group.get_buffers(), stats

    def where(self) -> list[dict]:
        """Where the group's ranks run (rank, node, pid, gpus, device)."""
        return list(self.group.where)

    def n_trainable(self) -> int:
        return self.n_params

    def close(self) -> None:
        self.group.close()
