"""Sample-level differential privacy: DP-SGD on each client (Abadi et al., CCS 2016) with opacus, ``--dp sample``.

What it protects: one training sample of one client. Everything a client sends over the run is
(epsilon_i, delta)-DP with respect to adding or removing one of its samples; ``epsilon_i`` is that client's own,
from its own accountant, and the run reports the largest (the worst client's). It says nothing about a client's
participation as a whole (that is ``--dp client``, :mod:`fedlt.core.dp`).

A client's local training -- the method's described steps (:class:`fedlt.core.steps.LocalSteps`), which
:func:`fedlt.core.steps.run_steps` hands to the method's step runner, here :meth:`DPSGD.run_steps` -- runs as DP-SGD:

- **batches**: Poisson sampling, as the accountant assumes: each of the client's ``n`` samples is in a step's batch
  with probability ``q = 1 / L`` independently (``L``: the number of batches of one of its epochs at
  ``--batch-size``; opacus's ``DPDataLoader`` takes ``sample_rate = 1 / len(data_loader)``), drawn by opacus's
  ``UniformWithReplacementSampler`` from the client's generator, ``L`` steps an epoch (a batch may be empty);
- **per-sample gradients** of the method's loss on one sample (``torch.func``: ``vmap`` of ``grad`` over the
  batch, the computation of opacus's functorch grad sampler, here over the whole loss: a proximal term or a
  trained extra tensor, which opacus's module hooks would not see, is per sample too);
- **clip, noise, average**: opacus's ``DPOptimizer`` around the step's SGD: each sample's gradient (over every
  trained tensor) clipped to L2 norm ``C`` (``--dp-clip``), ``N(0, (z C)^2 I)`` added to the batch's sum, divided by
  the expected batch size ``n q``; then the run's SGD step (momentum, weight decay: post-processing);
- **the accountant**: dp-accounting's ``RdpAccountant`` (the library of ``--dp client``, :mod:`fedlt.core.dp`, one for
  both levels), one per client: the optimiser's step hook composes every step into the client's ledger ``[(z, q,
  steps)]`` (:func:`fedlt.core.dpsgd_accounts.composed`), a ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` per step,
  converted to epsilon at ``delta`` over :data:`fedlt.core.dp.ORDERS`.

The noise multiplier: ``--dp-noise z`` for every client, or ``--dp-epsilon E``: each client's own ``z_i`` solved by
dp-accounting's ``calibrate_dp_mechanism`` for its ``q_i`` and its steps over the whole run (its rounds in the sampling
schedule, which is drawn from the seed before the run, times its steps a round), so that every client ends at or
below ``E``. ``delta``: ``--dp-delta``, else ``1 / n_max^1.1`` for every client (``n_max``: the largest client's
number of samples), below ``1 / n_i`` for every client.

What leaves a client: its model, trained only by these steps from what it received and from state that earlier
such steps made (covered); ``num_examples`` ``n_i`` (treated as public, as in DP-SGD's analysis, where the sampling
rate is set from it; the summary lists every ``q_i``); nothing else -- the loss statistics stay on the client, and a
post-training phase sends its count only. A part of the model that never leaves the client (a personal head) is
trained by the same DP-SGD where the described steps train it.

Which methods: those whose class declares ``dp_sample = True`` (:func:`fedlt.core.dp.runs_dp_sgd`): their local
training that shapes what the clients send runs only through described steps, and their loss of one sample reads
nothing of the client's other samples (class counts or priors of its data in the loss would let one sample move
every other sample's gradient). A subclass that changes a client hook without declaring it again is not covered.
BatchNorm models are refused (:func:`check_model`): a sample's output there depends on its batch.

On Flower (``fedlt flower``) each SuperNode runs its own client's DP-SGD (:meth:`SampleDP.on_client`, from the run's
settings and what the train message says: ``delta``, the client's rounds in the schedule, its noise multiplier once the
server knows it) and sends, beside its model and ``num_examples``, its accountant's new entries
(:data:`fedlt.core.dpsgd_wire.HISTORY`: ``(z_i, q_i, steps)``, which follow from ``n_i`` and the run's settings); the
server keeps every client's accountant from them (:meth:`fedlt.core.dpsgd_wire.SampleWire.arrived`, which checks the
rate and noise against the client's size and the run's settings), so that the run's epsilons, ``--dp-budget`` and the
summary's table are the simulator's. The per-sample gradient norms stay on the clients (the record's ``dp_clipped`` and
``dp_grad_norm`` are None there), and a SuperNode's describe sends its number of samples, no label counts.

Not batched: the clients of a round train one after another under ``--dp sample`` (``--client-parallel auto`` falls
back to that, ``--client-parallel N`` and ``--workers`` are refused); each client's per-sample gradients are
vectorised over its batch.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np
import torch
from torch.func import grad_and_value, vmap

from ..errors import ConfigError
from ..seeds import Purpose
from .dp import ACCOUNTANTS, reads_counts
from .dpsgd_accounts import SampleAccounts, batches_per_epoch, composed, delta_refusal, epsilon_of, sample_delta
from .dpsgd_wire import SampleWire, phase_replies
from .finetune import run_modules
from .noise import NOISE_SEEDS, keyed_seed
from .privacy import ROUNDS
from .steps import LocalSteps, StepModel, StepRun, Trained, frozen_net, split_loss, stats_of
from .training import Meter

COUNTS_NOISE = 5.0  # --dp-counts-noise's default: the std, in samples, of the noise on each class count
WORKING_MODELS = "smallcnn, cnn-mcmahan, vgg11 or mlp"


def import_opacus() -> Any:
    """The opacus package, or a one-line error that says how to install it."""
    try:
        import opacus
    except ImportError:
        raise ConfigError("--dp sample needs the opacus package (DP-SGD and its accountant): pip install "
                          "'fedlt[privacy]'") from None
    return opacus


def riders(cls) -> tuple[str, ...]:
    """The meta values that leave beside the model under DP-SGD (:func:`fedlt.core.dp.covered`), besides
    ``num_examples``: in the rounds, what method class ``cls``'s clients send back as the server sent it (category
    ``echo``: GBME's mode) and what follows from a client's size and the run's settings (``size``: FedNova's step
    weight; public, as ``num_examples`` is in DP-SGD's analysis)."""
    return tuple(s.name for s in getattr(cls, "sends", ()) if s.category in ("echo", "size") and s.meta
                 and s.when == ROUNDS and s.name != "num_examples")


