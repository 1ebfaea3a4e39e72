"""A Flower deployment on 127.0.0.1 only, for the slow tests and benchmarks/deployed_resume.py: a SuperLink (on a
database file, so that it can be killed and restarted), SuperNodes (each with its own ``--state-dir``) and runs
submitted with ``fedlt flower run``. Every process runs in its own session and is killed by :meth:`stop_all`; a
marker in the environment proves afterwards that none is left."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path


LIVE: set["Cluster"] = set()  # clusters not stopped yet (conftest.pytest_sessionfinish stops what is left)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tls(folder: Path, keys: tuple[str, ...] = ()) -> Path:
    """What a secure deployment on 127.0.0.1 needs, made with ``cryptography`` (Flower's own dependency):
    ``ca.crt`` (a CA), ``server.pem`` / ``server.key`` (the SuperLink's certificate, signed by it, for localhost and
    127.0.0.1), ``other-ca.crt`` (a CA that signed nothing of this deployment), and for each name in ``keys`` a
    SuperNode key pair NAME / NAME.pub (EC P-384, OpenSSH format: what ``ssh-keygen -t ecdsa -b 384`` writes)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    pem = serialization.Encoding.PEM

    def certificate(name, key, issuer=None, issuer_key=None, ca=False):
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
        if ca:
            b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return b.sign(issuer_key or key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("fedlt test CA", ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    (folder / "ca.crt").write_bytes(ca.public_bytes(pem))
    (folder / "server.pem").write_bytes(certificate("127.0.0.1", server_key, ca.subject, ca_key).public_bytes(pem))
    (folder / "server.key").write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                 serialization.NoEncryption()))
    other_key = ec.generate_private_key(ec.SECP256R1())
    (folder / "other-ca.crt").write_bytes(certificate("another CA", other_key, ca=True).public_bytes(pem))
    for name in keys:
        key = ec.generate_private_key(ec.SECP384R1())
        (folder / name).write_bytes(key.private_bytes(pem, serialization.PrivateFormat.OpenSSH,
                                                      serialization.NoEncryption()))
        (folder / f"{name}.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                           serialization.PublicFormat.OpenSSH))
    return folder


class Cluster:
    """Processes of one test, each in its own session (so its children can be killed with it). With ``tls`` (a
    folder of :func:`make_tls`): a SuperLink with TLS and SuperNode authentication, clients with its CA."""

    def __init__(self, tmp: Path, env: dict | None = None, tls: Path | None = None):
        self.tmp, self.tag, self.tls = Path(tmp), uuid.uuid4().hex, tls
        self.env = {**(env or os.environ), "FLWR_HOME": str(self.tmp / "flwr-home"),
                    "FEDLT_CACHE": str(self.tmp / "cache"), "FEDLT_TEST_PROCESS_TAG": self.tag,
                    "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = free_port()
        self.node_ports: dict[int, int] = {}
        self.starts: dict[str, int] = {}
        LIVE.add(self)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """``fedlt flower ARGS`` as process ``name``; its output goes to ``name.log`` (appended to on a
        restart, after a line that says so)."""
        self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.tmp / f"{name}.log", "a")
        if self.starts[name] > 1:
            log.write(f"\n===== restart {self.starts[name] - 1} of {name}\n")
            log.flush()
        p = subprocess.Popen([sys.executable, "-m", "fedlt", "flower", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=self.env, cwd=self.tmp, start_new_session=True)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client_security(self) -> list[str]:
        """A client's options for this cluster's SuperLink: its CA's certificate, or --insecure."""
        return ["--root-certificates", str(self.tls / "ca.crt")] if self.tls else ["--insecure"]

    def start_superlink(self, database: bool = True) -> None:
        """The SuperLink on this cluster's port, on ``superlink.db`` (kept across restarts) unless not
        ``database``; returns once it accepts connections."""
        t = self.tls
        security = ["--ssl-ca-certfile", str(t / "ca.crt"), "--ssl-certfile", str(t / "server.pem"), "--ssl-keyfile",
                    str(t / "server.key"), "--supernode-auth"] if t else ["--insecure"]
        self.start("superlink", "superlink", *security, "--host", "127.0.0.1", "--port", str(self.port),
                   *(["--database", str(self.tmp / "superlink.db")] if database else []))
        end = time.monotonic() + 120
        while True:  # the SuperLink accepts connections
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert self.procs["superlink"].poll() is None, self.log("superlink")
                assert time.monotonic() < end, "SuperLink did not start"
                time.sleep(0.5)

    def start_supernode(self, k: int, state_dir: bool = True, *security: str, name: str | None = None) -> None:
        """SuperNode ``k`` serving client k of the partition, with ``state{k}/`` as its ``--state-dir``, as process
        ``name`` (``supernode{k}``); ``security``: its connection options (by default :meth:`client_security`, and
        with TLS the key ``sn{k}``)."""
        port = self.node_ports.setdefault(name or k, free_port())
        security = security or (*self.client_security(), *(["--auth-key", str(self.tls / f"sn{k}")] if self.tls
                                                            else []))
        self.start(name or f"supernode{k}", "supernode", *security, "--superlink", self.address,
                   "--partition-id", str(k), "--host", "127.0.0.1", "--port", str(port),
                   *(["--state-dir", str(self.tmp / f"state{k}")] if state_dir else []))

    def up(self, n_nodes: int = 2, database: bool = False, state_dirs: bool = False) -> None:
        self.start_superlink(database)
        for k in range(n_nodes):
            if self.tls:
                self.register(k)
            self.start_supernode(k, state_dirs)

    def register(self, k: int) -> None:
        """Register SuperNode key ``sn{k}`` on the SuperLink (``fedlt flower register``)."""
        p = self.start(f"register{k}", "register", str(self.tls / f"sn{k}.pub"), "--superlink", self.address,
                       "--root-certificates", str(self.tls / "ca.crt"))
        assert p.wait(300) == 0, self.log(f"register{k}")

    def submit(self, *args: str, name: str = "dep", log: str = "run") -> subprocess.Popen:
        """``fedlt flower run`` of run ``name`` (its directory: runs/NAME) as process ``log``."""
        return self.start(log, "run", *self.client_security(), "--superlink", self.address,
                          "--app-dir", str(self.tmp / f"app-{name}"), "--out", str(self.tmp / "runs"),
                          "--name", name, *args)

    def wait_for(self, name: str, text: str, count: int = 1, timeout: float = 900, proc: str | None = None) -> None:
        """Until ``text`` appears ``count`` times in ``name``'s log (``proc``'s exit first is a failure)."""
        end = time.monotonic() + timeout
        while self.log(name).count(text) < count:
            p = self.procs.get(proc or name)
            assert p is None or p.poll() is None, f"{proc or name} ended before {text!r}:\n{self.log(name)[-3000:]}"
            assert time.monotonic() < end, f"{text!r} never appeared {count} time(s) in {name}'s log"
            time.sleep(0.2)

    def run_id(self, log: str, timeout: float = 600, proc: str | None = None) -> str:
        """The Flower run id that the ``fedlt flower run`` of process ``log`` started."""
        self.wait_for(log, "Successfully started run ", timeout=timeout, proc=proc or log)
        return re.search(r"Successfully started run (\d+)", self.log(log)).group(1)

    def wait_for_training(self, run_id: str, nodes: list[int], timeout: float = 900, proc: str | None = None) -> int:
        """Until one of the SuperNodes ``nodes`` has received a train message of Flower run ``run_id`` (not of
        an earlier run, whose messages a restarted SuperLink may still hand out); returns its number."""
        pat = re.compile(r"\[RUN %s, ROUND \d+\][^\n]*\n[^\n]*Receiving: train message" % run_id)
        end = time.monotonic() + timeout
        while True:
            for k in nodes:
                if pat.search(self.log(f"supernode{k}")):
                    return k
            p = self.procs.get(proc) if proc else None
            assert p is None or p.poll() is None, f"{proc} ended before a SuperNode trained:\n{self.log(proc)[-3000:]}"
            assert time.monotonic() < end, f"no SuperNode of {nodes} received a train message of run {run_id}"
            time.sleep(0.05)

    def kill(self, name: str, sig: int = signal.SIGKILL, tree: bool = False) -> None:
        """Kill process ``name``'s process group; with ``tree``, every process it started too, whatever their
        group (a machine that dies: the SuperLink's SuperExec and ServerApp processes have groups of their
        own)."""
        p = self.procs[name]
        pids = descendants(p.pid) if tree else []
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        p.wait(30)

    def stop_all(self) -> None:
        LIVE.discard(self)
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)
        # Flower's SuperLink starts its SuperExec in a process group of its own; it watches its parent and
        # exits with it. Give such processes a moment, then kill whatever still carries this test's tag.
        self.kill_tagged()
        left = self.tagged()
        assert not left, f"processes left running: {left}"

    def kill_tagged(self, wait: float = 20) -> None:
        """Wait up to ``wait`` s for the processes that carry this cluster's tag to end, then kill them."""
        end = time.monotonic() + wait
        while self.tagged() and time.monotonic() < end:
            time.sleep(0.5)
        for pid in self.tagged():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)

    def tagged(self, exclude: tuple[int, ...] = ()) -> list[int]:
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid() and int(d.name) not in exclude:
                try:
                    if f"FEDLT_TEST_PROCESS_TAG={self.tag}".encode() in (d / "environ").read_bytes():
                        found.append(int(d.name))
                except OSError:
                    pass
        return found

    def listening(self) -> list[str]:
        """Local addresses of the listening TCP sockets of our processes' ports (from /proc/net/tcp{,6})."""
        ports = {self.port} | {int(a[a.index("--port") + 1]) for a in (p.args for p in self.procs.values())
                               if "--port" in a}
        out = []
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(f).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.split(":")
                if state == "0A" and int(port, 16) in ports:
                    out.append(addr)
        return out


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, their children, and so on (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
