"""Nothing fedlt reads can run code; a run that diverges stops cleanly; checkpoints survive a bad write.

Malicious files: for every place fedlt loads a file from, a file is planted that creates a marker file when
unpickled (``_evil``), and loading it must fail with one line while the marker never appears.
"""
from __future__ import annotations

import json
import math
import pickle
import shutil

import numpy as np
import pytest
import torch

import fedlt
from fedlt import safefile
from fedlt.cli import main as cli_main
from fedlt.data.datasets import load_dataset
from fedlt.engine import Simulation
from fedlt.errors import ConfigError, DataError, Diverged
from fedlt.experiments import report as R
from fedlt.runner.divergence import DivergenceCheck, nonfinite_entry
from fedlt.runner.runstate import CHECKPOINT, PREVIOUS, load_checkpoint, load_final_state
from fedlt.experiments.sweep import parse_sweep, plan, run_plan, visible_gpus, worker_devices

from conftest import dies_in_round

QUIET = dict(progress=False, echo=lambda *a, **k: None)
TINY = ["--dataset", "digits", "--rho", "10", "--clients", "4", "--alpha", "1", "--local-epochs", "1",
        "--batch-size", "16", "--no-progress", "--threads", "1"]


class _Evil:
    """Unpickling this creates ``path`` (a stand-in for any code an attacker would run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil(marker) -> bytes:
    return pickle.dumps({"data": _Evil(marker), "sim": _Evil(marker)}, protocol=2)


def _evil_torch(marker, path) -> None:
    torch.save({"sim": _Evil(marker), "state": _Evil(marker)}, path)  # fedlt 0.1's format: a zip of pickles


def _one_line(msg: str) -> str:
    assert "\n" not in str(msg).strip(), msg
    return str(msg)


def test_the_planted_files_would_run_code(tmp_path):
    """The check has teeth: a plain unpickler does create the marker from these very files."""
    pickle.loads(_evil(tmp_path / "m1"))
    _evil_torch(tmp_path / "m2", tmp_path / "f.pt")
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert (tmp_path / "m1").exists() and (tmp_path / "m2").exists()


def _run_cli(argv, capsys):
    code = cli_main(argv)
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("name", [CHECKPOINT, "checkpoint.pt"])
@pytest.mark.parametrize("form", ["pickle", "torch"])
def test_malicious_checkpoint_is_refused_on_resume(tmp_path, capsys, name, form):
    marker, run = tmp_path / "PWNED", tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    if form == "pickle":
        (run / name).write_bytes(_evil(marker))
    else:
        _evil_torch(marker, run / name)
    code, err = _run_cli(["run", *TINY, "--rounds", "2", "--out", str(tmp_path / "runs"), "--name", "r",
                          "--resume"], capsys)
    assert code == 2 and not marker.exists()
    assert len(err.splitlines()) == 1 and "pickle" in err, err
    assert "does not load" in err or "no longer loads" in err
    assert "delete" in err  # says how to re-create the run


def test_malicious_final_state_is_refused_by_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    marker = tmp_path / "PWNED"
    root = tmp_path / "sweep"
    code, _ = _run_cli(["compare", "--methods", "fedavg", *TINY, "--rounds", "1", "--eval-every", "1",
                        "--out", str(tmp_path), "--name", "sweep", "--no-report"], capsys)
    assert code == 0
    (run,) = [p.parent for p in root.rglob("summary.json")]
    (run / "final_state.safetensors").unlink()
    (run / "final_state.pt").write_bytes(_evil(marker))  # a fedlt 0.1 run directory, or a planted one
    with pytest.raises(ConfigError) as e:
        load_final_state(run)
    assert "re-run" in _one_line(e.value) and "pickle" in str(e.value)
    _evil_torch(marker, run / "final_state.safetensors")  # the same under the new name
    with pytest.raises(ConfigError) as e:
        load_final_state(run)
    assert "pickle" in _one_line(e.value)
    code, err = _run_cli(["report", str(root)], capsys)  # tables still come, the head-norm panel says why not
    assert code == 0 and not marker.exists()
    assert (root / "report" / "table.md").is_file()


def test_malicious_cifar_batch_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    folder = tmp_path / "good" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps({"data": rng.integers(0, 255, (10, 3072)).astype(np.uint8),
                                                  "labels": list(range(10))}))
    assert len(load_dataset("cifar10", str(tmp_path / "good")).y_train) == 50  # the honest files load
    shutil.copytree(tmp_path / "good", tmp_path / "planted")
    (tmp_path / "planted" / "cifar-10-batches-py" / "data_batch_3").write_bytes(_evil(marker))
    with pytest.raises(DataError) as e:
        load_dataset("cifar10", str(tmp_path / "planted"))
    assert "refers to io.open, which no CIFAR batch holds" in _one_line(e.value)
    assert not marker.exists()
    # _codecs.encode is admitted for the one call Python 3 writes into protocol-2 pickles (text -> latin1 bytes)
    codec = b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00hiX\x06\x00\x00\x00base64\x86R."
    (tmp_path / "planted" / "cifar-10-batches-py" / "data_batch_3").write_bytes(codec)
    with pytest.raises(DataError) as e:
        load_dataset("cifar10", str(tmp_path / "planted"))
    assert "encodes with 'base64', which no CIFAR batch does" in _one_line(e.value)


def _py2_cifar_batch(n: int) -> bytes:
    """A batch pickled the way the official files are (Python 2 cPickle, protocol 2: byte strings as
    BINSTRING, numpy.core.multiarray._reconstruct), written opcode by opcode."""
    def s(text):  # SHORT_BINSTRING / BINSTRING
        b = text.encode("latin1") if isinstance(text, str) else text
        return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + len(b).to_bytes(4, "little") + b)

    def i(v):  # BININT1 / BININT2
        return b"K" + bytes([v]) if v < 256 else b"M" + v.to_bytes(2, "little")

    raw = bytes(range(256)) * (n * 3072 // 256)
    array = (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + i(0) + b"\x85" + s("b") + b"\x87R" +
             b"(" + i(1) + i(n) + i(3072) + b"\x86" + b"cnumpy\ndtype\n" + s("u1") + i(0) + i(1) + b"\x87R" +
             b"(" + i(3) + s("|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xff" + i(0) + b"tb" + b"\x89" + s(raw) +
             b"tb")
    labels = b"](" + b"".join(i(k % 10) for k in range(n)) + b"e"
    return b"\x80\x02}(" + s("batch_label") + s("training batch 1 of 5") + s("data") + array + s("labels") + \
        labels + b"u."


def test_official_python2_cifar_batches_still_load(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(_py2_cifar_batch(4))
    ds = load_dataset("cifar10", str(tmp_path))
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_train.dtype == torch.uint8
    assert ds.x_train.flatten()[:256].tolist() == list(range(256)) and ds.y_train[:4].tolist() == [0, 1, 2, 3]


def test_malicious_fixed_classifier_cache_is_rebuilt(tmp_path):
    from fedlt.core.etf import cached_fixed_classifier

    marker = tmp_path / "PWNED"
    W = cached_fixed_classifier(tmp_path, "sse-c", 16, 5, 0.6, 0, steps=5)
    (path,) = list(tmp_path.glob("*.safetensors"))
    for plant in (lambda p: p.write_bytes(_evil(marker)), lambda p: _evil_torch(marker, p)):
        plant(path)
        with pytest.warns(UserWarning, match="rebuilding"):
            assert torch.equal(cached_fixed_classifier(tmp_path, "sse-c", 16, 5, 0.6, 0, steps=5), W)
    assert not marker.exists()


def test_malicious_flower_client_state_and_client_data_are_refused(tmp_path):
    pytest.importorskip("flwr")
    from flwr.app import RecordDict

    from fedlt.core.method import RunSpec
    from fedlt.engine.flower.client import load_client_dir
    from fedlt.engine.flower.records import load_client_state, save_client_state, state_file

    marker = tmp_path / "PWNED"
    state = {"w": torch.arange(6.0).view(2, 3), "n": 3, "t": (1, "a")}
    save_client_state(RecordDict(), state, 4, tmp_path, run="r7")
    back, _ = load_client_state(RecordDict(), 4, tmp_path, run="r7")  # after a SuperNode restart
    assert torch.equal(back["w"], state["w"]) and back["n"] == 3 and back["t"] == (1, "a")
    state_file(tmp_path, "r7", 4).write_bytes(_evil(marker))
    with pytest.raises(ConfigError) as e:
        load_client_state(RecordDict(), 4, tmp_path, run="r7")
    assert "delete" in _one_line(e.value)
    # a client's own data: an npz whose array holds pickled objects
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "train.npz", x=np.array([_Evil(marker)], dtype=object), y=np.zeros(1, dtype=np.int64))
    spec = RunSpec(model="smallcnn", in_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(DataError) as e:
        load_client_dir(str(data), 0, spec, None)
    assert "not a readable npz" in _one_line(e.value)
    assert not marker.exists()


def test_safe_format_round_trips_types_and_refuses_foreign_files(tmp_path):
    tree = {"w": torch.randn(3, 4)[:, 1:], "alias": None, "i": torch.arange(5), "b": torch.tensor([True]),
            "h": torch.ones(2, dtype=torch.bfloat16), "u": torch.from_numpy(np.arange(4, dtype=np.uint32)),
            "np": np.random.get_state(), "nan": float("nan"), "ints": {3: [1, (2, "x")]}, "s": "ü", "e": []}
    tree["alias"] = tree["w"]  # two entries on one storage
    back = safefile.loads(safefile.dumps(tree, "checkpoint"), "checkpoint")
    assert torch.equal(back["w"], tree["w"]) and torch.equal(back["alias"], tree["w"])
    for k in ("i", "b", "h", "u"):
        assert back[k].dtype == tree[k].dtype and torch.equal(back[k], tree[k])
    assert back["np"][0] == "MT19937" and np.array_equal(back["np"][1], tree["np"][1])
    assert math.isnan(back["nan"]) and back["ints"] == {3: [1, (2, "x")]} and back["s"] == "ü"
    with pytest.raises(ConfigError, match="not a checkpoint"):
        safefile.loads(safefile.dumps(tree, "final-state"), "checkpoint")
    with pytest.raises(ConfigError, match="cannot carry|not a readable"):
        safefile.loads(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 8, "checkpoint")
    with pytest.raises(ConfigError, match="not a readable"):
        safefile.loads(safefile.dumps(tree, "checkpoint")[:-7], "checkpoint")
    with pytest.raises(ConfigError, match="cannot be sent"):
        safefile.dumps({"model": torch.nn.Linear(2, 2)}, "checkpoint")  # the state rule, enforced on write


# ------------------------------------------------------------------------------------------- checkpoints
def _strip(ev):
    return {k: v for k, v in ev.items() if k != "eval_time"}


def _tiny_run_plan(out, **over):
    base = {"dataset": "digits", "imbalance_ratio": 10, "clients": 4, "alpha": 1.0, "rounds": 4, "eval_every": 1,
            "local_epochs": 1, "batch_size": 16, **over}
    return plan(parse_sweep({"seeds": [0], "base": base, "methods": ["fedavg"]}, str(out)))


@pytest.fixture(scope="module")
def reference_and_cut(tmp_path_factory):
    """An uninterrupted 4-round run, and the same run killed during round 4 (checkpoints after rounds 2, 3)."""
    root = tmp_path_factory.mktemp("ck")
    (ref,) = _tiny_run_plan(root / "ref")
    run_plan([ref], checkpoint_every=1, **QUIET)
    (cut,) = _tiny_run_plan(root / "cut")
    with dies_in_round(Simulation, 4):
        run_plan([cut], checkpoint_every=1, **QUIET)
    return json.loads((ref.dir / "summary.json").read_text()), cut


def _resume_copy(cut, tmp_path, edit):
    (run,) = _tiny_run_plan(tmp_path)
    shutil.copytree(cut.dir, run.dir)
    edit(run.dir)
    lines = []
    run_plan([run], checkpoint_every=1, progress=False, echo=lines.append)
    return json.loads((run.dir / "summary.json").read_text()), run


def test_truncated_newest_checkpoint_falls_back_to_the_previous(reference_and_cut, tmp_path):
    want, cut = reference_and_cut
    assert (cut.dir / CHECKPOINT).is_file() and (cut.dir / PREVIOUS).is_file()

    def truncate(d):
        data = (d / CHECKPOINT).read_bytes()
        (d / CHECKPOINT).write_bytes(data[: len(data) // 3])  # a write cut short

    notes = []
    cfg = json.loads((cut.dir / "config.json").read_text())
    got, run = _resume_copy(cut, tmp_path, truncate)
    assert got["resumed_after_round"] == 2  # from the previous checkpoint
    assert got["last3"] == want["last3"] and _strip(got["final"]) == _strip(want["final"])
    rounds = [json.loads(x)["round"] for x in (run.dir / "metrics.jsonl").read_text().splitlines() if '"round"' in x]
    assert rounds == [1, 2, 3, 4]
    # both unreadable: one line that says what to do
    d = tmp_path / "both"
    shutil.copytree(cut.dir, d)
    for n in (CHECKPOINT, PREVIOUS):
        (d / n).write_bytes(b"\0" * 100)
    with pytest.raises(ConfigError) as e:
        load_checkpoint(d, cfg, notes)
    assert "delete" in _one_line(e.value)


def test_gpu_checkpoint_resumes_on_a_cpu_machine(reference_and_cut, tmp_path):
    """A checkpoint whose tensors say cuda and which carries CUDA random states (as a GPU run writes them):
    here, without CUDA, tensors come to the CPU, the CUDA states are ignored, each with a note, and the run
    ends as the uninterrupted one."""
    from safetensors.torch import save_file

    want, cut = reference_and_cut

    def make_gpu_like(d):
        ck = safefile.load_tree(d / CHECKPOINT, "checkpoint")
        ck["sim"]["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]
        tensors, meta = safefile._payload(ck, "checkpoint")
        meta["devices"] = json.dumps({k: "cuda:0" for k in tensors if "weights" in k})
        save_file(tensors, str(d / CHECKPOINT), metadata=meta)

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (run,) = _tiny_run_plan(tmp_path)
    shutil.copytree(cut.dir, run.dir)
    make_gpu_like(run.dir)
    notes = []
    load_checkpoint(run.dir, json.loads((run.dir / "config.json").read_text()), notes)
    assert any("CUDA random states" in n and "ignored" in n for n in notes), notes
    assert any("cuda:0" in n and "on the CPU" in n for n in notes), notes
    run_plan([run], checkpoint_every=1, **QUIET)
    got = json.loads((run.dir / "summary.json").read_text())
    assert got["resumed_after_round"] == 3
    assert got["last3"] == want["last3"] and _strip(got["final"]) == _strip(want["final"])
    state = load_final_state(run.dir)["state"]  # the report reads a GPU run's final state: all on the CPU
    assert all(t.device.type == "cpu" for t in state["weights"].values())


# ------------------------------------------------------------------------------------------- divergence
def test_divergence_check_reasons_and_one_sync_per_round():
    class Sim:
        history = [{"train_loss": 2.0}]
        state = {"weights": {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.long)}}

    check = DivergenceCheck("fedavg", 0.05, "stop", factor=100)
    assert check.reason(Sim, {"round": 2, "train_loss": 150.0}) is None
    assert "more than 100 times" in check.reason(Sim, {"round": 2, "train_loss": 250.0})
    assert "loss is nan" in check.reason(Sim, {"round": 2, "train_loss": float("nan")})
    assert "loss is inf" in check.reason(Sim, {"round": 2, "train_loss": float("inf")})
    Sim.state["weights"]["a"][1] = float("-inf")
    assert nonfinite_entry(Sim.state) == "weights/a"
    with pytest.raises(Diverged, match=r"round 2 \(fedavg\): the global state holds non-finite values \(weights/a\)"):
        check(Sim, {"round": 2, "train_loss": 1.0})
    said = []
    cont = DivergenceCheck("fedavg", 0.05, "continue", echo=said.append)
    cont(Sim, {"round": 2, "train_loss": 1.0})
    cont(Sim, {"round": 3, "train_loss": 1.0})
    assert len(said) == 1 and cont.first == {"round": 2, "reason": cont.reason(Sim, {"train_loss": 1.0})}


def _poison_in_round(n, monkeypatch):
    """The global weights become NaN in round ``n`` (as they do when training diverges)."""
    orig = Simulation.train_round

    def train_round(self):
        rec = orig(self)
        if self.round == n:
            w = self.state["weights"]
            w[next(iter(w))] = w[next(iter(w))] * float("nan")
        return rec

    monkeypatch.setattr(Simulation, "train_round", train_round)


def test_diverging_run_stops_with_exit_3_and_keeps_the_last_good_state(tmp_path, capsys, monkeypatch):
    _poison_in_round(3, monkeypatch)
    argv = ["run", *TINY, "--rounds", "5", "--eval-every", "1", "--out", str(tmp_path), "--name", "d",
            "--checkpoint-every", "1", "--lr", "0.07"]
    code, err = _run_cli(argv, capsys)
    assert code == 3 and len(err.splitlines()) == 1, err
    assert err.startswith("fedlt: error: run diverged in round 3 (fedavg): the global state holds non-finite")
    assert "--lr than 0.07" in err and "--on-diverge continue" in err and "checkpoint (round 2) is kept" in err
    d = tmp_path / "d"
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "diverged" and s["diverged"]["round"] == 3 and s["final"] is None and s["last3"] == {}
    assert s["last_finite_eval"]["round"] == 2 and s["last_finite_eval"]["global"]["global"]["acc"] > 0.1
    assert load_checkpoint(d, json.loads((d / "config.json").read_text()))["sim"]["round"] == 2
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs] == [1, 2, 3] and "diverged" in recs[-1] and "eval" not in recs[-1]
    assert not (d / "final_state.safetensors").exists()
    res = fedlt.load(d)  # the Python API reads it back: diverged, no numbers
    assert res.status == "diverged" and res.final is None and res.last3 is None
    # --on-diverge continue: fedlt 0.1's behaviour, with one warning
    code, err = _run_cli([*argv[:-4], "--name", "c", "--on-diverge", "continue"], capsys)
    assert code == 0
    s = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert s["status"] == "finished" and s["diverged_continued"]["round"] == 3


def test_sweep_records_a_diverged_run_carries_on_and_reports_it(tmp_path, monkeypatch):
    orig = Simulation.train_round

    def fedavg_diverges_in_round_2(self):
        rec = orig(self)
        if self.round == 2 and self.method.name == "fedavg":
            w = self.state["weights"]
            w[next(iter(w))] = w[next(iter(w))] * float("nan")
        return rec

    monkeypatch.setattr(Simulation, "train_round", fedavg_diverges_in_round_2)
    sw = parse_sweep({"seeds": [0], "base": {"dataset": "digits", "imbalance_ratio": 10, "clients": 4, "alpha": 1.0,
                                             "rounds": 2, "eval_every": 1, "local_epochs": 1, "batch_size": 16},
                      "methods": {"fedavg": {}, "fedprox": {"params": {"mu": 0.01}}}}, str(tmp_path))
    counts = run_plan(plan(sw), **QUIET)
    assert counts["diverged"] == 1 and counts["started"] == 2  # recorded, and the next run went on
    out = R.write_report(tmp_path, echo=lambda *a: None, figures=False)
    table = (out / "table.md").read_text().splitlines()
    row = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table[2:]}
    assert row["fedavg"][0] == "diverged" and row["fedavg"][1].startswith("diverged")
    assert row["fedprox"][0].startswith("**") and row["fedprox"][0][2].isdigit()  # the column's best
    assert ",diverged" in (out / "runs.csv").read_text() and "in round 2" in (out / "report.md").read_text()
    assert "fedavg,default,GM,,,1,0,diverged" in (out / "table.csv").read_text()


# ------------------------------------------------------------------------------------------- parallel
def test_gpu_assignment_spreads_workers_over_visible_gpus(monkeypatch):
    from fedlt.config import RunConfig

    assert worker_devices(5, ["0", "1"]) == ["0", "1", "0", "1", "0"]  # several runs per GPU
    assert worker_devices(2, ["3", "5", "7"]) == ["3", "5"]
    assert worker_devices(3, []) == [None, None, None]
    cuda, cpu, pinned = RunConfig(device="cuda"), RunConfig(device="cpu"), RunConfig(device="cuda:1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus([cuda, cuda]) == ["2", "3"]
    assert visible_gpus([cpu]) == []  # CPU runs: leave CUDA_VISIBLE_DEVICES alone
    assert visible_gpus([cuda, pinned]) == []  # a run pinned to cuda:1 keeps its device
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus([cuda]) == []


def test_malicious_imu_file_is_refused(tmp_path):
    """BalanceFL's IMU files are pickles inside .npy files (issue 13's numpy-only unpickler reads them)."""
    from fedlt.data.imu import read_object_npy

    marker = tmp_path / "PWNED"
    arr = np.empty(1, dtype=object)
    arr[0] = {"data": _Evil(marker), "label": 0}
    np.save(tmp_path / "aiot_train.npy", arr, allow_pickle=True)
    with pytest.raises(DataError) as e:
        read_object_npy(tmp_path / "aiot_train.npy")
    assert "not BalanceFL's IMU file" in _one_line(e.value) and not marker.exists()
