"""ResNet with bottleneck blocks (He et al., "Deep Residual Learning", 2016).

`resnet50()` with the defaults is the paper's ResNet-50: stages of 3, 4, 6 and
3 bottleneck blocks, stem width 64, 25.6 M parameters for 1000 classes.
`base_width` scales every layer's width so the same 50-layer structure can be
made cheaper (the parameter count scales with base_width squared).
`zero_init_residual` starts every block's last batch norm at zero, so each
block begins as the identity (Goyal et al., 2017); it keeps training from
scratch stable at larger learning rates.
"""

from typing import Sequence

from torch import nn

# Channels leaving a bottleneck block are this many times its inner width.
EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand, plus a shortcut."""

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            # Projection shortcut (option B of the paper) where shapes change.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks_per_stage: Sequence[int], base_width: int, num_classes: int, in_channels: int,
                 zero_init_residual: bool = False):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, base_width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(base_width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages = []
        channels = base_width
        for stage, blocks in enumerate(blocks_per_stage):
            width = base_width * 2**stage
            for block in range(blocks):
                # The first block of every stage but the first halves the resolution.
                stride = 2 if block == 0 and stage > 0 else 1
                stages.append(Bottleneck(channels, width, stride))
                channels = width * EXPANSION
                if zero_init_residual:
                    nn.init.zeros_(stages[-1].bn3.weight)
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, images):
        features = self.pool(self.stages(self.stem(images)))
        return self.fc(features.flatten(1))


def resnet50(base_width: int = 64, num_classes: int = 1000, in_channels: int = 3,
             zero_init_residual: bool = False) -> ResNet:
    return ResNet([3, 4, 6, 3], base_width, num_classes, in_channels, zero_init_residual)
