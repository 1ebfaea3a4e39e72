"""FEMNIST in LEAF's JSON format, and LEAF's conversion of NIST Special Database 19 into it.

A LEAF JSON file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats in 0..1],
...], "y": [labels 0..61]}}}``. LEAF's pipeline (``data/femnist/preprocess``) writes ``all_data/all_data_N.json``
(100 writers a file) and then, with ``-t sample``, ``train/`` and ``test/`` files holding each writer's
samples split 90/10. fedlt reads either; from ``all_data`` only it splits each writer's samples itself, as
LEAF's ``split_data.py -t sample --tf 0.9`` does (users with fewer than 2 samples dropped; a seeded split of
its own, so not LEAF's exact draw). Files are read in the numeric order of their names, users in file
order: that order is the training split's index space, and users are numbered 0.. in it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..registry import DATASETS
from .base import Dataset, candidate_dirs, capable
from .split import leaf_sample_split
from .store import Cache, file_signature, key_of, require_pillow

NUM_CLASSES, SIDE = 62, 28
WRITERS_PER_FILE = 100  # LEAF's MAX_WRITERS


def _numeric_order(paths):
    return sorted(paths, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])


def leaf_layout(d: Path) -> dict[str, list[Path]] | None:
    """The LEAF files under ``d``: {"train": [...], "test": [...]} or {"all": [...]}, or None."""
    for base in (d, d / "data"):
        tr, te = sorted((base / "train").glob("*.json")), sorted((base / "test").glob("*.json"))
        if tr and te:
            return {"train": _numeric_order(tr), "test": _numeric_order(te)}
        alld = sorted((base / "all_data").glob("*.json"))
        if alld:
            return {"all": _numeric_order(alld)}
    return None


def read_leaf_file(path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(user, x uint8 [n, 1, 28, 28], y int64 [n]) for every user of a LEAF FEMNIST file, checked."""
    try:
        doc = json.loads(path.read_text())
        users, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a LEAF JSON file (users, num_samples, user_data): {e}") from None
    if len(users) != len(counts):
        raise DataError(f"{path}: {len(users)} users but {len(counts)} num_samples entries")
    out = []
    for u, n in zip(users, counts):
        d = data.get(u) if isinstance(data, dict) else None
        if not isinstance(d, dict) or "x" not in d or "y" not in d:
            raise DataError(f"{path}: user {u} has no user_data with x and y")
        if not (len(d["x"]) == len(d["y"]) == n):
            raise DataError(f"{path}: user {u} has num_samples {n} but {len(d['x'])} images and {len(d['y'])} labels")
        try:
            x = np.asarray(d["x"], dtype=np.float32).reshape(n, 1, SIDE, SIDE)
            y = np.asarray(d["y"], dtype=np.int64).reshape(n)
        except (ValueError, TypeError):
            raise DataError(f"{path}: user {u}'s x must be lists of {SIDE * SIDE} numbers and y integers") from None
        if n and (x.min() < 0 or x.max() > 1):
            raise DataError(f"{path}: user {u}'s pixel values leave 0..1 (LEAF stores value / 255)")
        if n and (y.min() < 0 or y.max() >= NUM_CLASSES):
            raise DataError(f"{path}: user {u} has a label outside 0..{NUM_CLASSES - 1}")
        out.append((u, np.rint(x * 255).astype(np.uint8), y))
    return out


@DATASETS.register("femnist")
@capable(native_lt=True, natural_groups=True)
def load_femnist(data_dir: str | None = None, **_) -> Dataset:
    """FEMNIST (LEAF): 28x28 handwritten characters, 62 classes, ~3,500 writers; LEAF JSON (fedlt data fetch).

    ``--data-dir`` (or ``$FEDLT_DATA``, or their ``femnist/`` folder) holds LEAF's ``train/`` and ``test/``
    JSON folders (or ``data/train``, ``data/test``), or only ``all_data/`` (``fedlt data fetch femnist`` writes
    that from NIST SD19, as LEAF's preprocessing does). Decoded once into a cache. With ``--partition natural``
    the clients are writers, each with its own LEAF test samples as its personal test set.
    """
    dirs = candidate_dirs(data_dir, "femnist", [])
    found = next(((d, lay) for d in dirs if (lay := leaf_layout(d))), None)
    if found is None:
        raise DataError(f"femnist: no LEAF JSON (train/ and test/, or all_data/) in "
                        f"{', '.join(map(str, dirs)) or 'no data dir'}; "
                        f"run `fedlt data fetch femnist` or pass --data-dir to LEAF's data folder")
    root, layout = found
    files = [f for fs in layout.values() for f in fs]
    cache = Cache("femnist", key_of([file_signature(f) for f in files]))
    if cache.meta is None:
        _build_cache(cache, layout)
    meta = cache.meta
    names = json.loads((cache.dir / "users.json").read_text())
    return Dataset(name="femnist", x_train=cache.array("x_train"), y_train=cache.array("y_train"),
                   x_test=cache.array("x_test"), y_test=cache.array("y_test"), num_classes=NUM_CLASSES,
                   mean=(meta["mean"],), std=(meta["std"],), default_model="cnn-mcmahan",
                   train_groups=cache.array("g_train").numpy(), test_groups=cache.array("g_test").numpy(),
                   group_names=names, source=str(root))




