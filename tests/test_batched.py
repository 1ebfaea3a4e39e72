"""Batched local training (issue 12): a round's clients trained together give the run they give one after another.

The federation has clients of very different sizes (17 to 123 samples at batch 32: clients with a single batch,
clients whose last batch is partial, clients that run out of steps long before the others), half of them per
round, and the batched executor runs in chunks of 3, so clients are grouped by batch size within a step,
chunks differ in size, and the SGD momentum of a client starts at its own first step.

Tolerance: the vectorised kernels sum in another order than one client's, so after 2 rounds the weights agree
to 1e-5 (seen: 3e-8 to 5e-8) and GM/PM to 1e-4 (seen: equal).
"""
from __future__ import annotations

import pytest
import torch

from conftest import method_test_params, small_config
from fedlt.core.method import RunSpec
from fedlt.devcheck import ImplicitDevice, ReplayedGraphs
from fedlt.engine import EngineConfig, Simulation
from fedlt.engine import batched as batched_mod
from fedlt.engine.simulation import client_parallel_chunk
from fedlt.runner.rundir import federation_for, prepare
from fedlt.registry import METHODS

BATCHING = [m for m in METHODS.names() if METHODS.get(m).describes_steps()]
CASES = [(m, {}) for m in BATCHING] + [
    ("fedavg", {"model": "smallcnn-bn"}),  # per-client BatchNorm statistics, updated in the stacked buffers
    ("fedbn", {"model": "smallcnn-bn"}),
    ("fedloge", {"params": {"persist_phi_momentum": "true"}}),  # momentum carried in from the client state
    ("fedloge", {"params": {"backbone_loss": "etf-dr", "fixed": "etf"}}),  # a BatchNorm over each client's batch
]
_FED = {}


def _sim(method: str, client_parallel: str, params=None, **over) -> Simulation:
    # method_test_params: FedIC's default 3 x 100 server Adam steps amplify the executor's 1e-7 roundoff past 1e-5
    cfg = small_config(method=method, params=params or method_test_params(method), clients=8, alpha=0.3,
                       batch_size=32, rounds=2, eval_every=2, client_parallel=client_parallel, **over)
    if "fed" not in _FED:
        _FED["fed"] = federation_for(cfg)
    pr = prepare(cfg, _FED["fed"])
    return Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))


def _accs(ev: dict) -> dict:
    return {side: {mode: r["acc"] for mode, r in ev[side].items()} for side in ("global", "personal")}


# Batched and sequential steps run other kernels, so they round differently, and a rounding difference that flips
# a ReLU or a max-pool tie becomes a step: with torch's AVX2 kernels FedFocal's global weights agree to 1.7e-8 after
# round 1 and 2.5e-4 after round 2 (every other case within 3e-6 on the AVX-512, AVX2 and default kernels). A
# wrong batched step differs by orders of magnitude more, and the rounds' mean training losses keep the tight
# bound (1e-5; 1.6e-6 there).
WEIGHTS_ATOL = 1e-3
ACC_ATOL = 1e-2  # what one flipped prediction moves in a client's small test set


def _assert_same_run(a: Simulation, fa: dict, b: Simulation, fb: dict, atol: float = WEIGHTS_ATOL) -> None:
    for k, v in a.state["weights"].items():
        assert torch.allclose(v.float(), b.state["weights"][k].float(), atol=atol, rtol=0), k
    for cid, cs in a.client_states.items():
        for k, v in cs.items():
            if isinstance(v, torch.Tensor):
                assert torch.allclose(v.float(), b.client_states[cid][k].float(), atol=atol, rtol=0), (cid, k)
    for ra, rb in zip(a.history, b.history):  # the clients' mean training loss of each round
        if ra.get("train_loss") is not None:
            assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-5, (ra["round"], ra["train_loss"], rb["train_loss"])
    aa, bb = _accs(fa), _accs(fb)
    for side in aa:
        assert aa[side].keys() == bb[side].keys()
        for mode in aa[side]:
            assert abs(aa[side][mode] - bb[side][mode]) <= ACC_ATOL, (side, mode)