def counts_of(cfg) -> float:
    """--dp-counts-noise, else its default :data:`COUNTS_NOISE`."""
    value = getattr(cfg, "dp_counts_noise", None)
    return COUNTS_NOISE if value is None else float(value)


def check_counts_release(cfg, cls, sizes=None) -> None:
    """Before a run writes anything: a ``--dp-epsilon`` that the class counts' release alone would spend (a method
    whose loss reads them, :func:`reads_counts`) is one line. ``delta``: ``--dp-delta``, else the default from the
    clients' ``sizes`` (not checked here without either: the first client to solve its noise says it)."""
    if cfg.dp != "sample" or cfg.dp_epsilon is None or not reads_counts(cls):
        return
    if cfg.dp_delta is None and sizes is None:
        return
    delta = float(cfg.dp_delta) if cfg.dp_delta is not None else sample_delta(np.asarray(sizes))
    s = counts_of(cfg)
    if (alone := epsilon_of(((s, 1.0, 1),), delta)) >= cfg.dp_epsilon:
        raise ConfigError(f"--dp-epsilon {cfg.dp_epsilon:g}: the release of each client's class counts alone spends "
                          f"{alone:.3g} at delta {delta:.3g} (--dp-counts-noise {s:g}); raise --dp-epsilon or "
                          f"--dp-counts-noise")