def _build_cache(cache: Cache, layout: dict[str, list[Path]]) -> None:
    users: dict[str, int] = {}
    parts = {"train": ([], [], []), "test": ([], [], [])}

    def add(split, u, x, y):
        gid = users.setdefault(u, len(users))
        xs, ys, gs = parts[split]
        xs.append(x)
        ys.append(y)
        gs.append(np.full(len(y), gid, dtype=np.int64))

    if "all" in layout:
        rng = np.random.default_rng(0)  # the split belongs to the dataset, not to a run
        for f in layout["all"]:
            for u, x, y in read_leaf_file(f):
                tr, te = leaf_sample_split(len(y), rng)
                if len(tr):
                    add("train", u, x[tr], y[tr])
                    add("test", u, x[te], y[te])
    else:
        for split in ("train", "test"):
            for f in layout[split]:
                for u, x, y in read_leaf_file(f):
                    add(split, u, x, y)
    if not parts["train"][0]:
        raise DataError(f"femnist: the LEAF files hold no training samples ({layout})")
    cache.begin()
    try:
        arrays = {}
        for split, (xs, ys, gs) in parts.items():
            for name, chunks, dtype in (("x", xs, np.uint8), ("y", ys, np.int64), ("g", gs, np.int64)):
                shape = (sum(len(c) for c in chunks),) + ((1, SIDE, SIDE) if name == "x" else ())
                cache.write(f"{name}_{split}", chunks, dtype, shape)
                arrays[f"{name}_{split}"] = (np.dtype(dtype).name, shape)
        x = np.concatenate(parts["train"][0]).astype(np.float64) / 255
        (cache.dir / "users.json").write_text(json.dumps(list(users)))
        cache.finish(arrays, mean=float(x.mean()), std=float(x.std()))
    except BaseException:
        cache.abandon()
        raise


# ------------------------------------------------------------------------------------------- from NIST SD19
def relabel(hex_class: str) -> int:
    """LEAF's ``relabel_class``: NIST's hex ASCII code -> 0-9 digits, 10-35 upper case, 36-61 lower case."""
    if hex_class.isdigit() and int(hex_class) < 40:
        return int(hex_class) - 30
    code = int(hex_class, 16)
    return code - 55 if code <= 90 else code - 61


def to_leaf_json(by_class_zip: Path, by_write_zip: Path, out_dir: Path, progress: bool = True) -> int:
    """LEAF's FEMNIST preprocessing, from NIST SD19's ``by_class.zip`` and ``by_write.zip`` straight to
    ``out_dir/all_data/all_data_N.json`` (written to a temporary folder, renamed when complete). Returns the
    number of writers.

    As LEAF: the class of an image of ``by_write`` (writer folders) is that of the identical file (same MD5) in
    ``by_class`` (its ``hsf_*`` folders, not ``mit``); images are grouped by writer, converted to grey, shrunk to
    28x28 (``thumbnail``, Lanczos) and stored as value / 255, 100 writers a file. LEAF's ``group_by_writer.py``
    lists the first image of every writer after the first twice; that is kept, so the files match LEAF's
    counts. Files are taken in sorted path order (LEAF's follow ``os.listdir``), and Pillow's resampling has
    changed since LEAF's files were made, so pixel values can differ slightly from a LEAF-made copy.
    """
    Image = require_pillow()
    from io import BytesIO

    from tqdm.auto import tqdm

    def pngs(z: zipfile.ZipFile):
        return sorted(n for n in z.namelist() if n.lower().endswith(".png"))

    try:
        zc, zw = zipfile.ZipFile(by_class_zip), zipfile.ZipFile(by_write_zip)
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"femnist: cannot open the NIST archives: {e}") from None
    with zc, zw:
        class_of: dict[str, str] = {}
        names = [n for n in pngs(zc) if len(Path(n).parts) >= 4 and "hsf" in Path(n).parts[-2]
                 and "mit" not in Path(n).parts[-2]]
        for n in tqdm(reversed(names), total=len(names), desc="hashing by_class", disable=not progress, leave=False):
            class_of[hashlib.md5(zc.read(n)).hexdigest()] = Path(n).parts[-3]  # the first listed wins, as LEAF
        writers: list[tuple[str, list[tuple[str, str]]]] = []
        wnames = [n for n in pngs(zw) if len(Path(n).parts) >= 4]
        for n in tqdm(wnames, desc="matching by_write", disable=not progress, leave=False):
            w = Path(n).parts[-3]
            h = hashlib.md5(zw.read(n)).hexdigest()
            if h not in class_of:
                raise DataError(f"femnist: {n} of {by_write_zip.name} has no identical image in {by_class_zip.name}")
            if not writers or writers[-1][0] != w:
                writers.append((w, [(n, class_of[h])]))  # LEAF's group_by_writer lists this one twice
                if len(writers) == 1:
                    continue
            writers[-1][1].append((n, class_of[h]))
        tmp = out_dir / "all_data.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i in tqdm(range(0, len(writers), WRITERS_PER_FILE), desc="writing LEAF JSON", disable=not progress,
                      leave=False):
            doc = {"users": [], "num_samples": [], "user_data": {}}
            for w, items in writers[i: i + WRITERS_PER_FILE]:
                xs, ys = [], []
                for n, c in items:
                    with Image.open(BytesIO(zw.read(n))) as im:
                        g = im.convert("L")
                        g.thumbnail((SIDE, SIDE), Image.Resampling.LANCZOS, reducing_gap=None)
                        xs.append((np.asarray(g, dtype=np.float64).reshape(-1) / 255).tolist())
                    ys.append(relabel(c))
                doc["users"].append(w)
                doc["num_samples"].append(len(ys))
                doc["user_data"][w] = {"x": xs, "y": ys}
            (tmp / f"all_data_{i // WRITERS_PER_FILE}.json").write_text(json.dumps(doc))
    final = out_dir / "all_data"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return len(writers)
