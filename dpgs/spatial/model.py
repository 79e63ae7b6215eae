"""Sample-parallel ResNet-18/50: the big stages partitioned over the ranks, the tail on rank 0.

``SampleParallelResNet`` *is* a ``dpgs.biglayers.BigResNet`` (``big_stages`` = the partitioned stages), so
module, parameter and buffer names are torchvision's and a BigResNet/torchvision state dict loads
unchanged. Its ``forward_sharded(band, partition, ctx)``:

1. runs stages 0 .. ``partitioned_stages`` (stem, then ``layer1`` ..) on this rank's rectangle with the
   layers of ``dpgs.spatial.layers`` (halo exchange before every convolution and pooling, exact
   distributed BatchNorm);
2. gathers the downsampled activation on rank 0 (``GatherToRoot``), which runs the remaining stages, the
   global average pool and ``fc`` (or returns the feature map for a MIL head, see ``feature_map``).

Rank 0 returns the network output; the other ranks return an empty placeholder through which the
gradient of their rectangle arrives in the backward. After ``backward`` on every rank,
``allreduce_partitioned_grads`` sums the gradients of the partitioned layers over the ranks (each rank
holds the contribution of the outputs it owns); the tail's gradients exist on rank 0 only.
"""

from __future__ import annotations

import torch
from torch import nn

from dpgs.biglayers.config import DEFAULT_MAX_ELEMENTS
from dpgs.biglayers.resnet import BasicBlock, BigResNet, Bottleneck
from dpgs.spatial.halo import GatherToRoot, SpatialContext
from dpgs.spatial.layers import allreduce_grads, batch_norm, conv2d, max_pool2d
from dpgs.spatial.partition import Partition

ARCHS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}


def _block(block: nn.Module, x: torch.Tensor, part: Partition, sc: SpatialContext
           ) -> tuple[torch.Tensor, Partition]:
    """A BasicBlock/Bottleneck on this rank's rectangle (same arithmetic as its ``forward``)."""
    identity, id_part = x, part
    if block.downsample is not None:
        identity, id_part = conv2d(x, part, block.downsample[0], sc)
        identity = batch_norm(identity, block.downsample[1], sc)
    out, part = conv2d(x, part, block.conv1, sc)
    out = torch.relu_(batch_norm(out, block.bn1, sc))
    out, part = conv2d(out, part, block.conv2, sc)
    out = batch_norm(out, block.bn2, sc)
    if isinstance(block, Bottleneck):
        out = torch.relu_(out)
        out, part = conv2d(out, part, block.conv3, sc)
        out = batch_norm(out, block.bn3, sc)
    if id_part != part:
        raise RuntimeError(f"residual branches disagree: {id_part} vs {part}")
    out += identity
    return torch.relu_(out), part


class SampleParallelResNet(BigResNet):
    """ResNet whose stages 0..``partitioned_stages`` run sample-parallel (see module docstring).

    Args:
        arch: ``resnet18`` or ``resnet50``.
        partitioned_stages: 0 (stem only) .. 4 (every stage).
        num_classes: size of ``fc``; 0 returns pooled features.
        max_elements, storage_dtype, channels_last, dtype, device: as ``BigResNet`` (they apply to the
            strip-wise computation of each rank's rectangle).
    """

    def __init__(self, arch: str = "resnet18", *, partitioned_stages: int = 1, num_classes: int = 0,
                 max_elements: int = DEFAULT_MAX_ELEMENTS, device=None, dtype: torch.dtype | None = None,
                 **kwargs) -> None:
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
        if isinstance(partitioned_stages, bool) or partitioned_stages not in range(5):
            raise ValueError(f"partitioned_stages must be an int from 0 to 4, got {partitioned_stages!r}")
        block, blocks = ARCHS[arch]
        super().__init__(block, blocks, big_stages=partitioned_stages, max_elements=max_elements,
                         num_classes=num_classes, device=device, dtype=dtype, **kwargs)
        self.arch = arch
        self.partitioned_stages = partitioned_stages

    def stages(self) -> list[list[nn.Module]]:
        """Modules of stage 0 (stem) .. 4."""
        return [[self.conv1, self.bn1, self.maxpool], [self.layer1], [self.layer2], [self.layer3],
                [self.layer4]]

    def partitioned_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the partitioned stages (their gradients are summed over ranks)."""
        mods = [m for stage in self.stages()[:self.partitioned_stages + 1] for m in stage]
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def front(self, x: torch.Tensor, part: Partition, sc: SpatialContext) -> tuple[torch.Tensor, Partition]:
        """Stages 0 .. ``partitioned_stages`` on this rank's rectangle."""
        x, part = conv2d(x.to(self.conv1.weight.dtype), part, self.conv1, sc)
        x = torch.relu_(batch_norm(x, self.bn1, sc))
        x, part = max_pool2d(x, part, self.maxpool, sc)
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4)[:self.partitioned_stages]:
            for block in layer:
                x, part = _block(block, x, part, sc)
        return x, part

    def feature_map(self, full: torch.Tensor) -> torch.Tensor:
        """Rank 0: the gathered activation through the remaining stages -> [N, feature_dim, h, w]."""
        x = self._to_device(full)
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4)[self.partitioned_stages:]:
            x = layer(x)
        return x

    def forward_sharded(self, x: torch.Tensor, part: Partition, sc: SpatialContext,
                        pool: bool = True) -> torch.Tensor:
        """This rank's input rectangle -> rank 0: logits/features ([N, ...]); other ranks: placeholder.

        ``pool=False`` returns the final feature map [N, feature_dim, h, w] on rank 0 (for a MIL head over
        its positions) instead of ``fc(avgpool(.))``.
        """
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"expected an image rectangle of shape [N, 3, h, w], got {tuple(x.shape)}")
        if tuple(x.shape[2:]) != part.shape(sc.rank):
            raise ValueError(f"rank {sc.rank} owns a {part.shape(sc.rank)} rectangle of the "
                             f"{part.height}x{part.width} input but got {tuple(x.shape[2:])}")
        y, ypart = self.front(x.cpu(), part, sc)
        full = GatherToRoot.apply(y, ypart, sc)
        if sc.rank != 0:
            return full
        fmap = self.feature_map(full)
        return fmap if not pool else self.fc(torch.flatten(self.avgpool(fmap), 1))

    def allreduce_partitioned_grads(self, sc: SpatialContext) -> None:
        """Sum the partitioned layers' gradients over the ranks (call on every rank after backward)."""
        allreduce_grads(self.partitioned_parameters(), sc)
