"""ResNet-18/50 whose stem and first ``big_stages`` residual stages are big layers.

Stage 0 is the stem (conv1, bn1, relu, maxpool) and stages 1-4 are ``layer1`` .. ``layer4``. Stages
``<= big_stages`` keep their activations in host RAM and compute strip by strip on the device
(``BigConv2d``, ``BigBatchNorm2d``, host-side ReLU and ``BigMaxPool2d``); the activation is moved to the
device after the last big stage and the rest of the network runs as ordinary modules there. ``big_stages``
is -1 (the dense model) to 4 (every stage big).

Module, parameter and buffer names are those of torchvision's ResNet (``conv1``, ``bn1``,
``layer1.0.conv1``, ``layer2.0.downsample.0``/``.1``, ``fc``), so torchvision checkpoints load with
``load_state_dict``. With ``num_classes=0`` the model returns the pooled features ([N, 512] for
ResNet-18, [N, 2048] for ResNet-50) and ``load_state_dict`` ignores ``fc.*`` entries.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dpgs.biglayers.batchnorm import BigBatchNorm2d
from dpgs.biglayers.config import DEFAULT_MAX_ELEMENTS, BigConfig
from dpgs.biglayers.conv import BigConv2d
from dpgs.biglayers.pooling import BigMaxPool2d


class _Layers:
    """Builds the layers of one stage, big (host-resident) or dense."""

    def __init__(self, big: bool, config: BigConfig) -> None:
        self.big, self.config = big, config

    def conv(self, cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0) -> nn.Conv2d:
        if self.big:
            return BigConv2d(cin, cout, kernel, stride, padding, bias=False, config=self.config)
        return nn.Conv2d(cin, cout, kernel, stride, padding, bias=False)

    def bn(self, channels: int) -> nn.BatchNorm2d:
        return BigBatchNorm2d(channels, config=self.config) if self.big else nn.BatchNorm2d(channels)

    def maxpool(self) -> nn.MaxPool2d:
        if self.big:
            return BigMaxPool2d(3, 2, 1, config=self.config)
        return nn.MaxPool2d(3, 2, 1)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None,
                 layers: _Layers) -> None:
        super().__init__()
        self.conv1 = layers.conv(inplanes, planes, 3, stride, 1)
        self.bn1 = layers.bn(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = layers.conv(planes, planes, 3, 1, 1)
        self.bn2 = layers.bn(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 - 3x3 (strided) - 1x1 convolutions with a residual connection (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None,
                 layers: _Layers) -> None:
        super().__init__()
        self.conv1 = layers.conv(inplanes, planes, 1)
        self.bn1 = layers.bn(planes)
        self.conv2 = layers.conv(planes, planes, 3, stride, 1)
        self.bn2 = layers.bn(planes)
        self.conv3 = layers.conv(planes, planes * self.expansion, 1)
        self.bn3 = layers.bn(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class BigResNet(nn.Module):
    """ResNet with big stem/stages (see module docstring).

    Args:
        block: ``BasicBlock`` or ``Bottleneck``.
        blocks: number of blocks in each of the four stages.
        big_stages: -1 (dense) .. 4; stages 0 (stem) .. ``big_stages`` are big layers.
        max_elements: budget of the largest device tensor of one strip of any big layer.
        num_classes: size of the ``fc`` output; 0 returns pooled features.
        device: compute device (default: CUDA if available, else CPU).
        zero_init_residual: zero the last BatchNorm weight of every block (as torchvision's option).
        storage_dtype: dtype of host-resident activations (``None``: the input dtype).
        channels_last: channels-last host activations (faster strips on CPU and CUDA).
        overlap: double-buffered asynchronous staging on CUDA.
        dtype: parameter dtype (e.g. ``torch.float64`` for exactness checks).
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], blocks: list[int], *,
                 big_stages: int = 0,
                 max_elements: int = DEFAULT_MAX_ELEMENTS, num_classes: int = 0, device=None,
                 zero_init_residual: bool = False, storage_dtype: torch.dtype | None = None,
                 channels_last: bool = True, overlap: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        if isinstance(big_stages, bool) or not isinstance(big_stages, int) or not -1 <= big_stages <= 4:
            raise ValueError(
                f"big_stages must be an int from -1 (dense) to 4 (all stages), got {big_stages!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {num_classes!r}")
        device = torch.device(device) if device is not None else default_device()
        self.big_stages = big_stages
        self.num_classes = num_classes
        self.big_config = BigConfig(max_elements, storage_dtype, channels_last, overlap)
        stage = [_Layers(big_stages >= i, self.big_config) for i in range(5)]

        self.inplanes = 64
        self.conv1 = stage[0].conv(3, 64, 7, 2, 3)
        self.bn1 = stage[0].bn(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = stage[0].maxpool()
        self.layer1 = self._make_layer(block, 64, blocks[0], 1, stage[1])
        self.layer2 = self._make_layer(block, 128, blocks[1], 2, stage[2])
        self.layer3 = self._make_layer(block, 256, blocks[2], 2, stage[3])
        self.layer4 = self._make_layer(block, 512, blocks[3], 2, stage[4])
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.feature_dim = 512 * block.expansion
        self.fc = nn.Linear(self.feature_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights(zero_init_residual)
        self.to(device=device, dtype=dtype)

    def _make_layer(self, block, planes: int, count: int, stride: int, layers: _Layers) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                layers.conv(self.inplanes, planes * block.expansion, 1, stride),
                layers.bn(planes * block.expansion),
            )
        mods = [block(self.inplanes, planes, stride, downsample, layers)]
        self.inplanes = planes * block.expansion
        mods += [block(self.inplanes, planes, 1, None, layers) for _ in range(1, count)]
        return nn.Sequential(*mods)

    def _init_weights(self, zero_init_residual: bool) -> None:
        """He-normal (fan-out) convolutions, unit/zero BatchNorm affine, as torchvision's ResNet."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)
                elif isinstance(m, BasicBlock):
                    nn.init.zeros_(m.bn2.weight)

    @property
    def device(self) -> torch.device:
        return self.conv1.weight.device

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.device, dtype=self.conv1.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] images (host or device) -> [N, num_classes] logits or [N, feature_dim] features."""
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"BigResNet expects images of shape [N, 3, H, W], got {tuple(x.shape)}")
        x = x.cpu() if self.big_stages >= 0 else self._to_device(x)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        if self.big_stages == 0:
            x = self._to_device(x)
        for i, layer in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), start=1):
            x = layer(x)
            if i == self.big_stages:
                x = self._to_device(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """``nn.Module.load_state_dict``; a feature extractor (``num_classes=0``) drops ``fc.*`` entries."""
        if self.num_classes == 0:
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith("fc.")}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def memory_stats(self) -> dict[str, int]:
        """Peak device-side elements held by the big layers since the last reset (see ``MemoryMeter``)."""
        return self.big_config.meter.as_dict()

    def reset_memory_stats(self) -> None:
        self.big_config.meter.reset()


def resnet18(*, big_stages: int = 0, max_elements: int = DEFAULT_MAX_ELEMENTS, num_classes: int = 0,
             device=None, **kwargs) -> BigResNet:
    """ResNet-18 with ``big_stages`` big stages (see ``BigResNet`` for the other options)."""
    return BigResNet(BasicBlock, [2, 2, 2, 2], big_stages=big_stages, max_elements=max_elements,
                     num_classes=num_classes, device=device, **kwargs)


def resnet50(*, big_stages: int = 0, max_elements: int = DEFAULT_MAX_ELEMENTS, num_classes: int = 0,
             device=None, **kwargs) -> BigResNet:
    """ResNet-50 with ``big_stages`` big stages (see ``BigResNet`` for the other options)."""
    return BigResNet(Bottleneck, [3, 4, 6, 3], big_stages=big_stages, max_elements=max_elements,
                     num_classes=num_classes, device=device, **kwargs)
