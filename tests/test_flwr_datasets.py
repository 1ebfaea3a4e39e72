"""Flower Datasets both ways (issue 34 item 2): fedlt's long-tailed clients as a Flower Datasets partitioner
(``fedlt.flower.datasets.LongTailPartitioner``, row for row the clients of a run's partition.json), and a
Hugging Face dataset with any Flower Datasets partitioner as a fedlt run (``--dataset hf:DIR``,
``--partition flwr:CLASS``). No network: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, telemetry off (conftest)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from fedlt.config import load_config  # noqa: E402
from fedlt.data import load_dataset  # noqa: E402
from fedlt.errors import ConfigError, DataError  # noqa: E402
from fedlt.runner.rundir import federation_for  # noqa: E402


def fedlt(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fedlt", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def as_hf(ds, image: str = "image", label: str = "label", pil: bool = True):
    """A fedlt Dataset as a Hugging Face DatasetDict (train, test): images as PIL images or uint8 arrays."""
    names = [str(c) for c in range(ds.num_classes)]
    x_feature = datasets.Image() if pil else datasets.Array2D(tuple(ds.x_train.shape[2:]), "uint8")
    feats = datasets.Features({image: x_feature, label: datasets.ClassLabel(names=names)})

    def split(x, y):
        x = x[:, 0].numpy()
        if pil:
            from PIL import Image
            x = [Image.fromarray(a) for a in x]
        return datasets.Dataset.from_dict({image: x, label: y.numpy()}, features=feats)

    return datasets.DatasetDict({"train": split(ds.x_train, ds.y_train), "test": split(ds.x_test, ds.y_test)})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """scikit-learn's digits as a save_to_disk folder: PNG images in column 'img', labels in 'digit'."""
    path = tmp_path_factory.mktemp("hf") / "digits"
    as_hf(load_dataset("digits"), image="img", label="digit").save_to_disk(str(path))
    return path


def fmnist_or_digits():
    try:
        return load_dataset("fashion-mnist")
    except DataError:  # the Debian files are not installed: the same test on digits
        return load_dataset("digits")


def test_long_tail_partitioner_gives_the_clients_of_a_runs_partition_json(tmp_path):
    from flwr_datasets import FederatedDataset

    from fedlt.flower.datasets import LongTailPartitioner

    ds = fmnist_or_digits()
    r = fedlt("run", "--dataset", ds.name, "--clients", "20", "--rounds", "1", "--local-epochs", "0",
              "--eval-every", "1", "--threads", "1", "--no-progress", "--out", str(tmp_path), "--name", "run")
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "run" / "partition.json").read_text())
    expect = [np.asarray(doc["clients"][str(k)]) for k in range(len(doc["clients"]))]
    hf = as_hf(ds, pil=False)
    # the Dataset itself, then through FederatedDataset (which shuffles the split first, by default)
    direct = LongTailPartitioner(20, imbalance_ratio=100, alpha=0.5, seed=0)
    direct.dataset = hf["train"]
    files = tmp_path / "arrow"
    hf.save_to_disk(str(files))
    fds = FederatedDataset(dataset="arrow", data_files={s: [str(p) for p in (files / s).glob("*.arrow")]
                                                       for s in ("train", "test")},
                           partitioners={"train": LongTailPartitioner(20, imbalance_ratio=100, alpha=0.5, seed=0)})
    via_fds = fds.partitioners["train"]
    fds.load_partition(0)
    stored = np.asarray(via_fds.dataset._indices.column(0).to_numpy())  # shuffled position -> stored row
    assert not np.array_equal(stored, np.arange(len(stored)))
    assert direct.num_partitions == via_fds.num_partitions == len(expect) == 20
    for k, rows in enumerate(expect):
        assert np.array_equal(direct.indices(k), rows)  # the same rows, in the same order
        assert np.array_equal(stored[via_fds.indices(k)], rows)
        part = fds.load_partition(k)
        assert len(part) == len(rows) and np.array_equal(part["label"], ds.y_train.numpy()[rows])
    used = np.concatenate(expect)
    assert len(np.unique(used)) == len(used) == sum(doc["train_counts"]) < len(ds.y_train)  # dropped: no client


@pytest.mark.parametrize("settings", [dict(partition="local-longtail", imbalance_ratio=10, alpha=1.0),
                                      dict(partition="shards", imbalance_ratio=10, shards_per_client=3, seed=2),
                                      dict(partition="flwr:DirichletPartitioner", imbalance_ratio=10, seed=1,
                                           partition_args={"alpha": 0.3, "min_partition_size": 2})])
def test_long_tail_partitioner_takes_every_partition_and_its_settings(settings):
    from fedlt.flower.datasets import LongTailPartitioner

    ds = load_dataset("digits")
    run = federation_for(load_config(None, {"dataset": "digits", "clients": 8, **settings})).train_indices()
    p = LongTailPartitioner(8, **settings)
    p.dataset = as_hf(ds, pil=False)["train"]
    assert [list(p.indices(k)) for k in range(8)] == [list(r) for r in run]


