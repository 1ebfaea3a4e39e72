"""Datasets, loaded once into in-memory tensors.

Images are kept as uint8 tensors [N, C, H, W] (the synthetic set as float32) plus int64 labels. Batches are
normalised (and, for CIFAR, augmented) on the fly as whole tensors; see :mod:`fedlt.data.transforms`.

Where files are looked for: ``--data-dir`` first, then ``$FEDLT_DATA``, then where ``fedlt data fetch`` puts
them by default (``$XDG_DATA_HOME/fedlt``, i.e. ``~/.local/share/fedlt``), each also with a sub-folder named
after the dataset, then the dataset's system location (``/usr/share/datasets/fashion-mnist`` for Fashion-MNIST,
installed by ``apt-get install dataset-fashion-mnist``). Nothing here downloads anything (see
:mod:`fedlt.data.fetch`). ImageNet-LT, iNaturalist-User, FEMNIST, Speech Commands and the IMU set have loaders
of their own (:mod:`~fedlt.data.images`, :mod:`~fedlt.data.leaf`, :mod:`~fedlt.data.speech`, :mod:`~fedlt.data.imu`).
"""
from __future__ import annotations

import gzip
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataError
from ..registry import DATASETS
from .base import Dataset, NumpyUnpickler, candidate_dirs, capable, first_complete


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
        if zero != 0 or dtype != 0x08:
            raise ValueError("bad magic")
        shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
        data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
        return data.reshape(shape).copy()
    except (OSError, ValueError, EOFError, struct.error, zlib.error) as e:
        raise DataError(f"corrupt idx file {path}: {e}; delete it and re-install or re-copy the dataset") from None


def _check_labels(y: np.ndarray, num_classes: int, where: str) -> None:
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"{where}: labels outside 0..{num_classes - 1} (found {int(y.min())}..{int(y.max())}); "
                        f"is this the right dataset?")


# class names, in label order (a CLIP text head prompts with them: fedlt.pretrained.clip_text_head)
FASHION_MNIST_CLASSES = ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                         "ankle boot")
DIGIT_CLASSES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR100_CLASSES = tuple("""apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly
camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup dinosaur dolphin
elephant flatfish forest fox girl hamster house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster man
maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain
plate poppy porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper snail snake
spider squirrel streetcar sunflower sweet_pepper table tank telephone television tiger tractor train trout tulip turtle
wardrobe whale willow_tree wolf woman worm""".split())  # the fine_label_names of cifar-100-python/meta


def _load_idx_dataset(name, data_dir, system, install_hint, mean, std, num_classes=10, class_names=()) -> Dataset:
    stems = [("xtr", "train-images-idx3-ubyte"), ("ytr", "train-labels-idx1-ubyte"),
             ("xte", "t10k-images-idx3-ubyte"), ("yte", "t10k-labels-idx1-ubyte")]
    hint = f"put the four idx files (or their .gz) there" if data_dir else install_hint
    root, found = first_complete(candidate_dirs(data_dir, name, system), [[s + ".gz", s] for _, s in stems], name,
                                 hint)
    paths = {key: p for (key, _), p in zip(stems, found)}
    parts = {key: _read_idx(p) for key, p in paths.items()}
    for key, ndim in (("xtr", 3), ("ytr", 1), ("xte", 3), ("yte", 1)):
        if parts[key].ndim != ndim:
            raise DataError(f"{name}: {paths[key]} holds a {parts[key].ndim}-D array where {ndim}-D "
                            f"{'images' if ndim == 3 else 'labels'} belong; re-install the dataset files")
    if len(parts["xtr"]) != len(parts["ytr"]) or len(parts["xte"]) != len(parts["yte"]):
        raise DataError(f"{name}: image and label files disagree in length; re-install the dataset files")
    for key in ("ytr", "yte"):
        _check_labels(parts[key], num_classes, f"{name}: {paths[key]}")
    return Dataset(
        name=name,
        x_train=torch.from_numpy(parts["xtr"]).unsqueeze(1),
        y_train=torch.from_numpy(parts["ytr"].astype(np.int64)),
        x_test=torch.from_numpy(parts["xte"]).unsqueeze(1),
        y_test=torch.from_numpy(parts["yte"].astype(np.int64)),
        num_classes=num_classes,
        mean=mean,
        std=std,
        class_names=list(class_names),
        source=str(root),
    )


