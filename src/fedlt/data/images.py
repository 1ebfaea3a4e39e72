"""Image datasets read from JPEG files and split lists: ImageNet-LT and iNaturalist-User.

Both are decoded once (Pillow) into a uint8 cache (:mod:`fedlt.data.store`): each image's shorter side resized
to S = round(R * 256 / 224) (bilinear; JPEGs decoded at a reduced scale where Pillow can, never below S) and
the centre S x S crop kept, R the run's ``--image-size`` (224 by default; 64 or 112 for small runs). Training
batches are then augmented as torchvision's ImageNet recipe, on whole batches: a random resized crop (scale
0.08-1, aspect 3/4-4/3) of the cached S x S image to R x R and a horizontal flip; evaluation takes the centre
R x R crop (``Resize(256)`` + ``CenterCrop(224)`` at R = 224). The random resized crop sees the centre square
the cache kept, not the whole original image. Normalisation: ImageNet's mean and std.

The arrays are memory-mapped: a federation never holds the decoded set in RAM, and each batch reads its rows.
"""
from __future__ import annotations

import csv
import hashlib
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..registry import DATASETS
from .base import Dataset, candidate_dirs, capable, first_complete
from .store import Cache, key_of, require_pillow

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
LT_LISTS = {"train": "ImageNet_LT_train.txt", "test": "ImageNet_LT_test.txt"}


def stored_side(image_size: int) -> int:
    """S, the side of the cached centre crop, for model inputs of ``image_size`` (256 for 224)."""
    return int(round(image_size * 256 / 224))


def decode(path: str, side: int) -> np.ndarray:
    """One image as uint8 [3, side, side]: RGB, shorter side resized to ``side``, centre crop."""
    Image = require_pillow()
    with Image.open(path) as im:
        im.draft("RGB", (side, side))  # JPEG: decode at the smallest scale that is still >= side
        im = im.convert("RGB")
        w, h = im.size
        if w <= h:
            nw, nh = side, max(side, int(side * h / w))
        else:
            nw, nh = max(side, int(side * w / h)), side
        im = im.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = int(round((nw - side) / 2.0)), int(round((nh - side) / 2.0))
        im = im.crop((left, top, left + side, top + side))
        return np.ascontiguousarray(np.asarray(im, dtype=np.uint8).transpose(2, 0, 1))


def _decode_job(job: tuple[str, int, str]):
    path, side, where = job
    try:
        return decode(path, side)
    except Exception as e:  # noqa: BLE001 -- any undecodable file is the same user-facing problem
        return f"{where}: cannot decode {path} ({type(e).__name__}: {e})"


def _decoded(paths: list[str], where: list[str], side: int, what: str):
    """Decoded images in order (a process pool for large sets), each checked."""
    from tqdm.auto import tqdm

    jobs = [(p, side, w) for p, w in zip(paths, where)]
    workers = int(os.environ.get("FEDLT_DECODE_WORKERS", min(8, os.cpu_count() or 1)))
    bar = tqdm(total=len(jobs), desc=f"decoding {what}", unit="img", leave=False, disable=len(jobs) < 2000)
    if workers > 1 and len(jobs) >= 2000:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as ex:
            results = ex.map(_decode_job, jobs, chunksize=64)
            for r in results:
                bar.update(1)
                yield r
    else:
        for j in jobs:
            bar.update(1)
            yield _decode_job(j)
    bar.close()


def build_image_cache(name: str, splits: dict[str, tuple[list[str], list[str], np.ndarray]], side: int,
                      key_parts: list, extra: dict | None = None) -> Cache:
    """Decode every split's images into a cache entry (once) and return it. ``splits``: name -> (absolute
    paths, where each comes from for error messages, labels)."""
    cache = Cache(name, key_of(name, side, key_parts))
    if cache.meta is not None:
        return cache
    for split, (paths, where, _) in splits.items():  # every file must be there before anything is decoded
        for p, w in zip(paths, where):
            if not os.path.isfile(p):
                raise DataError(f"{w}: image {p} not found")
    cache.begin()
    try:
        arrays = {}
        for split, (paths, where, labels) in splits.items():
            def chunks():
                for r in _decoded(paths, where, side, f"{name} {split} ({len(paths)} images) into {cache.dir}"):
                    if isinstance(r, str):
                        raise DataError(r)
                    yield r
            shape = (len(paths), 3, side, side)
            cache.write(f"x_{split}", chunks(), np.uint8, shape)
            cache.write(f"y_{split}", [labels], np.int64, (len(labels),))
            arrays[f"x_{split}"], arrays[f"y_{split}"] = ("uint8", shape), ("int64", (len(labels),))
        cache.finish(arrays, **(extra or {}))
    except BaseException:
        cache.abandon()
        raise
    return cache


