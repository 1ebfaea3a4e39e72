"""Real deployment: the SuperLink and SuperNode command lines, the Flower App directory and the ``flwr run``
connection, with fedlt's defaults (telemetry and update checks off, no runtime dependency installation).

Flower 1.41/1.42 serve everything over HTTP(S): the SuperLink on one ``--host/--port`` (Fleet, Control and
Runtime APIs), each SuperNode its own Runtime API on ``--host/--port`` (so SuperNodes that share a host need
different ports). Across machines use TLS (``--ssl-*`` on the SuperLink, ``--root-certificates`` on the
SuperNodes and in the ``flwr run`` connection) and SuperNode authentication (``--enable-supernode-auth`` on the
SuperLink, ``fedlt flower register KEY.pub`` (:func:`register_supernode`), ``--auth-supernode-private-key`` on the
SuperNode). A client whose TLS settings do not fit the SuperLink's, or a SuperNode the SuperLink refuses, gets one
line that names the setting to fix (:func:`tls_problem`, :func:`supernode_refusal`).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from .settings import to_run_config

QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",  # no events to telemetry.flower.ai
    "FLWR_DISABLE_UPDATE_CHECK": "1",  # no version check against api.flower.ai
    "RAY_USAGE_STATS_ENABLED": "0",
}
NO_RUNTIME_INSTALL = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}  # no `uv sync` of the app's deps per run


def flower_env(allow_runtime_install: bool = False, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(QUIET_ENV)
    if not allow_runtime_install:
        env.update(NO_RUNTIME_INSTALL)
    bindir = str(Path(sys.executable).parent)  # the Flower programs of this environment come first
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def program(name: str) -> str:
    """The Flower program installed next to this Python (else on PATH)."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise ConfigError(f"{name} not found; install Flower with: pip install 'fedlt[flower]'")
    return found


def _tls_superlink(insecure: bool, ca: str | None, cert: str | None, key: str | None) -> list[str]:
    if insecure:
        if ca or cert or key:
            raise ConfigError("--insecure and TLS certificates exclude each other; drop one")
        return ["--insecure"]
    if not (ca and cert and key):
        raise ConfigError("a SuperLink needs TLS (--ssl-ca-certfile, --ssl-certfile, --ssl-keyfile) or, on a "
                          "trusted network or for tests on 127.0.0.1, --insecure")
    for p in (ca, cert, key):
        if not Path(p).is_file():
            raise ConfigError(f"TLS file {p} not found")
    return ["--ssl-ca-certfile", ca, "--ssl-certfile", cert, "--ssl-keyfile", key]


def superlink_argv(host: str = "127.0.0.1", port: int = 9093, database: str | None = None, insecure: bool = False,
                   ssl_ca_certfile: str | None = None, ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                   supernode_auth: bool = False, allow_runtime_install: bool = False,
                   extra: list[str] | None = None) -> list[str]:
    argv = [program("flower-superlink"), "--host", host, "--port", str(port)]
    argv += _tls_superlink(insecure, ssl_ca_certfile, ssl_certfile, ssl_keyfile)
    if database:
        argv += ["--database", database]
    if supernode_auth:
        if insecure:
            raise ConfigError("SuperNode authentication needs TLS; give the --ssl-* files instead of --insecure")
        argv.append("--enable-supernode-auth")
    argv.append("--allow-runtime-dependency-installation" if allow_runtime_install
                else "--disable-runtime-dependency-installation")
    return argv + list(extra or [])