@pytest.mark.parametrize("method,over", CASES, ids=[f"{m}-{'-'.join(o) or 'default'}" for m, o in CASES])
def test_batched_clients_train_as_they_do_one_after_another(method, over):
    sizes = sorted(len(c) for c in _sim(method, "off", **over).fed.clients)
    assert sizes[0] <= 32 < sizes[-1] and any(s % 32 for s in sizes)  # single-batch and partial-batch clients
    seq = _sim(method, "off", **over)
    f_seq = seq.run()
    bat = _sim(method, "3", **over)
    assert bat.parallel_chunk() == 3
    with ImplicitDevice() as guard:  # the executor names its devices too
        f_bat = bat.run()
    assert not guard.found, guard.found
    _assert_same_run(seq, f_seq, bat, f_bat)


def test_out_of_memory_halves_the_chunk_with_the_same_batches(monkeypatch):
    """auto: all of a round's clients at once; when CUDA runs out of memory, the chunk is halved and trained
    again from the start with fresh generators -- the run is the one of unbatched training -- and the size that
    fitted is kept."""
    real, sizes = batched_mod._train_chunk, []

    def flaky(method, jobs, graphs=None):
        sizes.append(len(jobs))
        if len(jobs) > 1:
            raise torch.OutOfMemoryError("simulated")
        return real(method, jobs, graphs)

    monkeypatch.setattr(batched_mod, "_train_chunk", flaky)
    seq = _sim("fedloge", "off")
    f_seq = seq.run()
    bat = _sim("fedloge", "off")
    bat.transport.parallel_chunk = lambda: None  # "auto" as on a GPU
    f_bat = bat.run()
    assert sizes[:2] == [4, 2] and set(sizes[2:]) == {1}  # the size that fitted is kept for round 2
    _assert_same_run(seq, f_seq, bat, f_bat)


def test_client_parallel_setting_picks_batched_only_where_it_can():
    def method(name, device="cpu", precision="fp32"):
        cls = METHODS.get(name)
        return cls(RunSpec("smallcnn", (1, 8, 8), 10, device=device, precision=precision))

    assert client_parallel_chunk("auto", method("fedavg")) == 0  # a CPU gains nothing from vmap
    assert client_parallel_chunk("4", method("fedavg")) == 4
    assert client_parallel_chunk("off", method("fedloge")) == 0
    assert client_parallel_chunk("4", method("fedrep")) == 0  # a loop of its own (two stages)
    assert client_parallel_chunk("4", method("fedavg", precision="fp16")) == 0  # the gradient scaler
    assert {"fedavg", "fedprox", "fedloge", "fedfocal", "fedlc", "fedavg-bsm", "fedntd", "fedrod",
            "fedbabu", "feddyn", "moon", "scaffold"} <= set(BATCHING)


def _max_diff(a: Simulation, b: Simulation) -> float:
    return max(float((v.float() - b.state["weights"][k].float()).abs().max()) for k, v in a.state["weights"].items())


def test_batched_bf16_with_batchnorm_trains_as_sequential_bf16():
    """Under autocast the executor runs BatchNorm in float32 (vmap's batch-norm rule cannot mix a bf16 input
    with float32 parameters: this crashed on resnet18 on the H100, and on a CPU). Batched and sequential bf16
    then differ by bf16 rounding, amplified over 2 rounds: no more than bf16 and fp32 differ from each other."""
    seq16, bat16, seq32 = (_sim("fedavg", cp, model="smallcnn-bn", precision=p)
                           for cp, p in (("off", "bf16"), ("3", "bf16"), ("off", "fp32")))
    f_seq16, f_bat16, _ = seq16.run(), bat16.run(), seq32.run()
    assert _max_diff(seq16, bat16) <= 2 * _max_diff(seq16, seq32)
    for side in ("global", "personal"):
        for mode, acc in _accs(f_seq16)[side].items():
            assert abs(acc - _accs(f_bat16)[side][mode]) <= 0.03
    losses = [[h["train_loss"] for h in s.history] for s in (seq16, bat16)]
    assert losses[1] == pytest.approx(losses[0], rel=0.02)