def check_before_run(cfg, cls, sizes, schedule=None, epochs: int = 1) -> None:
    """What ``--dp sample`` can tell before a run writes anything, once the clients' ``sizes`` are known (fedlt run's
    ``prepare``), each a one-line ConfigError: a given ``--dp-delta`` not below ``1 / n`` of the largest client
    (:func:`fedlt.core.dpsgd_accounts.delta_refusal`); a ``--dp-epsilon`` the class counts' release alone spends
    (:func:`check_counts_release`); and with the run's sampling ``schedule`` (``epochs``: a round's epochs,
    ``Method.dp_round_epochs``) a noise that no client can train under -- even the client with the largest expected
    batch ``n q`` gets noise of std ``z C / (n q)`` on its averaged step gradient above the clip ``C`` -- and a
    ``--dp-budget`` that the first round passes."""
    if cfg.dp != "sample":
        return
    sizes = np.asarray(sizes)
    if cfg.dp_delta is not None and (why := delta_refusal(cfg.dp_delta, sizes)):
        raise ConfigError(why)
    check_counts_release(cfg, cls, sizes)
    if schedule is None:
        return
    dp = SampleDP(cfg.dp_clip, cfg.dp_noise, cfg.dp_epsilon, cfg.dp_delta, schedule, lambda: sizes, cfg.dp_budget,
                  cfg.batch_size, epochs, counts_noise=counts_of(cfg) if reads_counts(cls) else None)
    noise, batch = {}, {}  # each client's noise multiplier z and expected batch n q = n / L
    for c in sorted({c for cids in schedule for c in cids}):
        L = batches_per_epoch(int(sizes[c]), cfg.batch_size)
        noise[c], batch[c] = dp.accounts.noise_of(c, 1.0 / L, epochs * L, keep=False), int(sizes[c]) / L
    best = min(noise, key=lambda c: (noise[c] / batch[c], c), default=None)
    if best is not None and noise[best] > batch[best]:
        given = "--dp-noise" if cfg.dp_noise is not None else f"solved for --dp-epsilon {cfg.dp_epsilon:g}"
        raise ConfigError(f"--dp sample: the noise multiplier {noise[best]:.3g} ({given}) puts noise of std "
                          f"{noise[best] / batch[best]:.3g} x --dp-clip on the averaged step gradient even of client "
                          f"{best}, the least noisy (expected batch {batch[best]:.3g} samples), more than any clipped "
                          f"gradient moves it, so nothing can train; "
                          + ("use a smaller --dp-noise" if cfg.dp_noise is not None else
                             "train fewer --rounds or --local-epochs, or allow a larger --dp-epsilon"))
    worst, eps = dp.accounts.round_epsilon(1)
    if cfg.dp_budget is not None and eps > cfg.dp_budget:
        raise ConfigError(f"--dp-budget {cfg.dp_budget:g} is below the first round's epsilon {eps:.3g} (client "
                          f"{worst}'s, delta {dp.accounts.delta:.3g}), so no round could run; raise --dp-budget, or "
                          f"spend less a round: more noise (--dp-noise, or a smaller --dp-epsilon) or fewer "
                          f"--local-epochs")


def check_model(model: torch.nn.Module, name: str) -> None:
    """A model DP-SGD cannot train (BatchNorm: each sample's output depends on its batch; opacus's
    ``ModuleValidator`` finds them): one line naming models that work."""
    import_opacus()
    from opacus.validators import ModuleValidator

    was = model.training
    errors = ModuleValidator.validate(model.train(), strict=False)
    model.train(was)
    norms = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms or errors:
        what = "BatchNorm layers (a sample's output depends on the others in its batch)" if norms else \
            str(errors[0]).split(". ")[0]
        raise ConfigError(f"--dp sample cannot train model {name}: it has {what}, which per-sample gradients "
                          f"cannot bound; use --model {WORKING_MODELS}")


def unamplified_words(table: dict) -> str:
    """The privacy line's words for the clients of a ``--dp sample`` run's table (:meth:`SampleDP.table`) that had no
    amplification by sampling (their samples make one batch an epoch,
    :func:`fedlt.core.dpsgd_accounts.batches_per_epoch`: sampling rate 1, every sample in every step), or "" where
    none."""
    none = table.get("unamplified") or []
    if not none:
        return ""
    return (f"{len(none)} of {len(table['clients'])} clients without amplification by sampling (one batch of "
            f"--batch-size an epoch: sampling rate 1)")


