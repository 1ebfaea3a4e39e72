"""Device correctness that a CPU-only machine can check (issue 11).

- Every registered method, through its whole life (server and client init, training, aggregation, phases,
  evaluation), creates no tensor without naming its device (``fedlt.devcheck.ImplicitDevice``): the cause of
  the CUDA crashes of FedLoGe (loss accumulator) and SphereFed (calibration sums).
- No method reads a tensor's value into Python once per local step: the number of such reads in
  ``local_train`` is the same with 1 and with 3 local epochs.
- The federation's samples live in one store, on the device or on the host: both give the same run.
"""
from __future__ import annotations

import pytest
import torch

from conftest import method_test_params, small_config
from fedlt.data.federated import placement
from fedlt.devcheck import HostSyncs, ImplicitDevice
from fedlt.engine import EngineConfig, Simulation
from fedlt.runner.rundir import federation_for, prepare
from fedlt.registry import METHODS

_FED = {}


def _sim(method: str, **over) -> Simulation:
    cfg = small_config(method=method, rounds=2, eval_every=2, params=method_test_params(method), **over)
    key = cfg.data_placement
    if key not in _FED:
        _FED[key] = federation_for(cfg)
    pr = prepare(cfg, _FED[key])
    return Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))


def _syncs_in_local_train(method: str, epochs: int) -> dict[str, int]:
    """Reads of tensor values into Python, by source line, during one round's ``local_train`` calls."""
    sim = _sim(method, local_epochs=epochs)
    counted, train = HostSyncs(), sim.method.local_train

    def watched(*a):
        with counted:
            return train(*a)

    sim.method.local_train = watched
    sim.train_round()
    return counted.count.sites


@pytest.mark.parametrize("method", METHODS.names())
def test_method_names_every_device_and_reads_no_value_per_step(method):
    with ImplicitDevice() as guard:
        sim = _sim(method)
        sim.run()
    assert not guard.found, "tensors created without device=:\n" + "\n".join(sorted(set(guard.found)))
    one, three = _syncs_in_local_train(method, 1), _syncs_in_local_train(method, 3)
    assert one == three, f"host reads per client grow with the local steps: 1 epoch {one}, 3 epochs {three}"


def test_guards_catch_a_planted_cpu_tensor_and_a_per_step_read(tmp_path):
    src = tmp_path / "planted.py"
    src.write_text("import torch\n"
                   "def acc(losses):\n"
                   "    parts = torch.zeros(3)\n"
                   "    for l in losses:\n"
                   "        parts.add_(l)\n"
                   "        float(l.sum())\n"
                   "    return parts\n")
    ns: dict = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    with ImplicitDevice(roots=[str(tmp_path)]) as guard, HostSyncs(roots=[str(tmp_path)]) as syncs:
        ns["acc"]([torch.ones(3)] * 4)
        torch.zeros(2)  # outside the watched files: not flagged
    assert len(guard.found) == 1 and guard.found[0].endswith("planted.py:3: torch.zeros without device=")
    assert syncs.count.total == 4


def test_placement_puts_data_on_the_gpu_only_when_it_fits():
    assert placement(10, "cpu") == "host"
    assert placement(10, "cuda", free_bytes=100) == "device"
    assert placement(26, "cuda", free_bytes=100) == "host"  # more than a quarter of the free memory
    assert placement(10**12, "cuda", "device", free_bytes=1) == "device"
    assert placement(1, "cuda", "host", free_bytes=10**12) == "host"


def test_device_and_host_placement_give_the_same_run():
    """The device path (a copy of the long-tailed subset, rows remapped; without augmentation kept normalised,
    so a batch is a plain gather) and the host path (rows into the dataset itself, each batch gathered, moved
    and normalised) give exactly the same batches, so the same run (the CPU kernels' float rounding may differ
    with where tensors were allocated: weights to 1e-6)."""
    sims = {where: _sim("fedloge", data_placement=where, local_epochs=1) for where in ("device", "host")}
    assert sims["device"].fed.clients[0]._x.dtype == torch.float32  # normalised once, not per batch
    assert sims["host"].fed.clients[0]._x.dtype == torch.uint8
    for a, b in zip(sims["device"].fed.clients, sims["host"].fed.clients):
        ga, gb = torch.Generator().manual_seed(a.client_id), torch.Generator().manual_seed(a.client_id)
        for (xa, ya), (xb, yb) in zip(a.batches(16, ga, epochs=2), b.batches(16, gb, epochs=2), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(a.prep(a.test_x), b.prep(b.test_x)) and torch.equal(a.test_y, b.test_y)
    finals = {}
    for where, sim in sims.items():
        assert sim.fed.where == where
        finals[where] = sim.run()
    for side in ("global", "personal"):
        for mode, r in finals["device"][side].items():
            assert abs(r["acc"] - finals["host"][side][mode]["acc"]) <= 1e-4, (side, mode)
    wd, wh = sims["device"].state["weights"], sims["host"].state["weights"]
    assert all(torch.allclose(wd[k].float(), wh[k].float(), atol=1e-6, rtol=0) for k in wd)


def test_rows_to_copies_the_kept_rows_in_chunks():
    from fedlt.data.federated import rows_to

    t = torch.arange(40 * 3, dtype=torch.uint8).view(40, 3)
    rows = torch.tensor([5, 0, 39, 7, 7, 12], device="cpu")
    assert torch.equal(rows_to(t, rows, "cpu", chunk_bytes=6), t[rows])  # two rows per chunk
    assert torch.equal(rows_to(t, None, "cpu", chunk_bytes=7), t)
