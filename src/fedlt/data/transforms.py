"""Batched tensor transforms: normalisation, CIFAR augmentation (random crop with padding, flip), ImageNet-style
augmentation (random resized crop, flip; a centre crop for evaluation), all on whole uint8 batches, and the input
of a pre-trained model (:func:`to_model_input`: its size, channels and normalisation)."""
from __future__ import annotations

import torch


def to_float(x: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [B, C, H, W] -> normalised float32. Float input (synthetic data) passes through. ``mean``/``std``:
    sequences, or tensors already on ``x``'s device (see ``Prep``: no host-to-device copy per batch)."""
    if x.dtype != torch.uint8:
        return x.float()
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return (x.float().div_(255.0) - m) / s


def to_model_input(x: torch.Tensor, mean, std, size, out_mean, out_std, mode: str = "bicubic") -> torch.Tensor:
    """A batch normalised with the dataset's ``mean``/``std`` -> a pre-trained model's input: back to [0, 1], grey
    repeated to 3 channels, resized (``mode``: bicubic or bilinear, as the model's preprocessor) to ``size`` (an
    int or ``(height, width)``; kept where the batch has it already), then normalised with the model's
    ``out_mean``/``out_std``. Used by every pre-trained backbone (``fedlt.pretrained``, FedGPA's ViT, CLIP2FL's
    tower), on the batch's device."""
    dev = x.device
    m = torch.tensor(mean, dtype=x.dtype, device=dev).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=dev).view(1, -1, 1, 1)
    img = (x * s + m).clamp(0, 1)
    if img.shape[1] == 1:
        img = img.expand(-1, len(out_mean), -1, -1)
    hw = (size, size) if isinstance(size, int) else tuple(size)
    if tuple(img.shape[-2:]) != hw:
        img = torch.nn.functional.interpolate(img, size=hw, mode=mode, align_corners=False)
    cm = torch.tensor(out_mean, dtype=x.dtype, device=dev).view(1, -1, 1, 1)
    cs = torch.tensor(out_std, dtype=x.dtype, device=dev).view(1, -1, 1, 1)
    return (img - cm) / cs


def to_device(t: torch.Tensor, dev: torch.device | str) -> torch.Tensor:
    """A small CPU tensor (indices, augmentation draws) on ``dev`` without making the host wait: a copy from
    pageable memory may wait for the GPU's queue, one from pinned memory does not."""
    dev = torch.device(dev)
    if dev.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def crop_flip_draws(b: int, gen: torch.Generator, padding: int = 4) -> tuple[torch.Tensor, ...]:
    """Random crop with zero padding and horizontal flip, the random part: per sample, the offsets and whether
    to flip, drawn on the CPU from ``gen`` (the same draws whatever the device); :func:`apply_crop_flip` applies."""
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=gen, device="cpu")
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=gen, device="cpu")
    flip = torch.rand(b, generator=gen, device="cpu") < 0.5
    return dy, dx, flip


def apply_crop_flip(x: torch.Tensor, draws: tuple[torch.Tensor, ...], padding: int = 4) -> torch.Tensor:
    """Crop and flip a batch by drawn offsets and flips (one sample each), on ``x``'s device."""
    b, c, h, w = x.shape
    dev = x.device
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    dy, dx, flip = (to_device(t, dev) for t in draws)
    rows = (dy.view(b, 1) + torch.arange(h, device=dev).view(1, h))  # [b, h]
    cols = (dx.view(b, 1) + torch.arange(w, device=dev).view(1, w))  # [b, w]
    cols = torch.where(flip.view(b, 1), cols.flip(1), cols)
    bi = torch.arange(b, device=dev).view(b, 1, 1)
    out = padded.permute(0, 2, 3, 1)[bi, rows.view(b, h, 1), cols.view(b, 1, w)]  # [b, h, w, c]
    return out.permute(0, 3, 1, 2).contiguous()


def draw_augment(kind: str, b: int, gen: torch.Generator, hw: tuple[int, int]) -> tuple[torch.Tensor, ...] | None:
    """The random draws of a training augmentation for ``b`` samples of size ``hw`` (None for ``none``). Drawing
    apart from applying lets the batched executor draw each client's from its own generator, in its own order,
    and apply them to all clients' samples at once (the draws of several batches concatenate)."""
    if kind == "crop-flip":
        return crop_flip_draws(b, gen)
    if kind.startswith("rrc-flip@"):
        return (rrc_theta(b, gen, *hw),)
    return None


