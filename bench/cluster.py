"""Heap tensors of another node, against their peers: a fetch of node a's 1 MiB and 64 MiB float32 heap tensors
from a node of the same host (it maps a's segment) and from a node of another host (streamed over a TCP peer link
with the token), each against a fetch from a itself; a program on the other host's node that reads the tensor
(a sum: the bytes cross the link, four bytes come back) against the same bytes sent over a bare loopback TCP socket;
and the same one-instruction program sent to a node of the other host that places it on a (programs across nodes:
the sum runs on a, only its result crosses back) against it run on a itself.
Prints ms and ratios; writes bench/results/cluster.json.

    python bench/cluster.py [--iters 10] [--rounds 3] [--big]     # --big: a 256 MiB tensor as well

Four deepxd on one redis-server of the benchmark's own: a and b say they run on one host, c and d on another (the
`host` setting), so c and d reach a over TCP on loopback, as nodes of another machine would over its network. c
runs with `placement = local` (it streams a's tensor and sums it itself), d with the default, `cost`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"1 MiB": 1 << 18, "64 MiB": 1 << 24}  # float32 elements
TOKEN = "bench-cluster-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(ready: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)


def _answers(address: str) -> bool:
    from deepx_core.client import NativeClient
    from deepx_core.errors import DeepxError

    try:
        NativeClient(address, timeout=2).close()
        return True
    except DeepxError:
        return False


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


#: the benchmark's nodes: name, the host it says it runs on, its placement
LAYOUT = (("a", "bench-1", "cost"), ("b", "bench-1", "cost"), ("c", "bench-2", "local"), ("d", "bench-2", "cost"))


@dataclass
class Running:
    addresses: dict[str, str]  # node name -> its socket address
    redis_port: int


@contextmanager
def cluster(folder: Path, layout: tuple[tuple[str, str, str], ...] = LAYOUT) -> Iterator[Running]:
    """deepxd for each node of `layout` (name, host, placement) on one redis-server of its own, until the block ends.
    With the default layout, a and b say they run on host `bench-1`, c and d on `bench-2`, and c places nothing."""
    redis = shutil.which("redis-server")
    if redis is None:
        raise SystemExit("bench/cluster.py needs redis-server on PATH (apt-get install redis-server)")
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    try:
        port = _free_port()
        p = subprocess.Popen([redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                              "--dir", str(folder), "--logfile", str(folder / "redis.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append((p, None))
        _wait(lambda: _redis_answers(port), "redis-server", p, folder / "redis.log")
        addresses = {}
        for node, host, placement in layout:  # started together, then waited for
            address = f"unix://{folder / f'{node}.sock'}"
            env = {**os.environ, "DEEPX_ROLES": "registry,heapmem,scheduler,op-cpu", "DEEPX_HOST": host,
                   "DEEPX_KV_PREFIX": f"benchcluster{os.getpid()}:", "DEEPX_NATIVE_BACKGROUND": "0",
                   "DEEPX_PLACEMENT": placement}
            logf = open(folder / f"{node}.log", "wb")  # (closed with the process, below)
            proc = subprocess.Popen([sys.executable, "-m", "deepxd", "start", "--listen", address, "--listen",
                                     "tcp://127.0.0.1:0", "--token-file", str(token), "--udp", "off", "--kv",
                                     f"redis://127.0.0.1:{port}/0", "--node-id", f"bench{os.getpid()}{node}",
                                     "--log-level", "warning"], stdout=logf, stderr=subprocess.STDOUT, env=env)
            procs.append((proc, logf))
            addresses[node] = address
        for (proc, _), (node, address) in zip(procs[1:], addresses.items(), strict=True):
            _wait(lambda a=address: _answers(a), f"deepxd {node}", proc, folder / f"{node}.log")  # type: ignore[misc]
        yield Running(addresses, port)
    finally:
        for p, logf in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if logf is not None:
                logf.close()


class BareSocket:
    """A loopback TCP connection to a thread that answers each byte it reads with `nbytes` bytes, which `copy()`
    receives into a preallocated buffer: the best a peer link can do (one copy out of the kernel), on a connection
    made once, as a link's is."""

    def __init__(self, nbytes: int) -> None:
        self.data = np.ones(nbytes, np.uint8)
        self.into = bytearray(nbytes)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.conn = socket.create_connection(self.server.getsockname()[:2])
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            while conn.recv(1):
                conn.sendall(memoryview(self.data))

    def copy(self) -> None:
        self.conn.sendall(b"x")
        view, got = memoryview(self.into), 0
        while got < len(view):
            got += self.conn.recv_into(view[got:])

    def close(self) -> None:
        self.conn.close()
        self.thread.join()
        self.server.close()


def median_time(fn: Callable[[], Any], iters: int) -> float:
    fn()  # the first: links made, segments mapped
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


#: how many of node d's timed runs of each size it placed on another node (the rest it ran itself)
PLACED: dict[str, list[int]] = {}


def placed(r: Any, label: str) -> None:
    """A run on node d, counted by where it ran: placed on another node, or run on d (where the cost model found the
    link's round trip dearer than the bytes: a small tensor, a slow ping)."""
    r.raise_for_error()
    away = r.placement is not None and r.placement["instructions"][0]["node"] != r.placement["node"]
    PLACED.setdefault(label, [0, 0])[0 if away else 1] += 1


