"""Data from the Hugging Face and Flower ecosystems: ``--dataset hf:NAME`` and ``--partition flwr:CLASS``
(``pip install 'fedlt[flwr-datasets]'``; docs/flower-datasets.md).

- ``hf:NAME``: a Hugging Face dataset with a ``train`` and a ``test`` split (``validation`` if it has no
  ``test``): a folder written by ``DatasetDict.save_to_disk``, or a dataset of the hub, read from the local HF
  cache when offline (``HF_HUB_OFFLINE=1``) and downloaded where online. Its samples come from an image column
  (PIL images or arrays, all of one size) or a column of feature vectors, its classes from a label column
  (``--image-column``, ``--label-column``; by default the first ``Image`` column and the first ``ClassLabel``
  column, else the columns named ``image``/``img`` and ``label``). The index space of ``partition.json`` is the
  train split in its stored order.
- ``flwr:CLASS``: any partitioner of ``flwr_datasets.partitioner`` (``IidPartitioner``,
  ``DirichletPartitioner``, ``PathologicalPartitioner``, ...), applied to fedlt's long-tailed training subset:
  it gets ``num_partitions`` = ``--clients``, ``partition_by="label"`` and ``seed`` = the run's seed where it
  takes them, and the rest of its arguments from ``--set partition.KEY=VALUE`` or the TOML table
  ``[partition_args]``. Rows that it leaves out belong to no client.

Both register like every other dataset and partition: this module is imported with the others of
:mod:`fedlt.data` and adds its prefixes to the registries (:meth:`fedlt.registry.Registry.add_prefix`).
"""
from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..decl import show, words
from ..errors import ConfigError, DataError
from ..registry import DATASETS, PARTITIONS, one_line
from .base import Dataset
from .partition import reads

INSTALL = "install it with: pip install 'fedlt[flwr-datasets]'"
TEST_SPLITS = ("test", "validation", "valid")


