"""How a client-state store keeps the states it spills (issue 31): one safetensors file per client state, or
every state in one memory-mapped file (safetensors blobs appended, an index of offsets, read through ``mmap``).

The workload is a cross-device run's: N clients' states written once (the first spill of each), then rounds in
which 20 random clients are read back, changed and written again. Printed per layout: the time to write a state,
to read one back, a round's 20 read+write, and the bytes on disk at the end (the appended file keeps every old
version until it is compacted; a file per client replaces its own).

    python benchmarks/client_state_files.py [--clients 2000] [--rounds 50] [--dir DIR]
"""
from __future__ import annotations

import argparse
import mmap
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from fedlt.safefile import dumps, loads  # noqa: E402

KIND = "client-state"


class PerFile:
    """One file per client: written beside, renamed into place (what fedlt.engine.clientstate does)."""

    def __init__(self, d: Path):
        self.d = d

    def put(self, cid: int, state: dict) -> None:
        path = self.d / f"{cid}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(dumps(state, KIND))
        os.replace(tmp, path)

    def get(self, cid: int) -> dict:
        return loads((self.d / f"{cid}.safetensors").read_bytes(), KIND)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.d.iterdir())

    def close(self) -> None:
        pass


class OneMapped:
    """Every state appended to one file; an index cid -> (offset, length); reads through one mmap, remapped
    when the file has grown past it."""

    def __init__(self, d: Path):
        self.path = d / "states.bin"
        self.f = open(self.path, "a+b")
        self.index: dict[int, tuple[int, int]] = {}
        self.mm: mmap.mmap | None = None

    def put(self, cid: int, state: dict) -> None:
        blob = dumps(state, KIND)
        self.f.seek(0, os.SEEK_END)
        off = self.f.tell()
        self.f.write(blob)
        self.index[cid] = (off, len(blob))

    def get(self, cid: int) -> dict:
        off, n = self.index[cid]
        if self.mm is None or off + n > len(self.mm):
            self.f.flush()
            if self.mm is not None:
                self.mm.close()
            self.mm = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_READ)
        return loads(self.mm[off:off + n], KIND)

    def nbytes(self) -> int:
        self.f.flush()
        return self.path.stat().st_size

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
        self.f.close()


def state_of(kind: str, g: torch.Generator) -> dict:
    if kind == "model":  # Ditto's / MOON's: a whole smallcnn (0.86 MB)
        return {"personal": {"w1": torch.randn(128, 1568, generator=g), "w2": torch.randn(32, 1, 5, 5, generator=g),
                             "w3": torch.randn(64, 32, 5, 5, generator=g), "head": torch.randn(10, 128, generator=g)}}
    return {"phi.weight": torch.randn(10, 128, generator=g), "phi.bias": torch.randn(10, generator=g)}  # a head


def measure(layout, kind: str, clients: int, rounds: int, d: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    store = layout(d)
    states = [state_of(kind, g) for _ in range(min(clients, 64))]
    t0 = time.perf_counter()
    for c in range(clients):
        store.put(c, states[c % len(states)])
    write = (time.perf_counter() - t0) / clients
    rng = random.Random(0)
    reads, t_round = [], 0.0
    for _ in range(rounds):
        picked = rng.sample(range(clients), 20)
        t0 = time.perf_counter()
        for c in picked:
            t1 = time.perf_counter()
            s = store.get(c)
            reads.append(time.perf_counter() - t1)
            store.put(c, s)
        t_round += time.perf_counter() - t0
    out = {"write_ms": 1e3 * write, "read_ms": 1e3 * sum(reads) / len(reads), "round_ms": 1e3 * t_round / rounds,
           "disk_mb": store.nbytes() / 1e6}
    store.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--dir", help="folder to write in (default: a temporary one; use the run's file system)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{a.clients} client states written once, then {a.rounds} rounds of 20 read + written back")
    print(f"{'state':<6} {'layout':<12} {'write ms':>9} {'read ms':>8} {'round ms':>9} {'disk MB':>8}")
    for kind, n in (("head", a.clients), ("model", min(a.clients, 1000))):
        for name, layout in (("file/client", PerFile), ("one mmap", OneMapped)):
            with tempfile.TemporaryDirectory(dir=a.dir) as d:
                r = measure(layout, kind, n, a.rounds, Path(d))
            print(f"{kind:<6} {name:<12} {r['write_ms']:9.3f} {r['read_ms']:8.3f} {r['round_ms']:9.2f} "
                  f"{r['disk_mb']:8.1f}")


if __name__ == "__main__":
    main()
