"""Big layers: train CNNs on inputs larger than accelerator memory, exactly.

Activations of big layers live in host RAM; convolutions and BatchNorm are computed on the device strip
by strip (forward and backward), ReLU and max pooling run on the host. See ``docs/biglayers.md``.
"""

from dpgs.biglayers.batchnorm import BigBatchNorm2d, BigBatchNorm2dFunction
from dpgs.biglayers.config import DEFAULT_MAX_ELEMENTS, BigConfig
from dpgs.biglayers.conv import BigConv2d, BigConv2dFunction
from dpgs.biglayers.memory import MemoryMeter
from dpgs.biglayers.planner import RowWindow, Strip, plan_strips
from dpgs.biglayers.pooling import BigMaxPool2d, BigMaxPool2dFunction
from dpgs.biglayers.resnet import BasicBlock, BigResNet, Bottleneck, default_device, resnet18, resnet50

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "BasicBlock",
    "BigBatchNorm2d",
    "BigBatchNorm2dFunction",
    "BigConfig",
    "BigConv2d",
    "BigConv2dFunction",
    "BigMaxPool2d",
    "BigMaxPool2dFunction",
    "BigResNet",
    "Bottleneck",
    "MemoryMeter",
    "RowWindow",
    "Strip",
    "default_device",
    "plan_strips",
    "resnet18",
    "resnet50",
]
