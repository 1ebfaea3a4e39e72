"""BalanceFL's IMU action-recognition set (8 activities, 30 people), from its own files where a user has them.

The files are public only as a SharePoint folder link in the BalanceFL repository (``dataset/IMU/Download URL``):
no direct URL and no published checksum, so ``fedlt data fetch`` cannot fetch or verify them. Download
``aiot_train.npy`` and ``aiot_test.npy`` by hand and pass their folder as ``--data-dir``.

Format, as BalanceFL's ``IMU/data/dataloader.py`` reads it: each file is a numpy object array holding a dict
with ``data`` (one [T, >= 9] array per sample: 2 s windows of 100 Hz 9-axis IMU frames, T = 200), ``label``
(0-7) and ``person_id`` (0-29). BalanceFL keeps the first 9 columns (``data_dim``) and flattens: 1,800
features. The dict is pickled inside the .npy file; it is read with an unpickler that admits only numpy
arrays, dtypes and scalars, so a crafted file cannot run code. Clients with ``--partition natural`` are the
people (BalanceFL's 30 nodes); the test set is the global one.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..registry import DATASETS
from .base import Dataset, NumpyUnpickler, candidate_dirs, capable, first_complete

DATA_DIM, FRAMES, NUM_CLASSES = 9, 200, 8
FILES = {"train": "aiot_train.npy", "test": "aiot_test.npy"}

def read_object_npy(path: Path):
    """The object inside a pickled (``allow_pickle``) .npy file, unpickling numpy types only."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = header(f)
            if dtype != np.dtype(object):
                raise ValueError(f"holds a {dtype} array, not BalanceFL's pickled dict")
            arr = NumpyUnpickler(f, "IMU file").load()
    except (OSError, ValueError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ImportError) as e:
        raise DataError(f"{path} is not BalanceFL's IMU file: {e}") from None
    obj = arr.item() if isinstance(arr, np.ndarray) and arr.size == 1 else arr
    if not isinstance(obj, dict) or not {"data", "label"} <= set(obj):
        raise DataError(f"{path} is not BalanceFL's IMU file: expected a dict with data, label and person_id")
    return obj


def _split(path: Path, need_person: bool):
    d = read_object_npy(path)
    n = len(d["data"])
    try:
        x = np.stack([np.asarray(s, dtype=np.float32)[:, :DATA_DIM] for s in d["data"]]) if n else \
            np.zeros((0, FRAMES, DATA_DIM), np.float32)
        y = np.asarray(d["label"], dtype=np.int64).reshape(-1)
        g = np.asarray(d["person_id"], dtype=np.int64).reshape(-1) if "person_id" in d else None
    except (ValueError, TypeError, IndexError) as e:
        raise DataError(f"{path}: samples must be [T, >= {DATA_DIM}] arrays with integer labels ({e})") from None
    if x.ndim != 3 or x.shape[2] != DATA_DIM:
        raise DataError(f"{path}: samples must be [T, >= {DATA_DIM}] arrays, got {x.shape[1:]}")
    if len(y) != n or (g is not None and len(g) != n) or (need_person and g is None):
        raise DataError(f"{path}: data has {n} samples but label / person_id have {len(y)} / "
                        f"{None if g is None else len(g)}")
    if n and (y.min() < 0 or y.max() >= NUM_CLASSES):
        raise DataError(f"{path}: a label is outside 0..{NUM_CLASSES - 1}")
    return torch.from_numpy(x.reshape(n, 1, x.shape[1], DATA_DIM)), torch.from_numpy(y), g


@DATASETS.register("imu")
@capable(native_lt=True, natural_groups=True)
def load_imu(data_dir: str | None = None, **_) -> Dataset:
    """BalanceFL's IMU set: 8 activities of 30 people, 200 frames x 9 axes; aiot_train/test.npy (fetched by hand).

    ``--data-dir`` (or ``$FEDLT_DATA``, or their ``imu/`` folder) holds ``aiot_train.npy`` and ``aiot_test.npy``.
    Training split in file order; long-tailed as collected (rho 24.8); ``--partition natural``: one client per
    person. Default model: the MLP.
    """
    root, _ = first_complete(candidate_dirs(data_dir, "imu", []), [[f] for f in FILES.values()], "imu",
                             "download them from the link in BalanceFL's dataset/IMU/ and pass --data-dir")
    xtr, ytr, groups = _split(root / FILES["train"], need_person=True)
    xte, yte, _ = _split(root / FILES["test"], need_person=False)
    if xtr.shape[2:] != xte.shape[2:]:
        raise DataError(f"imu: training samples are {tuple(xtr.shape[2:])}, test samples {tuple(xte.shape[2:])}")
    users = np.unique(groups)
    return Dataset(name="imu", x_train=xtr, y_train=ytr, x_test=xte, y_test=yte, num_classes=NUM_CLASSES,
                   default_model="mlp", train_groups=np.searchsorted(users, groups),
                   group_names=[str(u) for u in users], source=str(root))


