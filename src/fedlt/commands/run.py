"""fedlt run: one federated long-tailed experiment."""
from __future__ import annotations

import argparse

NAME = "run"
HELP = "run one method on one long-tailed federation and print GM, PM and many/medium/few"
ORDER = 10


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The run settings, shared by every command that runs experiments. Defaults (None here) come from
    fedlt.config.RunConfig: the fmnist-lt protocol of docs/protocol.md."""
    p.add_argument("--config", help="TOML file with run settings ([params] table for method parameters)")
    p.add_argument("--preset", help="named settings: fmnist-lt, fmnist-lt-official, smoke, or a paper's protocol "
                                     "(fedloge-cifar10-lt, redgrape-mnist-lt, ...; `fedlt list` shows them)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", help="fashion-mnist (default), mnist, cifar10, cifar100, imagenet-lt, inat-user, "
                                     "femnist, speech-commands, imu, digits, synthetic")
    g.add_argument("--data-dir", help="folder with the dataset files (else $FEDLT_DATA, then system location)")
    g.add_argument("--imbalance-ratio", "--rho", type=float, dest="imbalance_ratio",
                   help="n_max/n_min >= 1 (default 100)")
    g.add_argument("--image-size", type=int, help="imagenet-lt, inat-user: input resolution (default 224; "
                                                   "64 or 112 for small runs)")
    g.add_argument("--lt-profile", choices=["exp", "step", "none"],
                   help="exponential (default for balanced sets), step, or none (every sample; the default for "
                        "datasets long-tailed as published, local-longtail and partition files)")
    g.add_argument("--tail-classes", type=int, help="number of tail classes of the step profile (default 3)")
    g.add_argument("--n-max", type=int, help="samples of the head class (default: all it has)")
    g.add_argument("--partition", help="dirichlet (default), shards, iid, tau, pathological, exdir, local-longtail, "
                                       "natural (the dataset's own users)")
    g.add_argument("--partition-file", metavar="FILE.json",
                   help="the clients' training indices (a run's partition.json, or client -> indices); replaces "
                        "the long-tail subset and the partition")
    g.add_argument("--alpha", type=float, help="Dirichlet concentration (default 0.5)")
    g.add_argument("--shards-per-client", type=int, help="shards per client (default 2)")
    g.add_argument("--classes-per-client", type=int, help="pathological, exdir: classes per client (default 2)")
    g.add_argument("--balance", action="store_true", default=None,
                   help="LongTailLib's balanced client sizes (dirichlet: shares capped at N/K; pathological: equal)")
    g.add_argument("--tau", type=float, help="BalanceFL tau-sampling: n_tau = tau * n_min (default 2)")
    g.add_argument("--min-client-size", type=int, help="Dirichlet: redraw until every client has this many")
    g.add_argument("--clients", type=int, help="number of clients K (default 20)")
    g = p.add_argument_group("training")
    g.add_argument("--method", help="federated method (default fedavg; `fedlt list` shows all)")
    g.add_argument("--method-file", metavar="FILE.py",
                   help="a Python file that registers a method of your own (its code runs; see "
                        "docs/writing-a-method.md); --method defaults to the method it defines")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="method hyper-parameter, repeatable (e.g. --set mu=0.01)")
    g.add_argument("--model", help="mlp, smallcnn, smallcnn-bn, cnn-mcmahan, resnet8/18/34/50/56, resnet50-cifar, vgg11, "
                                   "mobilenet (default: per dataset)")
    g.add_argument("--rounds", type=int, help="communication rounds (default 50)")
    g.add_argument("--participation", type=float, help="fraction (<= 1) or count (> 1) of clients per round")
    g.add_argument("--local-epochs", type=int, help="local epochs (default 2)")
    g.add_argument("--batch-size", type=int, help="local batch size (default 32)")
    g.add_argument("--lr", type=float, help="local learning rate (default 0.05)")
    g.add_argument("--lr-schedule", help="lr per round: constant (default), step (x lr-gamma after each milestone), "
                                         "cosine (to 0 over the rounds)")
    g.add_argument("--lr-milestones", metavar="R1,R2", help="step schedule: rounds after which the lr decays "
                                                             "(FedDr+: 160,240)")
    g.add_argument("--lr-gamma", type=float, help="step schedule: decay factor (default 0.1)")
    g.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    g.add_argument("--weight-decay", type=float, help="weight decay (default 0)")
    g.add_argument("--seed", type=int, help="the one seed of the run (default 0)")
    g.add_argument("--device", help="cpu (default) or cuda")
    g.add_argument("--threads", type=int, help="torch CPU threads")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="training precision (default fp32): bf16 or fp16 autocast, fp16 with a gradient scaler "
                        "(CUDA only)")
    g.add_argument("--channels-last", choices=["auto", "on", "off"],
                   help="channels_last memory format for convolutional models (auto: on CUDA under bf16/fp16)")
    g.add_argument("--client-parallel", metavar="auto|off|N",
                   help="train a round's clients together (methods that describe their local steps): auto "
                        "(default: all at once on CUDA, one after another on a CPU), off, or N per chunk")
    g.add_argument("--cuda-graphs", action="store_true", default=None,
                   help="replay each batched step as one CUDA graph (fewer launches; --client-parallel on CUDA)")
    g.add_argument("--deterministic", action="store_true", default=None,
                   help="deterministic algorithms and cuDNN settings (slower on a GPU)")
    g.add_argument("--data-placement", choices=["auto", "device", "host"],
                   help="where the samples live: auto (default: on the GPU when they take at most a quarter of its "
                        "free memory, else in host memory with pinned per-batch copies), device, host")
    g.add_argument("--on-diverge", choices=["stop", "continue"],
                   help="a non-finite training loss or global weights: stop the run with exit status 3 "
                        "(default) or train on")
    g.add_argument("--diverge-factor", type=float, metavar="F",
                   help="also stop when the training loss exceeds F times the first round's (default 0: off; "
                        "100 suits cross-entropy)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=int, help="evaluate every N rounds (default 5)")
    g.add_argument("--split", choices=["fedloge", "fixed"], help="many/medium/few split (default fedloge)")
    g.add_argument("--out", help="folder for run directories (default runs/)")
    g.add_argument("--name", help="run directory name (default: method-dataset-...-timestamp)")


def parse_set(items: list[str], option: str = "--set") -> dict[str, str]:
    from ..errors import ConfigError

    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{option} expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def config_from_args(args: argparse.Namespace, **extra):
    from ..config import FIELDS, load_config

    over = {k: getattr(args, k) for k in FIELDS if k != "params" and getattr(args, k, None) is not None}
    over.update(extra)
    over["params"] = parse_set(getattr(args, "set", []))
    return load_config(getattr(args, "config", None), over)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_resume_arguments(p)


def add_resume_arguments(p) -> None:
    """--checkpoint-every and --resume (``fedlt run`` and the Flower runs)."""
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="write an atomic checkpoint every N rounds (default 1: a run stopped by a signal loses at "
                        "most the round in progress; 0: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out/--name from its last checkpoint (same settings required)")


def main(args: argparse.Namespace) -> int:
    from ..api import run

    res = run(config_from_args(args), progress=not args.no_progress, echo=print,
              checkpoint_every=args.checkpoint_every, resume=args.resume)
    return 3 if res.status == "diverged" else 0