def node_config_text(d: dict[str, Any]) -> str:
    """``--node-config`` text: ints as they are, strings as TOML literal strings."""
    parts = []
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, str):
            if "'" in v:
                raise ConfigError(f"{k}={v!r}: a quote in a node setting is not supported")
            parts.append(f"{k}='{v}'")
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def supernode_argv(superlink: str, partition_id: int | None = None, data_dir: str | None = None,
                   client_id: int | None = None, state_dir: str | None = None, device: str | None = None,
                   host: str = "127.0.0.1", port: int | None = None, insecure: bool = False,
                   root_certificates: str | None = None, auth_key: str | None = None,
                   max_retries: int | None = None, max_wait_time: float | None = None,
                   extra: list[str] | None = None) -> list[str]:
    if (partition_id is None) == (data_dir is None):
        raise ConfigError("a SuperNode serves either --partition-id K (a client of the fedlt partition) or "
                          "--data-dir DIR --client-id K (its own data)")
    if data_dir is not None:
        if client_id is None:
            raise ConfigError("--data-dir needs --client-id K (the client's number, 0..clients-1)")
        if not (Path(data_dir) / "train.npz").is_file():
            raise ConfigError(f"{data_dir}/train.npz not found; a client data directory holds train.npz "
                              f"(arrays x, y) and optionally test.npz")
        data_dir = str(Path(data_dir).resolve())
    cid = partition_id if partition_id is not None else client_id
    nc = {"partition-id": partition_id, "data-dir": data_dir, "client-id": client_id if data_dir else None,
          "state-dir": str(Path(state_dir).resolve()) if state_dir else None, "device": device}
    argv = [program("flower-supernode"), "--superlink", superlink, "--host", host,
            "--port", str(port if port is not None else 9094 + int(cid)), "--node-config", node_config_text(nc)]
    if insecure:
        if root_certificates:
            raise ConfigError("--insecure and --root-certificates exclude each other; drop one")
        argv.append("--insecure")
    elif root_certificates:
        if not Path(root_certificates).is_file():
            raise ConfigError(f"root certificate {root_certificates} not found")
        argv += ["--root-certificates", root_certificates]
    else:
        raise ConfigError("a SuperNode needs --root-certificates CA.crt (the CA that signed the SuperLink's "
                          "certificate) or, for tests on 127.0.0.1, --insecure")
    if auth_key:
        if not Path(auth_key).is_file():
            raise ConfigError(f"SuperNode key {auth_key} not found (make one with: ssh-keygen -t ecdsa -b 384 "
                              f"-N '' -f KEY)")
        argv += ["--auth-supernode-private-key", auth_key]
    if max_retries is not None:
        argv += ["--max-retries", str(max_retries)]
    if max_wait_time is not None:
        argv += ["--max-wait-time", str(max_wait_time)]
    return argv + list(extra or [])


# ------------------------------------------------------------------------- the Flower App and `flwr run`
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_table(name: str, d: dict) -> list[str]:
    lines = [f"[{name}]"]
    subs = []
    for k, v in d.items():
        key = k if k.replace("-", "").replace("_", "").isalnum() else _toml_value(k)
        if isinstance(v, dict):
            subs.append((f"{name}.{key}", v))
        else:
            lines.append(f"{key} = {_toml_value(v)}")
    for sub_name, sub in subs:
        lines += [""] + _toml_table(sub_name, sub)
    return lines


def write_app(app_dir: str | Path, cfg: RunConfig, **flower: Any) -> Path:
    """A Flower App directory for ``flwr run``: a pyproject.toml that names fedlt's ServerApp and ClientApp and
    holds the run settings (``out`` made absolute: the ServerApp writes the run directory there). fedlt itself
    must be installed on the SuperLink's and every SuperNode's machine (runtime installation stays off)."""
    app_dir = Path(app_dir)
    if app_dir.exists() and not app_dir.is_dir():
        raise ConfigError(f"--app-dir {app_dir} is a file; give a folder (it is created where it is not there)")
    try:
        app_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise ConfigError(f"--app-dir {app_dir}: cannot create the folder ({e.strerror or e}); give another")
    cfg = RunConfig(**{**cfg.to_dict(), "out": str(Path(cfg.out).resolve())})
    conf = to_run_config(cfg, **flower)
    lines = [
        "# A fedlt run as a Flower App: `flwr run <this folder> <connection>` (or `fedlt flower run`).",
        "# fedlt[flower] must be installed where the SuperLink and the SuperNodes run.",
        "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
        "[project]", f'name = "fedlt-{cfg.method.replace("_", "-")}"', 'version = "1.0.0"',
        f'description = "fedlt: {cfg.method} on {cfg.dataset}"', 'license = "Apache-2.0"',
        "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "fedlt"', "",
        "[tool.flwr.app.components]", 'serverapp = "fedlt.flower.server_app:app"',
        'clientapp = "fedlt.flower.client_app:app"', "",
    ] + _toml_table("tool.flwr.app.config", conf)
    (app_dir / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return app_dir


def write_connection(flwr_home: str | Path, superlink: str, name: str = "fedlt", insecure: bool = False,
                     root_certificates: str | None = None) -> Path:
    """``$FLWR_HOME/config.toml`` with one SuperLink connection for ``flwr run <app> <name>``."""
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f'address = "{superlink}"']
    if insecure:
        lines.append("insecure = true")
    elif root_certificates:
        lines.append(f'root-certificates = "{Path(root_certificates).resolve()}"')
    else:
        raise ConfigError("the connection needs --root-certificates CA.crt or, for tests on 127.0.0.1, --insecure")
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def flwr_run_argv(app_dir: str | Path, name: str = "fedlt", stream: bool = True,
                  run_config: list[str] | None = None) -> list[str]:
    argv = [program("flwr"), "run", str(app_dir), name]
    for rc in run_config or []:
        argv += ["--run-config", rc]
    return argv + (["--stream"] if stream else [])


