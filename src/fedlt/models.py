"""Backbones and the one model shape every method relies on: ``logits = head(backbone(x))``.

A backbone maps a batch of images ``[B, C, H, W]`` (or anything flattenable, for the MLP) to features
``[B, feature_dim]``; the head is a separate ``nn.Linear(feature_dim, num_classes)``. Methods pick
parts of the state dict by module (``head.*``, BatchNorm layers by type), never by index.

Registered names (``fedlt.registry.MODELS``): ``mlp``, ``smallcnn``, ``cnn-mcmahan``, ``resnet8``,
``resnet18``, ``resnet34``. Each registry entry is a *backbone factory* ``f(in_shape) -> backbone``;
:func:`build_model` adds the head and seeds the initialisation.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from .errors import ConfigError
from .registry import MODELS

__all__ = [
    "Model",
    "MLP",
    "SmallCNN",
    "McMahanCNN",
    "BasicBlock",
    "ResNet",
    "build_model",
    "module_param_names",
    "bn_keys",
    "head_keys",
    "backbone_keys",
]


class Model(nn.Module):
    """``backbone`` (x -> features ``[B, feature_dim]``) followed by ``head`` (features -> logits)."""

    def __init__(self, backbone: nn.Module, head: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.feature_dim = int(feature_dim)
        self.num_classes = int(num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


# ----------------------------------------------------------------------------------------------------
# Backbones
# ----------------------------------------------------------------------------------------------------


def _check_shape(in_shape, name: str) -> tuple[int, int, int]:
    try:
        c, h, w = (int(v) for v in in_shape)
    except (TypeError, ValueError):
        raise ConfigError(f"model {name!r} needs an input shape (channels, height, width), got {in_shape!r}") from None
    if min(c, h, w) < 1:
        raise ConfigError(f"model {name!r}: input shape must be positive, got {in_shape!r}")
    return c, h, w


class MLP(nn.Module):
    """Flatten, then ``Linear-ReLU`` per hidden layer (default two of 200 units); the feature is the last hidden layer."""

    def __init__(self, in_shape: tuple[int, ...], hidden: Iterable[int] = (200, 200)):
        super().__init__()
        hidden = tuple(int(h) for h in hidden)
        if not hidden:
            raise ConfigError("MLP needs at least one hidden layer")
        layers: list[nn.Module] = [nn.Flatten()]
        prev = math.prod(int(v) for v in in_shape)
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.ReLU(inplace=True)]
            prev = h
        self.net = nn.Sequential(*layers)
        self.feature_dim = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """The small CNN of BENCHMARKS.md.

    ``conv3x3(in->16, pad 1)-ReLU-maxpool2, conv3x3(16->32, pad 1)-ReLU-maxpool2, flatten, Linear(->128)-ReLU``;
    the 128-unit hidden layer is the feature. The flatten size is computed from the input shape
    (8x8 -> 32*2*2, 28x28 -> 32*7*7, 32x32 -> 32*8*8).

    With ``bn=True`` (``smallcnn-bn``) a BatchNorm layer follows each convolution and the hidden linear layer,
    before the ReLU, as in FedBN's CNNs: the variant on which FedBN differs from FedAvg.
    """

    def __init__(self, in_shape: tuple[int, int, int], width: int = 128, bn: bool = False):
        super().__init__()
        c, h, w = _check_shape(in_shape, "smallcnn")
        fh, fw = h // 2 // 2, w // 2 // 2
        if fh < 1 or fw < 1:
            raise ConfigError(f"smallcnn needs inputs of at least 4x4, got {h}x{w}")

        # smallcnn-bn: each layer's BatchNorm right after it; smallcnn: no placeholder, so its keys stay as they were
        def normed(layer, norm, n):
            return [layer, norm(n)] if bn else [layer]

        self.conv = nn.Sequential(
            *normed(nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d, 16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            *normed(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d, 32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(*normed(nn.Linear(32 * fh * fw, width), nn.BatchNorm1d, width),
                                nn.ReLU(inplace=True))
        self.feature_dim = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))


class McMahanCNN(nn.Module):
    """The CNN of McMahan et al. (2017), "Communication-efficient learning of deep networks".

    ``conv5x5(32, pad 2)-ReLU-maxpool2, conv5x5(64, pad 2)-ReLU-maxpool2, flatten, Linear(->512)-ReLU``;
    the 512-unit layer is the feature. "Same" padding keeps it valid for 8x8, 28x28 and 32x32 inputs
    (on 28x28x1 it has the paper's 1,663,370 parameters with a 10-class head).
    """

    def __init__(self, in_shape: tuple[int, int, int], width: int = 512):
        super().__init__()
        c, h, w = _check_shape(in_shape, "cnn-mcmahan")
        fh, fw = h // 2 // 2, w // 2 // 2
        if fh < 1 or fw < 1:
            raise ConfigError(f"cnn-mcmahan needs inputs of at least 4x4, got {h}x{w}")
        self.conv = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Linear(64 * fh * fw, width), nn.ReLU(inplace=True))
        self.feature_dim = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))


class BasicBlock(nn.Module):
    """``conv3x3-BN-ReLU-conv3x3-BN`` plus a shortcut (1x1 conv + BN when the shape changes), then ReLU."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
        else:
            self.shortcut = nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet backbone with BasicBlocks (as in the official FedLoGe code).

    Stem: ``conv3x3(in->widths[0], stride 1)-BN-ReLU``, no max-pool. Stage ``i`` has ``blocks[i]`` blocks of
    ``widths[i]`` channels; the first stage has stride 1, every later one stride 2. Then global average
    pooling and flatten: ``feature_dim = widths[-1]``. BatchNorm follows every convolution.

    - ResNet-8:  blocks (1, 1, 1),    widths (64, 128, 256)        -> feature 256
    - ResNet-18: blocks (2, 2, 2, 2), widths (64, 128, 256, 512)   -> feature 512
    - ResNet-34: blocks (3, 4, 6, 3), widths (64, 128, 256, 512)   -> feature 512
    """

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        blocks: Iterable[int] = (2, 2, 2, 2),
        widths: Iterable[int] = (64, 128, 256, 512),
    ):
        super().__init__()
        c, _, _ = _check_shape(in_shape, "resnet")
        blocks, widths = tuple(blocks), tuple(widths)
        if len(blocks) != len(widths) or not blocks:
            raise ConfigError("resnet: blocks and widths must be non-empty and of the same length")
        self.stem = nn.Sequential(
            nn.Conv2d(c, widths[0], 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages = []
        in_planes = widths[0]
        for i, (n, planes) in enumerate(zip(blocks, widths)):
            layers = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(BasicBlock(in_planes, planes, stride))
                in_planes = planes
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = widths[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.stages(self.stem(x))), 1)


# ----------------------------------------------------------------------------------------------------
# Registry entries: backbone factories f(in_shape) -> backbone with .feature_dim
# ----------------------------------------------------------------------------------------------------


@MODELS.register("mlp")
def _mlp(in_shape):
    """MLP: flatten, two hidden layers of 200 with ReLU; feature = last hidden layer (200)."""
    return MLP(in_shape)


@MODELS.register("smallcnn")
def _smallcnn(in_shape):
    """Small CNN of BENCHMARKS.md: conv3x3 16, pool, conv3x3 32, pool, 128-unit feature layer."""
    return SmallCNN(in_shape)


@MODELS.register("smallcnn-bn")
def _smallcnn_bn(in_shape):
    """The small CNN with BatchNorm after each conv and the feature layer (FedBN has something to keep)."""
    return SmallCNN(in_shape, bn=True)


@MODELS.register("cnn-mcmahan")
def _cnn_mcmahan(in_shape):
    """McMahan et al. 2017 CNN: conv5x5 32, pool, conv5x5 64, pool, 512-unit feature layer."""
    return McMahanCNN(in_shape)


@MODELS.register("resnet8")
def _resnet8(in_shape):
    """CIFAR-style ResNet-8: 3x3 stem, no max-pool, one BasicBlock per stage (64/128/256); feature 256."""
    return ResNet(in_shape, blocks=(1, 1, 1), widths=(64, 128, 256))


@MODELS.register("resnet18")
def _resnet18(in_shape):
    """CIFAR-style ResNet-18 (FedLoGe's CIFAR-10 model): 3x3 stem, no max-pool; feature 512."""
    return ResNet(in_shape, blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512))


@MODELS.register("resnet34")
def _resnet34(in_shape):
    """CIFAR-style ResNet-34 (FedLoGe's CIFAR-100 model): 3x3 stem, no max-pool; feature 512."""
    return ResNet(in_shape, blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512))


