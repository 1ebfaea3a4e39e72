"""Shared fixtures: small long-tailed federations that train in seconds on two CPU cores."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future
from pathlib import Path

# experiment trackers (fedlt.runner.trackers) in tests: nothing leaves the machine, nothing starts by default
for _k, _v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
               "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", "FEDLT_TENSORBOARD": "0"}.items():
    os.environ.setdefault(_k, _v)
os.environ.pop("MLFLOW_TRACKING_URI", None)  # the local store inside --out
os.environ.pop("WANDB_API_KEY", None)
# Hugging Face and Flower Datasets: no network, no telemetry in any test (docs/flower-datasets.md names these)
os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                   "FLWR_TELEMETRY_ENABLED": "0"})

# a client reply carrying an array or meta value its method does not declare (Method.sends) stops the run with one
# line (fedlt.core.privacy): every test that trains checks the declarations; child processes inherit it
os.environ["FEDLT_CHECK_SENDS"] = "1"

# the tests see the plugins they plant (each names its folder), never one installed in the environment (the
# writing-a-method tutorial's fedavg-la): fedlt.registry.plugin_visible; child processes inherit it
os.environ["FEDLT_PLUGIN_PATH"] = ""

# `make test` runs the suite in two pytest-xdist workers (one per core of the CI machine). Every torch beside
# another busy process uses one thread: two OpenMP threads on two busy cores wait for each other (rounds 25x
# slower); child processes inherit it. XDIST: this process is a worker.
XDIST = "PYTEST_XDIST_WORKER" in os.environ
if XDIST:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fedlt.config import RunConfig  # noqa: E402
from fedlt.engine import EngineConfig, Simulation  # noqa: E402
from fedlt.runner.rundir import federation_for, prepare  # noqa: E402

torch.set_num_threads(1)


def small_config(**over) -> RunConfig:
    """Digits, made long-tailed (rho 10), Dirichlet 1.0 over 6 clients, half of them per round."""
    base = dict(method="fedavg", dataset="digits", imbalance_ratio=10.0, alpha=1.0, clients=6,
                participation=0.5, rounds=8, eval_every=4, local_epochs=2, batch_size=16, lr=0.05,
                momentum=0.9, seed=0, model="smallcnn")
    base.update(over)
    if base["method"] in HEAD_ONLY and "finetune" not in over:  # runs only on a frozen pre-trained backbone
        base.update(finetune="head", model=tiny_hf_vit())
    return RunConfig(**base)


HEAD_ONLY = ("ggeur",)  # methods refused under --finetune full: the tests run them under head on a tiny ViT


def tiny_hf_vit() -> str:
    """``hf:DIR`` of a tiny random ViT (8x8 images, patches of 4, width 16, one block) saved with save_pretrained
    in safetensors, once per process (offline)."""
    if "hf-vit" not in _TINY_CLIP:
        import tempfile

        from transformers import ViTConfig, ViTModel

        os.environ["HF_HUB_OFFLINE"] = "1"
        d = tempfile.mkdtemp(prefix="fedlt-tiny-hf-vit-")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            ViTModel(ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=32)).save_pretrained(d)
        _TINY_CLIP["hf-vit"] = f"hf:{d}"
    return _TINY_CLIP["hf-vit"]


_FEDS: dict = {}


def run_small(method: str = "fedavg", params: dict | None = None, **over):
    """Train a method on the small federation; returns (simulation, final evaluation)."""
    cfg = small_config(method=method, params=params or {}, **over)
    key = (cfg.dataset, cfg.imbalance_ratio, cfg.alpha, cfg.clients, cfg.partition, cfg.seed)
    if key not in _FEDS:
        _FEDS[key] = federation_for(cfg)
    pr = prepare(cfg, _FEDS[key])
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    final = sim.run()
    return sim, final


def trained_runs():
    """``get(name, run=None, **params)``: the small federation trained once per (method, params, run settings)
    for as long as ``get`` lives (``run``: overrides of small_config, e.g. fewer rounds). A test module shares its
    trained runs through a module-scoped fixture returning one."""
    runs: dict = {}

    def get(name, run=None, **params):
        key = (name, tuple(sorted(params.items())), tuple(sorted((run or {}).items())))
        if key not in runs:
            runs[key] = run_small(name, params, **(run or {}))
        return runs[key]

    return get


def final_gm(final, mode=None):
    """A final evaluation's GM accuracy in ``mode`` (default: the first GM mode the method reports)."""
    return final["global"][mode or next(iter(final["global"]))]


