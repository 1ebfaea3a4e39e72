"""Small datasets written in their real on-disk formats, for the loader tests and trial runs.

    PYTHONPATH=tests python -m datafixtures OUT   # writes OUT/imagenet-lt, cifar10, inat-user, femnist, speech, imu
    PYTHONPATH=tests python -m datafixtures OUT --femnist-writers 3500   # OUT/femnist at FEMNIST's scale
"""
from __future__ import annotations

import io
import json
import sys
import wave
import zipfile
from pathlib import Path

import numpy as np


def _jpeg(path: Path, rng, size=(40, 30), tint=0) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    a = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    a[..., tint % 3] = (a[..., tint % 3] // 2) + 120  # a class-dependent colour cast
    Image.fromarray(a).save(path, "JPEG", quality=90)


def write_imagenet_lt(root: Path, counts=(12, 6, 3, 2), test_per_class=3, seed=0) -> Path:
    """ImageNet-LT's layout: train/<wnid>/<wnid>_<n>.JPEG, val/<wnid>/ILSVRC2012_val_<n>.JPEG and the
    ImageNet_LT_{train,val,test}.txt lists (``path label`` lines)."""
    rng = np.random.default_rng(seed)
    lines = {"train": [], "val": [], "test": []}
    k = 0
    for c, n in enumerate(counts):
        wnid = f"n{1440764 + c:08d}"
        for i in range(n):
            rel = f"train/{wnid}/{wnid}_{i}.JPEG"
            _jpeg(root / rel, rng, size=(40 + 4 * (i % 3), 30), tint=c)
            lines["train"].append(f"{rel} {c}")
        for split in ("val", "test"):
            for _ in range(test_per_class if split == "test" else 1):
                k += 1
                rel = f"val/{wnid}/ILSVRC2012_val_{k:08d}.JPEG"
                _jpeg(root / rel, rng, size=(30, 36), tint=c)
                lines[split].append(f"{rel} {c}")
    for split, ls in lines.items():
        (root / f"ImageNet_LT_{split}.txt").write_text("\n".join(ls) + "\n")
    return root


def write_cifar10(root: Path, per_class=100, test_per_class=10, seed=7) -> Path:
    """CIFAR-10's python version: cifar-10-batches-py/data_batch_1..5 and test_batch, pickled dicts (``data``
    uint8 [N, 3072] in channel-major order, ``labels``, ``batch_label``, ``filenames``) and batches.meta;
    ``per_class`` training images of each class spread over the five batches, each class with its own tint."""
    import pickle

    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def batch(n_per_class, label):
        y = np.repeat(np.arange(10), n_per_class)
        rng.shuffle(y)
        x = rng.integers(0, 160, (len(y), 3, 32, 32), dtype=np.uint8)
        x[np.arange(len(y)), y % 3] += (40 + 9 * y).astype(np.uint8)[:, None, None]  # a class-dependent cast
        return {"batch_label": label, "labels": y.tolist(), "data": x.reshape(len(y), 3072),
                "filenames": [f"img_{label[-1]}_{i}.png" for i in range(len(y))]}

    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch(per_class // 5, f"training batch {i} of 5"), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch(test_per_class, "testing batch 1 of 1"), f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                     "ship", "truck"], "num_cases_per_batch": 10 * per_class // 5,
                     "num_vis": 3072}, f)
    return root


def write_inat_user(root: Path, users=(("u7", 5), ("alice", 3), ("u9", 4)), classes=3, test=6, seed=1) -> Path:
    """Hsu et al.'s split files (federated_train_user_120k.csv: user_id,image_id,class,label; test.csv) and
    iNaturalist 2017 images in train_val_images/<super>/<species>/<image_id>.jpg."""
    rng = np.random.default_rng(seed)
    rows, k = ["user_id,image_id,class,label"], 0
    for u, n in users:
        for _ in range(n):
            c = int(rng.integers(classes))
            iid = f"{k:032x}"
            _jpeg(root / "train_val_images" / "Plantae" / f"species {c}" / f"{iid}.jpg", rng, tint=c)
            rows.append(f"{u},{iid},{c},{100 + c}")
            k += 1
    (root / "federated_train_user_120k.csv").write_text("\n".join(rows) + "\n")
    trows = ["image_id,class,label"]
    for i in range(test):
        iid = f"t{k:031x}"
        _jpeg(root / "train_val_images" / "Plantae" / f"species {i % classes}" / f"{iid}.jpg", rng, tint=i)
        trows.append(f"{iid},{i % classes},{100 + i % classes}")
        k += 1
    (root / "test.csv").write_text("\n".join(trows) + "\n")
    return root


def leaf_doc(users: dict[str, list[int]], seed=2, digits: int | None = None) -> dict:
    """A LEAF FEMNIST JSON document: users -> labels; images are value / 255 lists of 784 (``digits``: rounded to
    that many decimals, for smaller files)."""
    rng = np.random.default_rng(seed)
    pixels = (lambda v: v) if digits is None else (lambda v: v.round(digits))
    data = {u: {"x": [pixels(rng.integers(0, 256, 784) / 255).tolist() for _ in ys], "y": list(ys)}
            for u, ys in users.items()}
    return {"users": list(users), "num_samples": [len(v) for v in users.values()], "user_data": data}