REPLAYED = CASES + [("fedloge", {"lr_schedule": "cosine"})]  # a graph outlives a round's lr


@pytest.mark.parametrize("method,over", REPLAYED, ids=[f"{m}-{'-'.join(o) or 'default'}" for m, o in REPLAYED])
def test_cuda_graphs_replayed_train_as_one_after_another(method, over):
    """--cuda-graphs, with the graphs emulated (``devcheck.ReplayedGraphs``): the static mode's stacks keep
    their size for a whole chunk (clients out of batches stay in them, only the loss sums are masked; the lr is
    a tensor), and every step after the warm-up ones is a replay of the step *as captured*, on the graph's
    own input tensors, which the executor copies each step's batch and mask into. Every method that batches,
    BatchNorm buffers, momentum carried in, trained extra tensors (FedRoD's personal head), anchors (FedProx), a
    cosine lr schedule: the run of one client after another, and nothing in a step that a capture refuses."""
    seq = _sim(method, "off", **over)
    f_seq = seq.run()
    bat = _sim(method, "3", **over)
    bat.graphs = ReplayedGraphs()
    f_bat = bat.run()
    g = bat.graphs
    assert len(g.bound) >= 1 and g.captured >= 2 and g.replays > 0  # chunks of 3 and 1 (4 clients a round)
    assert g.failed is None and not g.unsafe.found, sorted(set(g.unsafe.found))
    _assert_same_run(seq, f_seq, bat, f_bat)


def test_replayed_graphs_catch_a_step_that_reads_its_batch_by_closure_and_a_sync():
    """The emulation can fail: a step that reads its batch through its closure instead of its inputs replays
    the capture step's batch (as a real graph would), and a ``.item()`` or a boolean mask inside a step is
    flagged."""
    xs = [torch.full((2,), float(i)) for i in range(6)]

    def total(through_inputs: bool) -> torch.Tensor:
        g = ReplayedGraphs(warmup=1)
        b = g.bind(("k",), {"P": {"w": torch.zeros(2)}})
        w = b.tensors["P"]["w"]
        for x in xs:
            if through_inputs:
                g.run(b, ("s",), lambda x_: w.add_(x_), x)
            else:
                g.run(b, ("s",), lambda _, x=x: w.add_(x), torch.zeros(1))
        assert g.captured == 1 and g.replays == 5 and not g.unsafe.found
        return w

    assert torch.equal(total(True), torch.full((2,), 15.0))
    assert torch.equal(total(False), torch.full((2,), 0.0 + 1 + 1 + 1 + 1 + 1))  # warm-up x0, then the captured x1
    g = ReplayedGraphs(warmup=0)
    b = g.bind(("k",), {"P": {"w": torch.zeros(3)}})

    def syncing(x):
        w = b.tensors["P"]["w"]
        w.add_(x[x > 0].sum())
        if float(x.sum()) > 0:
            w.add_(1)

    g.run(b, ("s",), syncing, torch.tensor([1.0, -1.0, 2.0]))
    found = " ".join(g.unsafe.found)
    assert "aten.index (boolean-mask" in found and "aten._local_scalar_dense" in found, found


def test_static_mode_keeps_copies_of_what_clients_share():
    """Static mode keeps a chunk shape's tensors and copies later chunks into them; a tensor the clients share
    (FedProx's anchor: the received global model itself) must be kept as a copy, or round 2 would overwrite
    round 1's global model."""
    sim = _sim("fedprox", "4")  # 4 clients a round: one chunk, the same shape every round
    sim.graphs = batched_mod.StepGraphs(capture=False)
    kept = dict(sim.state["weights"])  # round 1's anchor
    before = {k: v.clone() for k, v in kept.items()}
    sim.train_round()
    sim.train_round()  # its anchor, round 1's result, goes where round 1's was kept
    assert len(sim.graphs.bound) == 1
    assert all(torch.equal(kept[k], before[k]) for k in kept)
    assert not all(torch.equal(kept[k], sim.state["weights"][k]) for k in kept)  # the model did change