@contextlib.contextmanager
def eager_attention(*nets: torch.nn.Module):
    """While it lasts, the Hugging Face models inside ``nets`` attend "eager" (plain matmuls and a softmax) where
    they were "sdpa": torch has no vmap rule for scaled_dot_product_attention's CPU kernels, forward or backward, so
    under per-sample gradients they run one sample at a time (torch warns "There is a performance drop because we
    have not yet implemented the batching rule"), while eager attention batches like any layer. The same function to
    float rounding (``benchmarks/dp_attention.py`` measures both); restored after, as the backbone is shared by
    every model of the process (:func:`fedlt.core.finetune.shared_backbone`). Yields the models it switched."""
    switched = [m for net in nets for m in run_modules(net)
                if hasattr(m, "set_attn_implementation")
                and getattr(getattr(m, "config", None), "_attn_implementation", None) == "sdpa"]
    for m in switched:
        m.set_attn_implementation("eager")
    try:
        yield switched
    finally:
        for m in switched:
            m.set_attn_implementation("sdpa")


def per_sample_grads(method, steps: LocalSteps, run: StepRun, part_names: list[str]) -> Callable:
    """``f(tp, x, y) -> (grads, (losses, [loss, *parts] per sample))``: the gradient of the described loss of each
    sample of the batch ``(x, y)`` alone, with respect to the trained tensors ``tp`` (by name), vectorised over the
    batch; the other model tensors and the constant extras as they are now."""
    net, groups = run.net, run.groups
    train_model = [n for n in run.params if n in groups]
    train_extra = [n for n in run.extra if n in groups]
    fixed = {n: t.detach() for n, t in (*net.named_parameters(), *net.named_buffers()) if n not in groups}
    const = {n: t for n, t in run.extra.items() if n not in groups}
    frozen = frozen_net(method)

    def one(tp, x, y):
        model = {n: tp[n] for n in train_model}
        view = StepModel(net, model, frozen, {**fixed, **model})
        total, parts = split_loss(steps.loss(view, x[None], y[None], {**const, **{n: tp[n] for n in train_extra}}))
        part_names[:] = list(parts)
        return total, torch.stack([total, *parts.values()]).detach()

    return vmap(grad_and_value(one, has_aux=True), in_dims=(None, 0, 0), randomness="different")


