"""The convolutional benchmark models that the peer definitions lack (issue 37).

Each builder returns ``(module, inputs, input_names)`` like ../shared/peer/models_def.py's: the
module's forward returns the cross-entropy loss of 10 classes; inputs are a batch of 32 images
3 x 32 x 32 and their labels, drawn from a fixed seed. The peer's ``cnn`` (3 x [Conv3x3 no bias,
BatchNorm, ReLU, MaxPool2], Linear head) is the third CNN of the benchmarks.

- ``resnet18``: a ResNet-18-style net for 32 x 32 images: a 3x3 stem, four stages of two basic
  blocks (widths 32, 64, 128, 256: half the original's, so a step takes ~0.1-0.2 s on 2 cores),
  stride 2 and a strided 1x1 conv + BatchNorm shortcut at the first block of stages 2-4, global
  average pooling, Linear head;
- ``mobilenetv2``: a MobileNetV2-style net: a 3x3 stem, inverted residual blocks (1x1 expand,
  3x3 depthwise, 1x1 project, ReLU6, residual where shapes agree), a 1x1 head conv, global
  average pooling, Linear head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SEED = 1234
BATCH, CLASSES, SIZE = 32, 10, 32
RESNET_WIDTHS = (32, 64, 128, 256)
# MobileNetV2's (expansion, channels, blocks, stride) table, cut for 32 x 32 images.
MOBILENET_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 2, 2), (6, 64, 2, 2), (6, 96, 1, 1))
MOBILENET_STEM, MOBILENET_HEAD = 32, 320


def _inputs() -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    images = torch.randn(BATCH, 3, SIZE, SIZE, generator=gen)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen, dtype=torch.int64)
    return images, labels


def _classifier(features: Any, width: int) -> Any:
    import torch.nn as nn
    import torch.nn.functional as F

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = features
            self.fc = nn.Linear(width, CLASSES)

        def forward(self, images: Any, labels: Any) -> Any:
            pooled = F.adaptive_avg_pool2d(self.features(images), 1).flatten(1)
            return F.cross_entropy(self.fc(pooled), labels)

    return Classifier()


def build_resnet18() -> tuple[Any, tuple[Any, Any], list[str]]:
    import torch
    import torch.nn as nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = nn.Sequential()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))

    torch.manual_seed(SEED)
    layers: list[nn.Module] = [nn.Conv2d(3, RESNET_WIDTHS[0], 3, 1, 1, bias=False),
                               nn.BatchNorm2d(RESNET_WIDTHS[0]), nn.ReLU()]
    cin = RESNET_WIDTHS[0]
    for stage, width in enumerate(RESNET_WIDTHS):
        for block in range(2):
            layers.append(BasicBlock(cin, width, 2 if stage > 0 and block == 0 else 1))
            cin = width
    return _classifier(nn.Sequential(*layers), cin), _inputs(), ["images", "labels"]


def build_mobilenetv2() -> tuple[Any, tuple[Any, Any], list[str]]:
    import torch
    import torch.nn as nn

    def conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int, act: bool) -> list[nn.Module]:
        mods: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                                 nn.BatchNorm2d(cout)]
        return mods + [nn.ReLU6()] if act else mods

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = cin * expand
            mods = conv_bn(cin, hidden, 1, 1, 1, True) if expand != 1 else []
            mods += conv_bn(hidden, hidden, 3, stride, hidden, True) + conv_bn(hidden, cout, 1, 1, 1, False)
            self.body = nn.Sequential(*mods)
            self.residual = stride == 1 and cin == cout

        def forward(self, x: Any) -> Any:
            return x + self.body(x) if self.residual else self.body(x)

    torch.manual_seed(SEED)
    layers: list[nn.Module] = conv_bn(3, MOBILENET_STEM, 3, 1, 1, True)
    cin = MOBILENET_STEM
    for expand, cout, blocks, stride in MOBILENET_BLOCKS:
        for block in range(blocks):
            layers.append(InvertedResidual(cin, cout, stride if block == 0 else 1, expand))
            cin = cout
    layers += conv_bn(cin, MOBILENET_HEAD, 1, 1, 1, True)
    return _classifier(nn.Sequential(*layers), MOBILENET_HEAD), _inputs(), ["images", "labels"]


BUILDERS: dict[str, Callable[[], tuple[Any, tuple[Any, Any], list[str]]]] = {
    "resnet18": build_resnet18,
    "mobilenetv2": build_mobilenetv2,
}
