"""How much of a (pre-trained) backbone trains: ``--finetune full | head | lora``, and aggregating LoRA.

- ``full``: every weight trains, as fedlt always did (the model of :func:`fedlt.models.build_model`).
- ``head``: the backbone is frozen; the model is ``head(features)`` on the backbone's features, which each
  client computes once for its samples and keeps (:class:`FeatureStore`): a round costs what a linear model on
  those features costs, and the model's state dict -- what is sent, averaged, checkpointed, clipped under DP,
  masked under SecAgg -- is the head's (and whatever a method adds on top).
- ``lora``: ``peft``'s LoRA layers (Hu et al., ICLR 2022) in the frozen backbone's target modules (rank,
  alpha, dropout and targets are settings; the targets' default per architecture family is
  :mod:`fedlt.pretrained`'s ``lora_targets``); the adapters and the head train, the rest stays as loaded.

**Where the frozen weights live.** One frozen backbone per process (:func:`shared_backbone`), never copied
per client and never sent, as FedGPA's prompted ViT keeps its tower (``core/vit.py``): outside the module tree.
Under ``lora`` peft injects its LoRA layers once into that shared backbone (``peft.inject_adapter_in_model``,
its layers, scaling and dropout as peft has them); each model's backbone (:class:`LoraBackbone`) holds only
the adapter tensors, as its own parameters, and runs the shared module with them substituted
(``torch.func.functional_call``, which swaps in the given tensors for the call and leaves every other
parameter the shared, frozen one). So a model's state dict is ``backbone.adapters.<module>.lora_A/B...`` and
``head.*`` only, 100 clients' models hold 100 sets of adapters over one base (a test checks that two models
share the base's storage), and worker processes forked from the run's share it copy-on-write.

**BatchNorm** under ``head`` and ``lora`` (``--bn-stats``): ``frozen`` (default) normalises with the
pre-trained running statistics, which never change (the shared backbone stays in eval mode; ``head``'s features
are computed with them). Under ``lora``, ``local`` gives each model BatchNorm modules of its own holding running
statistics (``backbone.bn.<path>.running_mean/var``, no affine weights: those stay the pre-trained ones),
updated in training: FedBN (``fedbn``), which keeps every BatchNorm layer on its client, keeps them per client
(FedBN's way); any other method averages them like every other entry of the state dict.

**Aggregating LoRA** (``--lora-agg``). The mean of the clients' A and B is not the mean of their updates:
``mean_k(B_k) mean_k(A_k) != mean_k(B_k A_k)``. ``fedit`` averages A and B separately (FedIT, Zhang et al.,
ICASSP 2024: every method's averaging, unchanged). ``ffa`` is FFA-LoRA (Sun et al., ICLR 2024): A stays at its
shared initialisation (drawn from the run's seed, the same on every process, so it is part of the frozen
backbone and never sent), only B trains and is averaged, and ``mean_k(B_k) A = mean_k(B_k A)`` exactly.
:func:`lora_gap` measures ``|| mean_k(B_k A_k) - mean_k(B_k) mean_k(A_k) ||_F`` (summed over the adapted layers,
weighted as the server weighs the clients); a run records it each round as ``lora_gap`` in metrics.jsonl.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..data.federated import Clients, Federation, Prep
from ..decl import TRAIN, Relation, requires, setting
from ..errors import ConfigError

FINETUNE = ("full", "head", "lora")
LORA_AGG = ("fedit", "ffa")
BN_STATS = ("frozen", "local")

@dataclass
class Finetune:
    """The fine-tuning settings, declared once (the run's spec reads them: ``RunSpec`` includes each)."""

    finetune: str = setting("full", "how much of the model trains: full (every weight), head (the backbone "
                                    "frozen, its features computed once per client; the head and what a method "
                                    "adds train) or lora (peft's LoRA adapters in the frozen backbone, and the head)",
                            choices=FINETUNE, group=TRAIN, reads=("spec",))
    lora_rank: int = setting(8, "--finetune lora: the adapters' rank r", low=1, limit=4096, group=TRAIN,
                             reads=("spec",), only_with=("finetune", ("lora",)))
    lora_alpha: float = setting(8.0, "--finetune lora: alpha (the update B A is scaled by alpha / r)", low=0,
                                low_open=True, group=TRAIN, reads=("spec",), only_with=("finetune", ("lora",)))
    lora_dropout: float = setting(0.0, "--finetune lora: dropout on the adapters' input", low=0, high=1,
                                  high_open=True, group=TRAIN, reads=("spec",), only_with=("finetune", ("lora",)))
    lora_targets: str | None = setting(None, "--finetune lora: the modules that get adapters, comma-separated "
                                             "names (peft's target_modules)", metavar="NAMES", group=TRAIN,
                                       reads=("spec",), only_with=("finetune", ("lora",)),
                                       none_means="the pre-trained model's (a ViT's attention query and value, a "
                                                  "convolutional net's 1x1 convolutions), else every linear layer "
                                                  "and 1x1 convolution")
    lora_agg: str = setting("fedit", "--finetune lora: how the adapters are aggregated: fedit (A and B averaged "
                                     "separately) or ffa (FFA-LoRA: A fixed at its shared initialisation, only B "
                                     "trains and is averaged, which makes the mean exact)",
                            choices=LORA_AGG, group=TRAIN, reads=("spec",), only_with=("finetune", ("lora",)))
    bn_stats: str = setting("frozen", "--finetune lora: BatchNorm's running statistics: frozen (the pre-trained "
                                      "ones, as under head) or local (kept in each model, updated in training; "
                                      "FedBN keeps them per client)",
                            choices=BN_STATS, group=TRAIN, reads=("spec",),
                            only_with=("finetune", ("lora",), {"finetune": "head"},
                                       "under full BatchNorm trains as the model does, under head the features are "
                                       "computed once, with the pre-trained statistics"))


# What a method's algorithm needs that ``head`` or ``lora`` cannot give it, declared by the method
# (``Method.finetune_needs``: {need: what of it, in its words}); :func:`finetune_refusal` derives the refusal
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "images": (("head",), "reads the input images themselves ({what}), and under --finetune head its input is the "
                          "frozen backbone's features"),
    "body": (("head",), "trains the backbone with its classifier fixed ({what}), and under --finetune head the "
                        "backbone is frozen: nothing would train"),
    "own-model": (("head", "lora"), "builds a model of its own ({what}), not the --model backbone"),
    "frozen": (("full", "lora"), "fits statistics of a frozen pre-trained backbone's features ({what}), and under "
                                 "--finetune full or lora the backbone trains, so its features change"),
}


