"""The sample-parallel group worker: one logical DPGS worker whose bags are computed by G rank actors.

With ``dpgs.sample_parallel = G > 1`` (``data.kind=tiles``) each of the P DPGS workers owns a
:class:`~dpgs.spatial.sample_group.SampleParallelGroup` of G ranks. The worker keeps what every worker keeps
(``dpgs.workers.base``: the ``TileMIL`` replica on the CPU, its version, the uplink encoder, the reader);
its hook pushes the replica's weights and floating-point buffers to the ranks when they changed, and for
each bag b (tiles ``X_b`` [N_b, 3, s, s], label ``y_b``) runs ``group.compute(X_b, [y_b])``: every tile
is cut into the same grid (row bands by default), the ranks run the partitioned stages with halo
exchange and exact distributed BatchNorm over the bag's N_b tiles, rank 0 pools each tile's feature map
and computes the head's loss of the bag (``SpatialModelSpec(instances="images")``), so the gradient is
``d TileMIL.loss(X_b, y_b) / d theta``, summed over the micro-batch's bags. The ranks' running statistics
after the step are what the worker sends up.

The replica of every rank is a ``SampleParallelResNet`` (a ``BigResNet``) with the head registered after
it; its trainable parameters and floating-point buffers are those of ``TileMIL(encoder, head)`` by name
(less the ``encoder.`` prefix), shape and order, which :func:`check_layout` verifies at start-up, so the
flat vectors line up without any permutation.

Randomness: bag b of step s runs with the key ``s * 8191 + b`` (the rank seeds from
``spec.seed * 1_000_003 + key``): a re-run step computes the same gradient. Rank failures are handled
inside the group (rebuild and re-run of the bag); a group that exceeds its restart budget raises
``GroupFailure``, which the worker turns into its own death so that the pool restarts it and re-runs its
bags like any failed worker.
"""

from __future__ import annotations

import os
import sys
import uuid

import ray
import torch

from dpgs.config import Config
from dpgs.distributed.actors import release_named
from dpgs.distributed.messages import StepPlan
from dpgs.distributed.roles import WorkerLaunch
from dpgs.distributed.runtime import worker_resources
from dpgs.spatial.rank import SpatialModelSpec
from dpgs.spatial.sample_group import GroupFailure, SampleParallelGroup
from dpgs.workers.base import BagGradients, Worker

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
    params = [
        (n.removeprefix("encoder."), tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad
    ]
    buffers = [
        (n.removeprefix("encoder."), tuple(b.shape))
        for n, b in model.named_buffers()
        if b.is_floating_point()
    ]
    return params, buffers


def check_layout(model: torch.nn.Module, spec: SpatialModelSpec) -> None:
    """Raise ValueError unless the replica's flat parameter and buffer layouts equal ``model``'s."""
    for what, ours, theirs in zip(
        ("trainable parameters", "floating-point buffers"),
        replica_names(spec),
        tilemil_names(model),
        strict=True,
    ):
        if ours != theirs:
            first = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                min(len(ours), len(theirs)),
            )
            raise ValueError(
                f"sample-parallel replica and {type(model).__name__} disagree on their {what} at position "
                f"{first}: {ours[first : first + 1]} vs {theirs[first : first + 1]} "
                f"({len(ours)} vs {len(theirs)} tensors)"
            )