@DATASETS.register("fashion-mnist")
def load_fashion_mnist(data_dir: str | None = None, **_) -> Dataset:
    """Fashion-MNIST, 60k/10k 28x28 grey images, 10 classes (idx files; Debian's dataset-fashion-mnist)."""
    return _load_idx_dataset(
        "fashion-mnist", data_dir, ["/usr/share/datasets/fashion-mnist"],
        "install it with `apt-get install -y dataset-fashion-mnist` or pass --data-dir with the four idx files",
        mean=(0.2860,), std=(0.3530,), class_names=FASHION_MNIST_CLASSES,
    )


@DATASETS.register("mnist")
def load_mnist(data_dir: str | None = None, **_) -> Dataset:
    """MNIST, 60k/10k 28x28 digits, 10 classes (idx files in --data-dir or $FEDLT_DATA)."""
    return _load_idx_dataset(
        "mnist", data_dir, [],
        "pass --data-dir (or set $FEDLT_DATA) to a folder with the four MNIST idx files",
        mean=(0.1307,), std=(0.3081,), class_names=DIGIT_CLASSES,
    )


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            d = NumpyUnpickler(f, "CIFAR batch", encoding="latin1").load()
        if not isinstance(d, dict) or "data" not in d:
            raise ValueError("not a CIFAR batch (no 'data' key)")
        return d
    except (OSError, ValueError, EOFError, TypeError, IndexError, KeyError, MemoryError, RecursionError,
            pickle.UnpicklingError, AttributeError, ImportError) as e:
        raise DataError(f"corrupt CIFAR batch file {path}: {e}; re-extract the python-version archive") from None


def _load_cifar(name: str, data_dir: str | None, folder: str, train_files, test_files, label_key, num_classes,
                class_names):
    dirs = []
    for d in candidate_dirs(data_dir, name, []):
        dirs += [d / folder, d]
    base, _ = first_complete(dirs, [[f] for f in train_files + test_files], name,
                             f"pass --data-dir to the folder that holds {folder}/ (python-version batch files), "
                             f"or run `fedlt data fetch {name}`")

    def load(files):
        xs, ys = [], []
        for f in files:
            d = _unpickle(base / f)
            try:
                x = np.asarray(d["data"], dtype=np.uint8)
                y = np.asarray(d.get(label_key), dtype=np.int64)
            except (TypeError, ValueError, OverflowError) as e:
                raise DataError(f"corrupt CIFAR batch file {base / f}: {e}; re-extract the archive") from None
            if x.ndim != 2 or x.shape[1] != 3072:
                raise DataError(f"corrupt CIFAR batch file {base / f}: data has shape {x.shape}, expected [N, 3072]")
            if y.shape != (len(x),):
                raise DataError(f"corrupt CIFAR batch file {base / f}: {len(x)} images but {y.size} '{label_key}' "
                                f"labels; re-extract the archive")
            _check_labels(y, num_classes, f"{name}: {base / f}")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(y)
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    xtr, ytr = load(train_files)
    xte, yte = load(test_files)
    return Dataset(
        name=name, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte, num_classes=num_classes,
        mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616), augment="crop-flip",
        default_model="resnet8", class_names=list(class_names), source=str(base),
    )