# ------------------------------------------------------------------------- TLS and SuperNode authentication
AUTH_HINT = "fedlt flower register KEY.pub --superlink {superlink} --root-certificates CA.crt"


def tls_problem(superlink: str, insecure: bool, root_certificates: str | None, timeout: float = 5.0) -> str | None:
    """What is wrong with a client's TLS settings for the SuperLink at ``superlink`` (HOST:PORT), found by one TLS
    handshake with them: a SuperLink that speaks TLS to an ``insecure`` client, none to a client with
    ``root_certificates``, or a certificate that ``root_certificates`` does not verify. None when the handshake
    agrees with the settings, or nothing answers yet (Flower's clients retry)."""
    import socket
    import ssl

    host, _, port = superlink.rpartition(":")
    host = host.strip("[]")
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    elif not root_certificates:  # neither: the command says so itself
        return None
    elif not Path(root_certificates).is_file():
        return f"root certificate {root_certificates} not found; give --root-certificates the CA certificate that " \
               f"signed the SuperLink's (its --ssl-ca-certfile)"
    else:
        try:
            ctx = ssl.create_default_context(cafile=root_certificates)
        except (OSError, ssl.SSLError) as e:
            return f"--root-certificates {root_certificates} is no PEM certificate ({e}); give the CA certificate " \
                   f"that signed the SuperLink's (its --ssl-ca-certfile)"
    try:
        with socket.create_connection((host, int(port)), timeout) as s, ctx.wrap_socket(s, server_hostname=host):
            pass
    except ssl.SSLCertVerificationError as e:
        return cert_line(superlink, root_certificates, e.verify_message)
    except ssl.SSLError:  # no TLS on the other side (an HTTP answer to the handshake)
        if insecure:
            return None
        return f"the SuperLink at {superlink} does not use TLS (it was started with --insecure): start it with " \
               f"--ssl-ca-certfile, --ssl-certfile and --ssl-keyfile, or for tests on 127.0.0.1 give --insecure " \
               f"instead of --root-certificates"
    except OSError:  # not reachable (yet)
        return None
    if insecure:
        return f"the SuperLink at {superlink} uses TLS: give --root-certificates CA.crt (the CA certificate that " \
               f"signed the SuperLink's, its --ssl-ca-certfile) instead of --insecure"
    return None


def cert_line(superlink: str, root_certificates: str | None, why: str) -> str:
    """The line for a SuperLink certificate that the client's root certificates do not verify (``why``)."""
    head = f"the SuperLink at {superlink} presented a certificate that --root-certificates {root_certificates} " \
           f"does not verify ({why})"
    if "mismatch" in why.lower():  # signed by that CA, for another name
        return f"{head}: give the SuperLink a certificate (--ssl-certfile) whose subjectAltName holds " \
               f"{superlink.rpartition(':')[0]}, or connect to a name it holds"
    return f"{head}: give --root-certificates the CA certificate that signed the SuperLink's (its --ssl-ca-certfile)"


def check_connection(superlink: str, insecure: bool, root_certificates: str | None) -> None:
    """:func:`tls_problem` as a one-line error."""
    problem = tls_problem(superlink, insecure, root_certificates)
    if problem:
        raise ConfigError(problem)