def build_model(
    name: str, in_shape: tuple[int, int, int], num_classes: int, seed: int | None = None
) -> Model:
    """Build the registered backbone ``name`` plus an ``nn.Linear(feature_dim, num_classes)`` head (with bias).

    With a ``seed`` the weights are a pure function of (name, in_shape, num_classes, seed): they are drawn
    inside ``torch.random.fork_rng`` from a freshly seeded CPU generator, so the caller's global RNG state is
    left exactly as it was. With ``seed=None`` the global RNG is used (and advanced) as usual.
    """
    factory = MODELS.get(name)
    if int(num_classes) < 1:
        raise ConfigError(f"num_classes must be at least 1, got {num_classes}")

    def make() -> Model:
        backbone = factory(tuple(in_shape))
        d = int(backbone.feature_dim)
        return Model(backbone, nn.Linear(d, int(num_classes)), d, int(num_classes))

    if seed is None:
        return make()
    # devices=[]: only the CPU generator is saved/restored, and only the CPU generator is seeded
    # (torch.manual_seed would also reseed CUDA generators, outside what fork_rng restores).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(seed))
        return make()


# ----------------------------------------------------------------------------------------------------
# Picking parts of the state dict
# ----------------------------------------------------------------------------------------------------

_BN_TYPES = (nn.modules.batchnorm._BatchNorm,)


def module_param_names(model: nn.Module, types) -> set[str]:
    """State-dict keys (parameters *and* persistent buffers) owned by modules that are instances of ``types``.

    Chosen by module type, not by name: e.g. ``module_param_names(m, nn.BatchNorm2d)`` gives every
    BN ``weight``, ``bias``, ``running_mean``, ``running_var`` and ``num_batches_tracked``.
    """
    if isinstance(types, list):
        types = tuple(types)
    keys = set(model.state_dict().keys())
    out: set[str] = set()
    for mname, module in model.named_modules():
        if not isinstance(module, types):
            continue
        prefix = f"{mname}." if mname else ""
        for pname, _ in module.named_parameters(recurse=False):
            out.add(prefix + pname)
        for bname, _ in module.named_buffers(recurse=False):
            out.add(prefix + bname)
    return out & keys


def bn_keys(model: nn.Module) -> set[str]:
    """State-dict keys of every BatchNorm layer (any dimensionality), found by type."""
    return module_param_names(model, _BN_TYPES)


def head_keys(model: nn.Module) -> set[str]:
    """State-dict keys under ``head.``."""
    return {k for k in model.state_dict() if k.startswith("head.")}


def backbone_keys(model: nn.Module) -> set[str]:
    """State-dict keys under ``backbone.``."""
    return {k for k in model.state_dict() if k.startswith("backbone.")}
