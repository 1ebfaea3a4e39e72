"""``fedlt data fetch``: datasets with a public canonical source, downloaded and checked against the checksum
their publisher (or the reference loaders that everyone checks against) gives.

A download streams to ``<dir>/.fetch/<file>.part`` with a progress bar, hashing as it goes. An interrupted
download leaves its ``.part``; the next fetch asks the server for the rest (an HTTP range request) and starts
over when the server does not serve ranges. A finished download is verified: on a mismatch the file is
deleted and the command ends with one line saying so. Verified files are moved into place (``os.replace``);
archives are extracted into a temporary folder that is renamed when complete, then deleted. So a dataset
folder either is complete or is not there. Nothing at test or run time needs the network: ``fedlt run`` only
reads what is on disk.

Sources (and where their checksums come from):

- ``cifar10``, ``cifar100``: the python-version archives at cs.toronto.edu (MD5s on the CIFAR page).
- ``mnist``: the four idx files, from the mirror torchvision uses (yann.lecun.com no longer serves them
  reliably); MD5s as torchvision's.
- ``fashion-mnist``: the four idx files from Zalando's S3 bucket; MD5s from its README.
- ``femnist``: NIST Special Database 19 ``by_class.zip`` and ``by_write.zip``, LEAF's sources (MD5s as checked
  by FedML/FederatedScope and other LEAF loaders; NIST publishes none); then LEAF's preprocessing
  (:func:`fedlt.data.leaf.to_leaf_json`) writes ``femnist/all_data/*.json``.
- ``speech-commands``: ``speech_commands_v0.02.tar.gz`` from download.tensorflow.org; SHA-256 from TensorFlow
  Datasets' checksums (2,428,923,189 bytes), extracted to ``speech_commands_v0.02/``.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, DataError

CHUNK = 1 << 20


@dataclass
class Remote:
    url: str
    md5: str | None = None
    sha256: str | None = None

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    def checksum(self) -> tuple[str, str]:
        return ("sha256", self.sha256) if self.sha256 else ("md5", self.md5 or "")


@dataclass
class Source:
    name: str
    folder: str  # under the data dir; where the dataset's files end up
    files: list[Remote]
    extract: str | None = None  # "tar": each archive is extracted into ``folder``
    marker: str = ""  # a path under the data dir whose presence means "fetched"
    post: Callable[[Path, list[Path]], None] | None = None  # after the downloads: (dataset folder, files)
    keep_downloads: bool = False  # the downloads are the dataset's files (idx): moved into ``folder``
    note: str = ""


def _femnist_post(folder: Path, files: list[Path]) -> None:
    from .leaf import to_leaf_json

    by = {f.name: f for f in files}
    to_leaf_json(by["by_class.zip"], by["by_write.zip"], folder)
    for f in files:
        f.unlink(missing_ok=True)


_TORONTO = "https://www.cs.toronto.edu/~kriz/"
_MNIST = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_FMNIST = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_IDX = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz"]
SOURCES: dict[str, Source] = {
    "cifar10": Source("cifar10", ".", [Remote(_TORONTO + "cifar-10-python.tar.gz",
                                              md5="c58f30108f718f92721af3b95e74349a")],
                      extract="tar", marker="cifar-10-batches-py/test_batch"),
    "cifar100": Source("cifar100", ".", [Remote(_TORONTO + "cifar-100-python.tar.gz",
                                                md5="eb9058c3a382ffc7106e4002c42a8d85")],
                       extract="tar", marker="cifar-100-python/test"),
    "mnist": Source("mnist", "mnist", [Remote(_MNIST + f, md5=m) for f, m in zip(_IDX, [
        "f68b3c2dcbeaaa9fbdd348bbdeb94873", "d53e105ee54ea40749a09fcbcd1e9432", "9fb629c4189551a2d022fa330f9573f3",
        "ec29112dd5afa0611ce80d1b7f02629c"])], keep_downloads=True, marker="mnist/t10k-labels-idx1-ubyte.gz"),
    "fashion-mnist": Source("fashion-mnist", "fashion-mnist", [Remote(_FMNIST + f, md5=m) for f, m in zip(_IDX, [
        "8d4fb7e6c68d591d4c3dfef9ec88bf0d", "25c81989df183df01b3e8a0aad5dffbe", "bef4ecab320f06d8554ea6380940ec79",
        "bb300cfdad3c16e7a12a480ee83cd310"])], keep_downloads=True, marker="fashion-mnist/t10k-labels-idx1-ubyte.gz"),
    "femnist": Source("femnist", "femnist", [
        Remote("https://s3.amazonaws.com/nist-srd/SD19/by_class.zip", md5="79572b1694a8506f2b722c7be54130c4"),
        Remote("https://s3.amazonaws.com/nist-srd/SD19/by_write.zip", md5="a29f21babf83db0bb28a2f77b2b456cb")],
        post=_femnist_post, marker="femnist/all_data",
        note="NIST SD19 (about 2 GB), then LEAF's preprocessing to femnist/all_data/*.json"),
    "speech-commands": Source("speech-commands", "speech_commands_v0.02", [Remote(
        "http://download.tensorflow.org/data/speech_commands_v0.02.tar.gz",
        sha256="af14739ee7dc311471de98f5f9d2c9191b18aedfe957f4a6ff791c709868ff58")],
        extract="tar", marker="speech_commands_v0.02/testing_list.txt", note="2.4 GB"),
}
BY_HAND = {
    "imagenet-lt": "ImageNet 2012 images (image-net.org, after registration) + the ImageNet-LT lists (Liu et al. 2019)",
    "inat-user": "iNaturalist 2017 images (visipedia/inat_comp) + Hsu et al.'s split files (google-research)",
    "imu": "BalanceFL's aiot_train/test.npy, behind a SharePoint link (no direct URL, no checksum)",
}


def _hash_file(path: Path, algo: str) -> "hashlib._Hash":
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h


def download(remote: Remote, dest: Path, progress: bool = True, timeout: float = 60.0) -> Path:
    """Download ``remote`` to ``dest`` (verified; atomically renamed into place) and return ``dest``.

    A ``dest.part`` left by an interrupted download is continued with an HTTP range request, or dropped and
    started over when the server answers with the whole file."""
    from tqdm.auto import tqdm

    algo, expected = remote.checksum()
    if dest.is_file():  # verified by an earlier fetch that stopped later on (extraction)
        if _hash_file(dest, algo).hexdigest() == expected:
            return dest
        dest.unlink()
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    req = urllib.request.Request(remote.url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the .part is already whole: verify it below
            resp = None
        else:
            raise DataError(f"download of {remote.url} failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise DataError(f"download of {remote.url} failed: {getattr(e, 'reason', e)}") from None
    h = hashlib.new(algo)
    if resp is not None:
        with resp:
            resumed = have and resp.status == 206
            if resumed:
                h = _hash_file(part, algo)
            else:
                have = 0
            length = resp.headers.get("Content-Length")
            total = have + int(length) if length is not None else None
            bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=remote.filename, disable=not progress,
                       leave=False)
            got = have
            try:
                with open(part, "ab" if resumed else "wb") as f:
                    while True:
                        block = resp.read(CHUNK)
                        if not block:
                            break
                        f.write(block)
                        h.update(block)
                        got += len(block)
                        bar.update(len(block))
            except (OSError, http.client.HTTPException) as e:  # connection dropped: the .part stays for a resume
                raise DataError(f"download of {remote.filename} interrupted after {got} bytes ({e}); run the "
                                f"command again to continue") from None
            finally:
                bar.close()
            if total is not None and got < total:
                raise DataError(f"download of {remote.filename} interrupted after {got} of {total} bytes; run the "
                                f"command again to continue")
    else:
        h = _hash_file(part, algo)
    if h.hexdigest() != expected:
        part.unlink(missing_ok=True)
        raise DataError(f"{remote.filename}: {algo} checksum mismatch (got {h.hexdigest()}, expected {expected}); "
                        f"removed the download, run the command again")
    os.replace(part, dest)
    return dest


def _extract_tar(archive: Path, into: Path) -> None:
    try:
        with tarfile.open(archive) as t:
            t.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"cannot extract {archive.name}: {e}; delete it and fetch again") from None


def fetch(name: str, data_dir: Path, progress: bool = True, echo=print) -> Path:
    """Fetch dataset ``name`` into ``data_dir``; returns the dataset's folder. Already present: nothing to do."""
    if name not in SOURCES:
        why = f": {BY_HAND[name]}" if name in BY_HAND else ""
        fetchable = ", ".join(SOURCES)
        raise ConfigError(f"{name} has no public canonical download{why}; `fedlt data fetch` knows {fetchable}")
    src = SOURCES[name]
    data_dir = Path(data_dir)
    target = data_dir / src.folder
    if src.marker and (data_dir / src.marker).exists():
        echo(f"{name}: already in {target}")
        return target
    work = data_dir / ".fetch"
    files = [download(r, work / r.filename, progress) for r in src.files]
    if src.keep_downloads:
        target.mkdir(parents=True, exist_ok=True)
        for f in files:
            os.replace(f, target / f.name)
    elif src.extract == "tar":
        tmp = work / f"{name}.extract"
        shutil.rmtree(tmp, ignore_errors=True)
        for f in files:
            _extract_tar(f, tmp)
        entries = list(tmp.iterdir())
        if src.folder == ".":  # the archive holds the dataset's own folder (CIFAR)
            for e in entries:
                dest = data_dir / e.name
                if dest.exists():
                    shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
                os.replace(e, dest)
        else:  # the archive's content is the dataset's folder (Speech Commands)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        shutil.rmtree(tmp, ignore_errors=True)
        for f in files:
            f.unlink(missing_ok=True)
    if src.post is not None:
        target.mkdir(parents=True, exist_ok=True)
        src.post(target, files)
    if work.is_dir() and not any(work.iterdir()):
        work.rmdir()
    echo(f"{name}: fetched into {target}")
    return target