def linked(client: Any, to: str) -> None:
    """Until `client`'s node knows node `to` runs (placement looks only at nodes it knows; a link opens on demand)."""
    deadline = time.monotonic() + 60
    while not any(n["node"] == to and n.get("link") in ("none", "tcp", "unix") for n in client.admin("nodes")):
        if time.monotonic() > deadline:
            raise SystemExit(f"node {to} not known within 60 s")
        time.sleep(0.1)


def one_round(clients: dict[str, Any], iters: int) -> dict[str, dict[str, float]]:
    from deepx_core.ir import parse_text

    out: dict[str, dict[str, float]] = {}
    for label, n in SIZES.items():
        name = f"t{n}"
        total = parse_text(f"sum (tensor<float32>:{name}, vector:[0], var:False) -> (tensor<float32>:{name}_s)")
        out[label] = {
            "local_fetch": median_time(lambda name=name: clients["a"].fetch(name), iters),  # type: ignore[misc]
            "mapped_fetch": median_time(lambda name=name: clients["b"].fetch(name), iters),  # type: ignore[misc]
            "streamed_fetch": median_time(lambda name=name: clients["c"].fetch(name), iters),  # type: ignore[misc]
            "local_program": median_time(lambda t=total: clients["a"].run(t).raise_for_error(), iters),  # type: ignore[misc]
            "streamed_program": median_time(lambda t=total: clients["c"].run(t).raise_for_error(), iters),  # type: ignore[misc]
            "placed_program": median_time(lambda t=total, k=label: placed(clients["d"].run(t), k), iters),  # type: ignore[misc]
        }
        bare = BareSocket(n * 4)
        try:
            out[label]["bare_socket"] = median_time(bare.copy, iters)
        finally:
            bare.close()
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from deepx_core.client import NativeClient

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big", action="store_true", help="a 256 MiB tensor too (about 2 GiB of memory in all)")
    opts = ap.parse_args()
    if opts.big:
        SIZES["256 MiB"] = 1 << 26
    best: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="deepx-bench-cluster-") as tmp, cluster(Path(tmp)) as running:
        clients = {node: NativeClient(address, timeout=120) for node, address in running.addresses.items()}
        try:
            for n in SIZES.values():
                clients["a"].put(f"t{n}", np.random.default_rng(n).standard_normal(n).astype(np.float32), heap=True)
            linked(clients["d"], clients["a"].server["node"])
            # rounds in turn, each figure its best round: a slow spell of a shared machine falls on every figure
            for _ in range(opts.rounds):
                for label, figures in one_round(clients, opts.iters).items():
                    kept = best.setdefault(label, {})
                    for k, v in figures.items():
                        kept[k] = min(kept.get(k, v), v)
        finally:
            for c in clients.values():
                c.close()
    print(f"{os.cpu_count()} CPUs; the best of {opts.rounds} rounds, each the median of {opts.iters} calls")
    print(f"{'fetch of a heap tensor':24} {'local ms':>9} {'mapped ms':>10} {'ratio':>6} {'streamed ms':>12} "
          f"{'ratio':>6}")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "rounds": opts.rounds, "iters": opts.iters}
    for label, f in best.items():
        print(f"{label:24} {f['local_fetch'] * 1e3:9.2f} {f['mapped_fetch'] * 1e3:10.2f} "
              f"{f['mapped_fetch'] / f['local_fetch']:5.2f}x {f['streamed_fetch'] * 1e3:12.2f} "
              f"{f['streamed_fetch'] / f['local_fetch']:5.2f}x")
    print(f"{'sum over the link':24} {'local ms':>9} {'streamed ms':>12} {'bare TCP ms':>12} {'GB/s':>6} "
          f"{'of bare':>8}")
    for label, f in best.items():
        moved = f["streamed_program"] - f["local_program"]  # the link's part of the program
        nbytes = SIZES[label] * 4
        print(f"{label:24} {f['local_program'] * 1e3:9.2f} {f['streamed_program'] * 1e3:12.2f} "
              f"{f['bare_socket'] * 1e3:12.2f} {nbytes / max(moved, 1e-9) / 1e9:6.2f} "
              f"{f['bare_socket'] / max(moved, 1e-9):7.2f}x")
        results[label] = {**f, "mapped_vs_local": f["mapped_fetch"] / f["local_fetch"],
                          "streamed_vs_local": f["streamed_fetch"] / f["local_fetch"],
                          "link_vs_bare_socket": f["bare_socket"] / max(moved, 1e-9),
                          "placed_vs_local": f["placed_program"] / f["local_program"],
                          "placed_vs_streamed": f["placed_program"] / f["streamed_program"]}
    print(f"{'one-instruction program':24} {'on a ms':>9} {'placed ms':>10} {'ratio':>6} {'streamed ms':>12} "
          f"{'placed/streamed':>16}")
    for label, f in best.items():
        away, here = PLACED.get(label, [0, 0])
        results[label]["placed_runs"], results[label]["runs_on_d"] = away, here
        print(f"{label:24} {f['local_program'] * 1e3:9.2f} {f['placed_program'] * 1e3:10.2f} "
              f"{f['placed_program'] / f['local_program']:5.2f}x {f['streamed_program'] * 1e3:12.2f} "
              f"{f['placed_program'] / f['streamed_program']:15.2f}x   (placed on a's host {away} times of "
              f"{away + here})")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