@pytest.fixture
def small():
    return run_small


_TINY_CLIP: dict = {}


def tiny_clip_files(embed: int = 128, num_classes: int = 10) -> dict:
    """A small random CLIP image tower (OpenAI's ViT layout: width 32, 1 layer, patch 4, 8x8 input) and random
    class text embeddings, written once per process as safetensors files: the ``clip_weights`` and
    ``text_embeddings`` parameters CLIP2FL needs (the real CLIP cannot be fetched here). ``embed`` 128 equals
    smallcnn's feature width, so the feature-text contrast runs too."""
    key = (embed, num_classes)
    if key not in _TINY_CLIP:
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file

        from fedlt.core.clip import ImageTower

        d = Path(tempfile.mkdtemp(prefix="fedlt-tiny-clip-"))
        g = torch.Generator().manual_seed(0)
        tower = ImageTower(8, 4, 32, 1, 1, embed)
        sd = {f"visual.{k}": torch.randn(v.shape, generator=g) * 0.2 for k, v in tower.state_dict().items()}
        sd["token_embedding.weight"] = torch.zeros(3, 4)  # a text-tower key, to be ignored
        save_file(sd, str(d / "visual.safetensors"))
        save_file({"text": torch.randn(num_classes, embed, generator=g)}, str(d / "text.safetensors"))
        _TINY_CLIP[key] = {"clip_weights": str(d / "visual.safetensors"),
                           "text_embeddings": str(d / "text.safetensors")}
    return dict(_TINY_CLIP[key])


def informative_clip_files() -> dict:
    """The tiny random CLIP tower of :func:`tiny_clip_files`, with text embeddings that make it an informative
    teacher: each class's mean tower embedding over the small federation's data (zero-shot accuracy about 50 %,
    against 10 % by chance). Written once per process."""
    if "informative" not in _TINY_CLIP:
        import tempfile
        from pathlib import Path

        import torch.nn.functional as F
        from safetensors.torch import save_file

        from fedlt.core.clip import clip_input, load_image_tower

        files = tiny_clip_files()
        fed = federation_for(small_config())
        tower = load_image_tower(files["clip_weights"])
        e, y = [], []
        for c in fed.clients:
            for x, yy in c.batches(512, None, shuffle=False, train=False):
                e.append(tower(clip_input(x, c.prep.mean, c.prep.std, tower.resolution)))
                y.append(yy)
        e, y = F.normalize(torch.cat(e), dim=1), torch.cat(y)
        path = Path(tempfile.mkdtemp(prefix="fedlt-clip-text-")) / "text.safetensors"
        save_file({"text": torch.stack([e[y == k].mean(0) for k in range(fed.num_classes)])}, str(path))
        _TINY_CLIP["informative"] = {**files, "text_embeddings": str(path)}
    return dict(_TINY_CLIP["informative"])