def finetune_refusal(cls, mode: str) -> str:
    """Why method class ``cls`` cannot run under ``--finetune mode`` ("" where it can): from what it declares it
    needs (``finetune_needs``, :data:`NEEDS`)."""
    for need, what in getattr(cls, "finetune_needs", {}).items():
        modes, why = NEEDS[need]
        if mode in modes:
            return why.format(what=what)
    return ""


def relations(method_of: Callable[[Any], type]) -> list[Relation]:
    """The relations of the settings declared here that their declarations (``only_with``) do not make: a method
    refused under a mode where it declares a need the mode cannot meet (``method_of(c)``: the configuration's
    method class), the modes it runs under named."""
    def modes(c) -> str:
        return " or ".join(m for m in ("lora", "full", "head") if not finetune_refusal(method_of(c), m))

    return [
        requires("finetune", lambda c: not finetune_refusal(method_of(c), c.finetune),
                 lambda c: f"--finetune {c.finetune}: method {c.method} {finetune_refusal(method_of(c), c.finetune)}; "
                           f"choose --finetune {modes(c)} or another method",
                 when=lambda c: True, others=("method",),
                 bad=({"finetune": "head", "method": "fedbabu"}, {"finetune": "lora", "method": "fedgpa"},
                      {"finetune": "full", "method": "ggeur"})),
    ]