def apply_augment(x: torch.Tensor, kind: str, draws: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """A dataset's augmentation (``Dataset.augment``) of a stored uint8 batch, with draws from
    :func:`draw_augment`; ``draws`` None: the evaluation transform.

    - ``none``: as stored. ``crop-flip`` (CIFAR): random crop with 4-pixel padding and flip when training.
    - ``rrc-flip@R`` (ImageNet-LT, iNaturalist; samples stored as S x S centre crops, S = R * 256 / 224):
      training: a random resized crop to R x R and a flip (:func:`rrc_theta`, :func:`apply_rrc`); evaluation:
      the R x R centre crop (torchvision's ``Resize(256) + CenterCrop(224)`` at R = 224).
    """
    if kind == "crop-flip":
        return x if draws is None else apply_crop_flip(x, draws)
    if kind.startswith("rrc-flip@"):
        size = int(kind.split("@", 1)[1])
        return center_crop(x, size) if draws is None else apply_rrc(x, draws[0], size)
    return x


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """The centre ``size`` x ``size`` crop (offsets rounded as torchvision's ``center_crop``)."""
    h, w = x.shape[-2:]
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return x[..., top: top + size, left: left + size]


def rrc_theta(b: int, gen: torch.Generator, h: int, w: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
              attempts: int = 10) -> torch.Tensor:
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` + ``RandomHorizontalFlip``, the random part, for
    ``b`` samples of ``h`` x ``w``: per sample, the affine map [b, 2, 3] (CPU) from the output grid to its flipped
    box, in ``grid_sample``'s normalised coordinates (``align_corners=False``); :func:`apply_rrc` resamples.

    Per sample, up to ``attempts`` boxes of area ``U(scale) * H * W`` and aspect ``exp(U(log ratio))`` are
    drawn (all at once, on the CPU from ``gen``); the first that fits is used, else the centre box with the
    aspect clamped to ``ratio``; flipped with probability 1/2."""
    area = h * w
    cpu = dict(generator=gen, device="cpu")
    target = area * (scale[0] + (scale[1] - scale[0]) * torch.rand(b, attempts, **cpu))
    logr = torch.log(torch.tensor(ratio, dtype=torch.float32, device="cpu"))
    aspect = torch.exp(logr[0] + (logr[1] - logr[0]) * torch.rand(b, attempts, **cpu))
    cw = torch.sqrt(target * aspect).round()
    ch = torch.sqrt(target / aspect).round()
    ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((b,), -1, device="cpu"))
    pick = first.clamp_min(0).view(b, 1)
    bw, bh = cw.gather(1, pick).squeeze(1), ch.gather(1, pick).squeeze(1)
    # fallback: the whole image, aspect clamped to the ratio range, centred
    in_ratio = w / h
    fw = float(w) if in_ratio <= ratio[1] else round(h * ratio[1])
    fh = float(h) if in_ratio >= ratio[0] else round(w / ratio[0])
    use = first >= 0
    bw = torch.where(use, bw, torch.full_like(bw, fw))
    bh = torch.where(use, bh, torch.full_like(bh, fh))
    u1, u2 = torch.rand(b, **cpu), torch.rand(b, **cpu)
    top = torch.where(use, torch.floor(u1 * (h - bh + 1)), torch.round((h - bh) / 2))
    left = torch.where(use, torch.floor(u2 * (w - bw + 1)), torch.round((w - bw) / 2))
    flip = torch.rand(b, **cpu) < 0.5
    # affine map from the output grid to the box, in grid_sample's normalised coordinates (align_corners=False)
    sx = bw / w * torch.where(flip, -1.0, 1.0)
    sy = bh / h
    cx = (left + bw / 2) / w * 2 - 1
    cy = (top + bh / 2) / h * 2 - 1
    zero = torch.zeros(b, device="cpu")
    return torch.stack([torch.stack([sx, zero, cx], 1), torch.stack([zero, sy, cy], 1)], 1)


def apply_rrc(x: torch.Tensor, theta: torch.Tensor, size: int) -> torch.Tensor:
    """Resample each sample's box (``theta`` from :func:`rrc_theta`) to ``size`` x ``size`` by bilinear
    interpolation (``grid_sample``; no antialiasing, which matters little as cached images are at most 256/224
    of ``size``). Returns uint8 like the input."""
    b, c = x.shape[:2]
    grid = torch.nn.functional.affine_grid(to_device(theta, x.device), [b, c, size, size], align_corners=False)
    out = torch.nn.functional.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8) if x.dtype == torch.uint8 else out
