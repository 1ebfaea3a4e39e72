"""fedlt flower: run fedlt methods on Flower (a SuperLink, SuperNodes and `flwr run`), or in one process.

    fedlt flower superlink --insecure                      # tests on 127.0.0.1; across machines: --ssl-*
    fedlt flower supernode --superlink 127.0.0.1:9093 --partition-id 0 --insecure
    fedlt flower run --superlink 127.0.0.1:9093 --insecure --method fedloge --clients 2 ...
    fedlt flower inprocess --method fedloge ...            # the same apps in one process (no network)
    fedlt flower simulate --method fedloge --clients 1000 --gpus-per-client 0.1 ...   # Flower's Ray simulation
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..flower.settings import FLOWER_DEFAULTS
from .run import add_config_arguments, add_resume_arguments, config_from_args

NAME = "flower"
HELP = "run a method on Flower: superlink, supernode, register, app, run (flwr run), inprocess, simulate"
ORDER = 60


def _number(kind: type, low: float, low_open: bool = False, high: float | None = None):
    """An argparse type: a finite number of ``kind`` in range (argparse's one-line error otherwise)."""
    import math

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {'an int' if kind is int else 'a number'}, got {text!r}") \
                from None
        if not math.isfinite(v) or (v <= low if low_open else v < low) or (high is not None and v > high):
            where = f"{'>' if low_open else '>='} {low:g}" if high is None else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be a number {where}, got {text!r}")
        return v

    parse.__name__ = "int" if kind is int else "number"
    return parse


POSITIVE, COUNT, PORT = _number(float, 0, True), _number(int, 0), _number(int, 1, high=65535)
SECONDS, ID = POSITIVE, COUNT  # a duration, a client's number


def _address(text: str) -> str:
    """HOST:PORT (a host name, an IPv4 address, or [IPv6]) with a port in 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expects HOST:PORT (e.g. 127.0.0.1:9092), got {text!r}")
    return text


def _flower_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Flower")
    g.add_argument("--round-timeout", type=SECONDS, metavar="SECONDS",
                   help="seconds a round/phase/evaluation waits for replies; later clients count as missing "
                        f"({FLOWER_DEFAULTS['round-timeout']:g})")
    g.add_argument("--wait-timeout", type=SECONDS, metavar="SECONDS",
                   help=f"seconds the run waits at the start for its SuperNodes ({FLOWER_DEFAULTS['wait-timeout']:g})")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (as fedlt run; the Flower runs draw none: accepted for the same command line)")
    add_resume_arguments(g)


def _flower_kw(args) -> dict:
    """The Flower engine's settings given on the command line (those not given keep their defaults)."""
    kw = {"round_timeout": args.round_timeout, "wait_timeout": args.wait_timeout,
          "checkpoint_every": args.checkpoint_every, "resume": 1 if args.resume else None}
    return {k: v for k, v in kw.items() if v is not None}


def _connection_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection to the SuperLink")
    g.add_argument("--superlink", required=True, type=_address, metavar="HOST:PORT", help="the SuperLink's address")
    g.add_argument("--insecure", action="store_true", help="no TLS (tests on 127.0.0.1 only)")
    g.add_argument("--root-certificates", metavar="CA.crt", help="CA certificate that signed the SuperLink's")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="flower_command", required=True)

    s = sub.add_parser("superlink", help="start a Flower SuperLink (fedlt defaults: no telemetry, no runtime "
                                         "dependency installation)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 with TLS "
                                                        "to accept other machines)")
    s.add_argument("--port", type=PORT, default=9093, help="port of the SuperLink's HTTP APIs (default 9093)")
    s.add_argument("--database", help="SQLite file that keeps the SuperLink's state (default: in memory)")
    s.add_argument("--insecure", action="store_true", help="no TLS (tests on 127.0.0.1 only)")
    s.add_argument("--ssl-ca-certfile", help="CA certificate (PEM)")
    s.add_argument("--ssl-certfile", help="the SuperLink's certificate (PEM, with its host name / IP as SAN)")
    s.add_argument("--ssl-keyfile", help="the SuperLink's private key (PEM)")
    s.add_argument("--supernode-auth", action="store_true",
                   help="admit only SuperNodes whose keys are registered (fedlt flower register KEY.pub)")
    s.add_argument("--allow-runtime-dependency-installation", action="store_true",
                   help="let the SuperLink `uv sync` each app's dependencies (off by default)")

    n = sub.add_parser("supernode", help="start a Flower SuperNode that serves one client's data")
    n.add_argument("--superlink", required=True, type=_address, metavar="HOST:PORT", help="the SuperLink's address")
    n.add_argument("--partition-id", type=ID, help="serve client K of the run's fedlt partition (trials)")
    n.add_argument("--data-dir", help="serve the client's own data: DIR/train.npz (x, y), optional DIR/test.npz")
    n.add_argument("--client-id", type=ID, help="with --data-dir: this client's number, 0..clients-1")
    n.add_argument("--state-dir", help="also keep the client state here, so it survives a SuperNode restart")
    n.add_argument("--device", help="torch device for this client (default: the run's)")
    n.add_argument("--host", default="127.0.0.1", help="host of the SuperNode's own Runtime API (default 127.0.0.1)")
    n.add_argument("--port", type=PORT, help="port of the SuperNode's own Runtime API (default 9094 + client id)")
    n.add_argument("--insecure", action="store_true", help="no TLS (tests on 127.0.0.1 only)")
    n.add_argument("--root-certificates", metavar="CA.crt", help="CA certificate that signed the SuperLink's")
    n.add_argument("--auth-key", metavar="KEY", help="private EC key (OpenSSH format) registered on the SuperLink")
    n.add_argument("--max-retries", type=COUNT, help="give up after this many failed connection attempts")
    n.add_argument("--max-wait-time", type=SECONDS, help="give up after this many seconds without a connection")

    g = sub.add_parser("register", help="register a SuperNode's public key on a SuperLink started with "
                                        "--supernode-auth (flwr supernode register)")
    g.add_argument("public_key", metavar="KEY.pub", help="the SuperNode's public key (ssh-keygen -t ecdsa -b 384)")
    g.add_argument("--superlink", required=True, type=_address, metavar="HOST:PORT", help="the SuperLink's address")
    g.add_argument("--root-certificates", required=True, metavar="CA.crt",
                   help="CA certificate that signed the SuperLink's")
    g.add_argument("--name", help="a name for the SuperNode (flwr supernode list shows it)")

    a = sub.add_parser("app", help="write a Flower App directory (pyproject.toml) for `flwr run`")
    a.add_argument("--app-dir", required=True, help="folder to write")
    add_config_arguments(a)
    _flower_options(a)

    r = sub.add_parser("run", help="write the Flower App and submit it with `flwr run` to a SuperLink")
    r.add_argument("--app-dir", help="where to write the app (default: a temporary folder)")
    _connection_options(r)
    r.add_argument("--no-stream", action="store_true", help="submit and return (default: follow the run's log)")
    add_config_arguments(r)
    _flower_options(r)

    i = sub.add_parser("inprocess", help="run the Flower ServerApp and ClientApps in this process (no network)")
    add_config_arguments(i)
    _flower_options(i)

    m = sub.add_parser("simulate", help="run the Flower ServerApp and ClientApps on Flower's simulation runtime "
                                        "(Ray: the clients spread over every CPU and GPU of a node or cluster)")
    add_config_arguments(m)
    _flower_options(m)
    g = m.add_argument_group("simulation (pip install 'fedlt[simulation]')")
    g.add_argument("--cpus-per-client", type=POSITIVE, default=1.0, metavar="N",
                   help="CPUs each virtual client asks Ray for (default 1): CPUs / N clients train at once")
    g.add_argument("--gpus-per-client", type=_number(float, 0), default=0.0, metavar="F",
                   help="GPUs each virtual client asks Ray for (default 0; 0.25: four clients share a GPU)")
    g.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (auto, HOST:PORT) instead of "
                                                         "starting one on this machine")
    g.add_argument("--backend-config", metavar="JSON",
                   help="Flower's backend config, merged over the above: {\"init_args\": {...ray.init...}, "
                        "\"client_resources\": {...}, \"actor\": {...}}")