def _image_dataset(name: str, cache: Cache, num_classes: int, image_size: int, **kw) -> Dataset:
    return Dataset(name=name, x_train=cache.array("x_train"), y_train=cache.array("y_train"),
                   x_test=cache.array("x_test"), y_test=cache.array("y_test"), num_classes=num_classes,
                   mean=IMAGENET_MEAN, std=IMAGENET_STD, augment=f"rrc-flip@{image_size}", default_model="resnet50",
                   input_shape=(3, image_size, image_size), **kw)


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def read_split_list(path: Path, root: Path, max_classes: int) -> tuple[list[str], list[str], np.ndarray]:
    """An ImageNet-LT split list: lines ``relative/path.JPEG label``, paths relative to ``root``."""
    paths, where, labels = [], [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.strip().rsplit(maxsplit=1)
        try:
            label = int(parts[1])
        except (IndexError, ValueError):
            raise DataError(f"{path} line {n}: expected 'relative/path.JPEG label', got {line.strip()!r}") from None
        if not 0 <= label < max_classes:
            raise DataError(f"{path} line {n}: label {label} outside 0..{max_classes - 1}")
        paths.append(str(root / parts[0]))
        where.append(f"{path.name} line {n}")
        labels.append(label)
    if not paths:
        raise DataError(f"{path} lists no images")
    return paths, where, np.asarray(labels, dtype=np.int64)


@DATASETS.register("imagenet-lt")
@capable(native_lt=True, image_size=True)
def load_imagenet_lt(data_dir: str | None = None, image_size: int = 224, **_) -> Dataset:
    """ImageNet-LT (Liu et al. 2019): 1,000 classes, 5-1,280 train images each; JPEGs + ImageNet_LT_*.txt lists.

    ``--data-dir`` (or ``$FEDLT_DATA``, or its ``imagenet-lt/`` folder) holds ``ImageNet_LT_train.txt`` and
    ``ImageNet_LT_test.txt`` (lines ``train/n01440764/n01440764_190.JPEG 0``), and the image paths are relative
    to that folder: put or link ImageNet 2012's ``train/`` and ``val/`` (in class folders) beside the lists.
    Training split: 115,846 images in the list's line order (the partition-file index space); test: the
    balanced 50,000-image test list (``ImageNet_LT_val.txt`` is not used). Classes: the largest label + 1.
    """
    root, _ = first_complete(candidate_dirs(data_dir, "imagenet-lt", []), [[f] for f in LT_LISTS.values()],
                             "imagenet-lt", "pass --data-dir to the folder with the lists")
    splits = {s: read_split_list(root / f, root, 1000) for s, f in LT_LISTS.items()}
    num_classes = int(max(int(v[2].max()) for v in splits.values())) + 1
    side = stored_side(image_size)
    cache = build_image_cache("imagenet-lt", splits, side, [str(root.resolve())] +
                              [_sha1(root / f) for f in LT_LISTS.values()])
    return _image_dataset("imagenet-lt", cache, num_classes, image_size, source=str(root))




def _read_csv(path: Path, need: list[str]) -> list[tuple[int, dict]]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path} is not a readable CSV file: {e}") from None
    if not rows or any(c not in rows[0] for c in need):
        raise DataError(f"{path}: expected the columns {', '.join(need)} (Hsu et al.'s split files)")
    return list(enumerate(rows, 2))  # line numbers (the header is line 1)


@DATASETS.register("inat-user")
@capable(native_lt=True, natural_groups=True, image_size=True)
def load_inat_user(data_dir: str | None = None, image_size: int = 224, **_) -> Dataset:
    """iNaturalist-User (Hsu et al. 2020): iNat 2017 photos, clients = the users who took them; per-user CSV splits.

    ``--data-dir`` (or its ``inat-user/`` folder) holds the published split files of Hsu et al. (google-research
    ``federated_vision_datasets``): one ``federated_train*.csv`` (columns ``user_id,image_id,class``) and
    ``test.csv`` (``image_id,class``), and, anywhere below it, iNaturalist 2017's ``train_val_images/`` tree
    (images are found by file name, ``<image_id>.jpg``, as TFF does). Training split in CSV row order; users
    numbered in order of first appearance; with ``--partition natural`` the clients are users. FedLoGe calls
    its set iNaturalist-User-160k (160k images, 1,023 species); the split Hsu et al. publish is User-120k
    (9,275 users, 1,203 classes, 120,300 training images); either is read the same way.
    """
    dirs = candidate_dirs(data_dir, "inat-user", [])
    found = [(d, sorted(d.glob("federated_train*.csv"))) for d in dirs]
    root, trains = next(((d, t) for d, t in found if t and (d / "test.csv").is_file()), (None, []))
    if root is None:
        raise DataError(f"inat-user: federated_train*.csv and test.csv not found in "
                        f"{', '.join(map(str, dirs)) or 'no data dir'}; pass --data-dir to the split files' folder")
    if len(trains) > 1:
        raise DataError(f"inat-user: several training splits in {root} ({', '.join(t.name for t in trains)}); "
                        f"keep one per folder")
    train_rows = _read_csv(trains[0], ["user_id", "image_id", "class"])
    test_rows = _read_csv(root / "test.csv", ["image_id", "class"])
    images = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.lower().endswith(".jpg"):
                images.setdefault(f[:-4], os.path.join(dirpath, f))

    def split(rows, path):
        paths, where, labels = [], [], []
        for n, r in rows:
            try:
                label = int(r["class"])
            except ValueError:
                raise DataError(f"{path.name} line {n}: class {r['class']!r} is not an integer") from None
            if label < 0:
                raise DataError(f"{path.name} line {n}: class {label} is negative")
            if r["image_id"] not in images:
                raise DataError(f"{path.name} line {n}: image {r['image_id']}.jpg not found under {root}")
            paths.append(images[r["image_id"]])
            where.append(f"{path.name} line {n}")
            labels.append(label)
        return paths, where, np.asarray(labels, dtype=np.int64)

    splits = {"train": split(train_rows, trains[0]), "test": split(test_rows, root / "test.csv")}
    users: dict[str, int] = {}
    groups = np.asarray([users.setdefault(r["user_id"], len(users)) for _, r in train_rows], dtype=np.int64)
    num_classes = int(max(int(v[2].max()) for v in splits.values())) + 1
    cache = build_image_cache("inat-user", splits, stored_side(image_size),
                              [str(root.resolve()), _sha1(trains[0]), _sha1(root / "test.csv")])
    return _image_dataset("inat-user", cache, num_classes, image_size, train_groups=groups, group_names=list(users),
                          source=str(root))