@dataclass
class Presence:
    name: str
    where: str | None
    how: str
    caches: list[str] = field(default_factory=list)


MARKERS = {  # files that show a dataset is present in a folder (besides the fetch markers)
    "fashion-mnist": ["train-images-idx3-ubyte.gz", "train-images-idx3-ubyte"],
    "mnist": ["train-images-idx3-ubyte.gz", "train-images-idx3-ubyte"],
    "cifar10": ["cifar-10-batches-py/data_batch_1"], "cifar100": ["cifar-100-python/train"],
    "imagenet-lt": ["ImageNet_LT_train.txt"], "inat-user": ["test.csv"],
    "femnist": ["all_data", "train", "data/train", "data/all_data"],
    "speech-commands": ["speech_commands_v0.02/testing_list.txt", "testing_list.txt"],
    "imu": ["aiot_train.npy"],
}


def presence(data_dir: str | None = None) -> list[Presence]:
    """Where each registered dataset is found (the loaders' search order) and how to get it."""
    from ..registry import DATASETS
    from .base import candidate_dirs
    from .store import cache_root

    out = []
    system = {"fashion-mnist": ["/usr/share/datasets/fashion-mnist"]}
    caches = sorted(p.name for p in cache_root().glob("*-*") if (p / "meta.json").is_file())
    for name, _ in DATASETS.items():
        if name in ("digits", "synthetic"):
            out.append(Presence(name, "bundled" if name == "digits" else "generated", "-"))
            continue
        where = None
        for d in candidate_dirs(data_dir, name, system.get(name, [])):
            if any((d / m).exists() for m in MARKERS.get(name, [])):
                where = str(d)
                break
        how = f"fedlt data fetch {name}" if name in SOURCES else f"by hand: {BY_HAND.get(name, 'see docs/datasets.md')}"
        out.append(Presence(name, where, how, [c for c in caches if c.startswith(name + "-")]))
    return out