def tiny_vit_file() -> str:
    """A small random ViT in timm's layout (width 32, 2 blocks, patch 4, 8x8 input: the digits' size), written once
    per process as a safetensors file: the ``vit_weights`` FedGPA needs (the real ViT-B/16 cannot be fetched
    here)."""
    if "vit" not in _TINY_CLIP:
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file

        from fedlt.core.vit import ViTTower

        d = Path(tempfile.mkdtemp(prefix="fedlt-tiny-vit-"))
        g = torch.Generator().manual_seed(0)
        sd = {k: torch.randn(v.shape, generator=g) * 0.2 for k, v in ViTTower(8, 4, 32, 2, 1).state_dict().items()}
        sd.update({k: torch.ones_like(v) for k, v in sd.items() if "norm" in k and k.endswith("weight")})
        sd["head.weight"] = torch.zeros(1000, 32)  # the pre-trained classifier, to be ignored
        save_file(sd, str(d / "vit.safetensors"))
        _TINY_CLIP["vit"] = str(d / "vit.safetensors")
    return _TINY_CLIP["vit"]


_LIGHT = {"ccvr": {"per_class": 200}, "fedic": {"steps": 10}, "rucr": {"crt_epochs": 5}, "fedcrac": {"crt_epochs": 5},
          "dfl-fs": {"per_class": 100, "epochs": 5}, "fedgpa": {"tokens": 1},
          "fedlf": {"warmup_rounds": 0},  # global centres from round 1 on: two-round tests (resume) carry them
          "clip2fl": {"match_epochs": 5, "crt_epochs": 10}}


def method_test_params(method: str) -> dict:
    """Parameters for a method in the tests that run every registered method: the files it reads (CLIP2FL), and
    lighter settings where the defaults take many seconds on the tiny federation (those tests check the protocol
    -- resume, Flower -- not the setting)."""
    files = tiny_clip_files() if method == "clip2fl" else {"vit_weights": tiny_vit_file()} if method == "fedgpa" else {}
    return {**files, **_LIGHT.get(method, {})}


class Stop(Exception):
    """Stands for the process being killed (:func:`dies_in_round`)."""


@contextlib.contextmanager
def dies_in_round(cls, n: int, only=None):
    """The run started in the block dies (raises :class:`Stop`) as ``cls.train_round`` (``Simulation`` or
    ``Driver``) is about to train round ``n`` -- of a run ``only(self)`` picks, where given; the block must end
    so, and ``train_round`` is restored whatever happens."""
    orig, own = cls.train_round, "train_round" in vars(cls)

    def dying(self):
        if self.round == n - 1 and (only is None or only(self)):
            raise Stop(f"killed before round {n}")
        return orig(self)

    cls.train_round = dying
    try:
        with pytest.raises(Stop):
            yield
    finally:  # as it was: an inherited train_round (Simulation's is Driver's) is inherited again, not a copy
        if own:  # that would hide a later patch of the base class from the subclass
            cls.train_round = orig
        else:
            del cls.train_round


KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {src!r})
    from fedlt.runner import rundir
    from fedlt.config import RunConfig
    from fedlt.engine.driver import Driver

    real = Driver.train_round

    def dying(self):
        if self.round == {kill_after}:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self)

    Driver.train_round = dying
    rundir.run(RunConfig(**{cfg!r}), progress=False, checkpoint_every=1, echo=lambda *a: None)
""")


def run_killed(cfg: RunConfig, kill_after: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """``cfg`` run in a child process (a checkpoint every round) that kills itself with SIGKILL -- kill -9 -- as
    round ``kill_after + 1`` is about to train; its exit status is then -9."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return subprocess.run([sys.executable, "-c", KILLED.format(src=src, kill_after=kill_after, cfg=cfg.to_dict())],
                          capture_output=True, text=True, timeout=timeout)


def timeless(x):
    """A record (a summary's part, a metrics row) without its timings, which differ between two runs of the same
    work."""
    if isinstance(x, dict):
        return {k: timeless(v) for k, v in x.items() if "time" not in k}
    return [timeless(v) for v in x] if isinstance(x, list) else x


