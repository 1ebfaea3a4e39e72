"""Long-tail construction, partitions, per-client test sets, loaders and augmentation."""
from __future__ import annotations

import gzip
import pickle
import struct
import sys

import numpy as np
import pytest
import torch

from fedlt.data.datasets import load_dataset, _CACHE
from fedlt.data.federated import client_test_index
from fedlt.data.longtail import exp_profile, longtail_indices, step_profile
from fedlt.data.partition import count_matrix, partition
from fedlt.data.transforms import apply_crop_flip, crop_flip_draws
from fedlt.errors import ConfigError, DataError


def balanced_labels(C=10, n=500):
    return np.repeat(np.arange(C), n)


def test_exp_profile_matches_formula_and_ratio():
    counts = exp_profile(10, 6000, 100.0)
    assert counts[0] == 6000 and counts[-1] == 60
    assert np.all(np.diff(counts) < 0)
    expected = np.floor(6000 * 100.0 ** (-np.arange(10) / 9))
    assert np.array_equal(counts, expected.astype(int))


def test_ratio_below_one_is_rejected_with_inverse_hint():
    with pytest.raises(ConfigError, match="did you mean 100"):
        exp_profile(10, 6000, 0.01)


def test_step_profile_has_exactly_the_tail_classes():
    counts = step_profile(10, 1000, 100.0, num_tail=3, seed=1)
    assert sorted(np.unique(counts).tolist()) == [10, 1000]
    assert (counts == 10).sum() == 3


def test_longtail_indices_are_a_pure_function_with_profile_counts():
    y = balanced_labels()
    a = longtail_indices(y, 10, 50.0, seed=3)
    b = longtail_indices(y, 10, 50.0, seed=3)
    c = longtail_indices(y, 10, 50.0, seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(np.bincount(y[a], minlength=10), exp_profile(10, 500, 50.0))


@pytest.mark.parametrize("name,kw", [("dirichlet", {"alpha": 0.5}), ("shards", {"shards_per_client": 2}),
                                     ("iid", {}), ("tau", {"tau": 2.0})])
def test_partitions_cover_every_sample_once_and_depend_only_on_seed(name, kw):
    y = balanced_labels()[longtail_indices(balanced_labels(), 10, 20.0, 0)]
    parts = partition(name, y, 8, 10, seed=5, **kw)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(y) and len(np.unique(allidx)) == len(y)
    again = partition(name, y, 8, 10, seed=5, **kw)
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))


def test_dirichlet_small_alpha_is_more_skewed_than_large_alpha():
    y = balanced_labels()
    def skew(alpha):
        m = count_matrix(y, partition("dirichlet", y, 10, 10, seed=0, alpha=alpha), 10)
        p = m / m.sum(1, keepdims=True)
        return float((p.max(1)).mean())
    assert skew(0.1) > skew(100.0) + 0.2


def test_dirichlet_min_size_gives_up_with_a_message_instead_of_looping():
    y = balanced_labels(10, 20)
    with pytest.raises(ConfigError, match="min-client-size"):
        partition("dirichlet", y, 20, 10, seed=0, alpha=0.01, min_size=9, max_tries=3)


def test_dirichlet_rejects_nonpositive_alpha():
    with pytest.raises(ConfigError, match="alpha"):
        partition("dirichlet", balanced_labels(), 4, 10, seed=0, alpha=0.0)


def test_shards_give_each_client_at_most_s_classes():
    y = balanced_labels()
    m = count_matrix(y, partition("shards", y, 10, 10, seed=0, shards_per_client=2), 10)
    assert ((m > 0).sum(1) <= 2).all()
    assert len(set(m.sum(1).tolist())) == 1  # equal sizes


def test_tau_sampling_puts_tail_classes_on_few_clients():
    y = balanced_labels()[longtail_indices(balanced_labels(), 10, 50.0, 0)]
    m = count_matrix(y, partition("tau", y, 10, 10, seed=0, tau=1.0), 10)
    holders = (m > 0).sum(0)
    assert holders[-1] == 1  # tau = 1: the rarest class lives on one client (the paper's example)
    assert holders[0] > holders[-1]


def test_more_clients_than_samples_is_an_error():
    with pytest.raises(ConfigError, match="fewer clients"):
        partition("iid", np.arange(5) % 2, 6, 2, seed=0)