def test_long_tail_partitioner_keeps_each_path_a_user_imported_it_by():
    """``LongTailPartitioner`` moved (fedlt.flower.datasets -> fedlt.engine.flower.datasets -> back): a fresh
    interpreter importing it by either path gets the one class, a Flower Datasets partitioner."""
    code = ("from fedlt.engine.flower.datasets import LongTailPartitioner as Old\n"
            "from fedlt.flower.datasets import LongTailPartitioner as New\n"
            "from flwr_datasets.partitioner import Partitioner\n"
            "print(Old is New, issubclass(New, Partitioner), New.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "True", "fedlt.flower.datasets"], out.stderr[-2000:]


def test_long_tail_partitioner_bad_settings():
    from fedlt.flower.datasets import LongTailPartitioner

    with pytest.raises(TypeError, match="rounds"):
        LongTailPartitioner(8, rounds=3)
    with pytest.raises(ConfigError, match="alpha"):
        LongTailPartitioner(8, alpha=-1)
    with pytest.raises(ConfigError, match="unknown partition"):
        LongTailPartitioner(8, partition="dirichlett")


def test_hf_loader_reads_the_samples_and_labels_in_the_stored_order(saved):
    ref = load_dataset("digits")
    ds = load_dataset(f"hf:{saved}")  # the Image and ClassLabel columns found by their types
    assert ds.num_classes == 10 and ds.class_names == [str(c) for c in range(10)]
    for got, want in ((ds.x_train, ref.x_train), (ds.y_train, ref.y_train), (ds.x_test, ref.x_test),
                      (ds.y_test, ref.y_test)):
        assert got.dtype == want.dtype and np.array_equal(got.numpy(), want.numpy())  # PNG: lossless
    x = ref.x_train.numpy() / 255.0
    assert np.allclose(ds.mean, [x.mean()]) and np.allclose(ds.std, [x.std()])


def test_saved_hf_dataset_runs_end_to_end_and_learns(saved, tmp_path):
    r = fedlt("run", "--dataset", f"hf:{saved}", "--label-column", "digit", "--rho", "10", "--clients", "6",
              "--rounds", "10", "--eval-every", "5", "--threads", "1", "--no-progress", "--out", str(tmp_path),
              "--name", "hf")
    assert r.returncode == 0, r.stderr
    assert "GM global" in r.stdout
    summary = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["final"]["global"]["global"]["acc"] > 0.25  # 10 classes: chance is 0.1
    doc = json.loads((tmp_path / "hf" / "partition.json").read_text())
    assert doc["dataset"] == f"hf:{saved}" and doc["num_train"] == len(load_dataset("digits").y_train)


@pytest.mark.parametrize("name, args", [("IidPartitioner", {}),
                                        ("DirichletPartitioner", {"alpha": "0.3", "min_partition_size": "3"})])
def test_flower_partitioners_split_fedlts_long_tailed_subset(saved, name, args):
    cfg = lambda p, a: load_config(None, {"dataset": f"hf:{saved}", "clients": 6, "imbalance_ratio": 10,  # noqa
                                          "partition": p, "params": a})
    fedlt_parts = federation_for(cfg("iid", {})).train_indices()
    parts = federation_for(cfg(f"flwr:{name}", {f"partition.{k}": v for k, v in args.items()})).train_indices()
    every = np.concatenate(parts)
    assert len(parts) == 6 and len(np.unique(every)) == len(every)
    assert np.array_equal(np.sort(every), np.sort(np.concatenate(fedlt_parts)))  # after the long-tail construction
    sizes = [len(p) for p in parts]
    if name == "IidPartitioner":
        assert max(sizes) - min(sizes) <= 1
    else:
        assert min(sizes) >= 3 and max(sizes) > 2 * min(sizes)


def test_image_arrays_and_partition_args_from_toml(tmp_path):
    from fedlt.data.longtail import longtail_indices

    ds = load_dataset("digits")
    path = tmp_path / "arrays"
    as_hf(ds, pil=False).save_to_disk(str(path))
    (tmp_path / "run.toml").write_text(f'dataset = "hf:{path}"\nclients = 4\npartition = "flwr:ShardPartitioner"\n'
                                       f'[partition_args]\nnum_shards_per_partition = 3\n')
    cfg = load_config(str(tmp_path / "run.toml"))
    fed = federation_for(cfg)
    assert cfg.partition_args == {"num_shards_per_partition": 3} and fed.dataset.x_train.shape[1:] == (1, 8, 8)
    n_lt = len(longtail_indices(ds.y_train.numpy(), 10, cfg.imbalance_ratio, cfg.seed))
    assert list(fed.counts.sum(1)) == [3 * (n_lt // 12)] * 4  # three shards of the long-tailed subset each


@pytest.mark.parametrize("args, needle", [
    (["--image-column", "pixels"], "has no column 'pixels'"),
    (["--partition", "flwr:Dirichlet"], "did you mean 'DirichletPartitioner'"),
    (["--partition", "flwr:DirichletPartitioner", "--set", "partition.alpha=-1"], "Alpha values"),
    (["--partition", "flwr:IidPartitioner", "--set", "partition.alhpa=1"], "has no argument 'alhpa'"),
])
def test_bad_columns_and_partitioners_are_one_line_exit_2_and_write_nothing(saved, tmp_path, args, needle):
    out = tmp_path / "runs"
    r = fedlt("run", "--dataset", f"hf:{saved}", "--rounds", "1", *args, "--out", str(out), "--no-progress")
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err and not out.exists()


def test_partition_args_reach_a_flower_deployment_run_config():
    from fedlt.flower.settings import flatten, from_run_config, to_run_config

    cfg = load_config(None, {"dataset": "digits", "partition": "flwr:DirichletPartitioner", "clients": 6,
                             "params": {"partition.alpha": "0.3", "partition.min_partition_size": 3}})
    back, _ = from_run_config(flatten(to_run_config(cfg)))
    assert back.partition_args == cfg.partition_args == {"alpha": "0.3", "min_partition_size": 3}
    assert back.params == {} and federation_for(back).train_indices()[0].tolist() == \
        federation_for(cfg).train_indices()[0].tolist()