def write_femnist(root: Path, layout="split", seed=3, writers: int = 6, per_file: int = 4, sizes=(6, 14),
                  digits: int | None = None) -> Path:
    """LEAF's femnist/data/{train,test}/*.json (``split``: each writer's last 2 samples are its test samples) or
    femnist/data/all_data/*.json (``all``): ``writers`` writers of ``sizes`` (low, high) samples, ``per_file``
    writers a file (LEAF's hold about 100). FEMNIST's scale: ``writers=3500, per_file=100``."""
    rng = np.random.default_rng(seed)
    users = {f"f{i:04d}_{10 + i}": rng.integers(0, 62, int(rng.integers(*sizes))).tolist() for i in range(writers)}
    names = list(users)
    chunks = [names[i:i + per_file] for i in range(0, len(names), per_file)]
    base = root / "data"
    if layout == "all":
        (base / "all_data").mkdir(parents=True, exist_ok=True)
        for j, chunk in enumerate(chunks):
            (base / "all_data" / f"all_data_{j}.json").write_text(
                json.dumps(leaf_doc({u: users[u] for u in chunk}, digits=digits)))
        return root
    for split in ("train", "test"):
        (base / split).mkdir(parents=True, exist_ok=True)
        for j, chunk in enumerate(chunks):
            part = {u: (users[u][:-2] if split == "train" else users[u][-2:]) for u in chunk}
            (base / split / f"all_data_{j}_niid_0_keep_0_{split}_9.json").write_text(
                json.dumps(leaf_doc(part, j, digits)))
    return root


def _wav(path: Path, samples: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(samples.astype("<i2").tobytes())


def write_speech(root: Path, per_class=4, test_per_class=1, seed=4) -> Path:
    """speech_commands_v0.02/<word>/<speaker>_nohash_<n>.wav for BalanceFL's 35 words, and the split lists."""
    from fedlt.data.speech import CLASSES

    rng = np.random.default_rng(seed)
    base = root / "speech_commands_v0.02"
    tests, vals = [], []
    t = np.arange(16000) / 16000
    for c, word in enumerate(CLASSES):
        for i in range(per_class + test_per_class + 1):
            n = 16000 if i % 3 else 8000  # some short clips (BalanceFL resizes their spectrograms)
            tone = 8000 * np.sin(2 * np.pi * (200 + 40 * c) * t[:n]) + rng.normal(0, 500, n)
            rel = f"{word}/{i:08x}_nohash_0.wav"
            _wav(base / rel, np.clip(tone, -32768, 32767))
            if i >= per_class + 1:
                tests.append(rel)
            elif i == per_class:
                vals.append(rel)
    (base / "testing_list.txt").write_text("\n".join(tests) + "\n")
    (base / "validation_list.txt").write_text("\n".join(vals) + "\n")
    (base / "_background_noise_").mkdir(exist_ok=True)
    return root


def write_imu(root: Path, people=5, per_person=12, test=16, seed=5) -> Path:
    """BalanceFL's aiot_train.npy / aiot_test.npy: pickled dicts of data ([200, 12] windows), label, person_id."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)

    def split(n, pid):
        y = rng.integers(0, 8, n)
        data = [rng.normal(y_i, 1.0, (200, 12)).astype(np.float64) for y_i in y]
        d = {"data": data, "label": y.tolist()}
        if pid is not None:
            d["person_id"] = pid
        return d

    np.save(root / "aiot_train.npy", split(people * per_person, np.repeat(np.arange(people), per_person).tolist()),
            allow_pickle=True)
    np.save(root / "aiot_test.npy", split(test, None), allow_pickle=True)
    return root


def _png(rng) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 2, (128, 128), dtype=np.uint8) * 255).save(buf, "PNG")
    return buf.getvalue()


def write_nist_zips(root: Path, seed=6) -> tuple[Path, Path, dict]:
    """NIST SD19's by_class.zip and by_write.zip: the same PNGs filed by class (hsf_* folders, plus a train_*
    folder LEAF ignores) and by writer. Returns the zips and {writer: [hex classes in file order]}."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    truth: dict[str, list[str]] = {}
    bc, bw = root / "by_class.zip", root / "by_write.zip"
    with zipfile.ZipFile(bc, "w") as zc, zipfile.ZipFile(bw, "w") as zw:
        k = 0
        for w in ("f0000_14", "f0001_41", "f0002_01"):
            for hexc in ("30", "4a", "7a"):
                png = _png(rng)
                zc.writestr(f"by_class/{hexc}/hsf_0/hsf_0_{k:05d}.png", png)
                zc.writestr(f"by_class/{hexc}/train_{hexc}/train_{hexc}_{k:05d}.png", png)
                zw.writestr(f"by_write/hsf_0/{w}/c{w}/c{w}_{k:05d}.png", png)
                truth.setdefault(w, []).append(hexc)
                k += 1
    return bc, bw, truth


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if sys.argv[2:3] == ["--femnist-writers"]:  # FEMNIST alone, at a scale: OUT --femnist-writers 3500
        write_femnist(out / "femnist", writers=int(sys.argv[3]), per_file=100, digits=3)
        print(f"wrote {sys.argv[3]} FEMNIST writers under {out / 'femnist'}")
        raise SystemExit(0)
    write_imagenet_lt(out / "imagenet-lt")
    write_cifar10(out / "cifar10")
    write_inat_user(out / "inat-user")
    write_femnist(out / "femnist")
    write_speech(out / "speech")
    write_imu(out / "imu")
    print(f"wrote fixtures under {out}")
