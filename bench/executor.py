"""An instruction placed on an executor of another process (docs/executor.md), against its peers: a one-instruction
program `mul (x, x) -> y` on float32 tensors of 1K and 1M elements, run on the node's own worker, and placed on the
numpy executor of examples/executor_numpy.py (`// executor=numpy-extra`) with x a stack tensor (its bytes sent) and
a heap tensor (its segment's name sent, mapped by the executor); and a bare msgpack round trip over a Unix socket
carrying the same bytes there and back (what moving the tensors costs at the least). Prints medians and ratios;
writes bench/results/executor.json.

    python bench/executor.py [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"4 KiB": 1 << 10, "4 MiB": 1 << 20}  # float32 elements
_HEADER = struct.Struct(">I")


def _median_s(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm: plans made, segments mapped
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _echo_server(path: str) -> threading.Thread:
    """A msgpack echo over a Unix socket: each frame read whole, answered with a frame of the same bytes."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while True:
                head = conn.recv(4, socket.MSG_WAITALL)
                if len(head) < 4:
                    return
                (n,) = _HEADER.unpack(head)
                body = bytearray(n)
                view, got = memoryview(body), 0
                while got < n:
                    got += conn.recv_into(view[got:], n - got)
                frame = msgpack.unpackb(body, raw=False)
                out = msgpack.packb({"id": frame["id"], "ok": True, "data": frame["data"]}, use_bin_type=True)
                conn.sendall(_HEADER.pack(len(out)) + out)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def _echo_round_trip(sock: socket.socket, data: bytes) -> None:
    body = msgpack.packb({"id": 1, "op": "execute", "data": data}, use_bin_type=True)
    sock.sendall(_HEADER.pack(len(body)))
    sock.sendall(body)
    (n,) = _HEADER.unpack(sock.recv(4, socket.MSG_WAITALL))
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        got += sock.recv_into(view[got:], n - got)
    msgpack.unpackb(buf, raw=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    a = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from deepx_core.client import NativeClient
    from deepx_core.ir import parse_text

    folder = Path(tempfile.mkdtemp(prefix="deepx-bench-executor-"))
    address = f"unix://{folder / 'd.sock'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DEEPX_ROLES": "registry,heapmem,scheduler,op-cpu"}
    logs = [open(folder / "deepxd.log", "ab"), open(folder / "executor.log", "ab")]
    daemon = subprocess.Popen([sys.executable, "-m", "deepxd", "start", "--listen", address, "--udp", "off",
                               "--node-id", "bench-executor"], stdout=logs[0], stderr=subprocess.STDOUT, env=env)
    executor: subprocess.Popen[bytes] | None = None
    rows = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = NativeClient(address, timeout=60)
                break
            except Exception:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit(f"deepxd did not start: {(folder / 'deepxd.log').read_text()[-2000:]}") from None
                time.sleep(0.1)
        executor = subprocess.Popen([sys.executable, str(ROOT / "examples" / "executor_numpy.py"), address],
                                    stdout=logs[1], stderr=subprocess.STDOUT, env=env)
        while not c.admin("executors"):
            if time.monotonic() > deadline or executor.poll() is not None:
                raise SystemExit(f"the executor did not register: {(folder / 'executor.log').read_text()[-2000:]}")
            time.sleep(0.1)
        echo_path = str(folder / "echo.sock")
        _echo_server(echo_path)
        echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        echo.connect(echo_path)
        for label, n in SIZES.items():
            x = np.random.default_rng(0).normal(size=n).astype(np.float32)
            c.put(f"s{n}", x)
            c.put(f"h{n}", x, heap=True)
            here = parse_text(f"mul (tensor<float32>:s{n}, tensor<float32>:s{n}) -> (tensor<float32>:y{n})")
            stack = parse_text(f"mul (tensor<float32>:s{n}, tensor<float32>:s{n}) -> (tensor<float32>:y{n}) "
                               "// executor=numpy-extra")
            heap = parse_text(f"mul (tensor<float32>:h{n}, tensor<float32>:h{n}) -> (tensor<float32>:y{n}) "
                              "// executor=numpy-extra")
            for prog in (here, stack, heap):
                r = c.run(prog)
                assert r.ok, r.error
            t_here = _median_s(lambda: c.run(here), a.iters)
            t_stack = _median_s(lambda: c.run(stack), a.iters)
            t_heap = _median_s(lambda: c.run(heap), a.iters)
            data = x.tobytes()
            t_echo = _median_s(lambda: _echo_round_trip(echo, data), a.iters)
            rows.append({"size": label, "here_ms": t_here * 1e3, "executor_stack_ms": t_stack * 1e3,
                         "executor_heap_ms": t_heap * 1e3, "echo_ms": t_echo * 1e3})
        (calls,) = c.admin("executors")
        c.close()
    finally:
        if executor is not None:
            executor.terminate()
            executor.wait(30)
        daemon.terminate()
        daemon.wait(30)
        for f in logs:
            f.close()
    print("one-instruction program `mul (x, x) -> y`, float32, median of", a.iters, "runs (this machine, one run)")
    print(f"{'size':>7} {'node':>10} {'executor, x sent':>18} {'executor, x mapped':>20} {'echo of x':>11}"
          f" {'extra / echo (sent)':>20}")
    for r in rows:
        here, stack, heap, echo_ms = r["here_ms"], r["executor_stack_ms"], r["executor_heap_ms"], r["echo_ms"]
        print(f"{r['size']:>7} {here:>8.3f}ms {stack:>8.3f}ms ({stack / here:5.1f}x) {heap:>10.3f}ms "
              f"({heap / here:5.1f}x) {echo_ms:>8.3f}ms {(stack - here) / echo_ms:>19.2f}x")
    out = ROOT / "bench" / "results" / "executor.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"iters": a.iters, "rows": rows, "executor_calls": calls["calls"]}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