# ------------------------------------------------------------------------------------------------ the backbone


@dataclass(eq=False)
class Frozen:
    """A process's frozen backbone: ``net`` (whose modules LoRA adapts), ``prepare`` (a fedlt batch -> ``net``'s
    input: a pre-trained model's resizing and normalisation; None: the batch itself), the feature width and the
    default LoRA targets (None: every linear layer and 1x1 convolution)."""

    net: nn.Module
    feature_dim: int
    prepare: Callable | None = None
    targets: tuple[str, ...] | None = None

    def features(self, x: torch.Tensor, net: nn.Module | None = None) -> torch.Tensor:
        x = x if self.prepare is None else self.prepare(x)
        return (self.net if net is None else net)(x)


_SHARED: OrderedDict[tuple, Any] = OrderedDict()
_KEEP = 4  # frozen backbones kept per process (a sweep's runs in one process: the last settings')
LOADS = {"count": 0}  # backbones built in this process (tests: one per process, whatever the clients)


def _cached(key: tuple, make: Callable[[], Any]):
    got = _SHARED.get(key)
    if got is None:
        got = _SHARED[key] = make()
        while len(_SHARED) > _KEEP:
            _SHARED.popitem(last=False)
    _SHARED.move_to_end(key)
    return got


def _load(spec) -> Frozen:
    """The backbone ``spec.model`` names, frozen: a pre-trained one (:mod:`fedlt.pretrained`, its net shared with
    every other user in the process), else a registered fedlt backbone at its seeded initialisation (as
    ``build_model`` draws it)."""
    from .. import pretrained

    LOADS["count"] += 1
    if pretrained.is_pretrained(spec.model):
        pre = pretrained.load_for(spec)
        norm = (tuple(spec.data.get("input_mean") or (0.0,)), tuple(spec.data.get("input_std") or (1.0,)))
        return Frozen(pre.net, int(pre.feature_dim), lambda x: pre.preprocess(x, *norm), tuple(pre.lora_targets))
    from ..models import build_model

    module = build_model(spec.model, input_shape(spec), spec.num_classes, seed=spec.seed).backbone
    return Frozen(module.to(spec.device).eval().requires_grad_(False), int(module.feature_dim))


def input_shape(spec) -> tuple[int, ...]:
    """The shape of the samples the frozen backbone reads: the data's (``spec.data["input_shape"]``; under
    ``head`` ``spec.in_shape`` is the features')."""
    return tuple(spec.data.get("input_shape") or spec.in_shape)


def head_spec(spec):
    """``spec`` as the models under ``head`` see it: their input is the frozen backbone's features."""
    import dataclasses

    return dataclasses.replace(spec, in_shape=(shared_backbone(spec).feature_dim,))


def _base_key(spec) -> tuple:
    return (spec.model, input_shape(spec), spec.num_classes, spec.seed, str(spec.device),
            getattr(spec, "pretrained_size", None), str(spec.data.get("input_mean")), str(spec.data.get("input_std")))


def run_modules(net: nn.Module):
    """Every module ``net`` runs: its own, and those of the trees it runs without holding them (a
    :class:`LoraBackbone`'s shared base, ``shared_modules``)."""
    yield from net.modules()
    for m in list(net.modules()):
        for shared in getattr(m, "shared_modules", tuple)():
            yield from shared.modules()


def shared_backbone(spec) -> Frozen:
    """This process's frozen backbone for ``spec``: built on first use, then the same object."""
    return _cached(_base_key(spec), lambda: _load(spec))


def shared_lora(spec) -> nn.Module:
    """This process's frozen backbone with peft's LoRA layers for the spec's LoRA settings (:func:`inject_lora`):
    a copy of :func:`shared_backbone`'s module tree whose weights are the same tensors (no copy of them)."""
    key = (*_base_key(spec), spec.lora_rank, spec.lora_alpha, spec.lora_dropout, spec.lora_targets)
    return _cached(key, lambda: inject_lora(shared_backbone(spec), spec))