def test_client_test_set_mirrors_training_distribution():
    counts = np.array([[300, 100, 0], [0, 50, 550]])
    test_y = np.repeat(np.arange(3), 1000)
    idx = client_test_index(counts, test_y, seed=0, client_id=0)
    got = np.bincount(test_y[idx], minlength=3)
    expected = np.floor(counts[0] / counts.sum() * len(test_y)).astype(int)
    assert np.array_equal(got, expected)  # [1000, 333, 0]: t_c = floor(n_kc / N * n_test)
    assert len(np.unique(idx)) == len(idx)
    capped = client_test_index(np.array([[900, 100]]), np.repeat(np.arange(2), 50), seed=0, client_id=0)
    assert len(capped) == 50 + 10  # 90 wanted of class 0, capped at the 50 the test set holds


def write_idx(path, arr: np.ndarray):
    header = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def make_idx_dir(tmp_path, n=40):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(n) % 10)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", rng.integers(0, 255, (20, 28, 28)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(20) % 10)


def test_idx_loader_reads_real_format(tmp_path):
    make_idx_dir(tmp_path)
    _CACHE.clear()
    ds = load_dataset("mnist", str(tmp_path))
    assert ds.x_train.shape == (40, 1, 28, 28) and ds.x_train.dtype == torch.uint8
    assert ds.y_test.tolist() == (np.arange(20) % 10).tolist()


def test_idx_loader_missing_and_corrupt_files_give_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDLT_DATA", raising=False)
    _CACHE.clear()
    with pytest.raises(DataError, match="not found"):
        load_dataset("mnist", str(tmp_path))
    make_idx_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"garbage")
    _CACHE.clear()
    with pytest.raises(DataError, match="corrupt"):
        load_dataset("mnist", str(tmp_path))


def write_cifar(tmp_path, n=30):
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 255, (n, 3072)).astype(np.uint8),
                         "labels": (np.arange(n) % 10).tolist()}, f)
    return folder


def test_cifar_loader_reads_python_batches_and_rejects_corrupt(tmp_path):
    folder = write_cifar(tmp_path)
    _CACHE.clear()
    ds = load_dataset("cifar10", str(tmp_path))
    assert ds.x_train.shape == (150, 3, 32, 32) and ds.x_test.shape == (30, 3, 32, 32)
    assert ds.augment == "crop-flip"
    (folder / "test_batch").write_bytes(b"not a pickle")
    _CACHE.clear()
    with pytest.raises(DataError, match="corrupt CIFAR"):
        load_dataset("cifar10", str(tmp_path))


def test_random_crop_flip_is_a_shifted_window_of_the_padded_batch():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    out = apply_crop_flip(x, crop_flip_draws(2, torch.Generator().manual_seed(0), padding=2), padding=2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(2):
        windows = [padded[b, :, i:i + 8, j:j + 8] for i in range(5) for j in range(5)]
        assert any(torch.equal(out[b], w) or torch.equal(out[b], w.flip(-1)) for w in windows)


@pytest.mark.parametrize("n,bs,drop_last,sizes", [(65, 32, False, [32, 33]), (33, 32, False, [33]),
                                                  (1, 32, False, [1]), (66, 32, False, [32, 32, 2]),
                                                  (97, 32, True, [32, 32, 32]), (64, 32, False, [32, 32])])
def test_batches_never_end_with_a_lone_sample_and_cover_the_epoch(n, bs, drop_last, sizes):
    """A single last sample joins the batch before (BatchNorm cannot train on one); each epoch is a permutation."""
    from fedlt.data.federated import ClientData, Prep
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()  # float: as is
    c = ClientData(0, x, torch.zeros(n, dtype=torch.long), 2, Prep((0.0,), (1.0,)), x[:0], torch.zeros(0))
    got = list(c.batches(bs, torch.Generator().manual_seed(0), epochs=2, drop_last=drop_last))
    assert [len(y) for _, y in got] == sizes * 2
    for epoch in (got[: len(sizes)], got[len(sizes):]):
        seen = torch.cat([xb[:, 0, 0, 0] for xb, _ in epoch]).long()
        if not drop_last:
            assert sorted(seen.tolist()) == list(range(n))
        assert len(set(seen.tolist())) == len(seen)


def test_digits_are_scikit_learns_without_importing_it():
    """The digits loader reads the file scikit-learn bundles, as its load_digits reads it, in a process that never
    imports scikit-learn (whose import costs every digits run about 2 s)."""
    import subprocess

    from sklearn.datasets import load_digits

    from fedlt.data.datasets import _sklearn_digits

    images, target = _sklearn_digits()
    ref = load_digits()
    assert images.dtype == ref.images.dtype and np.array_equal(images, ref.images)
    assert target.dtype == ref.target.dtype and np.array_equal(target, ref.target)
    code = ("import sys; from fedlt.data.datasets import load_dataset; d = load_dataset('digits', None); "
            "print(len(d.y_train) + len(d.y_test), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1797", "False"]
