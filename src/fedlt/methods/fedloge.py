"""FedLoGe (Xiao et al., ICLR 2024): "FedLoGe: Joint Local and Generic Federated Learning under Long-tailed Data".

One shared backbone f_theta, trained through a frozen classifier (SSE-C), plus two trained heads on *detached*
features: a global auxiliary head psi (aggregated) and one local head phi_k per client (never leaves it). After
training, the heads are realigned by their norms: GA-FR for the global model, LA-FR for each personal model.

Algorithm 1 (stage numbers as in the paper)
-------------------------------------------
stage 1, server   build psi_SSE-C (Eq. 2-5, ``fedlt.core.etf``); every round send {theta, psi} to the sampled
                  clients; theta, psi <- sample-weighted mean of the replies (FedAvg over every state-dict entry).
stage 1, client   for each local epoch, for each mini-batch (x, y):
                      h = f_theta(x)
                      theta <- theta - eta grad_theta CE(psi_SSE-C(h), y)          (SSE-C frozen)
                      psi   <- psi   - eta grad_psi   CE(psi(h.detach()), y)
                      phi_k <- phi_k - eta grad_phi   CE(phi_k(h.detach()), y)
                  (one backward of the sum of the three losses: the detach keeps the gradients apart, so this
                  is exactly three optimisers stepping on the same forward pass, as the official code does.)
                  reply {theta, psi}; phi_k stays in the client state.
stage 2, server   GA-FR (Eq. 6):  psi'_c = psi_c / ||psi_c||                       -> the "generic" head
stage 3, client   LA-FR (Eq. 7):  phi'_{k,c} = psi_c * ||phi_{k,c}||                -> the "realigned" head
                  then (Alg. 1 line 12, App. A.5) optionally ``finetune_epochs`` of CE on the realigned head alone,
                  over detached features of the local data (default 0, as the released code).
inference         universal     logits = psi_SSE-C(f_theta(x))                         (GM; official README)
                  generic       logits = GA-FR(psi)(f_theta(x))                         (GM)
                  personalized  logits = phi_k(h) + realigned_k(h), classes absent from the client's *training*
                                data set to -inf                                         (PM; official code)
                  Extra modes, labelled: "psi" (the aggregated aux head before GA-FR), "phi+psi" (the PM the
                  official code logs every round: phi_k(h) + psi(h), masked), "phi" (local head alone, masked).
                  Before the phases have run, per-round evaluations report universal/psi and phi+psi/phi, and,
                  with ``preview`` (default on), "generic-preview" / "personalized-preview": GA-FR / LA-FR applied
                  to the current heads (what the phases would give if training stopped here; identical to the
                  phases when finetune_epochs = 0), so the last-3-evaluations protocol has them too.

The fixed classifier is a pure function of (kind, d, C, beta, seed, options): both sides derive it from the run
seed through the disk cache of ``fedlt.core.etf`` (0 bytes on the wire). With ``send_fixed=true`` the server
instead ships it once to each client in its first training message (C*d*4 bytes, plus C*4 with a bias) and the
client keeps it in its state; either way it is the same tensor, bit for bit, and it is never trained.

Paper vs. official code (ZackZikaiXiao/FedLoGe, read at commit f4cac52)
---------------------------------------------------------------------------------------
=========================  ===========================================  ============================================
                           paper (default)                              official code (option)
=========================  ===========================================  ============================================
SSE-C norm target gamma    1.0 (sensitivity section)                    0.1 (``sse_variant=official`` or gamma=0.1;
                                                                        the code's "tau" is this gamma)
SSE-C bias                 none                                         frozen random bias (``fixed_bias=true``)
SSE-C's Adam steps in      unspecified; here float64, rounded to        float32 (torch's default;
                           float32 once: the same matrix on every       ``sse_precision=float32``): its bits, and
                           x86 CPU (``fedlt.core.etf``)                 so the run's, depend on the CPU's kernels
GA-FR                      psi_c / ||psi_c||, no bias (Eq. 6)           1.7 psi_c / ||psi_c|| + b_psi
                                                                        (``realign=official``; 1.7 matters only
                                                                        because the bias is kept)
LA-FR                      (psi_c/||psi_c||) * ||phi_k,c||, no bias:    psi_c * ||phi_k,c|| + b_psi with the raw
                           Alg. 1 line 11 uses psi after line 8, so     psi (``realign=official``)
                           realigned rows have exactly phi_k's norms
PM logits                  Alg. 1 returns {theta, phi'_k}: the          phi_k(h) + realigned(h), masked (README and
                           realigned head alone (``pm_logits=           code). Default here, as the brief asks; the
                           realigned``)                                 code masks by the local *test* counts, we
                                                                        mask by the client's training classes
fine-tuning after LA-FR    "could be further conducted" (A.5: gains     0 epochs in the released code
                           up to 15 epochs)                             (``finetune_epochs``, default 0)
theta's loss               CE(psi_SSE-C(h), y) (Alg. 1)                 the same in ``fedloge.py``; the code's ETF
                                                                        baseline (``fedrod_etf.py``, run by
                                                                        FedReLa's ``fed_etf.py``) trains theta by
                                                                        dot regression instead:
                                                                        ``backbone_loss=etf-dr`` (below)
optimisers                 "SGD"                                        three SGDs (lr, momentum of the run),
                                                                        re-created every round: the default here;
                                                                        ``head_lr`` / ``head_momentum`` set the
                                                                        heads' own, ``persist_phi_momentum`` keeps
                                                                        phi_k's momentum buffer across rounds
phi_k^(0)                  unspecified                                  an independent default nn.Linear init per
                                                                        client: ours is U(-1/sqrt(d), 1/sqrt(d))
                                                                        from a seed derived from (seed, client)
=========================  ===========================================  ============================================

The official code's ETF baseline (``backbone_loss=etf-dr``, with ``--set fixed=etf``: a dense ETF, no bias): psi and
phi_k as above, theta through a BatchNorm projector (affine gamma = 1, beta = 0 at the start of every round,
trained with theta by the same SGD, never sent: the official ``g_head`` is copied from the server's every round and
never aggregated) and the L2 normalisation, by the dot-regression loss with per-batch class scaling:
    z = BN_batch(h; gamma, beta) (batches of one: z = h),   h^ = z / max(||z||, 1e-8)
    E_c = sqrt((B / |classes in the batch|) / n_c,batch) for a class in the batch, else 1   (``produce_Ew``)
    L = 1/2 mean_i (<h^_i, E_y m_y> - ||E_y m_y|| ||h^_i||)^2 / ||h^_i||   (``reg_dot_loss``, norms not differentiated)
Its universal prediction is M normalise(BN(h)), and the official evaluation (``globaltest_etf``) leaves ``g_head`` in
train mode: BN takes the statistics of the test batch (of 100) it is given, its affine as the server holds it (1
and 0). Here likewise, the batch being the whole balanced test set, which the evaluation hands the head at once: a
test-time normalisation, the released code's, not a statistic the server has. (The re-labelling's Q, the official
``collect_Q``, runs the projector in eval mode: its initial running statistics, the identity up to a scale.)

Ablations (Table 3, App. A.10): ``fixed`` = sse-c | etf | xavier | gaussian | uniform | orthogonal |
kaiming_uniform; ``beta`` (sparsity; None = the kind's default: 0.6 for sse-c, 0 for the rest); ``refine``
(auto: run the SSE-C geometry optimisation when sparse, i.e. Table 9's "Sparse X"); ``ga_fr`` / ``la_fr`` on/off.
Since GA-FR and LA-FR (without fine-tuning) do not change training, one run gives every Table 3 row of its
fixed classifier: GM universal vs generic is "GA-FR off/on", PM phi+psi vs personalized is "LA-FR off/on".

Under ``--finetune head`` / ``lora`` (docs/finetune.md): theta is the frozen pre-trained backbone (head) or its LoRA
adapters (lora). Under head nothing trains through the SSE-C (its "universal" GM is the fixed SSE-C on the
pre-trained features); psi (the state's ``head``) and each phi_k train on the features as always, and GA-FR and
LA-FR realign them. Under lora the adapters train through the frozen SSE-C, as theta does in full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import LocalSteps, Message, Meter, Method, Predictor, Train, derive_seed, load_weights
from ..core.etf import KINDS, PRECISIONS, SSE_LR, SSE_PRECISION, SSE_STEPS, cached_fixed_classifier, etf_report
from ..core.losses import etf_dot_regression, etf_features, linear_heads_ce, masked_logits
from ..core.personal import personal_net
from ..core.privacy import MODEL, sent, sends_with
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS

PHI_INIT, FIXED_BIAS = 0xF10, 0xF11  # seed streams (with the run seed, and the client id for phi_k^(0))
HEAD = ("head.weight", "head.bias")


# ------------------------------------------------------------------------------------------------ realignment
def ga_fr(weight: torch.Tensor, norm: float = 1.0) -> torch.Tensor:
    """GA-FR (Eq. 6): every class vector rescaled to the same norm, ``norm * psi_c / ||psi_c||``."""
    return weight * (norm / weight.norm(dim=1, keepdim=True).clamp_min(1e-12))


def la_fr(psi: torch.Tensor, phi: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """LA-FR (Eq. 7): ``psi_c * ||phi_k,c||``, with ``psi_c`` first normalised (paper, Alg. 1 line 11 after
    line 8: the rows then have exactly the local head's norms) or raw (official code)."""
    base = ga_fr(psi) if normalize else psi
    return base * phi.norm(dim=1, keepdim=True)


def linear_head(weight: torch.Tensor, bias: torch.Tensor, present=None):
    """logits = weight h + bias; with ``present`` (class indices) every other class's logit is -inf."""
    if present is None:
        return lambda h: F.linear(h, weight, bias)
    return lambda h: masked_logits(F.linear(h, weight, bias), present, float("-inf"))


@METHODS.register("fedloge")
class FedLoGe(Method):
    personalized = True
    # --dp sample: stage 1 is described steps, each sample's three cross-entropies against the server's SSE-C, psi
    # and phi_k (trained by the same DP-SGD); the phases send only a count
    dp_sample = True
    # --secagg (core.secagg): its server takes the num_examples-weighted mean of theta and psi, and notes who replied
    secagg = True

    @dataclass
    class Params:
        # stage 1: the frozen classifier (fedlt.core.etf)
        fixed: str = setting("sse-c", "the frozen classifier's kind (Table 3's ablation)", choices=KINDS)
        beta: float | None = setting(None, "sparsity", low=0, high=1, high_open=True, old_none="< 0",
                                     none_means="the kind's default (0.6 for sse-c, 0 = dense for the others)")
        refine: str = setting("auto", "SSE-C geometry loss on the surviving entries: auto (sse-c or sparse) | true | "
                                      "false", choices=("auto", "true", "false"))
        gamma: float | None = setting(None, "norm target", low=0, old_none="< 0",
                                      none_means="the variant's (paper 1.0, official 0.1 = the code's \"tau\")",
                                      low_open=True)
        sse_variant: str = setting("paper", "paper | official (gamma 0.1, U[0,1) basis, floor rounding)",
                                   choices=("paper", "official"))
        sse_steps: int = setting(SSE_STEPS, "Adam steps of the SSE-C construction (official: 10,000)", low=0,
                                 limit=10**6)
        sse_lr: float = setting(SSE_LR, "its learning rate (official: 1e-4)", low=0, low_open=True)
        sse_precision: str = setting(SSE_PRECISION, "dtype of those steps: float64 (the same matrix on every CPU) | "
                                                "float32 (official code; its bits depend on the CPU's kernels)",
                                     choices=tuple(PRECISIONS))
        fixed_bias: bool = setting(False, "official code: a frozen random bias U(-1/sqrt(d), 1/sqrt(d)) on the SSE-C")
        send_fixed: bool = setting(False, "ship the matrix once per client instead of deriving it from the seed")
        # stage 1: optimisers (backbone: the run's lr/momentum; re-created every round, like the official code)
        backbone_loss: str = setting("ce", "theta's loss through the fixed classifier: ce (Alg. 1) | etf-dr (the "
                                           "official code's ETF baseline, with fixed=etf: see the method's doc)",
                                     choices=("ce", "etf-dr"))
        head_lr: float | None = setting(None, "lr of psi and phi_k (official: the same lr for all three)", low=0,
                                        low_open=True, none_means="the round's lr", old_none="< 0")
        head_momentum: float | None = setting(None, "momentum of psi and phi_k", low=0, high=1, high_open=True,
                                              none_means="the run's momentum", old_none="< 0")
        persist_phi_momentum: bool = setting(False, "keep phi_k's SGD momentum in the client state across rounds")
        # stages 2-3: realignment
        ga_fr: bool = setting(True, "the GA-FR phase (Eq. 6): the generic head")
        la_fr: bool = setting(True, "the LA-FR phase (Eq. 7): the personalized heads")
        realign: str = setting("paper", "paper (Eq. 6-7, no bias) | official (GA-FR norm 1.7 + bias, LA-FR on raw psi "
                                        "+ bias)", choices=("paper", "official"))
        gafr_norm: float | None = setting(None, "GA-FR target norm", low=0, low_open=True, old_none="<= 0",
                                          none_means="the variant's (paper 1.0, official 1.7)")
        pm_logits: str = setting("sum", "sum: phi_k(h) + realigned(h) (official) | realigned: the realigned head alone "
                                        "(Alg. 1)", choices=("sum", "realigned"))
        mask_absent: bool = setting(True, "personal logits of classes absent from the client's training data -> -inf")
        finetune_epochs: int = setting(0, "CE epochs on the realigned head after LA-FR (Alg. 1 line 12; official 0)",
                                       low=0, limit=10**4)
        preview: bool = setting(True, "per-round evaluations also report GA-FR / LA-FR of the current heads")

    @dataclass
    class State(Method.State):
        fixed_report: dict | None = None  # the frozen classifier's spec and Table 6 quantities (saved with the run)
        fixed: dict[str, torch.Tensor] | None = None  # send_fixed: the frozen classifier's entries, as shipped
        has_fixed: list[int] | None = None  # send_fixed: the clients that have received it
        generic: dict[str, torch.Tensor] | None = None  # the GA-FR head {"weight", "bias"} (None: before the phase)

    sends = sends_with(
        Method.sends,
        sent(MODEL, "model", "the trained backbone theta and auxiliary head psi (phi_k never leaves the client)"),
        sent("num_examples", "size", "the number of training samples", meta=True, when="ga-fr"),
        sent("num_examples", "size", "the number of training samples", meta=True, when="la-fr"),
        sent("*", "scalars", "with finetune_epochs: the fine-tuning's mean loss", meta=True, numbers_only=True,
             when="la-fr"),
    )

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        p = self.p
        self.phases = tuple(name for name, on in (("ga-fr", p.ga_fr), ("la-fr", p.la_fr)) if on)
        official = p.realign == "official"
        self.gafr_norm = p.gafr_norm if p.gafr_norm is not None else (1.7 if official else 1.0)
        self.keep_bias = official  # the official code keeps b_psi in both realigned heads
        self.lafr_normalize = not official
        self._fixed: tuple[torch.Tensor, torch.Tensor] | None = None
        if p.backbone_loss == "etf-dr" and p.fixed_bias:
            raise ConfigError(f"{self.name}: backbone_loss=etf-dr trains theta on the fixed classifier's vectors, "
                              f"which have no bias; drop fixed_bias")

    @classmethod
    def dp_sample_refusal(cls, p) -> str:
        if p.backbone_loss == "etf-dr":
            return ("backbone_loss=etf-dr normalises the features over the batch (its BatchNorm projector), so one "
                    "sample's loss reads the others'; use backbone_loss=ce")
        return ""

    # ---------------------------------------------------------------------------------------- fixed classifier
    @property
    def feature_dim(self) -> int:
        return self.net.feature_dim

    def fixed_spec(self) -> tuple[str, float | None, dict]:
        """(kind, beta, options) for ``fedlt.core.etf``: everything that determines the fixed matrix."""
        p = self.p
        sparse = (p.fixed == "sse-c") if p.beta is None else p.beta > 0
        refine = {"auto": p.fixed == "sse-c" or sparse, "true": True, "false": False}[p.refine]
        opts: dict = {"variant": p.sse_variant, "refine": refine}
        if refine:
            opts.update(steps=p.sse_steps, lr=p.sse_lr, precision=p.sse_precision)
            if p.gamma is not None:
                opts["gamma"] = p.gamma
        return p.fixed, p.beta, opts

    def fixed_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W [C, d], b [C]) of the frozen classifier, derived from the run seed (built once, cached on disk)."""
        if self._fixed is None:
            s, (kind, beta, opts) = self.spec, self.fixed_spec()
            d, C = self.feature_dim, s.num_classes
            W = cached_fixed_classifier(s.cache_dir, kind, d, C, beta, seed=s.seed, **opts).to(s.device)
            b = torch.zeros(C, device="cpu")
            if self.p.fixed_bias:
                g = torch.Generator().manual_seed(derive_seed(s.seed, FIXED_BIAS))
                b = (torch.rand(C, generator=g, device="cpu") * 2 - 1) / math.sqrt(d)
            self._fixed = (W, b.to(s.device))
        return self._fixed

    def _client_fixed(self, payload: Message, cstate: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.p.send_fixed:
            return self.fixed_head()
        if "fixed.weight" in payload.arrays:
            cstate["fixed.weight"], cstate["fixed.bias"] = payload.arrays["fixed.weight"], payload.arrays["fixed.bias"]
        return cstate["fixed.weight"], cstate["fixed.bias"]

    # ------------------------------------------------------------------------------------------------- server
    def init_server(self) -> "FedLoGe.State":
        state = super().init_server()
        W, b = self.fixed_head()
        rep = etf_report(W)  # Table 6's quantities, saved with the run (final_state.safetensors) and printed
        kind, beta, opts = self.fixed_spec()
        state.fixed_report = {"kind": kind, "beta": beta, **opts, "bias": self.p.fixed_bias, **rep}
        print(f"fedloge: fixed classifier {kind} [{rep['C']}x{rep['d']}] sparsity "
              f"{rep['sparsity']:.3f}, norm {rep['norm_mean']:.4f} (var {rep['norm_var']:.2e}), pairwise angle "
              f"{rep['angle_mean_deg']:.3f} deg (var {rep['angle_var_deg2']:.2e}; ETF {rep['etf_angle_deg']:.3f})")
        if self.p.send_fixed:
            state.fixed = {"fixed.weight": W, "fixed.bias": b}
            state.has_fixed = []
        return state

    def configure(self, state: "FedLoGe.State", rnd: int, cid: int) -> Message:
        arrays = dict(state.weights)
        if self.p.send_fixed and cid not in state.has_fixed:
            arrays.update(state.fixed)
        return Message(arrays=arrays)

    def aggregate(self, state: "FedLoGe.State", rnd: int, replies) -> "FedLoGe.State":
        state = super().aggregate(state, rnd, replies)  # theta and psi, weighted by num_examples
        if self.p.send_fixed:
            state.has_fixed = sorted(set(state.has_fixed) | {cid for cid, _ in replies})
        return state

    # ------------------------------------------------------------------------------------------------- client
    def init_client(self, cid: int, data) -> dict:
        """phi_k^(0): a fresh linear head per client (the default nn.Linear init range, seeded by (seed, cid))."""
        d, C = self.feature_dim, self.spec.num_classes
        g = torch.Generator().manual_seed(derive_seed(self.spec.seed, PHI_INIT, cid))
        bound = 1.0 / math.sqrt(d)
        w = (torch.rand(C, d, generator=g, device="cpu") * 2 - 1) * bound
        b = (torch.rand(C, generator=g, device="cpu") * 2 - 1) * bound
        return {"phi.weight": w.to(self.spec.device), "phi.bias": b.to(self.spec.device)}

    def _lr(self, payload) -> tuple[float, float]:
        """The heads' lr and momentum: head_lr / head_momentum, else the round's lr (the payload's) and the run's
        momentum."""
        p = self.p
        return (self.round_lr(payload) if p.head_lr is None else p.head_lr), \
            (self.spec.momentum if p.head_momentum is None else p.head_momentum)

    def local_steps(self, payload, cstate, data):
        """Stage 1 on the client: theta through the frozen SSE-C, psi and phi_k on detached features, each with its
        SGD (the heads at head_lr / head_momentum); phi_k's momentum carried over with persist_phi_momentum."""
        W, b = self._client_fixed(payload, cstate)
        head_lr, head_mom = self._lr(payload)
        extra = {"phi.weight": cstate["phi.weight"], "phi.bias": cstate["phi.bias"], "fixed.weight": W, "fixed.bias": b}
        momentum = {k: cstate[f"phi.momentum.{k[4:]}"] for k in ("phi.weight", "phi.bias")
                    if self.p.persist_phi_momentum and f"phi.momentum.{k[4:]}" in cstate}
        train = (Train("backbone."), Train("head.", head_lr, head_mom), Train("phi.", head_lr, head_mom))
        if self.p.backbone_loss == "etf-dr":  # the projector: fresh each round, trained with theta, never sent
            d = W.shape[1]
            extra.update({"proj.weight": torch.ones(d, device=W.device), "proj.bias": torch.zeros(d, device=W.device)})
            train = (*train, Train("proj."))
        return LocalSteps(payload.arrays, self.stage1_loss, extra=extra, momentum=momentum, train=train)

    @staticmethod
    def stage1_loss(model, x, y, extra):
        h = model.backbone(x)
        hd = h.detach()
        heads = [(hd, model.params["head.weight"], model.params["head.bias"]),  # psi, detached
                 (hd, extra["phi.weight"], extra["phi.bias"])]  # phi_k, detached
        if "proj.weight" in extra:  # backbone_loss=etf-dr: theta by dot regression through the projector
            theta = etf_dot_regression(h, y, extra["fixed.weight"], extra["proj.weight"], extra["proj.bias"])
            losses = torch.cat([theta[None], linear_heads_ce(heads, y)])
        else:  # theta through the SSE-C
            losses = linear_heads_ce([(h, extra["fixed.weight"], extra["fixed.bias"]), *heads], y)
        return losses.sum(), {"loss": losses[0], "loss_psi": losses[1], "loss_phi": losses[2]}

    def local_reply(self, payload, cstate, data, out):
        """Reply {theta, psi}; phi_k (and, with persist_phi_momentum, its momentum) stays on the client."""
        new = {**cstate, "phi.weight": out.extra["phi.weight"], "phi.bias": out.extra["phi.bias"]}
        if self.p.persist_phi_momentum:
            new.update({f"phi.momentum.{k[4:]}": v for k, v in out.momentum.items() if k.startswith("phi.")})
        return Message(out.weights, {"num_examples": len(data), **out.stats}), new

    # ----------------------------------------------------------------------------------- stages 2 and 3
    def phase_configure(self, phase: str, state: "FedLoGe.State", cid: int) -> Message:
        if phase == "ga-fr":  # server-only: nothing to send
            return Message()
        # LA-FR needs psi; fine-tuning also needs the backbone to compute features
        w = state.weights
        return Message(arrays=dict(w) if self.p.finetune_epochs > 0 else {k: w[k] for k in HEAD})

    def phase_client(self, phase: str, payload: Message, cstate: dict, data, gen):
        if phase == "ga-fr":
            return Message(meta={"num_examples": len(data)}), cstate
        psi_w, psi_b = payload.arrays["head.weight"], payload.arrays["head.bias"]
        rw = la_fr(psi_w, cstate["phi.weight"], self.lafr_normalize)
        rb = psi_b.clone() if self.keep_bias else torch.zeros_like(psi_b)
        meta: dict = {"num_examples": len(data)}
        if self.p.finetune_epochs > 0:
            rw, rb, meta["loss"] = self._finetune(payload, rw, rb, data, gen)
        return Message(meta=meta), {**cstate, "realigned.weight": rw, "realigned.bias": rb}

    def _finetune(self, payload, rw, rb, data, gen):
        """Alg. 1 line 12: CE on the realigned head alone, over detached features of the local data."""
        net = self.net
        load_weights(net, payload.arrays)
        net.eval()  # the backbone is the shared global one: no BN statistics move
        w = rw.clone().requires_grad_(True)
        b = rb.clone().requires_grad_(self.keep_bias)
        lr, mom = self._lr(payload)
        opt = torch.optim.SGD([w, b] if self.keep_bias else [w], lr=lr, momentum=mom)
        meter = Meter()
        for x, y in data.batches(self.spec.batch_size, gen, epochs=self.p.finetune_epochs):
            with torch.no_grad():
                h = net.backbone(x)
            loss = F.cross_entropy(F.linear(h, w, b), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter.add(loss)
        return w.detach(), b.detach(), meter.mean()

    def phase_aggregate(self, phase: str, state: "FedLoGe.State", replies) -> "FedLoGe.State":
        if phase == "ga-fr":
            w, b = self._generic(state.weights["head.weight"], state.weights["head.bias"])
            state.generic = {"weight": w, "bias": b.clone()}
        return state

    # ------------------------------------------------------------------------------------------- inference
    def _generic(self, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ga_fr(w, self.gafr_norm), (b if self.keep_bias else torch.zeros_like(b))

    def global_model(self, state: "FedLoGe.State") -> dict[str, Predictor]:
        m = self.eval_model(state.weights)
        W, b = self.fixed_head()
        psi_w, psi_b = m.head.weight.detach(), m.head.bias.detach()
        modes: dict[str, Predictor] = {}
        if state.generic is not None:  # after the GA-FR phase
            modes["generic"] = Predictor(m.backbone, linear_head(state.generic["weight"], state.generic["bias"]),
                                         shared_backbone=True)
        universal = linear_head(W, b)
        if self.p.backbone_loss == "etf-dr":  # the official globaltest_etf: g_head left in train mode
            universal = lambda h: F.linear(etf_features(h), W)  # noqa: E731
        modes["universal"] = Predictor(m.backbone, universal, shared_backbone=True)
        modes["psi"] = Predictor(m.backbone, linear_head(psi_w, psi_b), shared_backbone=True)
        if state.generic is None and self.p.ga_fr and self.p.preview:
            modes["generic-preview"] = Predictor(m.backbone, linear_head(*self._generic(psi_w, psi_b)),
                                                 shared_backbone=True)
        return modes

    def eval_payload(self, state: "FedLoGe.State", cid: int) -> Message:
        return Message(arrays=dict(state.weights))

    def personal_model(self, payload: Message, cstate: dict, data) -> dict[str, Predictor]:
        net = personal_net(self)  # the client-side evaluation copy, loaded with the global weights received
        load_weights(net, payload.arrays)
        net.eval()
        present = data.classes if self.p.mask_absent else None
        psi_w, psi_b = payload.arrays["head.weight"], payload.arrays["head.bias"]
        phi_w, phi_b = cstate["phi.weight"], cstate["phi.bias"]

        def head(w, b):  # a sum of linear heads is one linear head
            return Predictor(net.backbone, linear_head(w, b, present), shared_backbone=True)

        def personalized(rw, rb):
            return head(phi_w + rw, phi_b + rb) if self.p.pm_logits == "sum" else head(rw, rb)

        modes: dict[str, Predictor] = {}
        if "realigned.weight" in cstate:  # after the LA-FR phase
            modes["personalized"] = personalized(cstate["realigned.weight"], cstate["realigned.bias"])
        modes["phi+psi"] = head(phi_w + psi_w, phi_b + psi_b)  # what the official code logs every round
        modes["phi"] = head(phi_w, phi_b)
        if "realigned.weight" not in cstate and self.p.la_fr and self.p.preview:
            rb = psi_b if self.keep_bias else torch.zeros_like(psi_b)
            modes["personalized-preview"] = personalized(la_fr(psi_w, phi_w, self.lafr_normalize), rb)
        return modes