def resumed_as_uninterrupted(tmp_path, over: dict, n: int = 3) -> tuple[dict, dict]:
    """``small_config(**over)`` run in ``tmp_path`` uninterrupted (``ref``) and again killed as round ``n`` starts
    (checkpoints every round), then resumed (``cut``): the resumed run says where it went on, and both end with
    the same metrics.jsonl and final evaluation, times aside. Returns the two summaries (ref, resumed)."""
    import json

    from fedlt.engine.driver import Driver
    from fedlt.runner import rundir

    quiet = lambda *a: None  # noqa: E731
    ref = rundir.run(small_config(**over, out=str(tmp_path), name="ref"), progress=False, echo=quiet)
    cfg = small_config(**over, out=str(tmp_path), name="cut")
    with dies_in_round(Driver, n):
        rundir.run(cfg, progress=False, echo=quiet, checkpoint_every=1)
    out = rundir.run(cfg, progress=False, echo=quiet, checkpoint_every=1, resume=True)
    assert out["resumed_after_round"] == n - 1
    rows = lambda name: [timeless(json.loads(x))  # noqa: E731
                         for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert rows("cut") == rows("ref") and timeless(out["final"]) == timeless(ref["final"])
    return ref, out


# ------------------------------------------------------------------------------------------- background jobs
# A few tests spend minutes mostly waiting (Flower deployments: a process per message, 3-s polls, 60 s until a dead
# SuperNode is noticed). A module that defines ``start_background(items, base)`` is handed its collected tests once
# the session has collected them, and starts their work with :func:`background`; each test then waits for its job's
# result and checks it. The work is the same as in the test itself: only when it runs changes. (CPU-bound work gains
# nothing so: tried with the documentation pages' commands, the suite took as long and the tests beside them slowed.)
#
# Under xdist (`make test`: two workers, --dist loadfile) every worker collects every test, and the first to claim a
# module (a file created exclusively in the folder both workers' temporary folders share) starts its jobs at once;
# a job's result (or error) is written there for whichever worker runs the module's tests, which go last
# (:data:`LAST`), by when the deployments have long finished beside the other tests. A worker that started jobs
# waits for them before it ends.
BACKGROUND: dict[str, Future] = {}
SHARED: list = []  # [the folder both workers share] under xdist


def _shared():
    return SHARED[0] if SHARED else None


def background(jobs: dict) -> None:
    """Start ``jobs`` (name: a function of no arguments), each in a daemon thread of its own; :func:`job_result`
    gives a job's result (a job started twice runs once). Under xdist each result is also written to the shared
    folder (``<name>.result``, a pickle of ("ok", value) or ("error", exception)), announced by ``<name>.started``."""
    import pickle

    new = {k: f for k, f in jobs.items() if k not in BACKGROUND}
    for k in new:
        BACKGROUND[k] = Future()
        if _shared() is not None:
            (_shared() / f"{k}.started").touch()

    def work(k):
        try:
            _quiet_first()
            out = ("ok", new[k]())
            BACKGROUND[k].set_result(out[1])
        except BaseException as e:  # noqa: BLE001 -- the test re-raises it
            out = ("error", e)
            BACKGROUND[k].set_exception(e)
        if _shared() is not None:
            try:
                data = pickle.dumps(out)
            except Exception:  # noqa: BLE001 -- an exception that does not pickle: its text
                data = pickle.dumps(("error", RuntimeError(repr(out[1]))))
            tmp = _shared() / f"{k}.result.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, _shared() / f"{k}.result")

    for k in new:
        threading.Thread(target=work, args=(k,), name=f"background-{k}", daemon=True).start()


def job_result(name: str, fn, timeout: float = 3600):
    """The result of background job ``name``: this process's, or (xdist) the other worker's from the shared folder;
    ``fn()`` started now if no one started it."""
    import pickle
    import time

    shared = _shared()
    if name not in BACKGROUND and shared is not None and (shared / f"{name}.started").exists():
        end = time.monotonic() + timeout
        while not (shared / f"{name}.result").exists():
            assert time.monotonic() < end, f"background job {name} of the other worker gave no result in {timeout} s"
            time.sleep(0.5)
        kind, value = pickle.loads((shared / f"{name}.result").read_bytes())
        if kind == "error":
            raise value
        return value
    if name not in BACKGROUND:
        background({name: fn})  # started by hand (a test run alone by its node id still has the session hook)
    return BACKGROUND[name].result(timeout=timeout)


_STARTED: set = set()
# files whose tests must have run before the background jobs start under xdist: a Ray cluster's start times out
# beside five Flower deployments starting at once (seen: "The current node timed out during startup"), and a
# Flower simulation on Ray is slow beside them
QUIET_FIRST = ("test_ray.py", "test_flower_simulation.py")
_QUIET: dict[str, int] = {}  # such a file: its tests this session has yet to finish (those of the worker that runs it)


def _quiet_first(limit: float = 600) -> None:
    """Under xdist, wait (at most ``limit`` seconds) until every :data:`QUIET_FIRST` file collected has finished,
    in whichever worker ran it (``<file>.done`` in the shared folder)."""
    import time

    end = time.monotonic() + limit
    while _shared() is not None and time.monotonic() < end and \
            not all((_shared() / f"{name}.done").exists() for name in _QUIET):
        time.sleep(1)


def pytest_runtest_logfinish(nodeid, location):
    name = os.path.basename(location[0])
    if name in _QUIET and _shared() is not None:
        _QUIET[name] -= 1
        if _QUIET[name] == 0:
            (_shared() / f"{name}.done").touch()


def _start_background(session, only=None) -> None:
    """Hand every module that defines ``start_background`` (or only module ``only``) its collected tests, once
    (under xdist: where this worker claims it first)."""
    by_module: dict = {}
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and hasattr(mod, "start_background") and only in (None, mod) and mod not in _STARTED:
            by_module.setdefault(mod, []).append(item)
    for mod, items in by_module.items():
        _STARTED.add(mod)
        if _shared() is not None:
            try:
                os.close(os.open(_shared() / f"{mod.__name__}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue  # the other worker runs its jobs
            base = _shared() / f"bg-{mod.__name__}"
            base.mkdir()
        else:
            base = session.config._tmp_path_factory.mktemp(f"bg-{mod.__name__}", numbered=False)
        mod.start_background(items, base)


# the files that take longest (a Ray cluster, or many runs of a page's commands) go first under xdist (with
# --no-loadscope-reorder, as `make test` runs it), one to each worker, so that no worker starts one of them when the
# other has nothing left; the files whose deployments run in the background from the start go last
FIRST = ("test_docs_pages.py", "test_ray.py", "test_flower_simulation.py", "test_docs_tutorial.py", "test_docs.py")
LAST = ("test_secagg.py", "test_flower_deploy.py", "test_flower_secure.py")


def pytest_collection_modifyitems(session, config, items):
    if XDIST:
        rank = {name: i for i, name in enumerate(FIRST)}
        rank.update({name: len(FIRST) + 1 + i for i, name in enumerate(LAST)})
        items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))


def pytest_collection_finish(session):
    # at once, beside every other test: in one process its jobs; under xdist, each worker the modules it claims
    if session.config.option.collectonly:
        return
    if XDIST:
        shared = session.config._tmp_path_factory.getbasetemp().parent / "background"  # the workers' common folder
        shared.mkdir(exist_ok=True)
        SHARED[:] = [shared]
        for name in QUIET_FIRST:
            if n := sum(item.path.name == name for item in session.items):
                _QUIET[name] = n
    _start_background(session)


def pytest_sessionfinish(session, exitstatus):
    """The background jobs this process started, awaited (under xdist the other worker may still need their results;
    not after an interrupt); whatever deployment is still up (a session interrupted), down with it."""
    import sys
    from concurrent.futures import wait

    if exitstatus != pytest.ExitCode.INTERRUPTED:
        wait(list(BACKGROUND.values()), timeout=3600)

    fc = sys.modules.get("flowercluster")
    for c in list(getattr(fc, "LIVE", ())):
        c.stop_all()
