"""Real deployment: the SuperLink and SuperNode command lines, the Flower App directory and the ``flwr run``
connection, with fedlt's defaults (telemetry and update checks off, no runtime dependency installation).

Flower 1.41/1.42 serve everything over HTTP(S): the SuperLink on one ``--host/--port`` (Fleet, Control and
Runtime APIs), each SuperNode its own Runtime API on ``--host/--port`` (so SuperNodes that share a host need
different ports). Across machines use TLS (``--ssl-*`` on the SuperLink, ``--root-certificates`` on the
SuperNodes and in the ``flwr run`` connection) and SuperNode authentication (``--enable-supernode-auth`` on the
SuperLink, ``flwr supernode register KEY.pub <connection>``, ``--auth-supernode-private-key`` on the SuperNode).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
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
        "[tool.flwr.app.components]", 'serverapp = "fedlt.engine.flower.server_app:app"',
        'clientapp = "fedlt.engine.flower.client_app:app"', "",
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
