"""``SampleParallelGroup``: G Ray actors that together run one huge input (one logical DPGS worker).

The group starts a ``SpatialRank`` actor in its own placement-group bundle per rank
(``dpgs.distributed.actors.PlacedActors``) and creates a ``torch.distributed`` process group inside the actors
(gloo on CPU; NCCL on GPUs, which needs a whole GPU per rank: a request that could put two ranks on one
GPU is refused, and so is a placement that did). The rendezvous is a store that rank 0 serves on its node's
address, on a port the operating system picks for it, anew each build.

``compute(images, labels, step)`` sends each rank only its rectangle of the input (or a reader that each
rank calls for its own rectangle), runs one forward/backward and returns rank 0's flat gradient (the sum
over the step's images of their losses' gradients) and statistics.

Failures: every ``ray.get`` has a deadline (``call_timeout_s``). When a rank dies or the step times out,
the whole group is torn down (actors killed, placement group released) and rebuilt with new actors and
a new store; the driver's copy of the weights and of every buffer (BatchNorm running statistics and
counters, as of the last completed step) is loaded into the new ranks and the step re-runs. Partial
updates of the failed attempt die with its actors, so nothing is counted twice. A step that fails while
every rank is alive (a genuine error in the model or the input) is raised, not retried.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dpgs.distributed.actors import Bundle, PlacedActors, get_all
from dpgs.distributed.rendezvous import host_store
from dpgs.spatial.partition import Grid, Partition, Rect, make_grid
from dpgs.spatial.rank import RankState, SpatialModelSpec, flat_tensors


class GroupFailure(RuntimeError):
    """The group could not complete a step within its restart budget."""


class SpatialRank:
    """A rank of a sample-parallel group: a thin actor around ``dpgs.spatial.rank.RankState``."""

    def __init__(self, rank: int, grid: Grid, spec: SpatialModelSpec, device: str, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.grid, self.device = rank, grid, device
        self.state: RankState | None = None
        self.spec = spec
        self.store = None  # rank 0: the group's rendezvous store, served from :meth:`rendezvous`

    def rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Serve the group's rendezvous store in this process (asked of rank 0); where it listens."""
        self.store = host_store(timeout_s)
        return self.store.host, self.store.port

    def setup(self, host: str, port: int, timeout_s: float) -> dict:
        """Join the process group and build the replica; returns where this rank runs."""
        import torch.distributed as dist

        device = self.device
        if device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU(s) as CUDA_VISIBLE_DEVICES
        timeout = timedelta(seconds=timeout_s)
        store = self.store
        if store is None:  # not rank 0: a client of rank 0's store
            store = dist.TCPStore(host, port, self.grid.size, False, timeout=timeout)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store,
                                rank=self.rank, world_size=self.grid.size, timeout=timeout)
        self.state = RankState(self.rank, self.grid, self.spec, "cuda:0" if device == "cuda" else "cpu")
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node": ctx.get_node_id(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "device": device}

    def ping(self) -> int:
        return os.getpid()

    def get_state(self):
        return self.state.get_state()

    def set_state(self, params, buffers) -> None:
        self.state.set_state(params, buffers)

    def state_dict(self) -> dict:
        return {k: v.detach().cpu() for k, v in self.state.model.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        self.state.model.load_state_dict(state)

    def step(self, band, rect: Rect, height: int, width: int, labels, step: int, input_grad: bool) -> dict:
        if not isinstance(band, torch.Tensor):  # a reader: this rank reads its own rectangle
            band = band.read(rect)
        return self.state.step(band, height, width, labels, step, input_grad)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _input_shape(images) -> tuple[int, ...]:
    shape = tuple(images.shape)
    if len(shape) != 4 or shape[1] != 3:
        raise ValueError(f"sample-parallel input must have shape [N, 3, H, W], got {shape}")
    return shape


class SampleParallelGroup:
    """G ranks that compute the gradient of one input together (see module docstring).

    Args:
        spec: the model every rank builds (``SpatialModelSpec``).
        ranks: G (``dpgs.sample_parallel``).
        grid: (rows, cols) with rows * cols = G (``dpgs.sample_grid``); default (G, 1) row bands.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL; one whole GPU per rank).
        cpus_per_rank, gpus_per_rank: the placement-group bundle of a rank.
        threads: torch threads per rank.
        call_timeout_s: deadline of every remote call and of the process-group operations.
        max_restarts: rebuilds allowed per step before ``GroupFailure``.
        hooks: fault injection for tests: ``{"after_submit": fn(group, attempt)}`` runs once the step's
            tasks are submitted.
        name: prefix of the placement group's name (each build appends a fresh suffix); an owner that may
            be restarted (``GroupWorker``) passes a stable prefix and calls
            ``dpgs.distributed.actors.release_named(prefix)`` first to free what a dead incarnation left.
    """

    def __init__(self, spec: SpatialModelSpec, ranks: int, grid: tuple[int, int] | None = None, *,
                 device: str = "cpu", cpus_per_rank: float = 1.0, gpus_per_rank: float | None = None,
                 threads: int = 1, call_timeout_s: float = 300.0, max_restarts: int = 3,
                 hooks: dict[str, Callable] | None = None, name: str = "") -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        gpus = (1.0 if device == "cuda" else 0.0) if gpus_per_rank is None else float(gpus_per_rank)
        if device == "cuda" and gpus < 1:
            raise ValueError(f"NCCL needs one whole GPU per rank (never two ranks on one GPU); got "
                             f"gpus_per_rank={gpus}")
        if device == "cpu" and gpus:
            raise ValueError("gpus_per_rank must be 0 with device='cpu'")
        self.spec = spec
        self.grid = make_grid(ranks, grid)
        self.device = device
        self.bundle = Bundle(cpus_per_rank, gpus)
        self.threads = threads
        self.call_timeout_s = call_timeout_s
        self.max_restarts = max_restarts
        self.hooks = hooks or {}
        self.name = name
        self.restarts = 0
        self.ranks: PlacedActors | None = None
        self.where: list[dict] = []
        self._build()
        self._params, self._buffers = self._get([self.actors[0].get_state.remote()])[0]
        self._push_state()

    # lifecycle -----------------------------------------------------------------------------------
    @property
    def actors(self) -> list:
        return [] if self.ranks is None else self.ranks.handles

    def _get(self, refs: list, timeout_s: float | None = None) -> list:
        """``ray.get`` of ``refs`` with one deadline; the first failure is raised as soon as it is known."""
        return get_all(refs, timeout_s or self.call_timeout_s, "sample-parallel group")

    def _build(self) -> None:
        label = f"{self.name}{uuid.uuid4().hex[:8]}" if self.name else ""
        self.ranks = PlacedActors(
            SpatialRank, self.grid.size, lambda r: (r, self.grid, self.spec, self.device, self.threads),
            bundle=self.bundle, placed=True, max_restarts=0, timeout_s=self.call_timeout_s, name=label,
        )
        try:
            host, port = self._get([self.actors[0].rendezvous.remote(self.call_timeout_s)])[0]
            self.where = self._get([a.setup.remote(host, port, self.call_timeout_s) for a in self.actors])
        except BaseException:
            self._teardown()  # no half-started group stays behind
            raise
        if self.device == "cuda":
            seen: dict[tuple[str, str], int] = {}
            for w in self.where:
                for gpu in w["gpus"]:
                    if (w["node"], gpu) in seen:
                        self._teardown()
                        raise ValueError(f"ranks {seen[(w['node'], gpu)]} and {w['rank']} were placed on the "
                                         f"same GPU {gpu}; NCCL needs one GPU per rank")
                    seen[(w["node"], gpu)] = w["rank"]

    def _teardown(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def _push_state(self) -> None:
        params, buffers = ray.put(self._params), ray.put(self._buffers)
        self._get([a.set_state.remote(params, buffers) for a in self.actors])

    def _rebuild(self) -> None:
        self._teardown()
        self._build()
        self._push_state()
        self.restarts += 1

    def _alive(self) -> bool:
        try:
            self._get([a.ping.remote() for a in self.actors], timeout_s=min(self.call_timeout_s, 30.0))
        except (RayActorError, RayTaskError, GetTimeoutError):
            return False
        return True

    def close(self) -> None:
        """Leave the process group and release the actors and their placement group."""
        if self.actors:
            try:
                self._get([a.shutdown.remote() for a in self.actors], timeout_s=30.0)
            except (RayActorError, RayTaskError, GetTimeoutError):
                pass  # a dead rank has nothing left to shut down
        self._teardown()

    def __enter__(self) -> SampleParallelGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # weights -------------------------------------------------------------------------------------
    def get_params(self) -> torch.Tensor:
        """Flat trainable parameters (``model.parameters()`` order, parameter dtype)."""
        return self._params.clone()

    def set_params(self, flat: torch.Tensor) -> None:
        """Load ``flat`` into every rank (e.g. after the DPGS master's update)."""
        self.set_state(params=flat)

    def set_state(self, params: torch.Tensor | None = None, buffers: torch.Tensor | None = None) -> None:
        """``set_params(params)`` and ``set_buffers(buffers)`` (either may be None), one push to the ranks."""
        if params is None and buffers is None:
            return
        if params is not None:
            if params.numel() != self._params.numel():
                raise ValueError(f"set_params: got {params.numel()} values, the model has "
                                 f"{self._params.numel()}")
            self._params = params.detach().cpu().to(self._params.dtype).clone()
        if buffers is not None:
            self._load_float_buffers(buffers)
        self._push_state()

    def get_buffers(self) -> torch.Tensor | None:
        """Floating-point buffers (BatchNorm running statistics) as one float64 vector, as DPGS workers."""
        floats = [b for b in self._buffers if b.is_floating_point()]
        return flat_tensors(floats).double() if floats else None

    def set_buffers(self, flat: torch.Tensor | None) -> None:
        """Load the master's averaged floating-point buffers into every rank (counters are kept)."""
        self.set_state(buffers=flat)

    def _load_float_buffers(self, flat: torch.Tensor) -> None:
        """``flat`` (float64, ``get_buffers`` layout) into the driver's copy of the buffers."""
        total = sum(b.numel() for b in self._buffers if b.is_floating_point())
        if flat.numel() != total:
            raise ValueError(f"set_buffers: got {flat.numel()} values, the model has {total}")
        offset, loaded = 0, []
        for b in self._buffers:
            if b.is_floating_point():
                b = flat[offset:offset + b.numel()].view_as(b).to(b.dtype).clone()
                offset += b.numel()
            loaded.append(b)
        self._buffers = loaded

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._get([self.actors[0].state_dict.remote()])[0]

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a BigResNet/torchvision-named state dict (plus ``head.*`` with a head) into every rank."""
        ref = ray.put(state)
        self._get([a.load_state_dict.remote(ref) for a in self.actors])
        self._params, self._buffers = self._get([self.actors[0].get_state.remote()])[0]

    # the step ------------------------------------------------------------------------------------
    def _inputs(self, images) -> tuple[list, list[Rect], int, int]:
        n, _, h, w = _input_shape(images)
        part = Partition(self.grid, h, w, "input image")
        rects = [part.owned(r) for r in range(self.grid.size)]
        if isinstance(images, torch.Tensor):
            bands = [ray.put(images[:, :, r.r0:r.r1, r.c0:r.c1].contiguous()) for r in rects]
        elif callable(getattr(images, "read", None)):
            bands = [images] * len(rects)
        else:
            raise TypeError(f"images must be a Tensor or a reader with .shape and .read(rect), got "
                            f"{type(images).__name__}")
        return bands, rects, h, w

    def compute(self, images, labels, step: int = 0, input_grad: bool = False) -> tuple[torch.Tensor, dict]:
        """One forward/backward of ``images`` ([N, 3, H, W] tensor or reader) with ``labels`` ([N]).

        Returns ``(flat_grad, stats)``: ``flat_grad`` is the gradient of the sum of the N per-image losses
        w.r.t. every trainable parameter (``get_params`` order and dtype); ``stats`` holds ``losses`` [N],
        ``logits`` [N, C], ``buffers`` (float64 vector of rank 0's floating buffers after the step),
        the bytes each kind of traffic moved summed over the ranks (``halo_bytes``, ``gather_bytes``,
        ``stats_bytes``, ``grad_bytes``), ``seconds``, ``restarts`` (rebuilds during this call) and, with
        ``input_grad``, ``input_grad`` (the gradient of the whole input, assembled from the ranks).
        """
        bands, rects, h, w = self._inputs(images)
        labels = torch.as_tensor(labels).reshape(-1)
        start, restarts = time.perf_counter(), 0
        while True:
            refs = [a.step.remote(bands[r], rects[r], h, w, labels, step, input_grad)
                    for r, a in enumerate(self.actors)]
            if "after_submit" in self.hooks:
                self.hooks["after_submit"](self, restarts)
            try:
                results = self._get(refs)
                break
            except (RayActorError, RayTaskError, GetTimeoutError) as err:
                if isinstance(err, RayTaskError) and self._alive():
                    raise  # every rank is alive: a genuine error, retrying would not help
                if restarts >= self.max_restarts:
                    self._teardown()
                    raise GroupFailure(f"sample-parallel step {step} failed {restarts + 1} times; last "
                                       f"error: {type(err).__name__}: {err}") from err
                restarts += 1
                self._rebuild()
        root = results[0]
        self._buffers = root["buffers"]
        stats = {"losses": root["losses"], "logits": root["logits"], "buffers": self.get_buffers(),
                 "seconds": time.perf_counter() - start, "restarts": restarts, "ranks": self.grid.size,
                 "rank_seconds": [r["seconds"] for r in results]}
        for kind in ("halo_bytes", "gather_bytes", "stats_bytes", "grad_bytes"):
            stats[kind] = sum(r[kind] for r in results)
        if input_grad:
            n = results[0]["input_grad"].shape[0]
            full = torch.zeros((n, 3, h, w), dtype=results[0]["input_grad"].dtype)
            for r, res in zip(rects, results, strict=True):
                full[:, :, r.r0:r.r1, r.c0:r.c1] = res["input_grad"]
            stats["input_grad"] = full
        return root["grad"], stats