def import_optional(module: str):
    """Import ``datasets`` / ``flwr_datasets.partitioner``, or a one-line ConfigError with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"this needs the {module.split('.')[0]} package; {INSTALL}") from None


# ------------------------------------------------------------------------------------------------ hf:NAME
def open_splits(source: str):
    """The ``DatasetDict`` of a ``save_to_disk`` folder, or of the hub dataset ``source`` (the HF cache offline)."""
    datasets = import_optional("datasets")
    path = Path(source).expanduser()
    if path.exists():
        try:
            d = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError, KeyError, TypeError, IndexError, AttributeError) as e:
            # a dataset_dict.json / state.json without its keys: a KeyError of datasets' reader
            what = f"a file of it lacks the key {e}" if isinstance(e, KeyError) else one_line(e)
            raise DataError(f"hf:{source}: not a folder written by save_to_disk ({what}); write it again with "
                            f"DatasetDict.save_to_disk") from None
    else:
        try:
            d = datasets.load_dataset(source)
        except Exception as e:  # noqa: BLE001 -- hub, cache and network errors of every kind: one line
            raise DataError(f"hf:{source}: no such folder, and the hub dataset could not be loaded "
                            f"({one_line(e)}); offline, only datasets already in the HF cache load") from None
    if not isinstance(d, datasets.DatasetDict):
        raise DataError(f"hf:{source} holds one split; fedlt needs a train and a test split: save a "
                        f"DatasetDict({{'train': ..., 'test': ...}})")
    return d


def pick_column(split, asked: str | None, kind: str, source: str, feature_type: str, names: tuple[str, ...],
                exclude: str | None = None) -> str:
    """The column ``asked`` (checked), else the first of ``feature_type`` (Image / ClassLabel), else the first
    present of ``names``."""
    cols = list(split.column_names)
    if asked is not None:
        if asked not in cols:
            close = difflib.get_close_matches(asked, cols, n=1)
            raise ConfigError(f"hf:{source} has no column {asked!r}" + (f" (did you mean {close[0]!r}?)" if close
                                                                       else "") +
                              f"; its columns: {', '.join(cols)} (choose with --{kind}-column)")
        return asked
    for c in cols:
        if c != exclude and type(split.features[c]).__name__ == feature_type:
            return c
    for c in names:
        if c in cols and c != exclude:
            return c
    raise ConfigError(f"hf:{source}: no {kind} column found among {', '.join(cols)}; name it with --{kind}-column")


def column(split, name: str):
    """One column of a split, read whole: a numpy array (a list where the samples differ in shape)."""
    return split.select_columns([name]).with_format("numpy")[:][name]


def labels_of(splits: dict, name: str) -> tuple[dict[str, np.ndarray], int, list[str]]:
    """Integer labels of each split, the number of classes and their names (a ClassLabel's; strings: sorted)."""
    feat = next(iter(splits.values())).features[name]
    raw = {k: column(s, name) for k, s in splits.items()}
    if type(feat).__name__ == "ClassLabel":
        return {k: np.asarray(v, np.int64) for k, v in raw.items()}, int(feat.num_classes), list(feat.names)
    values = {k: np.asarray(v) for k, v in raw.items()}
    if all(v.dtype.kind in "iub" for v in values.values()):
        top = max(int(v.max()) for v in values.values() if len(v)) + 1
        if min(int(v.min()) for v in values.values() if len(v)) < 0:
            raise DataError(f"label column {name!r} holds negative labels; classes must be 0..C-1")
        return {k: v.astype(np.int64) for k, v in values.items()}, top, [str(c) for c in range(top)]
    if all(v.dtype.kind in "UO" for v in values.values()):
        names = sorted({str(x) for v in values.values() for x in v})
        index = {n: i for i, n in enumerate(names)}
        return {k: np.array([index[str(x)] for x in v], np.int64) for k, v in values.items()}, len(names), names
    raise DataError(f"label column {name!r} holds {values['train'].dtype} values; fedlt needs integer or "
                    f"class-name labels (choose another with --label-column)")


def samples_of(split, name: str, source: str) -> np.ndarray:
    """The column as one array [N, ...]: decoded images (PIL) or arrays, all of one shape."""
    values = column(split, name)
    if isinstance(values, list) or (isinstance(values, np.ndarray) and values.dtype == object):
        shapes = {np.asarray(v).shape for v in values}
        if len(shapes) > 1:
            a, b = sorted(shapes)[:2]
            raise DataError(f"hf:{source}: column {name!r} holds samples of different shapes ({a} and {b}); "
                            f"resize them to one size first (Dataset.map) or choose another --image-column")
        values = np.stack([np.asarray(v) for v in values]) if len(values) else np.zeros((0, 1))
    if values.dtype.kind not in "uifb":
        raise DataError(f"hf:{source}: column {name!r} holds {values.dtype} values, not images or numbers; "
                        f"choose another with --image-column")
    return values


def as_images(x: np.ndarray) -> np.ndarray:
    """[N, D] features -> [N, 1, 1, D]; [N, H, W] -> [N, 1, H, W]; channels last (1, 3 or 4) -> first."""
    if x.ndim == 2:
        return x[:, None, None, :]
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if x.ndim == 4:
        return x
    raise DataError(f"samples of shape {x.shape[1:]}: fedlt takes images (H x W, H x W x C, C x H x W) or "
                    f"feature vectors")


def channel_stats(x: np.ndarray, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of uint8 images [N, C, H, W] on the 0..1 scale, summed a chunk at
    a time (no float copy of the whole set)."""
    c = x.shape[1]
    s, s2, n = np.zeros(c), np.zeros(c), 0
    for i in range(0, len(x), chunk):
        b = x[i:i + chunk].astype(np.float64).transpose(1, 0, 2, 3).reshape(c, -1) / 255.0
        s, s2, n = s + b.sum(1), s2 + (b * b).sum(1), n + b.shape[1]
    if n == 0:
        return (0.0,) * c, (1.0,) * c
    mean = s / n
    return tuple(float(m) for m in mean), tuple(max(float(v), 1e-6) for v in np.sqrt(np.maximum(s2 / n - mean ** 2, 0)))


def load_hf(source: str, image_column: str | None = None, label_column: str | None = None) -> Dataset:
    d = open_splits(source)
    if "train" not in d:
        raise DataError(f"hf:{source} has no train split (its splits: {', '.join(d)})")
    test = next((s for s in TEST_SPLITS if s in d), None)
    if test is None:
        raise DataError(f"hf:{source} has no test split (its splits: {', '.join(d)}); add one, e.g. "
                        f"d['train'].train_test_split(test_size=0.2), and save_to_disk")
    splits = {"train": d["train"], "test": d[test]}
    label = pick_column(splits["train"], label_column, "label", source, "ClassLabel", ("label", "labels"))
    image = pick_column(splits["train"], image_column, "image", source, "Image", ("image", "img"), exclude=label)
    if image == label:
        raise ConfigError(f"hf:{source}: --image-column and --label-column both name {label!r}")
    ys, num_classes, names = labels_of(splits, label)
    present = np.unique(ys["train"])
    if len(present) < 2:  # no long tail, no classifier: --rho would become 1 without a word
        raise DataError(f"hf:{source}: the training split holds {len(present)} class of label column {label!r}; "
                        f"fedlt needs at least 2 (choose another with --label-column)")
    xs = {k: as_images(samples_of(s, image, source)) for k, s in splits.items()}
    if xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise DataError(f"hf:{source}: train samples of shape {xs['train'].shape[1:]}, test samples of shape "
                        f"{xs['test'].shape[1:]}; they must agree")
    feature = xs["train"].shape[2] == 1  # [N, 1, 1, D]: a feature vector
    if xs["train"].dtype == np.uint8:  # images: normalised on the fly, like the built-in sets
        mean, std = channel_stats(xs["train"])
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in xs.items()}
    else:  # numbers: standardised once with the training split's statistics (float32 passes through as is)
        train = xs["train"].astype(np.float32)
        mu, sd = train.mean(0, keepdims=True), train.std(0, keepdims=True) + 1e-6
        tensors = {k: torch.from_numpy(((v.astype(np.float32) - mu) / sd).astype(np.float32)) for k, v in xs.items()}
        mean, std = (0.0,), (1.0,)
    return Dataset(name=f"hf:{source}", x_train=tensors["train"], y_train=torch.from_numpy(ys["train"]),
                   x_test=tensors["test"], y_test=torch.from_numpy(ys["test"]), num_classes=num_classes,
                   mean=mean, std=std, default_model="mlp" if feature else "smallcnn", class_names=names)


def hf_dataset(source: str):
    """The loader of ``hf:SOURCE`` (nothing is read until the run loads it)."""
    def load(data_dir: str | None = None, image_column: str | None = None, label_column: str | None = None, **_):
        return load_hf(source, image_column, label_column)

    load.__doc__ = f"the Hugging Face dataset {source} (a save_to_disk folder, the HF cache or the hub)"
    load.columns = True  # --image-column / --label-column apply
    return load


DATASETS.add_prefix("hf", hf_dataset, "a Hugging Face dataset: a save_to_disk folder or a hub name")


# ------------------------------------------------------------------------------------------------ flwr:CLASS
def partitioner_classes() -> dict[str, type]:
    """Flower Datasets' horizontal partitioners by class name (the vertical ones split columns, not rows)."""
    fp = import_optional("flwr_datasets.partitioner")
    return {n: c for n, c in vars(fp).items() if isinstance(c, type) and issubclass(c, fp.Partitioner)
            and c is not fp.Partitioner and not n.startswith("Vertical") and not inspect.isabstract(c)}


def parse_value(v: Any) -> Any:
    """Text from ``--set`` as a Python value (``0.3``, ``true``, ``[10, 20]``); anything else stays text. TOML
    values pass through."""
    if not isinstance(v, str):
        return v
    low = v.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(v.strip())
    except (ValueError, SyntaxError):
        return v


def make_partitioner(name: str, cls: type, clients: int, seed: int, args: dict | None):
    """``cls`` with the run's clients, labels and seed where it takes them, and ``args``; one-line errors."""
    params = {p for p in inspect.signature(cls.__init__).parameters if p != "self"}
    kw = {k.replace("-", "_"): parse_value(v) for k, v in (args or {}).items()}
    for k in kw:
        if k == "num_partitions":
            raise ConfigError(f"partition flwr:{name}: the number of partitions is --clients ({clients}); drop "
                              f"partition.num_partitions")
        if k not in params:
            takes = sorted(params - {"num_partitions"})
            raise ConfigError(f"partition flwr:{name} has no argument {k!r} " + (
                f"(its arguments: {', '.join(takes)}); drop partition.{k} or correct its name" if takes else
                f"(it takes none but its number of partitions, which is --clients); drop partition.{k}"))
    signature = inspect.signature(cls.__init__).parameters
    for k, v in kw.items():  # the partitioner's own checks say little of a wrong type ("'>=' not supported")
        kinds = _kinds(signature[k].annotation)
        if kinds and not _fits(v, kinds):
            if _KINDS[float] in kinds:
                kinds = kinds - {_KINDS[int]}
            raise ConfigError(f"partition flwr:{name}: partition.{k} expects {words(sorted(kinds), 'or')}, got "
                              f"{show(v)} (--set partition.{k}=VALUE)")
    for k, v in (("num_partitions", clients), ("partition_by", "label"), ("seed", seed)):
        if k in params:
            kw.setdefault(k, v)
    try:
        with warnings.catch_warnings():  # its warnings are no part of fedlt's one line
            warnings.simplefilter("ignore")
            return cls(**kw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"partition flwr:{name}: {one_line(e)}") from None


_KINDS = {bool: "true or false", int: "an int", float: "a number", str: "text", type(None): "none", list: "a list"}


def _kinds(annotation) -> set[str]:
    """What a partitioner's parameter annotation allows, in words (empty: not known, anything goes)."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return set()
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if args and origin in (typing.Union, types.UnionType):
        out = set()
        for a in args:
            k = _kinds(a)
            if not k:
                return set()
            out |= k
        return out
    if annotation in _KINDS:
        return {_KINDS[annotation]}
    if origin in (list, tuple) or annotation in (list, tuple) or \
            (origin is not None and origin.__name__ in ("Sequence", "ndarray")) or annotation is np.ndarray:
        return {_KINDS[list]}
    return set()


def _fits(v, kinds: set[str]) -> bool:
    if isinstance(v, bool):
        return _KINDS[bool] in kinds
    if isinstance(v, int):
        return bool(kinds & {_KINDS[int], _KINDS[float]})
    if isinstance(v, float):
        return _KINDS[float] in kinds
    if v is None:
        return _KINDS[type(None)] in kinds
    if isinstance(v, (list, tuple)):
        return _KINDS[list] in kinds
    if isinstance(v, str):
        return _KINDS[str] in kinds
    return True


def flwr_partition(name: str):
    """The partition ``flwr:NAME``: a fedlt partition function that runs the Flower Datasets partitioner."""
    classes = partitioner_classes()
    if name not in classes:
        close = difflib.get_close_matches(name, list(classes), n=1)
        raise ConfigError(f"unknown Flower Datasets partitioner {name!r}" +
                          (f" (did you mean {close[0]!r}?)" if close else "") +
                          f"; choose one of: {', '.join(sorted(classes))}")
    cls = classes[name]

    @reads(args="partition_args")
    def part(labels, num_clients: int, num_classes: int, seed: int, args: dict | None = None, groups=None, **_):
        datasets = import_optional("datasets")
        p = make_partitioner(name, cls, num_clients, seed, args)
        columns = {"label": np.asarray(labels, np.int64), "row": np.arange(len(labels), dtype=np.int64)}
        if groups is not None:
            columns["group"] = np.asarray(groups)
        p.dataset = datasets.Dataset.from_dict(columns)
        try:
            with warnings.catch_warnings():  # Flower Datasets' warnings (redraws): fedlt says one line
                warnings.simplefilter("ignore")
                if p.num_partitions != num_clients:  # a partitioner whose sizes say how many (SizePartitioner)
                    raise ConfigError(f"partition flwr:{name} makes {p.num_partitions} partitions but the run has "
                                      f"--clients {num_clients}; make them agree")
                parts = [np.asarray(p.load_partition(k)["row"], np.int64) for k in range(num_clients)]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            least = (args or {}).get("min_partition_size", (args or {}).get("min-partition-size"))
            if least is not None and "attempts" in str(e):  # Flower blames alpha for what min_partition_size asks
                raise ConfigError(f"partition flwr:{name} could not give every client min_partition_size={least} "
                                  f"samples ({len(labels)} samples over {num_clients} clients: "
                                  f"{len(labels) // max(num_clients, 1)} each on average); lower "
                                  f"partition.min_partition_size") from None
            raise ConfigError(f"partition flwr:{name}: {one_line(e)}") from None
        every = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(np.unique(every)) < len(every):
            raise ConfigError(f"partition flwr:{name} gives a sample to two clients; fedlt's clients hold "
                              f"disjoint samples")
        return parts

    part.__doc__ = f"Flower Datasets' {name} ({cls.__module__}), after the long-tail construction"
    part.flwr_class = cls
    part.check_args = lambda clients, seed, args: make_partitioner(name, cls, clients, seed, args)
    return part


PARTITIONS.add_prefix("flwr", flwr_partition, "a Flower Datasets partitioner class, e.g. flwr:DirichletPartitioner")
