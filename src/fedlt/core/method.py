"""The method interface: one object with server hooks and client hooks that exchange plain messages.

A method never imports an engine, and an engine never names a method. The simulation engine calls the hooks
in one process; the Flower engine maps the very same calls onto ServerApp/ClientApp messages. So the only
things that cross between the two sides are :class:`Message` objects (flat ``str -> Tensor`` arrays plus a
small dict of numbers/strings/lists), and each side keeps its own state:

server side                                   client side
-----------                                   -----------
init_server() -> state                        init_client(cid, data) -> client_state   (never leaves the client)
configure(state, rnd, cid) -> Message   ==>   local_train(payload, cstate, data, gen) -> (Message, cstate)
                                              (or, described: local_steps(payload, cstate, data) -> LocalSteps,
                                              run by the engine, then local_reply(..., Trained) -> (Message,
                                              cstate); see fedlt.core.steps) -- at the round's lr, which the
                                              driver sends with every payload (Message.lr)
aggregate(state, rnd, [(cid, Message)]) <==
after the rounds, for each name in ``phases`` (one message to each client the driver's phases reach -- every
client, or at cross-device scale the ones that trained and the evaluation sample -- and back):
phase_configure(name, state, cid)       ==>   phase_client(name, payload, cstate, data, gen)
phase_aggregate(name, state, replies)   <==
inference:
global_model(state) -> Predictor | {mode: Predictor}
eval_payload(state, cid)                ==>   personal_model(payload, cstate, data) -> Predictor | dict | None
``rnd`` is the training round (1, 2, ...); the base phase_configure and eval_payload call configure with the named
stages PHASE and EVALUATION instead (:class:`Stage`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..decl import check_values, from_values
from ..models import Model, build_model, model_options
from ..seeds import derive_seed  # noqa: F401  (the methods' name for it: fedlt.core.derive_seed)
from .finetune import build_finetune_model
from .privacy import MODEL, Sent, check_declaration, sent
from .spec import RunSpec, load_weights, weights_of
from .state import ServerState, state_from
from .steps import PLAIN_STEPS, StepRunner, run_steps

Meta = dict[str, Any]


@dataclass
class Message:
    """What crosses between server and client: named arrays and a small dict of plain values (``meta``, the
    method's), plus ``config``: the values of this round that the run driver sets on every message it sends --
    ``lr``, the round's local learning rate (a post-training phase gets the last round's) -- as Flower's
    strategies put per-round values in a message's config. A method neither sets nor copies ``config``; its
    client hooks read the round's lr as :attr:`lr`, and the shared training loop and step executors take it
    from there."""

    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: Meta = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.arrays.values()))

    @property
    def lr(self) -> float | None:
        """The round's local learning rate this message carries (None: none was sent, e.g. a hook called
        directly in a test; the run's ``spec.lr`` applies)."""
        v = self.config.get("lr")
        return None if v is None else float(v)

    def with_config(self, values: dict[str, Any]) -> "Message":
        """This message with ``values`` added to its config (a new Message; the arrays and meta are shared)."""
        return Message(self.arrays, self.meta, {**self.config, **values})


@dataclass
class Predictor:
    """An inference path: ``head(backbone(x))``.

    ``shared_backbone`` promises that ``backbone`` computes exactly the global model's features, so the
    evaluator may compute test features once and reuse them for every client's head.
    """

    backbone: Callable[[torch.Tensor], torch.Tensor]
    head: Callable[[torch.Tensor], torch.Tensor]
    shared_backbone: bool = False


class Stage(int):
    """What :meth:`Method.configure`'s ``rnd`` is outside the training rounds (1, 2, ...): :data:`PHASE`, a
    post-training phase's message, or :data:`EVALUATION`, an evaluation's. An int (-1, 0) for the methods that
    compare round numbers (``rnd > warmup`` is false for both); test which with ``rnd is PHASE``."""

    def __new__(cls, value: int, name: str):
        self = super().__new__(cls, value)
        self.name = name
        return self

    def __repr__(self) -> str:
        return self.name.upper()


PHASE = Stage(-1, "phase")
EVALUATION = Stage(0, "evaluation")