def _exec(argv: list[str], env: dict) -> int:
    """Replace this process with the Flower program (signals then reach it directly)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
    return 0  # not reached


LOST = "Connection to the SuperLink is unavailable"  # flwr's message when the SuperLink is gone


def _flwr_run(argv: list[str], env: dict, follow: bool, out: Path | None = None, name: str | None = None,
              superlink: str = "") -> int:
    """`flwr run`, echoing its output; with ``follow``, exit status 1 unless the run finished completed (flwr's
    own exit status is 0 once the run was submitted, whatever became of it). A SuperLink lost during the run
    (killed, its machine down) is one line instead of Flower's box: the round the run directory ``out`` has
    checkpointed and how to resume, exit status 75 (:class:`~fedlt.errors.Interrupted`)."""
    import json
    import re

    from ..errors import Interrupted
    from ..flower import deploy

    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_id, box, lost = None, [], False
    for line in proc.stdout:
        m = re.search(r"Successfully started run (\d+)", line)
        run_id = run_id or (m.group(1) if m else None)
        if line.lstrip().startswith("╭") or box:  # a box of Flower's: held until it is closed
            box.append(line)
            if not line.lstrip().startswith("╰"):
                continue
            held, box = box, []
            if LOST in " ".join(" ".join(x.strip("│╭╰─ \n") for x in held).split()):
                lost = True  # said in fedlt's line instead
                continue
            line = "".join(held)
        sys.stdout.write(line)
        sys.stdout.flush()
    rc = proc.wait()
    sys.stdout.writelines(box)
    if lost:
        raise Interrupted(_lost_line(superlink, run_id, out, name))
    if rc or not follow or run_id is None:
        return rc or (1 if run_id is None else 0)
    ls = subprocess.run([deploy.program("flwr"), "ls", "--run-id", run_id, "--format", "json"], env=env,
                        capture_output=True, text=True)
    try:
        status = json.loads(ls.stdout)["runs"][0]["status"]
    except (ValueError, KeyError, IndexError):
        if LOST in " ".join(ls.stdout.split()):
            raise Interrupted(_lost_line(superlink, run_id, out, name)) from None
        print(f"fedlt: could not read the status of run {run_id}: {ls.stdout.strip()[-300:]}", file=sys.stderr)
        return 1
    print(f"fedlt: run {run_id} {status}", flush=True)
    return 0 if status.endswith("completed") else 1


def _lost_line(superlink: str, run_id: str | None, out: Path | None, name: str | None) -> str:
    """What a `fedlt flower run` that lost its SuperLink says: the round its run directory has checkpointed (when
    that directory is on this machine) and how to go on."""
    from ..runner.preempt import again
    from ..runner.runstate import checkpointed_round

    if run_id is None:
        return f"cannot reach the SuperLink at {superlink}; start it (fedlt flower superlink) or fix --superlink"
    head = f"lost the SuperLink at {superlink} during Flower run {run_id}"
    resume = f"restart the SuperLink on its --database and run {again(out, name)}"
    if out is None or not out.is_dir():
        return f"{head}; its run directory is on the SuperLink's machine: to finish it, {resume}"
    rnd = checkpointed_round(out)
    if rnd is None:
        return f"{head}; run {out} has no checkpoint yet: start it again (without --resume)"
    return f"{head}; run {out} has round {rnd} checkpointed: to finish it, {resume}"


def main(args: argparse.Namespace) -> int:
    from ..engine.flower import require_flwr

    require_flwr()
    from ..flower import deploy

    cmd = args.flower_command
    if cmd == "superlink":
        argv = deploy.superlink_argv(args.host, args.port, args.database, args.insecure, args.ssl_ca_certfile,
                                     args.ssl_certfile, args.ssl_keyfile, args.supernode_auth,
                                     args.allow_runtime_dependency_installation)
        return _exec(argv, deploy.flower_env(args.allow_runtime_dependency_installation))
    if cmd == "supernode":
        argv = deploy.supernode_argv(args.superlink, args.partition_id, args.data_dir, args.client_id, args.state_dir,
                                     args.device, args.host, args.port, args.insecure, args.root_certificates,
                                     args.auth_key, args.max_retries, args.max_wait_time)
        deploy.check_connection(args.superlink, args.insecure, args.root_certificates)
        if args.insecure:
            return _exec(argv, deploy.flower_env())
        return deploy.run_supernode(argv, deploy.flower_env(), args.superlink, args.auth_key, args.root_certificates)
    if cmd == "register":
        node = deploy.register_supernode(args.public_key, args.superlink, args.root_certificates, args.name)
        print(f"fedlt: registered {args.public_key} on the SuperLink at {args.superlink}: SuperNode {node}")
        return 0
    cfg = config_from_args(args)
    if cmd == "app":
        path = deploy.write_app(args.app_dir, cfg, **_flower_kw(args))
        print(f"wrote {path / 'pyproject.toml'}; run it with: flwr run {path} <connection>  (or fedlt flower run)")
        return 0
    if cmd == "run":
        from ..config import RunConfig
        from ..runner.rundir import run_dir_for

        deploy.check_connection(args.superlink, args.insecure, args.root_certificates)
        name = cfg.name  # as given: a run named here is resumed with its name (preempt.again)
        if name is None:  # named here, so that this command knows the run directory the ServerApp writes
            cfg = RunConfig(**{**cfg.to_dict(), "name": run_dir_for(cfg).name})
        out = run_dir_for(cfg).resolve()
        app_dir = Path(args.app_dir or tempfile.mkdtemp(prefix="fedlt-flower-app-"))
        deploy.write_app(app_dir, cfg, **_flower_kw(args))
        env = deploy.flower_env()
        env["FLWR_HOME"] = tempfile.mkdtemp(prefix="fedlt-flwr-home-")  # never touch the user's ~/.flwr
        deploy.write_connection(env["FLWR_HOME"], args.superlink, insecure=args.insecure,
                                root_certificates=args.root_certificates)
        argv = deploy.flwr_run_argv(app_dir, stream=not args.no_stream)
        print(f"fedlt: {' '.join(argv)}  (FLWR_HOME={env['FLWR_HOME']}; run directory under {Path(cfg.out).resolve()})",
              flush=True)
        try:
            return _flwr_run(argv, env, not args.no_stream, out, name, args.superlink)
        finally:
            shutil.rmtree(env["FLWR_HOME"], ignore_errors=True)
    if cmd == "simulate":
        from ..runner.preempt import Preempted
        from ..flower.simulation import backend_config_of, run_simulation

        backend = backend_config_of(args.cpus_per_client, args.gpus_per_client, args.ray_address, args.backend_config)
        try:
            run_simulation(cfg, backend, **_flower_kw(args))
        except Preempted as e:  # Flower's ServerApp thread is no daemon: it would hold the process for a round timeout
            sys.stderr.write(e.line() + "\n")
            sys.stderr.flush()
            os._exit(e.exit_status)
        return 0
    if cmd == "inprocess":
        from ..flower.inprocess import run_inprocess

        run_inprocess(cfg, **_flower_kw(args))
        return 0
    raise AssertionError(cmd)
