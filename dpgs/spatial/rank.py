"""What one rank of a sample-parallel group does, independent of Ray (``group.SpatialRank`` wraps it).

Per step every rank

1. reads its rectangle of the input (``dpgs.spatial.partition``: row bands x column bands),
2. runs the partitioned stages with halo exchange and exact distributed BatchNorm, and sends the
   downsampled activation to rank 0, which runs the tail and the loss,
3. back-propagates the **sum** of the per-image losses (the DPGS worker contract: the master divides by
   the step's bag count); rank 0 starts the backward, the others receive their rectangle's gradient,
4. all-reduces the gradients of the partitioned layers.

Rank 0 returns the flat gradient (every trainable parameter, in parameter dtype and ``parameters()``
order), the per-image losses and logits, and its buffers; every rank returns its communication meter.

Loss (``SpatialModelSpec.instances``):

* ``"positions"`` (default). Without a head, ``cross_entropy(fc(avgpool(features)), label)`` per image;
  with a MIL head (``dpgs.models``), the positions of the final feature map of an image are its
  instances ([h*w, feature_dim]) and the head's per-bag loss is used: N images, N labels, N losses.
* ``"images"`` (a bag of tiles, ``dpgs.models.tilemil.TileMIL``). The N images of the input are the N
  instances of ONE bag: rank 0 pools every image's feature map, ``h_i = avgpool(f_i)`` ([N, D]; the
  ResNet has no ``fc``), and the head's loss of the bag ``head.loss(H, label)`` is the step's single loss
  (one label). Training-mode BatchNorm normalises over all N images (and all their positions), as
  ``TileMIL`` embedding a bag in one encoder pass, so the loss and gradient equal
  ``TileMIL.loss(tiles, label)``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dpgs.biglayers.config import DEFAULT_MAX_ELEMENTS
from dpgs.models import build_head
from dpgs.spatial.halo import SpatialContext
from dpgs.spatial.model import SampleParallelResNet
from dpgs.spatial.partition import Grid, Partition

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
INSTANCES = ("positions", "images")


@dataclass(frozen=True)
class SpatialModelSpec:
    """Everything a rank needs to build its replica (picklable, sent to the actors).

    ``head`` names a MIL head of ``dpgs.models`` (then ``num_classes`` is the head's class count and the
    ResNet has no ``fc``); ``None`` uses the ResNet's own ``fc`` with ``num_classes`` outputs.
    ``instances`` says what the head's instances are (module docstring): ``"positions"`` of each image's
    final feature map (one bag per image) or ``"images"`` (the whole input is one bag of tiles; needs a
    head). ``class_weights`` ([C] floats, optional) are passed to the head's loss.

    Parameter order: the replica is a ``BigResNet`` (torchvision module order) with the head registered
    after it, so ``parameters()`` lists ``conv1 .. layer4`` then ``head.*``: the order of
    ``TileMIL(encoder, head)`` (``encoder.*`` then ``head.*``), and the flat vectors of the two line up.
    """

    arch: str = "resnet18"
    partitioned_stages: int = 1
    num_classes: int = 2
    head: str | None = None
    head_params: dict = field(default_factory=dict)
    dtype: str = "float32"
    max_elements: int = DEFAULT_MAX_ELEMENTS
    channels_last: bool = False
    seed: int = 0
    instances: str = "positions"
    class_weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"SpatialModelSpec.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.num_classes < 1:
            raise ValueError(f"SpatialModelSpec.num_classes must be >= 1, got {self.num_classes}")
        if self.instances not in INSTANCES:
            raise ValueError(f"SpatialModelSpec.instances must be one of {INSTANCES}, got {self.instances!r}")
        if self.instances == "images" and self.head is None:
            raise ValueError("SpatialModelSpec(instances='images') needs a MIL head (head=...)")
        if self.class_weights is not None and len(self.class_weights) != self.num_classes:
            raise ValueError(f"SpatialModelSpec.class_weights has {len(self.class_weights)} entries for "
                             f"{self.num_classes} classes")

    def build(self, device: str | torch.device = "cpu") -> SampleParallelResNet:
        """The replica (identical on every rank: seeded), with ``head`` registered as ``model.head``."""
        torch.manual_seed(self.seed)
        dtype = _DTYPES[self.dtype]
        model = SampleParallelResNet(
            self.arch, partitioned_stages=self.partitioned_stages,
            num_classes=0 if self.head else self.num_classes, max_elements=self.max_elements,
            channels_last=self.channels_last, device=device, dtype=dtype)
        model.head = (build_head(self.head, model.feature_dim, self.num_classes, **self.head_params)
                      .to(device=device, dtype=dtype) if self.head else None)
        return model


def flat_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenation of ``tensors`` (detached, on the host, dtype kept; integers become float64)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    dtype = torch.promote_types(tensors[0].dtype, torch.float32) if tensors[0].is_floating_point() \
        else torch.float64
    return torch.cat([t.detach().reshape(-1).cpu().to(dtype) for t in tensors])


def load_flat(tensors: list[torch.Tensor], flat: torch.Tensor, what: str) -> None:
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"{what}: got {flat.numel()} values, the model has {total}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()


class RankState:
    """One rank's replica, its place in the grid and its step (see module docstring)."""

    def __init__(self, rank: int, grid: Grid, spec: SpatialModelSpec, device: str = "cpu") -> None:
        self.rank, self.spec = rank, spec
        self.device = torch.device(device)
        self.model = spec.build(self.device)
        self.ctx = SpatialContext(grid, rank, comm_device=self.device)

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def get_state(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(flat parameters in parameter dtype, every buffer including BatchNorm counters)."""
        return flat_tensors(self.params()), [b.detach().cpu().clone() for b in self.model.buffers()]

    def set_state(self, params: torch.Tensor | None, buffers: list[torch.Tensor] | None) -> None:
        if params is not None:
            load_flat(self.params(), params, "parameters")
        if buffers is not None:
            mine = list(self.model.buffers())
            if len(buffers) != len(mine):
                raise ValueError(f"buffers: got {len(buffers)} tensors, the model has {len(mine)}")
            with torch.no_grad():
                for b, v in zip(mine, buffers, strict=True):
                    b.copy_(v)

    def _class_weights(self, device: torch.device) -> torch.Tensor | None:
        if self.spec.class_weights is None:
            return None
        return torch.tensor(self.spec.class_weights, dtype=self.model.conv1.weight.dtype, device=device)

    def _loss(self, out: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: per-bag losses [B] and logits [B, C] (B = N images, or 1 with ``instances="images"``)."""
        head = self.model.head
        weights = self._class_weights(out.device)
        if head is None:
            return F.cross_entropy(out, labels, weight=weights, reduction="none"), out
        if self.spec.instances == "images":  # out: pooled features [N, D] of the bag's N tiles
            res = head.loss(out, labels[0], class_weights=weights)
            return res["per_bag"].reshape(1), res["logits"].reshape(1, -1)
        per_bag, logits = [], []
        for i in range(out.shape[0]):
            res = head.loss(out[i].flatten(1).T, labels[i], class_weights=weights)
            per_bag.append(res["per_bag"].reshape(()))
            logits.append(res["logits"].reshape(-1))
        return torch.stack(per_bag), torch.stack(logits)

    def step(self, band: torch.Tensor, height: int, width: int, labels: torch.Tensor, step: int = 0,
             input_grad: bool = False) -> dict:
        """Forward + backward of this rank's rectangle ``band`` of an [N, 3, height, width] input.

        ``labels``: [N] (one per image), or [1] with ``instances="images"`` (the label of the bag).
        """
        start = time.perf_counter()
        ctx = self.ctx
        ctx.meter.reset()
        part = Partition(ctx.grid, height, width, "input image")
        torch.manual_seed(self.spec.seed * 1_000_003 + step)  # dropout of a head: same on a re-run
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        dtype = self.model.conv1.weight.dtype
        x = band.to(dtype).requires_grad_(input_grad)
        images = self.spec.instances == "images"
        out = self.model.forward_sharded(x, part, ctx, pool=self.model.head is None or images)
        result: dict = {"rank": self.rank}
        if self.rank == 0:
            labels = torch.as_tensor(labels, dtype=torch.long, device=out.device).reshape(-1)
            expected = 1 if images else out.shape[0]
            if labels.numel() != expected:
                raise ValueError(f"got {labels.numel()} labels for {out.shape[0]} images "
                                 f"({'one bag: one label' if images else 'one label per image'})")
            per_bag, logits = self._loss(out, labels)
            per_bag.sum().backward()
            result.update(losses=per_bag.detach().cpu(), logits=logits.detach().cpu())
        else:
            out.sum().backward()  # the empty placeholder: receives this rank's gradient from rank 0
        self.model.allreduce_partitioned_grads(ctx)
        if self.rank == 0:
            result["grad"] = flat_tensors([p.grad if p.grad is not None else torch.zeros_like(p)
                                           for p in self.params()])
            result["buffers"] = [b.detach().cpu().clone() for b in self.model.buffers()]
        if input_grad:
            result["input_grad"] = x.grad.detach().cpu()
        result.update(ctx.meter.as_dict(), seconds=time.perf_counter() - start)
        return result