class DPSGD:
    """DP-SGD for a client's described steps (the module doc), the :class:`fedlt.core.steps.StepRunner` of ``--dp
    sample``: Poisson batches, per-sample gradients, opacus's DPOptimizer around the run's SGD, its step hook composing
    every step into the client's accountant (``accounts``: :class:`fedlt.core.dpsgd_accounts.SampleAccounts`); the class
    counts a loss reads, noised once (:meth:`client_data`). ``key``: the clients' noise key (``--dp-noise-seed secret``;
    None: from the run's ``seed``)."""

    per_sample = True

    def __init__(self, accounts: SampleAccounts, clip: float, key: str | None = None, seed: int = 0):
        self.accounts, self.clip, self.key, self.seed = accounts, float(clip), key, int(seed)
        self.norms: list[torch.Tensor] = []  # this round's per-sample gradient norms (before clipping)

    @property
    def counts_noise(self) -> float | None:
        return self.accounts.counts_noise

    def client_data(self, data):
        """``data`` as the client's loss may read it under DP-SGD: for a method whose loss reads the class counts,
        a view whose ``counts`` are the client's own plus ``N(0, counts_noise^2)`` per class, rounded, at least 0
        (post-processing), the same draw every time (from the noise key, or the run's seed, and the client's id:
        one release); else ``data`` itself."""
        if self.counts_noise is None:
            return data
        import copy

        from .noise import noise_generator

        counts = np.asarray(data.counts, dtype=np.float64)
        gen = noise_generator(self.key, self.seed, Purpose.DP_COUNTS, int(data.client_id))
        noise = torch.randn(len(counts), generator=gen, dtype=torch.float64).numpy() * self.counts_noise
        view = copy.copy(data)
        view.counts = np.clip(np.rint(counts + noise), 0, None)
        return view

    def run_steps(self, method, steps: LocalSteps, data, gen: torch.Generator, lr: float | None = None) -> Trained:
        """One client's described steps as DP-SGD (the module doc): Poisson batches, per-sample gradients, opacus's
        DPOptimizer around the run's SGD, its step hook composing every step into the client's ledger."""
        from opacus.optimizers import DPOptimizer
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        spec = method.spec
        cid, n = int(data.client_id), len(data)
        L = batches_per_epoch(n, spec.batch_size)
        rate, epochs = 1.0 / L, spec.local_epochs if steps.epochs is None else steps.epochs
        per_round = method.dp_round_epochs() * L  # all of the round's stages (FedRep: head, then body)
        accounts = self.accounts
        z = accounts.noise_of(cid, rate, per_round)
        accounts.steps_of[cid] = per_round
        run = StepRun(method, steps, lr)
        run.net.train()
        trained = [run.live[k] for k in run.groups]
        dev = trained[0].device if trained else torch.device(spec.device)
        draw = int(torch.randint(0, 2**62, (1,), generator=gen))  # the same batches with either --dp-noise-seed
        noise_gen = torch.Generator(device=dev).manual_seed(draw if self.key is None else
                                                            keyed_seed(self.key, cid, draw))
        opt = DPOptimizer(run.opt, noise_multiplier=z, max_grad_norm=self.clip, expected_batch_size=n * rate,
                          generator=noise_gen)
        ledger = [tuple(h) for h in accounts.history_of(cid)]

        def step_hook(optim) -> None:  # each step: one Poisson-sampled Gaussian mechanism, into the ledger
            ledger[:] = composed(ledger, [(optim.noise_multiplier, rate * optim.accumulated_iterations, 1)])

        opt.attach_step_hook(step_hook)
        part_names: list[str] = []
        with eager_attention(run.net, frozen_net(method)):  # vmap batches it (see there)
            grads_of = per_sample_grads(method, steps, run, part_names)
            sampler = UniformWithReplacementSampler(num_samples=n, sample_rate=rate, generator=gen, steps=L)
            meter, norms, done = Meter(), [], 0
            for _ in range(epochs):
                for idx in sampler:
                    opt.zero_grad(set_to_none=True)
                    if idx:
                        x, y = data.sample_batch(torch.tensor(idx, dtype=torch.long), gen, train=True)
                        grads, (_, vec) = grads_of({k: t.detach() for k, t in zip(run.groups, trained)}, x, y)
                        for k, t in zip(run.groups, trained):
                            t.grad_sample = grads[k]
                        norms.append(torch.stack([g.reshape(len(g), -1).norm(2, dim=1) for g in grads.values()], 1)
                                     .norm(2, dim=1))
                        meter.add(vec.mean(0))
                    else:  # an empty Poisson batch: the step is the noise alone (opacus's empty-batch case)
                        for t in trained:
                            t.grad_sample = t.new_zeros((0, *t.shape))
                    with torch.autocast(dev.type, enabled=False):  # opacus's clip and sum in the parameters' dtype
                        opt.step()
                    done += 1
        for t in trained:  # nothing of the per-sample gradients outlives the steps
            t.grad_sample = t.summed_grad = None
        accounts.trained(cid, ledger, rate)
        if norms:
            self.norms.append(torch.cat(norms).detach().cpu())
        means = meter.mean() if meter.steps else [0.0] * (1 + len(part_names))
        return run.trained(stats_of(part_names, means, done))