def supernode_refusal(text: str, superlink: str, auth_key: str | None, root_certificates: str | None) -> str | None:
    """fedlt's line for a Flower SuperNode's failure to connect, from Flower's error text ``text``: a key the
    SuperLink does not know, no key where it admits registered SuperNodes only, a certificate that the root
    certificates do not verify. None for any other failure."""
    import re

    hint = AUTH_HINT.format(superlink=superlink)
    if "[code: 2004]" in text and auth_key:  # FLEET_NODE_ACTIVATION_FAILED: no SuperNode has this key, or one is on
        return f"the SuperLink at {superlink} refused this SuperNode's --auth-key {auth_key}: no SuperNode is " \
               f"registered with it ({hint.replace('KEY', auth_key)} registers it) or another one is online with it " \
               f"(give each SuperNode a key of its own)"
    if "[code: 2001]" in text:  # FLEET_SUPERNODE_REGISTRATION_DISABLED: authentication on, the SuperNode has no key
        return f"the SuperLink at {superlink} admits registered SuperNodes only (--supernode-auth): give --auth-key " \
               f"KEY, a private key whose public key is registered ({hint})"
    m = re.search(r"CERTIFICATE_VERIFY_FAILED\] certificate verify failed: ([^(\n]*)", text)
    if m:
        return cert_line(superlink, root_certificates, m.group(1).strip())
    return None


def run_supernode(argv: list[str], env: dict, superlink: str, auth_key: str | None,
                  root_certificates: str | None) -> int:
    """The Flower SuperNode ``argv`` as a child whose output this process passes on, line by line, and whose
    signals it forwards; Flower's error block at a failed start (``Exit Code: ...`` to its link) is held back. A
    refusal that :func:`supernode_refusal` knows becomes its one-line error; another failure shows the block."""
    import signal
    import subprocess
    import threading

    proc = subprocess.Popen(argv, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    old = {s: signal.signal(s, lambda sig, _frame: proc.send_signal(sig)) for s in forwarded}
    held: list[str] = []

    def pump():  # till the pipe's end: the SuperNode's own children hold it a while after it exits
        for line in proc.stdout:
            if held or "Exit Code:" in line:
                held.append(line)
                continue
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    reader.join(1)
    refusal = supernode_refusal("".join(held), superlink, auth_key, root_certificates) if rc else None
    if refusal:
        raise ConfigError(refusal)
    sys.stdout.writelines(held)
    sys.stdout.flush()
    return rc


def register_supernode(public_key: str, superlink: str, root_certificates: str, name: str | None = None) -> str:
    """Register the SuperNode key ``public_key`` (OpenSSH, EC) on the SuperLink at ``superlink`` (started with
    ``--supernode-auth``) with ``flwr supernode register`` over a connection of its own; returns the node id.
    Flower's refusal (a key already registered, one that is no EC key) is a one-line error."""
    import json
    import re
    import subprocess
    import tempfile

    if not Path(public_key).is_file():
        raise ConfigError(f"public key {public_key} not found (a SuperNode key pair: ssh-keygen -t ecdsa -b 384 -N '' "
                          f"-f KEY writes KEY and KEY.pub)")
    check_connection(superlink, False, root_certificates)
    env = flower_env()
    with tempfile.TemporaryDirectory(prefix="fedlt-flwr-home-") as home:
        env["FLWR_HOME"] = home
        write_connection(home, superlink, root_certificates=root_certificates)
        argv = [program("flwr"), "supernode", "register", str(Path(public_key).resolve()), "fedlt", "--format",
                "json", *(["--name", name] if name else [])]
        res = subprocess.run(argv, env=env, capture_output=True, text=True)
    try:
        reply = json.loads(res.stdout[res.stdout.index("{"):])
    except ValueError:
        reply = {}
    if res.returncode == 0 and reply.get("success"):
        return str(reply["node-id"])
    why = (reply.get("error-message") or "").strip().splitlines()[-1:]  # after "Using SuperLink: ..."
    if not why:  # Flower's exit report (a key that is no EC key in OpenSSH format): its lines, in one
        text = re.sub(r"\x1b\[[0-9;]*m|[│╭╰─╮╯]", " ", res.stdout + res.stderr).splitlines()
        why = [" ".join(" ".join(x for x in text if "Exit Code:" not in x and "For more information" not in x).split())]
    if "SuperLink is unavailable" in why[0]:
        raise ConfigError(f"cannot reach the SuperLink at {superlink}; start it (fedlt flower superlink) or fix "
                          f"--superlink")
    raise ConfigError(f"the SuperLink at {superlink} did not register {public_key}: {why[0]}")
