"""The deployment's own security on 127.0.0.1 (issue 55, item 8), as docs/flower.md shows it: a SuperLink with TLS
(``--ssl-ca-certfile --ssl-certfile --ssl-keyfile``) and SuperNode authentication (``--supernode-auth``), the
SuperNodes' keys registered with ``fedlt flower register``, SuperNodes and ``fedlt flower run`` with
``--root-certificates`` (and ``--auth-key``). The CA, the certificates and the keys are made here
(:func:`flowercluster.make_tls`).

One SuperLink session: while the authenticated run trains, a SuperNode with a key the SuperLink does not know, one
with another CA's certificate, one with ``--insecure`` and a ``fedlt flower run`` with another CA's certificate
try to join. The run ends as the simulation of the same settings (as the insecure deployments of
test_flower_deploy.py do); each of the others ends with exit status 2 and one line that names the setting to fix.
Slow like the other deployments, and run in the background from the session's start (conftest's background jobs).
The TLS check that fedlt makes before Flower starts, and its reading of Flower's refusals, are also checked here
without Flower, in seconds, against a TLS server of the test's own.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("cryptography")

from conftest import background, job_result  # noqa: E402
from flowercluster import Cluster, free_port, make_tls, records  # noqa: E402
from fedlt.runner.runstate import load_final_state  # noqa: E402

RUN_TIMEOUT = 900  # s, as test_flower_deploy's
SETTINGS = ["--preset", "smoke", "--clients", "2", "--participation", "1.0", "--rounds", "2", "--eval-every", "2",
            "--seed", "0", "--threads", "1", "--method", "fedavg"]
JOB = "deploy-secure"


def start_background(items, base: Path) -> None:
    if any(i.get_closest_marker("slow") for i in items):  # the deployment's tests were collected
        background({JOB: lambda: secure_scenario(base / "secure")})


def scenario(tmp_path: Path) -> dict:
    return job_result(JOB, lambda: secure_scenario(tmp_path), timeout=3 * RUN_TIMEOUT)


def secure_scenario(tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    tls = make_tls(tmp / "tls", keys=("sn0", "sn1", "stranger"))
    ca, other = str(tls / "ca.crt"), str(tls / "other-ca.crt")
    c = Cluster(tmp, tls=tls)
    try:
        c.up()  # TLS and --supernode-auth; sn0 and sn1 registered, SuperNodes 0 and 1 with them
        run = c.submit(*SETTINGS, "--round-timeout", "300")
        c.wait_for_training(c.run_id("run", proc="run"), [0, 1], proc="run")
        # while it trains: a SuperNode whose key nobody registered, clients without the SuperLink's CA
        c.start_supernode(0, False, "--root-certificates", ca, "--auth-key", str(tls / "stranger"), name="stranger")
        c.start_supernode(1, False, "--root-certificates", other, "--auth-key", str(tls / "sn1"), name="other-ca")
        c.start_supernode(1, False, "--insecure", name="insecure")
        c.start("run-other-ca", "run", "--root-certificates", other, "--superlink", c.address, "--out",
                str(tmp / "refused-runs"), *SETTINGS)
        refused = {name: c.procs[name].wait(300) for name in ("stranger", "other-ca", "insecure", "run-other-ca")}
        assert run.wait(RUN_TIMEOUT) == 0, c.log("run")[-3000:]
    finally:
        c.stop_all()
    logs = {name: c.log(name) for name in ("run", "superlink", "supernode0", "supernode1", *refused)}
    return {"out": tmp / "runs" / "dep", "refused": refused, "logs": logs, "refused_runs": tmp / "refused-runs"}


def last_line(log: str) -> str:
    return [x for x in log.splitlines() if x.strip()][-1]


def one_line(log: str) -> str:
    """The refusal's line; nothing of Flower's error report or a trace beside it."""
    for flower_words in ("Traceback", "Exit Code", "╭", "SSLError", "CERTIFICATE_VERIFY_FAILED", "code: 2004"):
        assert flower_words not in log, log[-3000:]
    line = last_line(log)
    assert line.startswith("fedlt: error: ") and log.count("fedlt: error") == 1, log[-3000:]
    return line


@pytest.mark.slow
def test_tls_run_with_authenticated_supernodes_is_the_simulation(tmp_path):
    """TLS and SuperNode authentication change nothing in the run: the simulation's model and accuracy (to float
    rounding across processes), both SuperNodes in every round."""
    from fedlt.cli import build_parser
    from fedlt.commands.run import config_from_args
    from fedlt.engine import EngineConfig, Simulation
    from fedlt.runner.rundir import federation_for, prepare

    res = scenario(tmp_path)
    out, log = res["out"], res["logs"]["run"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["missing"] == {}
    assert [(r["sampled"], r["arrived"]) for r in records(out) if "round" in r] == [(2, 2), (2, 2)]
    cfg = config_from_args(build_parser().parse_args(["run", *SETTINGS]))
    pr = prepare(cfg, federation_for(cfg))
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    final = sim.run()
    state = load_final_state(out)["state"]
    assert max(float((state["weights"][k] - sim.state.weights[k]).abs().max()) for k in state["weights"]) < 1e-5
    for kind in ("global", "personal"):
        assert abs(summary["final"][kind]["global"]["acc"] - final[kind]["global"]["acc"]) \
            <= 1.0 / len(sim.fed.dataset.y_test) + 1e-9
    print("\nTLS + authenticated SuperNodes:\n" + "\n".join(
        x for x in log.splitlines() if "GM global" in x or "PM global" in x or x.startswith("fedlt: run")))


@pytest.mark.slow
def test_unknown_supernode_is_refused_in_one_line_and_never_receives_the_model(tmp_path):
    res = scenario(tmp_path)
    log, superlink = res["logs"]["stranger"], res["logs"]["superlink"]
    assert res["refused"]["stranger"] == 2
    line = one_line(log)
    assert "--auth-key" in line and "fedlt flower register" in line and "stranger.pub" in line, line
    assert "Receiving" not in log  # no message of the run, no model
    assert "[/v1/fleet/activate-node][ApiError:2004]" in superlink  # the SuperLink refused its activation...
    assert superlink.count("[Fleet.ActivateNode] Activated node_id") == 2  # ...and admitted the registered two only
    print(f"\nunknown SuperNode: {line}")


@pytest.mark.slow
def test_client_without_the_root_certificate_cannot_connect(tmp_path):
    """A SuperNode with another CA's certificate or none (--insecure) and a `fedlt flower run` with another CA's
    certificate: exit status 2, one line that names --root-certificates; the run wrote nothing."""
    res = scenario(tmp_path)
    for name in ("other-ca", "insecure", "run-other-ca"):
        assert res["refused"][name] == 2, res["logs"][name][-3000:]
        line = one_line(res["logs"][name])
        assert "--root-certificates" in line and res["logs"][name].count("Receiving") == 0, line
        print(f"\n{name}: {line}")
    assert not res["refused_runs"].exists()


# ------------------------------------------------------------------------- without Flower: fedlt's own checks
@pytest.fixture
def tls_server(tmp_path):
    """A TLS server on 127.0.0.1 with :func:`make_tls`'s SuperLink certificate, and a plain HTTP one (each answers
    every connection in a thread of its own); yields (tls folder, TLS address, plain address)."""
    import socket
    import ssl
    import threading

    tls = make_tls(tmp_path / "tls")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls / "server.pem", tls / "server.key")
    servers = []

    def serve(wrap):
        s = socket.create_server(("127.0.0.1", 0))
        servers.append(s)

        def loop():
            while True:
                try:
                    conn, _ = s.accept()
                except OSError:
                    return
                try:
                    with (ctx.wrap_socket(conn, server_side=True) if wrap else conn) as c:
                        if not wrap:
                            c.recv(1024)
                            c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                except (OSError, ssl.SSLError):
                    pass
        threading.Thread(target=loop, daemon=True).start()
        return f"127.0.0.1:{s.getsockname()[1]}"

    yield tls, serve(True), serve(False)
    for s in servers:
        s.close()


def test_tls_problem_names_the_setting_to_fix(tls_server):
    """The one TLS handshake fedlt makes before a SuperNode or `fedlt flower run` starts Flower: the right CA passes,
    another CA, --insecure against TLS and a CA against a server without TLS each give the line that names what to
    change; nothing listening is no problem yet (Flower's clients retry)."""
    from fedlt.flower.deploy import tls_problem

    tls, secure, plain = tls_server
    assert tls_problem(secure, False, str(tls / "ca.crt")) is None
    assert tls_problem(plain, True, None) is None
    wrong = tls_problem(secure, False, str(tls / "other-ca.crt"))
    assert "does not verify" in wrong and "give --root-certificates the CA certificate" in wrong, wrong
    assert "instead of --insecure" in tls_problem(secure, True, None)
    assert "does not use TLS" in tls_problem(plain, False, str(tls / "ca.crt"))
    assert "not found" in tls_problem(secure, False, str(tls / "none.crt"))
    assert tls_problem(f"127.0.0.1:{free_port()}", False, str(tls / "ca.crt")) is None


def test_flower_refusals_are_read_as_one_line(tls_server):
    """:func:`supernode_refusal` on the error text a Flower SuperNode prints when it cannot start (``flwr_exit``:
    exit code 305, then ``[code: N] <the catalog's public message>``, or the TLS error's text): the unknown key names
    --auth-key and how to register it, no key where the SuperLink admits registered SuperNodes only names --auth-key,
    a certificate that the CA does not verify names --root-certificates; any other failure is left to Flower."""
    import socket
    import ssl

    from flwr.supercore.error.base import ApiErrorCode
    from flwr.supercore.error.catalog import API_ERROR_MAP

    from fedlt.flower.deploy import supernode_refusal

    tls, secure, _ = tls_server

    def flower_text(detail):
        return f"Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n{detail}\n" \
               f"The SuperNode could not establish a connection to the SuperLink.\n"

    def api(code):
        return flower_text(f"[code: {int(code)}] {API_ERROR_MAP[code].public_message}")

    unknown = supernode_refusal(api(ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED), secure, "sn2", "ca.crt")
    assert "--auth-key sn2" in unknown and "fedlt flower register sn2.pub" in unknown, unknown
    nokey = supernode_refusal(api(ApiErrorCode.FLEET_SUPERNODE_REGISTRATION_DISABLED), secure, None, "ca.crt")
    assert "give --auth-key KEY" in nokey, nokey
    host, port = secure.rsplit(":", 1)
    try:  # the error text of a handshake with another CA, as Flower's client meets it
        with socket.create_connection((host, int(port)), 5) as s, \
                ssl.create_default_context(cafile=str(tls / "other-ca.crt")).wrap_socket(s, server_hostname=host):
            pass
    except ssl.SSLCertVerificationError as e:
        text = flower_text(str(e))
    else:
        pytest.fail("another CA's certificate verified the server's")
    cert = supernode_refusal(text, secure, None, "other-ca.crt")
    assert "--root-certificates other-ca.crt does not verify" in cert, cert
    assert supernode_refusal(flower_text("[code: 2008] Failed to get run."), secure, "sn2", "ca.crt") is None


def test_register_refusals_are_one_line(tmp_path):
    """`fedlt flower register`: a file that is no EC public key in OpenSSH format, and a SuperLink that is not there,
    each one line with exit status 2 (Flower's exit report and its 'address in the connection configuration' --
    a file fedlt writes itself -- never shown)."""
    from test_declared_inputs import run_cli

    tls = make_tls(tmp_path / "tls", keys=("sn0",))
    (tmp_path / "rsa.pub").write_text("ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQC7 test\n")
    where = ["--superlink", f"127.0.0.1:{free_port()}", "--root-certificates", str(tls / "ca.crt")]
    for key, words in (("rsa.pub", "elliptic curve"), ("tls/sn0.pub", "cannot reach the SuperLink")):
        code, err = run_cli(["flower", "register", str(tmp_path / key), *where], tmp_path)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and words in lines[0] and "Exit Code" not in err, err
