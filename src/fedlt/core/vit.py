"""A frozen vision transformer in timm's layout (``vit_base_patch16_224`` and its relatives), loaded from a
safetensors file the user supplies, with learnable visual prompts (VPT, Jia et al., ECCV 2022): FedGPA's model.

Nothing here runs code from a file: the weights are read with ``safetensors`` (raw tensors and a JSON header)
and the architecture is inferred from their shapes, so any plain ViT in timm's layout loads:
``patch_embed.proj.weight`` [width, 3, patch, patch] (and ``.bias``), ``cls_token`` [1, 1, width], ``pos_embed``
[1, grid^2 + 1, width], ``blocks.{i}.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``; every
other key (the pre-trained ``head``) is ignored. Heads = width // 64 (ViT-B/16: 12), at least 1; GELU, LayerNorm
eps 1e-6, as timm's ViT.

Or, with the ``pretrained`` extra, a Hugging Face ViT: ``vit_weights=hf:google/vit-base-patch16-224`` (a hub id,
through the hub's cache) or ``hf:/path/to/dir`` (a ``save_pretrained`` directory), read as safetensors and
converted to timm's layout (:func:`fedlt.pretrained.hf_vit_as_timm`).

Getting the file (on a machine with ``timm`` and internet access)::

    import timm
    from safetensors.torch import save_file
    m = timm.create_model("vit_base_patch16_224", pretrained=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, "vit_b16.safetensors")

The tower's parameters are frozen and kept outside the module tree of :class:`PromptedViT` (a shared, read-only
object): a model's state dict -- what is sent, averaged and checkpointed -- holds the prompts only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..data.transforms import to_model_input
from .clip import check_keys, frozen_tower, read_safetensors


class Block(nn.Module):
    """A pre-norm transformer block in timm's layout (``norm1``, ``attn.qkv``, ``attn.proj``, ``norm2``,
    ``mlp.fc1``, ``mlp.fc2``)."""

    def __init__(self, width: int, heads: int, device="cpu", eps: float = 1e-6):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, eps=eps, device=device)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(width, 3 * width, device=device)
        self.attn.proj = nn.Linear(width, width, device=device)
        self.norm2 = nn.LayerNorm(width, eps=eps, device=device)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(width, 4 * width, device=device)
        self.mlp.fc2 = nn.Linear(4 * width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, L, width]
        B, L, D = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)
        x = x + self.attn.proj(a)
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm2(x))))


class ViTTower(nn.Module):
    """The frozen ViT: patch embedding, class token, position embedding, blocks, final norm."""

    def __init__(self, resolution: int, patch: int, width: int, depth: int, heads: int, device="cpu",
                 eps: float = 1e-6):
        super().__init__()
        self.resolution, self.width, self.depth = resolution, width, depth
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, width, patch, stride=patch, device=device)
        grid = resolution // patch
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width, device=device))
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, width, device=device))
        self.blocks = nn.ModuleList([Block(width, heads, device, eps) for _ in range(depth)])
        self.norm = nn.LayerNorm(width, eps=eps, device=device)

    def forward(self, x: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """The class token's final representation [B, width] of images ``x`` [B, 3, R, R] (ViT-normalised). With
        deep ``prompts`` [depth, P, width]: before block i its P prompt tokens are appended, after it removed."""
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        n = x.shape[1]
        for i, block in enumerate(self.blocks):
            if prompts is not None:
                x = torch.cat([x, prompts[i].expand(x.shape[0], -1, -1)], dim=1)
            x = block(x)[:, :n]
        return self.norm(x)[:, 0]


def load_vit(path: str, device="cpu") -> ViTTower:
    """A :class:`ViTTower` with the architecture and weights of the safetensors file (frozen, eval mode); ``path``
    ``hf:<hub id or directory>``: a Hugging Face ViT, read as :mod:`fedlt.pretrained` reads every model
    (safetensors only, the hub's cache, ``HF_HUB_OFFLINE``) and converted to timm's layout (its heads and
    LayerNorm epsilon from its config)."""
    heads = eps = None
    if path.startswith("hf:"):
        from ..pretrained import hf_vit_as_timm

        sd, config = hf_vit_as_timm(path[3:])
        heads, eps = int(config.get("num_attention_heads", 12)), float(config.get("layer_norm_eps", 1e-12))
    else:
        sd = read_safetensors(path, "ViT weights")
    check_keys(sd, ("patch_embed.proj.weight", "cls_token", "pos_embed", "norm.weight"), f"ViT weights: {path}",
            "timm's ViT layout")
    width, _, patch, _ = sd["patch_embed.proj.weight"].shape
    grid = round((sd["pos_embed"].shape[1] - 1) ** 0.5)
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    tower = ViTTower(grid * patch, patch, width, depth, heads or max(width // 64, 1), device, eps or 1e-6)
    return frozen_tower(tower, sd, f"ViT weights: {path} does not fit a ViT of width {width}, {depth} blocks")


class PromptedViT(nn.Module):
    """The backbone of a prompt-tuned frozen ViT: its only parameter is ``prompts`` [depth, P, width] (zeros at
    first, as the official VPT code); ``feature_dim`` is the tower's width. Input: a batch normalised with the
    dataset's ``mean``/``std``, made the tower's (back to [0, 1], grey to RGB, bicubic to its resolution, then
    ``vit_mean``/``vit_std``)."""

    def __init__(self, tower: ViTTower, tokens: int, mean, std, vit_mean, vit_std):
        super().__init__()
        object.__setattr__(self, "tower", tower)  # shared and frozen: not a sub-module, not in the state dict
        self.prompts = nn.Parameter(torch.zeros(tower.depth, tokens, tower.width, device=tower.cls_token.device))
        self.feature_dim = tower.width
        self.norms = (tuple(mean), tuple(std), tuple(vit_mean), tuple(vit_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, std, vit_mean, vit_std = self.norms
        return self.tower(to_model_input(x, mean, std, self.tower.resolution, vit_mean, vit_std), self.prompts)