def default_targets(frozen: Frozen) -> list[str]:
    """The pre-trained model's default targets (:mod:`fedlt.pretrained`: the attention's query and value for a
    ViT, the 1x1 convolutions of a convolutional net), else every ``nn.Linear`` and 1x1 ``nn.Conv2d``."""
    if frozen.targets is not None:
        return list(frozen.targets)
    return [n for n, m in frozen.net.named_modules() if isinstance(m, nn.Linear) or
            (type(m) is nn.Conv2d and m.kernel_size == (1, 1) and m.groups == 1)]


def inject_lora(frozen: Frozen, spec) -> nn.Module:
    """A copy of ``frozen.net``'s module tree sharing its tensors, with peft's LoRA layers in its target modules
    (``peft.inject_adapter_in_model``), their initialisation drawn from the run's seed (A as peft draws it, B
    zero), everything frozen: the models' :class:`LoraBackbone` hold the tensors that train."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    targets = [t.strip() for t in spec.lora_targets.split(",") if t.strip()] if spec.lora_targets else \
        default_targets(frozen)
    if not targets:
        raise ConfigError(f"--finetune lora: {spec.model} has no linear layer or 1x1 convolution to adapt; name "
                          f"modules with --lora-targets")
    same = {id(t): t for t in (*frozen.net.parameters(), *frozen.net.buffers())}  # deepcopy keeps these as they are
    net = copy.deepcopy(frozen.net, memo=dict(same))
    config = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                        target_modules=targets)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(spec.seed))
        try:
            net = inject_adapter_in_model(config, net)
        except ValueError as e:  # peft's "Target modules ... not found" and its relatives
            raise ConfigError(f"--finetune lora: {str(e).splitlines()[0]} (--lora-targets names modules of "
                              f"{spec.model})") from None
    return net.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------ the models


class Features(nn.Module):
    """``head``'s backbone: its input is already the frozen backbone's features (:class:`FeatureStore`)."""

    def __init__(self, feature_dim: int):
        super().__init__()
        self.feature_dim = int(feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def adapter_names(base: nn.Module, agg: str) -> list[str]:
    """The base's parameter names that a model trains: every LoRA A and B (``fedit``), or only the Bs (``ffa``)."""
    kinds = ("lora_A.", "lora_B.") if agg == "fedit" else ("lora_B.",)
    return [n for n, _ in base.named_parameters() if any(k in n for k in kinds)]


