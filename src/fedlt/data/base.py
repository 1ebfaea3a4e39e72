"""What every dataset loader shares: the in-memory :class:`Dataset`, where files are looked for
(:func:`candidate_dirs`) and the restricted unpickler for datasets published as pickles.

The loaders (:mod:`~fedlt.data.datasets` for the small built-in sets, :mod:`~fedlt.data.images`,
:mod:`~fedlt.data.leaf`, :mod:`~fedlt.data.speech`, :mod:`~fedlt.data.imu`) import this module and register
themselves in :data:`fedlt.registry.DATASETS`; :mod:`fedlt.data` installs the registry's loader that imports
them. This module imports none of them.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor  # uint8 [N, C, H, W] (float32 for synthetic)
    y_train: torch.Tensor  # int64 [N]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    augment: str = "none"  # "none", "crop-flip" (CIFAR) or "rrc-flip" (ImageNet-style; data.transforms)
    default_model: str = "smallcnn"
    class_names: list[str] = field(default_factory=list)
    # natural owners (writer / user, as integers 0..U-1, named in group_names) of the samples, or None
    train_groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None
    group_names: list[str] = field(default_factory=list)
    input_shape: tuple[int, int, int] | None = None  # model input, when stored samples are larger (crops)
    lt_n_max: int | None = None  # the head class's size of the long-tail profile when --n-max is not given
    source: str = ""  # where the samples came from: the folder the files were read from (runs print and record it)

    @property
    def in_shape(self) -> tuple[int, int, int]:
        return self.input_shape or tuple(self.x_train.shape[1:])  # type: ignore[return-value]


@dataclass(frozen=True)
class Capabilities:
    """What a dataset loader declares about its data, beyond the arrays (:func:`capable`), read by the settings
    it decides: a capability a loader does not declare is False."""

    native_lt: bool = False  # long-tailed as published: its default --lt-profile is none, exp/step are refused
    natural_groups: bool = False  # its samples come with their users: --partition natural splits by them
    image_size: bool = False  # resizes its images: --image-size applies
    per_class: bool = False  # generated with n_per_class samples a class: --synthetic-per-class applies


CAPABILITIES = tuple(f.name for f in fields(Capabilities))


def capable(**declared: bool):
    """Declare a loader's :class:`Capabilities` beside its registration, as a partition declares the settings it
    reads::

        @DATASETS.register("femnist")
        @capable(native_lt=True, natural_groups=True)
        def load_femnist(data_dir=None, **_): ...
    """
    unknown = sorted(set(declared) - set(CAPABILITIES))
    if unknown:
        raise TypeError(f"unknown dataset capabilit{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                        f"choose from {', '.join(CAPABILITIES)}")

    def deco(fn):
        fn.capabilities = Capabilities(**declared)
        return fn

    return deco


def capabilities_of(loader) -> Capabilities:
    """A loader's declared capabilities; a loader of fedlt 0.1 style that set them as its own attributes
    (``load.native_lt = True``) is read the same way."""
    caps = getattr(loader, "capabilities", None)
    if isinstance(caps, Capabilities):
        return caps
    return Capabilities(**{n: bool(getattr(loader, n, False)) for n in CAPABILITIES})


def default_data_home() -> Path:
    """Where ``fedlt data fetch`` puts datasets without ``--data-dir`` or ``$FEDLT_DATA``."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "fedlt"


def candidate_dirs(data_dir: str | None, name: str, system: list[str]) -> list[Path]:
    """The folders a dataset's files are looked for in, in order. ``data_dir`` given (``--data-dir``): that
    folder and its sub-folder ``name``, nothing else (never a silent fall-back to another copy); it must be a
    folder. Else ``$FEDLT_DATA`` and :func:`default_data_home`, each also with a sub-folder ``name``, then the
    ``system`` locations."""
    if data_dir:
        d = Path(data_dir)
        if not d.is_dir():
            raise DataError(f"--data-dir {show(data_dir)} is {'a file' if d.exists() else 'not there'}; give the "
                            f"folder that holds the {name} files")
        return [d, d / name]
    dirs: list[Path] = []
    for base in [os.environ.get("FEDLT_DATA"), default_data_home()]:
        if base:
            dirs += [Path(base), Path(base) / name]
    return dirs + [Path(p) for p in system]


def first_complete(dirs: list[Path], files: list[list[str]], name: str, hint: str) -> tuple[Path, list[Path]]:
    """The first of ``dirs`` that holds every file of ``files`` (each a list of accepted names, e.g. with and
    without ``.gz``), and the paths of those files: all from one folder, never mixed. None holds them all: a
    one-line DataError naming the files missing from the folder that holds most of them (``hint``: how to get
    them)."""
    def have(d: Path) -> list[Path | None]:
        return [next((d / n for n in names if (d / n).is_file()), None) for names in files]

    found = [(d, have(d)) for d in dirs]
    for d, paths in found:
        if all(paths):
            return d, paths  # type: ignore[return-value]
    best = max(found, key=lambda f: sum(p is not None for p in f[1]), default=None)
    if best is None or not any(best[1]):
        where = ", ".join(str(d) for d in dirs) or "no data folder"
        raise DataError(f"{name}: {files[0][0]} not found in {where}; {hint}")
    missing = [names[0] for names, p in zip(files, best[1]) if p is None]
    raise DataError(f"{name}: {best[0]} lacks {', '.join(missing)} (it holds the other "
                    f"{len(files) - len(missing)} of the {len(files)} files); {hint}")


def show(value, width: int = 60) -> str:
    """``repr(value)``, shortened to about ``width`` characters for a one-line message."""
    from ..decl import show as _show

    return _show(value, width)


class NumpyUnpickler(pickle.Unpickler):
    """Unpickles what dataset files published as pickles hold -- dicts, lists, strings, numbers and numpy arrays
    (the CIFAR python batches, BalanceFL's IMU ``.npy`` files) -- and nothing else: any other global a pickle
    names (``os.system``, ``eval``, a class) is refused before it is looked up, so a planted file cannot run
    code. ``what`` names the file kind in the one-line error."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def __init__(self, file, what: str, **kw):
        super().__init__(file, **kw)
        self.what = what

    def find_class(self, module: str, name: str):
        if (module, name) == ("_codecs", "encode"):  # bytes in a protocol-2 pickle written by Python 3
            return self._latin1_encode
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which no {self.what} holds")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):  # numpy 1 pickles, read by numpy 2
            module = "numpy._core." + module[len("numpy.core."):]
        return super().find_class(module, name)

    def _latin1_encode(self, text: str, encoding: str = "latin1") -> bytes:
        """``_codecs.encode(text, "latin1")``, the one call Python 3 writes into protocol-2 pickles to make bytes;
        any other codec name is refused (a codec is a lookup by name: nothing else is needed, so nothing else is
        allowed)."""
        if not isinstance(text, str) or encoding.lower().replace("-", "").replace("_", "") not in ("latin1",
                                                                                                  "iso88591"):
            raise pickle.UnpicklingError(f"it encodes with {encoding!r}, which no {self.what} does")
        return text.encode("latin1")


