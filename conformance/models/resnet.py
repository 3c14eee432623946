"""A ResNet-style CNN: a conv stem, two basic residual blocks (the second strided, with a 1x1
projection shortcut), BatchNorm after every convolution, global average pooling and a linear head.

Why it is built in: the image model users bring. BatchNorm's batch statistics are per shard
(each rank normalises with its own), its running statistics are buffers that a buffer rule must
keep (DDP: rank 0's broadcast before every forward), and a residual adds two paths into one
gradient. torchvision's initialisation (Kaiming for convolutions, BatchNorm weight 1 / bias 0).
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + shortcut)


class ResNet(nn.Module):
    """Images (batch, 3, 8, 8) -> logits (batch, classes)."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.fc = nn.Linear(2 * width, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x, *, rank=0, micro=0):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.layer2(self.layer1(h))
        return self.fc(h.mean(dim=(2, 3)))