def _bn_modules(base: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in base.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class LoraBackbone(nn.Module):
    """A model's backbone under ``lora``: its own adapter tensors (``adapters.<module path>.lora_B.default.weight``
    ...; with ``bn_stats="local"`` also ``bn.<path>.running_mean/var``) over the process's shared frozen
    backbone with peft's layers in it (:func:`shared_lora`), which it runs with its tensors substituted."""

    def __init__(self, spec):
        super().__init__()
        self.spec_key = spec  # to find the shared backbone again in another process (pickling)
        self._attach()
        self.feature_dim = self.frozen.feature_dim
        self.names = adapter_names(self.base, spec.lora_agg)
        self.adapters = nn.Module()
        for n in self.names:
            _put(self.adapters, n, nn.Parameter(_get(self.base, n).detach().clone()))
        self.bn_paths: list[str] = []
        if spec.bn_stats == "local":  # BatchNorm modules of its own (found by type: FedBN keeps them per client)
            self.bn = nn.Module()
            for path, m in _bn_modules(self.base):
                own = type(m)(m.num_features, eps=m.eps, momentum=m.momentum, affine=False,
                              device=m.running_mean.device)
                own.load_state_dict({k: v for k, v in m.state_dict().items() if k in own.state_dict()})
                _put(self.bn, path, own, module=True)
                self.bn_paths.append(path)

    def _attach(self) -> None:
        base = shared_lora(self.spec_key)
        for k, v in (("base", base), ("frozen", shared_backbone(self.spec_key))):
            object.__setattr__(self, k, v)  # shared and frozen: not sub-modules, not in the state dict
        self._dropouts = [m for n, m in base.named_modules() if n.endswith("lora_dropout")]
        self._bns = [m for _, m in _bn_modules(base)]

    def shared_modules(self) -> tuple[nn.Module, ...]:
        """The module trees it runs that are not its sub-modules: the process's shared base."""
        return (self.base,)

    def substitutes(self) -> dict[str, torch.Tensor]:
        out = {n: _get(self.adapters, n) for n in self.names}
        for path in self.bn_paths:
            own = self.bn.get_submodule(path)
            out.update({f"{path}.{k}": v for k, v in own.named_buffers()})
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for d in self._dropouts:  # peft's dropout follows this model's mode; the base stays in eval mode ...
            d.train(self.training)
        local = self.training and bool(self.bn_paths)
        for m in self._bns:  # ... but for BatchNorm with statistics of this model's own (bn_stats local)
            m.train(local)
        x = x if self.frozen.prepare is None else self.frozen.prepare(x)
        try:
            return torch.func.functional_call(self.base, self.substitutes(), (x,), strict=False)
        finally:
            for m in (*self._dropouts, *self._bns):
                m.train(False)

    def __getstate__(self):  # pickled (spawned workers, deep copies): without the shared base, found again there
        d = dict(self.__dict__)
        for k in ("base", "frozen", "_dropouts", "_bns"):
            d.pop(k, None)
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._attach()


def _get(root: nn.Module, dotted: str) -> torch.Tensor:
    mod, _, leaf = dotted.rpartition(".")
    return getattr(root.get_submodule(mod) if mod else root, leaf)


def _put(root: nn.Module, dotted: str, value, buffer: bool = False, module: bool = False) -> None:
    """Register ``value`` (a parameter, a buffer, a module) at ``dotted`` below ``root``, making empty modules for
    the path."""
    *path, leaf = dotted.split(".")
    m = root
    for p in path:
        if not hasattr(m, p):
            m.add_module(p, nn.Module())
        m = getattr(m, p)
    if module:
        m.add_module(leaf, value)
    elif buffer:
        m.register_buffer(leaf, value)
    else:
        m.register_parameter(leaf, value)


def build_finetune_model(spec):
    """The model of ``spec`` under ``head`` or ``lora`` (:class:`fedlt.models.Model`): the run's head
    (``fedlt.models.head_for``: ``--head``, ``--head-fixed``) seeded from the run's seed, on :class:`Features`
    (``head``: ``spec.in_shape`` is the features' width) or on a :class:`LoraBackbone`."""
    from ..models import Model, head_for

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(spec.seed))
        if spec.finetune == "head":
            backbone: nn.Module = Features(spec.in_shape[0])
        else:
            backbone = LoraBackbone(spec)
        head = head_for(spec, backbone.feature_dim)
    return Model(backbone, head, backbone.feature_dim, spec.num_classes).to(spec.device)


# ------------------------------------------------------------------------------------------------ head: features