@DATASETS.register("cifar10")
def load_cifar10(data_dir: str | None = None, **_) -> Dataset:
    """CIFAR-10, 50k/10k 32x32 colour images, 10 classes (python batches in cifar-10-batches-py/)."""
    return _load_cifar("cifar10", data_dir, "cifar-10-batches-py",
                       [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "labels", 10, CIFAR10_CLASSES)


@DATASETS.register("cifar100")
def load_cifar100(data_dir: str | None = None, **_) -> Dataset:
    """CIFAR-100, 50k/10k 32x32 colour images, 100 fine classes (python batches in cifar-100-python/)."""
    ds = _load_cifar("cifar100", data_dir, "cifar-100-python", ["train"], ["test"], "fine_labels", 100,
                     CIFAR100_CLASSES)
    ds.mean, ds.std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    return ds


def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as its ``load_digits`` gives them (images [1797, 8, 8], targets), read from the file it
    bundles (``datasets/data/digits.csv.gz``, as its loader reads it) without importing scikit-learn, whose import
    costs a process about 2 s; its loader where that file is not found."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sk_load

        d = sk_load()
        return d.images, d.target
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


@DATASETS.register("digits")
def load_digits(data_dir: str | None = None, seed: int = 0, test_fraction: float = 0.3, **_) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 images), split into a balanced test set per class."""
    images, target = _sklearn_digits()
    x = np.clip(images * 16.0, 0, 255).astype(np.uint8)[:, None]  # 0..16 -> 0..255
    y = target.astype(np.int64)
    rng = np.random.default_rng(12345)  # fixed split, independent of the run seed
    n_test = int(min(np.bincount(y)) * test_fraction)
    test_idx = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:n_test] for c in range(10)])
    mask = np.ones(len(y), bool)
    mask[test_idx] = False
    return Dataset(
        name="digits", x_train=torch.from_numpy(x[mask]), y_train=torch.from_numpy(y[mask]),
        x_test=torch.from_numpy(x[test_idx]), y_test=torch.from_numpy(y[test_idx]), num_classes=10,
        mean=(0.30,), std=(0.38,), default_model="smallcnn", class_names=list(DIGIT_CLASSES),
        source="scikit-learn's bundled copy",
    )


@DATASETS.register("synthetic")
@capable(per_class=True)
def load_synthetic(data_dir: str | None = None, num_classes: int = 10, n_per_class: int = 600,
                   n_test_per_class: int = 100, dim: int = 64, noise: float = 1.0, **_) -> Dataset:
    """A Gaussian mixture in R^dim, shaped as 1 x 8 x 8 'images' so every model takes it. For tests."""
    side = int(round(dim ** 0.5))
    if side * side != dim:
        raise ConfigError(f"synthetic dim {dim} must be a perfect square (e.g. 64)")
    g = torch.Generator().manual_seed(2024)
    means = torch.randn(num_classes, dim, generator=g, device="cpu") * 1.5

    def draw(n):  # x = means[y] + noise * N(0, 1), built in place: one copy of the set in memory, not three
        y = torch.arange(num_classes, device="cpu").repeat_interleave(n)
        x = torch.randn(len(y), dim, generator=g, device="cpu").mul_(noise)
        for c in range(num_classes):
            x[c * n:(c + 1) * n] += means[c]
        return x.view(-1, 1, side, side).float(), y

    xtr, ytr = draw(n_per_class)
    xte, yte = draw(n_test_per_class)
    return Dataset(name="synthetic", x_train=xtr, y_train=ytr, x_test=xte, y_test=yte,
                   num_classes=num_classes, default_model="mlp", source="generated (a Gaussian mixture)")




_CACHE: dict[tuple, Dataset] = {}


def load_dataset(name: str, data_dir: str | None = None, **kw) -> Dataset:
    """Load (once per process) a registered dataset by name."""
    loader = DATASETS.get(name)
    key = (name, data_dir, tuple(sorted(kw.items())))
    if key not in _CACHE:
        _CACHE[key] = loader(data_dir=data_dir, **kw)
    return _CACHE[key]
