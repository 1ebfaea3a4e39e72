"""A CLIP image tower (the vision transformer of Radford et al., 2021) that loads its weights from a safetensors
file, and class text embeddings from another: the frozen teacher of CLIP2FL.

Nothing here can run code from a file: both files are read with ``safetensors`` (raw tensors and a JSON
header, no pickle, no TorchScript). The architecture is inferred from the tensors' shapes, as OpenAI's
``clip.model.build_model`` does, so any ViT-based CLIP image tower in OpenAI's layout loads:
``conv1.weight`` [width, 3, patch, patch], ``class_embedding`` [width], ``positional_embedding`` [grid^2 + 1,
width], ``ln_pre``, ``transformer.resblocks.{i}.{ln_1, attn.in_proj_weight/bias, attn.out_proj, ln_2, mlp.c_fc,
mlp.c_proj}``, ``ln_post``, ``proj`` [width, embed]; a ``visual.`` prefix (the whole model's state dict) is
stripped and every other key ignored. Heads = width // 64 (OpenAI's rule), at least 1.

Or, with the ``pretrained`` extra, a Hugging Face CLIP model for both: ``hf:openai/clip-vit-base-patch32`` (a hub
id, through the hub's cache) or ``hf:/path/to/dir``, read as safetensors (:mod:`fedlt.pretrained`): the image
tower converted to OpenAI's layout, the text embeddings computed from its text tower and the dataset's class names.

Getting the files (on a machine with the ``clip`` package and internet access; see docs/methods-guide.md)::

    import clip, torch
    from safetensors.torch import save_file
    model, _ = clip.load("ViT-B/32", device="cpu")
    save_file({k: v.float().contiguous() for k, v in model.visual.state_dict().items()}, "clip_visual.safetensors")
    with torch.no_grad():
        t = model.encode_text(clip.tokenize([f"a photo of a {c}" for c in class_names])).float()
    save_file({"text": t / t.norm(dim=-1, keepdim=True)}, "text_embeddings.safetensors")
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..data.transforms import to_model_input
from ..errors import ConfigError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, device=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, device=device)
        self.ln_1 = nn.LayerNorm(width, device=device)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(width, 4 * width, device=device)),
                                              ("gelu", QuickGELU()),
                                              ("c_proj", nn.Linear(4 * width, width, device=device))]))
        self.ln_2 = nn.LayerNorm(width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L, B, width]
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, device=None):
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads, device) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resblocks(x)


class ImageTower(nn.Module):
    """CLIP's VisionTransformer: images [B, 3, R, R] (CLIP-normalised) -> embeddings [B, embed]."""

    def __init__(self, resolution: int, patch: int, width: int, layers: int, heads: int, embed: int, device="cpu"):
        super().__init__()
        self.resolution = resolution
        self.conv1 = nn.Conv2d(3, width, patch, stride=patch, bias=False, device=device)
        grid = resolution // patch
        self.class_embedding = nn.Parameter(torch.zeros(width, device=device))
        self.positional_embedding = nn.Parameter(torch.zeros(grid * grid + 1, width, device=device))
        self.ln_pre = nn.LayerNorm(width, device=device)
        self.transformer = Transformer(width, layers, heads, device)
        self.ln_post = nn.LayerNorm(width, device=device)
        self.proj = nn.Parameter(torch.zeros(width, embed, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x).flatten(2).transpose(1, 2)  # [B, grid^2, width]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype))
        x = self.transformer(x.transpose(0, 1)).transpose(0, 1)
        return self.ln_post(x[:, 0]) @ self.proj


def read_safetensors(path: str, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing, unreadable or non-safetensors file is a one-line error."""
    if not path:
        raise ConfigError(f"{what}: no file given")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{what}: {p} not found")
    from safetensors.torch import load_file  # a core dependency (fedlt's own state files use it)

    try:
        return load_file(str(p), device="cpu")
    except Exception as e:  # noqa: BLE001 -- any unreadable file is the same user-facing problem
        raise ConfigError(f"{what}: {p} is not a readable safetensors file ({type(e).__name__})") from None


def load_image_tower(path: str, device="cpu") -> ImageTower:
    """An :class:`ImageTower` with the architecture and weights of the file (frozen, eval mode); ``path``
    ``hf:<hub id or directory>``: a Hugging Face CLIP model, read as :mod:`fedlt.pretrained` reads every model
    (safetensors only, the hub's cache, ``HF_HUB_OFFLINE``) and converted to OpenAI's layout."""
    heads = None
    if path.startswith("hf:"):
        from ..pretrained import hf_clip_as_openai

        sd, config = hf_clip_as_openai(path[3:])
        heads = int(config.get("num_attention_heads", 12))
    else:
        sd = read_safetensors(path, "CLIP image tower")
    if any(k.startswith("visual.") for k in sd):
        sd = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
    check_keys(sd, ("conv1.weight", "class_embedding", "positional_embedding", "proj"),
            f"CLIP image tower: {path}", "OpenAI's ViT layout")
    width, _, patch, _ = sd["conv1.weight"].shape
    grid = round((sd["positional_embedding"].shape[0] - 1) ** 0.5)
    layers = len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})
    tower = ImageTower(grid * patch, patch, width, layers, heads or max(width // 64, 1), sd["proj"].shape[1], device)
    return frozen_tower(tower, sd, f"CLIP image tower: {path} does not fit a ViT of width {width}, {layers} layers")


def check_keys(sd: dict[str, torch.Tensor], keys, what: str, layout: str) -> None:
    """A one-line error naming the ``keys`` a weights file lacks."""
    missing = [k for k in keys if k not in sd]
    if missing:
        raise ConfigError(f"{what} lacks {', '.join(missing)} (expected {layout})")


def frozen_tower(tower: nn.Module, sd: dict[str, torch.Tensor], misfit: str) -> nn.Module:
    """``tower`` loaded strictly with the entries of ``sd`` it has (as float32), frozen, in eval mode; a file that
    does not fit is one line, ``misfit`` and the first line of PyTorch's complaint."""
    try:
        tower.load_state_dict({k: v.float() for k, v in sd.items() if k in tower.state_dict()}, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"{misfit} ({str(e).splitlines()[0]})") from None
    return tower.eval().requires_grad_(False)


def load_text_embeddings(path: str, num_classes: int, device="cpu", class_names=()) -> torch.Tensor:
    """The file's ``text`` tensor [C, embed], L2-normalised (one row per class, in class order); ``path``
    ``hf:<a CLIP model>``: its text tower's embeddings of "a photo of a {class}" for ``class_names``
    (:func:`fedlt.pretrained.clip_text_head`, the rows of ``--head clip-text``)."""
    if path.startswith("hf:"):
        from ..pretrained import clip_text_head

        return clip_text_head(path, class_names).to(device)
    sd = read_safetensors(path, "CLIP text embeddings")
    t = sd.get("text")
    if t is None or t.dim() != 2 or t.shape[0] != num_classes:
        raise ConfigError(f"CLIP text embeddings: {path} must hold a tensor 'text' of shape [{num_classes}, embed]")
    return F.normalize(t.float(), dim=1).to(device)


def clip_input(x: torch.Tensor, mean, std, resolution: int) -> torch.Tensor:
    """A batch normalised with the dataset's ``mean``/``std`` -> CLIP's input (``fedlt.data.transforms.to_model_input``
    with CLIP's normalisation)."""
    return to_model_input(x, mean, std, resolution, CLIP_MEAN, CLIP_STD)