class FeatureStore:
    """A sample store's rows as the frozen backbone's features, each row encoded the first time it is asked for
    (without augmentation: ``prep``'s evaluation transform) and kept: used in place of the store's tensor
    (indexing by rows or a slice, ``shape``, ``device``, ``len``). ``encoded``: rows encoded; ``calls``: the
    backbone's forward passes."""

    def __init__(self, x: torch.Tensor, prep, spec, chunk: int = 256):
        self.x, self.prep, self.spec, self.chunk = x, prep, spec, chunk
        frozen = shared_backbone(spec)
        dev = torch.device(prep.device)
        self.feats = torch.empty(len(x), frozen.feature_dim, device=dev)  # untouched pages cost nothing
        self.done = torch.zeros(len(x), dtype=torch.bool, device=dev)
        self.encoded = 0
        self.calls = 0

    @property
    def shape(self):
        return self.feats.shape

    @property
    def device(self):
        return self.feats.device

    @property
    def dtype(self):
        return self.feats.dtype

    def __len__(self) -> int:
        return len(self.feats)

    def ensure(self, rows: torch.Tensor) -> None:
        """Encode the rows not encoded yet, ``chunk`` at a time."""
        rows = rows.to(self.done.device)
        need = torch.unique(rows[~self.done[rows]])
        if not len(need):
            return
        frozen = shared_backbone(self.spec)
        with torch.no_grad():
            for s in range(0, len(need), self.chunk):
                r = need[s: s + self.chunk]
                self.feats[r] = frozen.features(self.prep(self.x[r.to(self.x.device)])).float()
                self.done[r] = True
                self.calls += 1
                self.encoded += len(r)

    def __getitem__(self, rows):
        if isinstance(rows, slice):
            rows = torch.arange(len(self.feats), device=self.done.device)[rows]
        self.ensure(rows)
        return self.feats[rows.to(self.feats.device)]


def feature_prep(device):
    """The features' transform: none (they are float; moved to the device)."""
    return Prep((0.0,), (1.0,), "none", device)


class FeatureViews:
    """A federation's clients with their samples as features (:class:`FeatureStore`): a sample is encoded the
    first time a batch holds it -- a client's training samples in its first epoch, its test samples when it is
    first evaluated -- and never again."""

    def __init__(self, clients, stores: dict[int, FeatureStore], prep):
        self.clients, self.stores, self.prep = clients, stores, prep

    def __call__(self, k: int):
        import copy

        c = copy.copy(self.clients[k])
        c._x, c._tx, c.prep = self.stores[id(c._x)], self.stores[id(c._tx)], self.prep
        return c


def feature_client(c, spec):
    """One client's data (a SuperNode's own directory) with its samples as features, as :func:`feature_federation`
    makes a federation's."""
    stores = {id(t): FeatureStore(t, c.prep, spec) for t in (c._x, c._tx)}
    out = FeatureViews([c], stores, feature_prep(c.prep.device))(0)
    if out.rows is None:  # its own samples: rows of its stores, so that every read goes through them
        out.rows = torch.arange(len(out.y), device=out._x.device)
        out.test_rows = torch.arange(len(out.test_y), device=out._tx.device)
    return out


class FeatureFederation(Federation):
    """A federation whose samples are features (:func:`feature_federation`): its input shape is theirs."""

    feature_dim: int = 0

    @property
    def in_shape(self):
        return (self.feature_dim,)


def feature_federation(fed, spec):
    """``fed`` with every sample as the frozen backbone's features (``--finetune head``): a new federation over
    :class:`FeatureStore` s of its training and test stores (``fed`` itself is left as it was)."""
    import copy

    test = fed.test_x if fed.test_x is not None else fed.dataset.x_test
    stores: dict[int, FeatureStore] = {}
    for t in ((fed.clients[0]._x, fed.clients[0]._tx) if len(fed.clients) else ()) + (test,):
        if id(t) not in stores:
            stores[id(t)] = FeatureStore(t, fed.prep, spec)
    prep = feature_prep(fed.prep.device)
    out = copy.copy(fed)
    out.__class__ = FeatureFederation
    out.clients = Clients(FeatureViews(fed.clients, stores, prep), len(fed.clients)) if len(fed.clients) else []
    out.prep = prep
    out.test_x = stores[id(test)]
    out.test_y = fed.test_y if fed.test_y is not None else fed.dataset.y_test
    out.feature_dim = shared_backbone(spec).feature_dim
    out.stores = list(stores.values())
    return out


# ------------------------------------------------------------------------------------------------ LoRA's mean


_AB = re.compile(r"^(.*)\.lora_([AB])\.(\w+)\.weight$")