class SampleDP:
    """The run's sample-level DP (``--dp sample``), a :class:`fedlt.core.privacy.PrivacyMechanism`: each client's
    accountant (``accounts``, :class:`fedlt.core.dpsgd_accounts.SampleAccounts`), the DP-SGD its described steps run by
    (``trainer``, :class:`DPSGD`, the step runner the engine gives the method), the Flower wire protocol (``wire``,
    :class:`fedlt.core.dpsgd_wire.SampleWire`), and what the driver asks of a mechanism (the replies as they leave, the
    round's record, the checkpoint, the summary's table)."""

    def __init__(self, clip: float, noise: float | None, target: float | None, delta: float | None,
                 schedule: list[list[int]], sizes: Callable[[], Any], budget: float | None = None,
                 batch_size: int = 32, local_epochs: int = 1, key: str | None = None,
                 counts_noise: float | None = None, seed: int = 0, riders: tuple[str, ...] = (), source: str = ""):
        import_opacus()
        self.accounts = SampleAccounts(noise, target, delta, schedule, sizes, budget, batch_size, local_epochs,
                                       counts_noise)
        # --dp-noise-seed secret: the clients' noise key (a SuperNode's own: on_client); None: from the run's seed
        self.trainer = DPSGD(self.accounts, clip, key, seed)
        # the meta a round's reply keeps: its size and what rides with it
        self.wire = SampleWire(self.accounts, ("num_examples", *riders))
        self.source = source  # where the noise comes from, in words (core.noise.noise_source)
        self.remote = False  # the clients train by DP-SGD themselves (Flower's): their gradient norms stay there

    @property
    def key(self) -> str | None:
        return self.trainer.key

    @classmethod
    def of(cls, cfg, method, schedule: list[list[int]], sizes: Callable[[], Any]) -> "SampleDP":
        """The run's sample-level DP from its settings (``cfg``: the engine's, ``fedlt.engine.driver.EngineConfig``,
        every ``dp_*`` setting by its declared name), the method (its batch size and epochs a round, whether its
        loss reads the class counts, what rides with its replies), the sampling ``schedule`` and the clients'
        sizes (read when first needed)."""
        from .noise import noise_key, noise_source

        kind = type(method)
        return cls(cfg.dp_clip, cfg.dp_noise, cfg.dp_epsilon, cfg.dp_delta, schedule, sizes, budget=cfg.dp_budget,
                   batch_size=method.spec.batch_size, local_epochs=method.dp_round_epochs(),
                   key=noise_key(cfg, cfg.deployed), counts_noise=counts_of(cfg) if reads_counts(kind) else None,
                   seed=cfg.seed, riders=riders(kind), source=noise_source(cfg, "sample", cfg.deployed))

    @classmethod
    def on_client(cls, cfg, cid: int, ctl, key: str | None = None, counts: bool = False,
                  riders: tuple[str, ...] = ()) -> "SampleDP":
        """A SuperNode's DP-SGD for its client ``cid`` (Flower; its ``trainer`` the method's step runner, its ``wire``
        the reply's form): the run's clip and noise or target epsilon, and what the server's message says
        (``dp-delta``; ``dp-rounds``: the client's rounds in the schedule, for
        --dp-epsilon; ``dp-noise``: its noise multiplier, once the server knows it from an earlier reply);
        ``key``: the SuperNode's own noise key (``--dp-noise-seed secret``); ``counts``: the method's loss reads the
        client's class counts (:func:`reads_counts`; ``dp-counted``: the server has counted their release)."""
        if "dp-delta" not in ctl:
            raise ConfigError("--dp sample: the message carries no delta (dp-delta), so this client cannot solve its "
                              "noise: the server runs another fedlt")
        dp = cls(cfg.dp_clip, cfg.dp_noise, cfg.dp_epsilon, float(ctl["dp-delta"]), [], lambda: [],
                 batch_size=cfg.batch_size, local_epochs=cfg.local_epochs, key=key,
                 counts_noise=counts_of(cfg) if counts else None, seed=cfg.seed, riders=riders)
        a = dp.accounts
        a.rounds_of = {int(cid): int(ctl.get("dp-rounds", 1))}
        if int(ctl.get("dp-counted", 0)):
            a.counted.add(int(cid))
        if "dp-noise" in ctl:
            a.noises[int(cid)] = float(ctl["dp-noise"])
        return dp

    # ------------------------------------------------------------------------------------------- the driver
    def client_side(self, payloads: dict, replies: list) -> list:
        """Each reply as its client sends it: the model it trained by DP-SGD, ``num_examples`` and the meta that
        rides with it (:func:`riders`); its training statistics stay with it."""
        from .method import Message

        keep = self.wire.keep
        return [(cid, Message(r.arrays, {k: r.meta[k] for k in keep if k in r.meta})) for cid, r in replies]

    def phase_side(self, phase: str, replies: list) -> list:
        """A post-training phase's replies: ``num_examples`` only (:func:`fedlt.core.dpsgd_wire.phase_replies`)."""
        return phase_replies(phase, replies)

    def arrived(self, payloads: dict, replies: list, phase: str | None = None) -> tuple[list, dict[int, str]]:
        """The replies of clients that trained by DP-SGD themselves (Flower's SuperNodes): checked and counted
        (:meth:`fedlt.core.dpsgd_wire.SampleWire.arrived`), then as :meth:`client_side` (a phase's: :meth:`phase_side`)
        gives them."""
        self.remote = True
        out, why = self.wire.arrived(replies, phase)
        return (self.client_side(payloads, out) if phase is None else self.phase_side(phase, out)), why

    def server_side(self, replies: list, gen: torch.Generator) -> list:
        """Nothing: the noise was added on the clients."""
        return replies

    def epsilon(self, rounds: int) -> float:
        """The worst client's epsilon after the rounds done (``rounds`` is the driver's; the accountants hold them)."""
        return self.accounts.worst()[1]

    def over_budget(self, rnd: int) -> str | None:
        return self.accounts.over_budget(rnd)

    def record(self) -> dict:
        """The round's DP fields of metrics.jsonl: the worst client so far, the share of per-sample gradients the
        clip shortened and their median norm before clipping (the number to tune --dp-clip to)."""
        t = self.trainer
        norms = torch.cat(t.norms) if t.norms else torch.zeros(0)
        t.norms = []
        if self.remote:
            return {"dp_worst_client": self.accounts.worst()[0], "dp_clipped": None, "dp_grad_norm": None}
        return {"dp_worst_client": self.accounts.worst()[0],
                "dp_clipped": float((norms > t.clip).double().mean()) if len(norms) else 0.0,
                "dp_grad_norm": float(norms.median()) if len(norms) else None}

    def state_dict(self) -> dict:
        """What a checkpoint keeps: every client's accountant
        (:meth:`fedlt.core.dpsgd_accounts.SampleAccounts.state_dict`) and the noise key."""
        return {**self.accounts.state_dict(), **({} if self.key is None else {"key": self.key})}

    def load_state_dict(self, d: dict) -> None:
        self.accounts.load_state_dict(d)
        if self.key is not None and "key" in d:
            self.trainer.key = str(d["key"])

    def table(self, rounds: int) -> dict:
        """summary.json's ``dp``: the worst client's epsilon, and every client's accountant inputs, to recompute
        each with dp-accounting (:func:`fedlt.core.dpsgd_accounts.epsilon_of`)."""
        from importlib.metadata import version

        opacus = import_opacus().__version__
        a = self.accounts
        worst, eps = a.worst()
        return {"level": "sample", "epsilon": eps, "worst_client": worst, "delta": a.delta,
                "noise_multiplier": a.noise, "target_epsilon": a.target, "clip": self.trainer.clip, "rounds": rounds,
                "clients": a.clients(),
                "unamplified": [c for c in sorted(a.histories) if a.rates[c] >= 1.0],
                "sampling": "Poisson: each sample in a step with probability sample_rate = 1 / (its batches an "
                            "epoch), 1 / sample_rate steps an epoch (opacus UniformWithReplacementSampler)",
                "adjacency": "add or remove one sample of one client",
                "noise_seed": NOISE_SEEDS["run" if self.key is None else "secret"],
                **({"noise_source": self.source} if self.source else {}),
                **({} if a.counts_noise is None else {
                    "counts_noise": a.counts_noise,
                    "counts": "the method's loss reads each client's class counts: it reads them plus N(0, "
                              "counts_noise^2) per class, rounded, at least 0, drawn once (a histogram one sample "
                              "changes by 1: each history begins with (counts_noise, 1, 1))"}),
                "mechanism": f"opacus {opacus} DPOptimizer: per-sample gradients clipped to clip, "
                             f"N(0, (noise_multiplier clip)^2) on their sum, divided by samples x sample_rate",
                "accountant": f"dp-accounting {version('dp-accounting')} {ACCOUNTANTS['rdp']}, one per client, "
                              f"composing PoissonSampledDpEvent(sample_rate, GaussianDpEvent(noise_multiplier)) "
                              f"steps times for each entry of its history [(noise_multiplier, sample_rate, steps)] "
                              f"(opacus's DPOptimizer step hook composes every step into it), get_epsilon(delta)"}