class Method:
    """Base class with FedAvg behaviour; a method overrides the hooks it changes.

    Its name is its registration's (``@METHODS.register("name")`` sets ``name``). Subclasses set a ``Params`` dataclass of hyper-parameters (defaults as the paper, each field
    declared with :func:`fedlt.decl.setting`: its help, range or choices, None for "the variant's default";
    the base class checks every value against its declaration, so a method checks only what relates two
    parameters; a plain field with a comment still works), and
    ``personalized`` when they have personal models and ``generic = False`` when ``global_model`` returns
    None (no generic model). ``phases`` names the post-training phases.
    """

    name: str = "base"
    personalized: bool = False
    generic: bool = True
    phases: tuple[str, ...] = ()

    @dataclass
    class Params:
        pass

    State = ServerState  # the server state's fields (core.state): a method with more declares State(Base.State)

    # what its clients send, every array and meta value, in the rounds and in each phase (core.privacy, the page
    # docs/privacy.md): a method whose replies differ declares its own beside its Params/State, built from its base
    # class's by name: ``sends_with(Base.sends, sent(...), ...)`` (an item of the same name replaces the base's)
    sends: tuple[Sent, ...] = (
        sent(MODEL, "model", "the trained model, every entry of its state dict"),
        sent("num_examples", "size", "the number of training samples", meta=True),
        sent("*", "scalars", "training statistics: the mean loss, its parts, the steps", meta=True, numbers_only=True),
    )
    # --dp sample (core.dpsgd): True where the local training that shapes what the clients send runs only through
    # described steps (local_steps) whose loss of one sample reads nothing of the client's other samples; "counts"
    # where that loss also reads the client's class counts (data.counts), which DP-SGD then gives it noised once
    # (--dp-counts-noise, counted in the client's accountant); a subclass that changes a client hook declares it
    # again (dp.runs_dp_sgd)
    dp_sample: bool | str = False
    # --dp client: why its server's use of each reply is not covered by the noised mean, in words ("" where it is)
    dp_client_refusal: str = ""
    # --dp sample: what else it needs, in words for ``fedlt list`` ("" where nothing); :meth:`dp_sample_refusal` checks
    dp_sample_needs: str = ""
    # --secagg (core.secagg): True where the rounds' aggregate needs only the num_examples-weighted mean of the
    # replies' floating-point arrays (and each reply's meta, which SecAgg+ leaves in the clear) -- what Flower's
    # SecAgg+ hands the server; a subclass that changes aggregate or sends declares it again (:func:`declares`)
    secagg: bool = False
    # --finetune head/lora (core.finetune.NEEDS): what of the model the algorithm needs that a frozen pre-trained
    # backbone may not give it, {need: what, in the method's words}; the run refuses the modes that lack it
    finetune_needs: dict[str, str] = {}
    # how the clients' described steps run (core.steps.StepRunner): plain SGD; under --dp sample the run's DP-SGD
    # (core.dpsgd.DPSGD), selected by the privacy mechanism for the clients it trains (engine.privacy) and by a
    # Flower SuperNode for its own
    step_runner: StepRunner = PLAIN_STEPS

    def dp_round_epochs(self) -> int:
        """--dp sample: the epochs of DP-SGD a client runs in a round, over all its described stages (its accountant
        steps ``L`` times these): the run's local epochs; a method that runs several stages says their sum."""
        return self.spec.local_epochs

    @classmethod
    def dp_sample_refusal(cls, params) -> str:
        """Under --dp sample, why these parameters ask for local training other than the declared DP-SGD-able one
        and what to set instead ("" where they do not): the run refuses it in one line (``fedlt.config``)."""
        return ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for base in cls.__mro__[1:]:  # a State that drops a base's fields would fail in that base's hooks
            st = base.__dict__.get("State")
            if st is not None and not issubclass(cls.State, st):
                raise TypeError(f"{cls.__qualname__}.State must subclass {base.__qualname__}.State "
                                f"(declare State({base.__qualname__}.State, ...))")
        check_declaration(cls)  # every Sent sent in the rounds, "*" or one of its phases

    def __init__(self, spec: RunSpec, params: Any = None):
        self.spec = spec
        self.p = params if params is not None else self.Params()
        if dataclasses.is_dataclass(self.p):  # every parameter against its declaration, however Params was made
            check_values(self.p, prefix=self.name, allow_large=getattr(spec, "allow_large", False))
        self._net: Model | None = None  # client-side working model, reused across clients

    # ---------------------------------------------------------------- hyper-parameters
    @classmethod
    def make_params(cls, overrides: dict[str, Any] | None = None, allow_large: bool = False):
        """Params from defaults plus overrides (TOML values, or text from the command line), each coerced to its
        declared type and checked against its declaration (:mod:`fedlt.decl`): one-line ConfigErrors.
        ``allow_large`` (the run's ``--allow-large``) lets values past a declared limit through."""
        return from_values(cls.Params, dict(overrides or {}), prefix=cls.name, owner=f"method {cls.name}",
                           what="parameter", allow_large=allow_large)

    # ---------------------------------------------------------------- models
    # fp16 needs a gradient scaler around every backward and optimiser step: the shared loop and the step
    # executors have one; a method whose loop of its own has none sets this False (fp16 is then refused).
    fp16: bool = True

    def new_model(self) -> Model:
        """The initial model: identical on every process (seeded by the run seed), on the run's device, in
        channels_last memory format where that is asked for (see ``RunSpec.channels_last``)."""
        s = self.spec
        if s.finetune != "full":  # a frozen backbone, shared, outside the model (core.finetune)
            return build_finetune_model(s)
        m = build_model(s.model, s.in_shape, s.num_classes, seed=s.seed, **model_options(s)).to(s.device)
        conv = any(isinstance(x, nn.Conv2d) for x in m.modules())
        auto = torch.device(s.device).type == "cuda" and s.precision != "fp32" and conv
        if s.channels_last == "on" or (s.channels_last == "auto" and auto):
            m = m.to(memory_format=torch.channels_last)
        return m

    @property
    def net(self) -> Model:
        if self._net is None:
            self._net = self.new_model()
        return self._net

    # ---------------------------------------------------------------- server
    def init_server(self) -> ServerState:
        return self.State(weights=weights_of(self.new_model()))

    def server_state(self, tree: Any) -> ServerState:
        """The method's :attr:`State` from a saved tree (a checkpoint's, a Flower record's: ``core.state.tree_of``)."""
        return state_from(self.State, tree, owner=f"method {self.name}")

    def configure(self, state: ServerState, rnd: int, cid: int) -> Message:
        return Message(arrays=dict(state.weights))

    def aggregate(self, state: ServerState, rnd: int, replies: list[tuple[int, Message]]) -> ServerState:
        """The round's new server state from the replies. Default: FedAvg's mean of the replies' arrays, weighted by
        ``num_examples``.

        Contract -- *replies rewritten to the mechanism's estimate*: a privacy mechanism hands this hook replies
        rewritten so that the statistic a mean-taking server computes from them is the mechanism's estimate, and the
        method runs unchanged. Under ``--dp client`` every reply weighs 1 and their uniform mean is DP-FedAvg's
        noised estimate ``w + (sum of clipped updates + noise) / (q K)`` (:func:`fedlt.core.dp.noised_replies`), a
        class-mean array's per-class mean is the noised sum over the noised count
        (:func:`fedlt.core.dp.noised_class_means`); under ``--secagg`` each reply is what it received plus the
        securely aggregated mean update, so any weighted mean of them is that mean
        (:func:`fedlt.core.secagg.replies_with_mean`). A method whose server reads a reply on its
        own (a norm, a per-client statistic, a reply's weight) is outside the contract and says so
        (``dp_client_refusal``, ``secagg``)."""
        from .aggregation import weighted_average

        new = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies])
        state.weights = {**state.weights, **new}
        return state

    # ---------------------------------------------------------------- client
    def init_client(self, cid: int, data) -> dict:
        return {}

    def local_steps(self, payload: Message, cstate: dict, data):
        """This client's local training as a :class:`fedlt.core.steps.LocalSteps` (a loss, which tensors train
        and how), for the engine to run -- alone or batched with the round's other clients. None (the default):
        the method runs its own loop in :meth:`local_train`."""
        return None

    def local_reply(self, payload: Message, cstate: dict, data, out) -> tuple[Message, dict]:
        """The reply (and new client state) from the :class:`fedlt.core.steps.Trained` of :meth:`local_steps`.
        Default: the whole trained model, with the number of examples and the training statistics."""
        return Message(out.weights, {"num_examples": len(data), **out.stats}), cstate

    def local_train(self, payload: Message, cstate: dict, data, gen: torch.Generator) -> tuple[Message, dict]:
        """One client's training of one round. Default: run :meth:`local_steps` here, one client alone, and
        answer with :meth:`local_reply`; a method with a loop of its own overrides this instead."""
        data = self.step_runner.client_data(data)  # DP-SGD: class counts the loss reads, noised once (core.dpsgd)
        steps = self.local_steps(payload, cstate, data)
        if steps is None:
            raise NotImplementedError(f"method {self.name} defines neither local_steps nor local_train")
        return self.local_reply(payload, cstate, data, run_steps(self, steps, data, gen, payload.lr))

    def round_lr(self, payload: Message) -> float:
        """The round's local learning rate: the one ``payload`` carries (:attr:`Message.lr`, set by the run
        driver), else the run's ``spec.lr``."""
        return self.spec.lr if payload.lr is None else payload.lr

    @classmethod
    def describes_steps(cls) -> bool:
        """Whether the method describes its local training (:meth:`local_steps`), so clients can be batched."""
        return cls.local_steps is not Method.local_steps and cls.local_train is Method.local_train

    # ---------------------------------------------------------------- post-training phases
    def phase_configure(self, phase: str, state: ServerState, cid: int) -> Message:
        return self.configure(state, PHASE, cid)

    def phase_client(self, phase: str, payload: Message, cstate: dict, data, gen) -> tuple[Message, dict]:
        return Message(), cstate

    def phase_aggregate(self, phase: str, state: ServerState, replies: list[tuple[int, Message]]) -> ServerState:
        return state

    # ---------------------------------------------------------------- inference
    def global_model(self, state: ServerState) -> Predictor | dict[str, Predictor]:
        m = self.eval_model(state.weights)
        return Predictor(m.backbone, m.head, shared_backbone=True)

    def eval_payload(self, state: ServerState, cid: int) -> Message:
        return self.configure(state, EVALUATION, cid)

    def personal_model(self, payload: Message, cstate: dict, data) -> Predictor | dict[str, Predictor] | None:
        """None: no personal model; PM is then the global model on the client's test set (labelled so)."""
        return None

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """State kept on the method *instance* that a checkpoint needs for an exact resume (the engine saves
        the round, the server state, the client states and the RNG states itself). Default: the client-side
        working model ``net`` (a hook that does not reload every entry would otherwise see other values after
        a restart). A method that caches anything else across rounds on ``self`` overrides this (calling
        super) -- better still, keep such things in the server state or the client states."""
        return {"net": weights_of(self._net)} if self._net is not None else {}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if "net" in d:
            load_weights(self.net, d["net"])

    def eval_model(self, weights: dict[str, torch.Tensor]) -> Model:
        """A server-side evaluation copy of the model loaded with ``weights`` (kept apart from ``net``)."""
        if getattr(self, "_eval_net", None) is None:
            self._eval_net = self.new_model()
        load_weights(self._eval_net, weights)
        self._eval_net.eval()
        return self._eval_net


def declares(cls: type, flag: str, hooks: tuple[str, ...]) -> bool:
    """Whether method class ``cls`` has the boolean class attribute ``flag``: the nearest class of its MRO that sets
    it says so, unless a class below that one changes one of ``hooks`` (what the flag vouches for) without setting
    it again."""
    return bool(declared_value(cls, flag, hooks))


def declared_value(cls: type, flag: str, hooks: tuple[str, ...]):
    """The value of class attribute ``flag`` that vouches for method class ``cls`` (:func:`declares`): the nearest
    class of its MRO that sets it, or False where a class below that one changes one of ``hooks`` without setting
    it again (or none sets it)."""
    for klass in cls.__mro__:
        if flag in vars(klass):
            return vars(klass)[flag]
        if any(h in vars(klass) for h in hooks):
            return False
    return False