def lora_pairs(arrays: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None = None) -> dict[str, tuple]:
    """``{layer: (A, B)}`` of the LoRA entries of ``arrays`` (a model's state dict or a reply's), A taken from
    ``base`` (the shared backbone's, under ``ffa``) where ``arrays`` has none; A and B as matrices ``[r, in]``,
    ``[out, r]`` (a convolution's kernel flattened)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in arrays.items():
        m = _AB.match(k)
        if m:
            layer = m.group(1).split("adapters.", 1)[-1]
            found.setdefault(layer, {})[m.group(2)] = v
    out = {}
    for layer, ab in found.items():
        A = ab.get("A", (base or {}).get(f"{layer}.lora_A.default.weight"))
        B = ab.get("B")
        if A is None or B is None:
            continue
        out[layer] = (A.detach().double().reshape(A.shape[0], -1), B.detach().double().reshape(B.shape[0], -1))
    return out


def lora_gap(replies: list[tuple[dict[str, torch.Tensor], float]], base: dict[str, torch.Tensor] | None = None
             ) -> dict[str, float]:
    """``|| mean_k(B_k A_k) - mean_k(B_k) mean_k(A_k) ||_F`` over the adapted layers (root of the sum of squares),
    the means weighted by each reply's weight (its num_examples); ``relative``: over ``|| mean_k(B_k A_k) ||_F``.
    ``replies``: (arrays, weight) pairs; ``base``: where the As come from when the replies hold none (ffa)."""
    pairs = [(lora_pairs(a, base), float(w)) for a, w in replies]
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return {"gap": 0.0, "relative": 0.0}
    gap2 = norm2 = 0.0
    for layer in pairs[0][0]:
        mean_ba = sum(w * (p[layer][1] @ p[layer][0]) for p, w in pairs) / total
        mean_a = sum(w * p[layer][0] for p, w in pairs) / total
        mean_b = sum(w * p[layer][1] for p, w in pairs) / total
        gap2 += float(((mean_ba - mean_b @ mean_a) ** 2).sum())
        norm2 += float((mean_ba ** 2).sum())
    return {"gap": gap2 ** 0.5, "relative": (gap2 / norm2) ** 0.5 if norm2 > 0 else 0.0}


def base_adapters(spec) -> dict[str, torch.Tensor]:
    """The shared backbone's LoRA tensors (under ``ffa`` its As are every model's)."""
    base = shared_lora(spec)
    return {n: p for n, p in base.named_parameters() if "lora_" in n}


def adapter_rows(index: int, replies) -> list[dict]:
    """``sent.jsonl``'s breakdown of a ``lora`` round's model rows: the LoRA adapters' part of what the clients sent
    (``part``: these bytes are within the round's ``<model>`` row, not beside it), as ``fedlt.core.privacy``'s rows
    count arrays and bytes."""
    from .privacy import MODEL

    got = [{k: v for k, v in r.arrays.items() if _AB.match(k)} for _, r in replies]
    got = [a for a in got if a]
    if not got:
        return []
    return [{"round": index, "sent": MODEL, "part": "LoRA adapters", "category": "model",
             "arrays": max(len(a) for a in got), "bytes": sum(t.numel() * t.element_size() for a in got
                                                               for t in a.values()), "clients": len(got)}]


class GapMeter:
    """A run's ``lora_gap`` (:func:`lora_gap`) of each training round's replies: :meth:`replies` measures it (the
    driver's ``on_replies`` hook, for a training round), :meth:`record` puts it in the round's record
    (metrics.jsonl; the driver's ``after_train`` hook)."""

    def __init__(self, spec):
        self.base = base_adapters(spec)
        self.last: dict[str, float] | None = None

    def replies(self, replies) -> None:
        if replies:
            self.last = lora_gap([(r.arrays, r.meta.get("num_examples", 1)) for _, r in replies], self.base)

    def record(self, driver, rec: dict) -> None:
        if self.last is not None:
            rec["lora_gap"], rec["lora_gap_relative"] = self.last["gap"], self.last["relative"]
            self.last = None
