"""LongTailLib's partitions (pathological, extended Dirichlet, local long tail, balanced sizes), the natural
partition, and partition files: export, import, bad files."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedlt.cli import main
from fedlt.config import load_config
from fedlt.data.longtail import longtail_indices
from fedlt.data.partition import count_matrix, least_samples, partition
from fedlt.errors import ConfigError
from fedlt.runner.runstate import load_final_state


def lt_labels(C=10, n=300, rho=10.0):
    y = np.repeat(np.arange(C), n)
    return y[longtail_indices(y, C, rho, 0)]


def covers_once(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


@pytest.mark.parametrize("balance", [False, True])
def test_pathological_gives_each_client_at_most_c_classes_and_every_sample(balance):
    y = lt_labels()
    parts = partition("pathological", y, 20, 10, seed=1, classes_per_client=2, balance=balance)
    m = count_matrix(y, parts, 10)
    assert covers_once(parts, len(y))
    assert ((m > 0).sum(1) <= 2).all() and ((m > 0).sum(0) == 4).all()  # ceil(20 / 10 * 2) clients per class
    for c in range(10):
        shares = m[m[:, c] > 0, c]
        if balance:  # equal shares, the last client takes the remainder
            assert (shares[:-1] == len(y[y == c]) // 4).all()
    if not balance:
        assert len({tuple(m[m[:, c] > 0, c]) for c in range(10)}) > 1


def test_exdir_limits_classes_and_caps_client_sizes():
    y = lt_labels(n=200)
    parts = partition("exdir", y, 10, 10, seed=2, alpha=0.5, classes_per_client=3)
    m = count_matrix(y, parts, 10)
    assert covers_once(parts, len(y))
    assert ((m > 0).sum(1) <= 3).all() and min(len(p) for p in parts) >= 10
    # no client is given more of a class once it holds N/K samples: at most N/K plus one class's samples
    assert max(len(p) for p in parts) <= len(y) / 10 + np.bincount(y).max()


def test_balanced_dirichlet_evens_out_client_sizes():
    y = lt_labels(n=400)
    sizes = {b: np.array([len(p) for p in partition("dirichlet", y, 10, 10, seed=3, alpha=0.3, balance=b)])
             for b in (False, True)}
    for b in (False, True):
        assert sizes[b].sum() == len(y)
    assert sizes[True].std() < sizes[False].std()
    assert sizes[True].min() >= least_samples(len(y), 10)


def test_local_longtail_makes_each_client_long_tailed_with_rho():
    y = np.repeat(np.arange(5), 2000)  # balanced globally
    parts = partition("local-longtail", y, 4, 5, seed=4, alpha=1.0, rho=20.0)
    m = count_matrix(y, parts, 5)
    all_idx = np.concatenate(parts)
    assert len(np.unique(all_idx)) == len(all_idx) < len(y)
    step = 20.0 ** (1 / 4)  # rho 20 over a client's 5 classes: each class keeps 1/step of the one before
    for row in m:
        held = np.sort(row[row > 0])[::-1]
        assert len(held) == 5 and held[0] / held[-1] > 5  # targets above what a client holds are capped
        assert abs(held[-2] / held[-1] - step) < 0.1 and abs(held[-3] / held[-2] - step) < 0.1
    with pytest.raises(ConfigError, match="local-longtail"):
        load_config(overrides={"partition": "local-longtail", "lt_profile": "exp"})
    from fedlt.data.split import default_lt_profile

    assert default_lt_profile("cifar10", "local-longtail", None) == "none"
    assert default_lt_profile("cifar10", "dirichlet", None) == "exp"
    assert default_lt_profile("femnist", "iid", None) == default_lt_profile("cifar10", "iid", "p.json") == "none"


def test_natural_partition_gives_whole_users_and_checks_k():
    y = np.arange(60) % 3
    groups = np.repeat(np.arange(12), 5)
    parts = partition("natural", y, 4, 3, seed=0, groups=groups)
    users = [np.unique(groups[p]) for p in parts]
    assert all(len(u) == 1 for u in users) and len({int(u[0]) for u in users}) == 4
    assert all(len(p) == 5 for p in parts)
    with pytest.raises(ConfigError, match="has 12 users"):
        partition("natural", y, 13, 3, seed=0, groups=groups)
    with pytest.raises(ConfigError, match="own users"):
        load_config(overrides={"dataset": "cifar10", "partition": "natural"})


RUN = ["run", "--dataset", "digits", "--rho", "10", "--clients", "5", "--participation", "1", "--rounds", "1",
       "--local-epochs", "1", "--eval-every", "1", "--model", "smallcnn", "--threads", "1", "--no-progress"]


def test_partition_export_then_import_gives_the_same_clients_and_first_round_weights(tmp_path, capsys):
    assert main(RUN + ["--out", str(tmp_path), "--name", "a", "--alpha", "0.3"]) == 0
    exported = json.loads((tmp_path / "a" / "partition.json").read_text())
    assert exported["format"] == "fedlt-partition/1" and exported["index_space"] == "train"
    capsys.readouterr()
    pfile = str(tmp_path / "a" / "partition.json")
    assert main(RUN[:5] + RUN[7:] + ["--out", str(tmp_path), "--name", "b", "--partition-file", pfile]) == 0
    printed = capsys.readouterr().out
    imported = json.loads((tmp_path / "b" / "partition.json").read_text())
    assert imported["client_class_counts"] == exported["client_class_counts"]
    assert imported["clients"] == exported["clients"]
    cfg_b = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg_b["partition"] == "file" and cfg_b["clients"] == 5 and cfg_b["lt_profile_used"] == "none"
    wa = load_final_state(tmp_path / "a")["state"]["weights"]
    wb = load_final_state(tmp_path / "b")["state"]["weights"]
    assert wa.keys() == wb.keys() and all(torch.equal(v, wb[k]) for k, v in wa.items())
    assert "5 clients" in printed


def write(tmp_path, obj, name="p.json"):
    f = tmp_path / name
    f.write_text(json.dumps(obj))
    return str(f)


@pytest.mark.parametrize("clients,msg", [
    ({"0": [1, 2, 3], "1": [3, 4]}, "index 3 is in client 0 and client 1"),
    ({"0": [1, 2, 2], "1": [5]}, "index 2 appears twice in client 0"),
    ({"0": [1, 2], "1": [99999]}, "outside the training split"),
    ({"0": [1, 2], "1": []}, "non-empty list of integer indices"),
    ({"0": [1, 2.5]}, "integer indices"),
])
def test_bad_partition_files_are_one_line_errors_and_write_nothing(tmp_path, capsys, clients, msg):
    f = write(tmp_path, {"format": "fedlt-partition/1", "dataset": "digits", "clients": clients})
    assert main(RUN[:5] + RUN[7:] + ["--out", str(tmp_path / "runs"), "--partition-file", f]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err
    assert not (tmp_path / "runs").exists()


def test_partition_file_other_checks(tmp_path, capsys):
    f = write(tmp_path, [[0, 1], [2, 3]])  # a plain list of index lists (another framework's split)
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(overrides={"partition": "shards", "partition_file": f})
    assert load_config(overrides={"partition_file": f}).clients == 2
    for args, msg in [(["--partition-file", f, "--clients", "3"], "has 2 clients but the run asks for 3"),
                      (["--partition-file", write(tmp_path, {"dataset": "mnist", "clients": [[0]]}, "m.json")],
                       "is for dataset 'mnist'"),
                      (["--partition-file", str(tmp_path / "missing.json")], "not found"),
                      (["--partition-file", f, "--lt-profile", "exp"], "decides which samples")]:
        assert main(RUN[:5] + RUN[7:] + ["--out", str(tmp_path / "runs")] + args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, err