class GroupWorker(Worker):
    """One logical DPGS worker backed by a sample-parallel group (module docstring).

    ``ranks``, ``grid``: G and the (rows, cols) grid (``dpgs.sample_parallel``/``sample_grid``);
    ``cpus_per_rank``, ``gpus_per_rank``, ``rank_threads``: each rank's bundle and torch threads;
    ``name``: placement-group name prefix unique to this worker (what a previous incarnation of this
    worker reserved under it is released first). The worker process itself holds the replica on the CPU.
    """

    @classmethod
    def launch(cls, config: Config) -> WorkerLaunch:
        """P coordinators without a CPU or bundle of their own; their G ranks each are sized as P * G workers
        would be (``worker_resources``; ``dpgs.cpus_per_worker`` and ``dpgs.gpus_per_worker`` are per rank).
        On CUDA every rank needs a whole GPU (NCCL)."""
        cfg = config.dpgs
        p, g = cfg.workers, cfg.sample_parallel
        res = worker_resources(cfg.model_copy(update={"workers": p * g}), config.train.device)
        if 0 < res.gpus < 1:
            source = (
                f"dpgs.gpus_per_worker={cfg.gpus_per_worker:g}"
                if cfg.gpus_per_worker
                else f"{ray.cluster_resources().get('GPU', 0):g} GPUs for {p * g} ranks"
            )
            raise ValueError(
                f"dpgs.sample_parallel={g}: NCCL needs one whole GPU per rank, never two ranks on one GPU "
                f"({source}); set dpgs.gpus_per_worker=1 with dpgs.workers * dpgs.sample_parallel <= GPUs, "
                f"or train.device=cpu"
            )
        prefix = f"dpgs-group-{uuid.uuid4().hex[:12]}-"
        grid = None if cfg.sample_grid is None else tuple(cfg.sample_grid)
        kwargs = tuple(
            {"ranks": g, "grid": grid, "rank_device": res.device, "cpus_per_rank": res.cpus,
             "gpus_per_rank": res.gpus, "rank_threads": res.threads, "name": f"{prefix}{w}-"}
            for w in range(p)
        )
        return WorkerLaunch(cpus=0.0, gpus=0.0, placed=False, threads=1, device="cpu", kwargs=kwargs,
                            reservation_prefix=prefix)

    def __init__(
        self,
        worker: int,
        model_spec,
        config: Config,
        device: str = "cpu",
        threads: int = 1,
        *,
        ranks: int,
        grid: tuple[int, int] | None = None,
        rank_device: str = "cpu",
        cpus_per_rank: float = 1.0,
        gpus_per_rank: float | None = None,
        rank_threads: int = 1,
        name: str = "",
    ):
        super().__init__(worker, model_spec, config, device=device, threads=threads)
        self.spec = spatial_spec(model_spec, config.seed)
        check_layout(self.model, self.spec)
        self.rank_device = rank_device
        self.name = name
        self.leftovers = release_named(name) if name else 0
        self.group = SampleParallelGroup(
            self.spec,
            ranks,
            grid,
            device=rank_device,
            cpus_per_rank=cpus_per_rank,
            gpus_per_rank=gpus_per_rank,
            threads=rank_threads,
            call_timeout_s=config.dpgs.call_timeout_s,
            max_restarts=3,
            name=name,
        )
        self.pushed_version: int | None = None

    def build_model(self, model_spec) -> torch.nn.Module:
        return model_spec.build()

    def on_weights_changed(self) -> None:
        self.pushed_version = None

    def bag_gradients(self, indices: list[int], bags: list, step: StepPlan) -> BagGradients:
        if self.pushed_version != self.replica.version:  # the step's weights and merged buffers
            self.group.set_state(params=self.replica.flat_params(), buffers=self.replica.flat_buffers())
            self.pushed_version = self.replica.version
        total, losses, traffic, restarts = None, [], 0, 0
        weights = self.class_weights
        for index, bag in zip(indices, bags, strict=True):
            tiles = torch.as_tensor(bag.features)
            try:
                grad, out = self.group.compute(
                    tiles, torch.tensor([int(bag.label)]), step=step.index * 8191 + index
                )
            except GroupFailure as err:
                # The group ran out of rebuilds and released its ranks: die, so that the pool restarts this
                # worker (a fresh group) and re-runs its bags, counting it against dpgs.max_worker_restarts.
                print(
                    f"[dpgs] group worker {self.worker}: {err}; exiting for a restart",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
            loss = float(out["losses"].reshape(-1)[0])
            if weights is not None:  # TileMIL.loss weighs each bag's loss by its class weight
                w = float(weights[int(bag.label)])
                grad, loss = grad * w, loss * w
            total = grad.to(torch.float32, copy=True) if total is None else total.add_(grad)
            losses.append(loss)
            restarts += out["restarts"]
            traffic += sum(out[kind] for kind in TRAFFIC)
        return BagGradients(total, losses, sum(int(b.features.shape[0]) for b in bags), traffic, restarts)

    def step_buffers(self) -> torch.Tensor | None:
        return self.group.get_buffers()

    def where(self) -> list[str]:
        rows, cols = self.group.grid.rows, self.group.grid.cols
        ranks = self.group.where
        lines = [f"{super().where()[0]} (coordinator of a sample-parallel group of {len(ranks)} ranks, "
                 f"{rows}x{cols} grid; {self.leftovers} stale reservation(s) released)"]
        return lines + [f"  rank {r['rank']}: node={r['node'][:12]} pid={r['pid']} device={r['device']}"
                        for r in ranks]

    def close(self) -> None:
        """Release the ranks and their placement group (call before killing the actor)."""
        self.group.close()
