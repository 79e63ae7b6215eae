"""Plain torch.nn ResNet-18/50 used as the reference for the big-layer tests.

Written independently of ``dpgs.biglayers`` (only torch.nn modules) with torchvision's module names, so
its state dict is a torchvision-format checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class _Bottle(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != out:
            self.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class DenseResNet(nn.Module):
    def __init__(self, block, blocks, num_classes: int = 0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks, strict=True), start=1):
            mods = []
            for j in range(count):
                mods.append(block(cin, planes, 2 if (j == 0 and i > 1) else 1))
                cin = planes * block.expansion
            setattr(self, f"layer{i}", nn.Sequential(*mods))
        self.fc = nn.Linear(cin, num_classes) if num_classes else nn.Identity()

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean(dim=(2, 3)))


def dense_resnet(arch: str, num_classes: int = 0, dtype=torch.float64, seed: int = 0) -> DenseResNet:
    """A reference ResNet with random weights and non-trivial BatchNorm affine parameters/statistics."""
    torch.manual_seed(seed)
    block, blocks = {"resnet18": (_Basic, [2, 2, 2, 2]), "resnet50": (_Bottle, [3, 4, 6, 3])}[arch]
    model = DenseResNet(block, blocks, num_classes).to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.8, 1.2)
    return model
