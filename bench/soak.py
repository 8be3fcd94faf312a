"""A soak run against one deepxd: fuzz, load and faults for N minutes, then one table.

Starts its own redis-server (append-only file, fsync on every write) and deepxd on loopback (or attaches to a running
deepxd with --address/--udp), then, at once until the time is up:

1. UDP fuzzing: datagrams of deepxIR lines, valid ones and malformed ones (garbage and non-UTF-8 bytes, truncated
   instructions, unknown ops, wrong shapes and kinds, huge numbers, long names); every line carries a unique id
   and must get exactly one reply.
2. Native fuzzing: bad frames on fresh connections (bad lengths, short headers, oversized lengths, bodies that are
   not msgpack or not a map, fields of the wrong types, deep nesting, pipelined frames); every complete frame
   must get exactly one reply with its id, and the connection must keep serving where the protocol says so.
3. Load: --clients native clients, each putting, running (matmul, add, mulscalar, sum, programs refused whole)
   and fetching tensors of its own, checked exactly against numpy (integer-valued data, so no tolerance) and
   against what it put: a wrong value is a wrong result, a tensor gone or changed is data lost.
4. Faults: client processes SIGKILLed mid-request (mid-frame, mid-program), and Redis stopped (SIGTERM or
   SIGKILL) and started again on the same port; a heap canary tensor must keep its value throughout.
5. Watch: a native ping and a UDP one-liner every second with a 5 s deadline (hangs, worst latency); the daemon's
   process exiting is a crash (its stderr tail is printed, and it is started again on the same node id).

Prints one table; exits 1 on any crash, wrong result or data loss. Loopback only; stops by itself.

    python bench/soak.py [--minutes 5] [--seed 0] [--clients 64]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_core.ir.ops import OPS
from deepx_core.ir.wire import instr_to_obj
from deepx_sdk.client import DeepxTimeoutError, NativeClient

HEADER = struct.Struct(">I")
DEADLINE_S = 5.0  # a ping or UDP one-liner slower than this is a hang
UDP_WAIT_S = 20.0  # a fuzz datagram's lines must all be answered within this
NATIVE_WAIT_S = 20.0
CLIENT_TIMEOUT_S = 30.0
MAX_DATAGRAM = 60_000
REPLY = re.compile(rb"^(\d+) (ok|error)// recv_at=(\d+) start_at=(\d+) finish_at=(\d+)(?: (.*))?$", re.DOTALL)
CANARY = "soak_canary"
CANARY_VALUE = (np.arange(256, dtype=np.float32) * 1.5 - 7).reshape(16, 16)


# -- what happened --------------------------------------------------------------------------------------------------

@dataclass
class Stats:
    counts: collections.Counter = field(default_factory=collections.Counter)
    worst: dict[str, float] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def event(self, key: str, what: str, keep: int = 4, alike: bool = False) -> None:
        """Counts `key` and keeps its first few descriptions for the report (those alike but for their numbers once,
        unless `alike`)."""
        with self.lock:
            self.counts[key] += 1
            seen = self.examples[key]
            if len(seen) < keep and (alike or all(_shape_of(what) != _shape_of(x) for x in seen)):
                seen.append(what)

    def latency(self, key: str, seconds: float) -> None:
        with self.lock:
            self.worst[key] = max(self.worst.get(key, 0.0), seconds)


def _shape_of(text: str) -> str:
    """A message with its numbers blanked: examples of one kind of event are kept once."""
    return re.sub(r"\d+", "#", text[:200])


def short(x: Any, n: int = 160) -> str:
    s = repr(x) if not isinstance(x, str) else x
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


# -- the processes under test ---------------------------------------------------------------------------------------

def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    """A redis-server on a loopback port whose data outlives a restart (AOF, fsync on every write)."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.dir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server on port {self.port} did not start:\n{self.log_tail()}")
            time.sleep(0.05)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        return ""


def deepxd_command() -> list[str]:
    exe = shutil.which("deepxd")
    return [exe] if exe else [sys.executable, "-m", "deepxd.cli"]


class Deepxd:
    """The daemon under test, started by the soak (or, with `proc` None, one it attached to)."""

    def __init__(self, workdir: Path | None, address: str, udp_port: int, kv: str, log_level: str) -> None:
        self.dir = workdir
        self.address = address
        self.udp_port = udp_port
        self.kv = kv
        self.log_level = log_level
        self.node_id = f"soak-{os.getpid()}"
        self.proc: subprocess.Popen | None = None
        self.generation = 0  # one more at every start: stack tensors do not outlive a daemon
        self.up = threading.Event()  # set while the daemon of this generation serves
        self.crash_counted = False  # the monitor counted this process's exit
        self.starts = 0

    @property
    def owned(self) -> bool:
        return self.dir is not None

    def start(self) -> None:
        assert self.dir is not None
        io = self.dir / "io"
        (io / "cwd").mkdir(parents=True, exist_ok=True)
        self.up.clear()
        self.crash_counted = False
        self.generation += 1
        self.starts += 1
        self.log = self.dir / f"deepxd-{self.starts}.log"
        env = {**os.environ, "DEEPX_ROLES": "registry,heapmem,scheduler,op-cpu"}
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(
                [*deepxd_command(), "start", "--listen", self.address, "--kv", self.kv, "--node-id", self.node_id,
                 "--udp", f"127.0.0.1:{self.udp_port}", "--io-root", str(io), "--log-level", self.log_level],
                stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=io / "cwd")
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"deepxd exited with {self.proc.returncode} while starting:\n{self.tail()}")
            with contextlib.suppress(DeepxError, OSError):
                NativeClient(self.address, timeout=5).close()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"deepxd did not come up within 60 s:\n{self.tail()}")
            time.sleep(0.1)
        self.up.set()

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def tail(self, n: int = 40) -> str:
        """The log's last lines, without the newtensor warnings the fuzzer provokes by the thousand."""
        if not self.owned:
            return "(attached: no log)"
        with contextlib.suppress(OSError):
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if "keeping the old one" not in ln]
            return "\n".join(short(ln, 400) for ln in lines[-n:]) or "(only the fuzz's newtensor warnings)"
        return ""

    def log_errors(self, stats: Stats) -> None:
        """ERROR lines of the daemon's logs (an exception a handler caught and logged is a bug found)."""
        if self.dir is None:
            return
        for log in sorted(self.dir.glob("deepxd-*.log")):
            lines = log.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if " ERROR " in line or " CRITICAL " in line:
                    stats.event("daemon_log_errors", short("\n    ".join(lines[i:i + 25]), 3000), keep=3)

    def stop(self) -> tuple[int | None, float]:
        """SIGTERM, as an operator stops it: the exit code and the seconds it took (None: killed after 30 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return (self.proc.returncode if self.proc else None), 0.0
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc: int | None = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        return rc, time.monotonic() - t


@dataclass
class Run:
    """What every worker shares: the daemon, the clock, the tallies."""

    daemon: Deepxd
    stats: Stats
    stop: threading.Event
    end: float
    seed: int
    max_frame: int = 1 << 30

    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.end

    def sleep(self, seconds: float) -> None:
        self.stop.wait(max(0.0, min(seconds, self.end - time.monotonic())))

    def excused(self, generation: int) -> bool:
        """The daemon died or was started again since `generation`: what failed with it is the crash's."""
        d = self.daemon
        return not d.up.is_set() or d.generation != generation or d.exited() is not None

    def report(self, generation: int, key: str, what: str) -> None:
        """An event, unless the daemon crashed meanwhile (the crash is counted once, by the monitor)."""
        if not self.excused(generation):
            time.sleep(0.5)  # a killed daemon's sockets close a moment before its exit shows
        if self.excused(generation):
            self.stats.add("excused_by_crash")
        else:
            self.stats.event(key, what)


# -- UDP fuzzing ----------------------------------------------------------------------------------------------------

FUZZ_NAMES = [f"fz{i}" for i in range(8)] + ["fz.w", "7", "fz_long"]
PRECISIONS = ["float32", "float64", "int32", "int64", "int16", "int8", "bool", "float16", "bfloat16", "any", "float",
              "int", "float8e5m2", "int4", "string", "wat", "float32|int32", ""]
SMALL = ["0", "1", "2", "3", "-1", "0.5", "-2.5", "1e-3", "true", "False", "7"]
# numbers that fit nothing: never a size the machine could try to allocate (each >= 2**62 elements or not a size)
HUGE = ["99999999999999999999999", str(2**62), str(2**63), str(-(2**63) - 1), str(2**64), str(10**30), "1e308",
        "1e999", "-1e999", "nan", "inf", "-inf", "-7", "1.5", "0x10", str(10**300)]
PATHS = ["fz_file", "fz_dir/fz_file", "../fz_up", "../../fz_escape", "/etc/passwd", "/dev/zero", "", "fz file",
         "fz,a->b//c"]
GARBAGE_ALPHABET = "abcdefgxyz0123456789 ()[]<>:,->=_.|\t\"'\\%$#@!?*&^~`{};+"


def nosoak(s: str) -> str:
    """Fuzz text never names the load clients' or the canary's tensors (all named soak...)."""
    return s.replace("soak", "so_k")


class LineMaker:
    """deepxIR lines for the fuzzer: valid ones on its own small tensors, lines built from the op catalogue with
    random parameters, and both mutated. Sizes stay small or absurd (never a size the machine could allocate)."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng
        self.ops = sorted(OPS)

    def name(self) -> str:
        return self.r.choice(FUZZ_NAMES)

    def dims(self, n: int | None = None) -> list[str]:
        n = self.r.randint(0, 3) if n is None else n
        return [str(self.r.randint(0, 4)) for _ in range(n)]

    def tensor(self) -> str:
        p = self.r.choice(PRECISIONS[:8])
        return f"tensor<{p}>:{self.name()}" if self.r.random() < 0.6 else f"tensor:{self.name()}"

    def param(self, kind: str) -> str:
        r = self.r
        if r.random() < 0.08:  # the wrong kind
            kind = r.choice(["tensor", "var", "vector", "listtensor", "shape", "junk"])
        if kind == "tensor":
            return self.tensor()
        if kind == "var":
            v = r.choice(SMALL) if r.random() < 0.8 else r.choice(HUGE + PATHS)
            return f"var<{r.choice(PRECISIONS)}>:{v}" if r.random() < 0.5 else f"var:{v}"
        if kind in ("vector", "shape"):
            if kind == "shape" and r.random() < 0.2:
                return f"var<string>:[{' '.join(self.dims())}]"
            items = self.dims()
            if items and r.random() < 0.1:
                items[r.randrange(len(items))] = r.choice(HUGE)
            return f"vector<int32>:[{' '.join(items)}]"
        if kind == "listtensor":
            return f"listtensor<float32>:[{' '.join(self.name() for _ in range(r.randint(0, 4)))}]"
        return r.choice(["junk", "tensor<", "var:", ":", "[", "<float32>:x", "vector:[1 2"])

    def catalogue_line(self) -> str:
        """An op of the catalogue with parameters of random values, sometimes too few or too many."""
        r = self.r
        op = OPS[r.choice(self.ops)]
        args = [self.param(a.kind) for a in op.args if a.required or r.random() < 0.5]
        rets = [self.param(a.kind) if a.kind != "tensor" else f"tensor<{r.choice(PRECISIONS[:7])}>:{self.name()}"
                for a in op.returns]
        if args and r.random() < 0.1:
            args.pop(r.randrange(len(args)))
        if r.random() < 0.1:
            args.append(self.param(r.choice(["tensor", "var", "vector"])))
        name = op.name
        if op.name in ("save", "load", "loadtensordata"):
            args[-1:] = [f"var<string>:{r.choice(PATHS)}"] if args else []
        if op.name == "renametensor" and args:
            args[0] = f"var<string>:{self.name()}"
        return f"{name} ({', '.join(args)}) -> ({', '.join(rets)})"

    def valid_line(self) -> str:
        r, n = self.r, self.name()
        shape = " ".join(str(r.randint(1, 4)) for _ in range(r.randint(1, 3)))
        k = r.randint(1, 4)
        return r.choice([
            f"newtensor (vector<int32>:[{shape}]) -> (tensor<{r.choice(PRECISIONS[:7])}>:{n})",
            f"constant (var<float32>:{r.choice(SMALL)}) -> (tensor<float32>:{n})",
            f"arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:{n})",
            f"addscalar (tensor<float32>:{n}, var<float32>:0.5) -> (tensor<float32>:{n})",
            f"mulscalar (tensor:{n}, var:2) -> (tensor:{self.name()})",
            f"add (tensor:{n}, tensor:{self.name()}) -> (tensor:{self.name()})",
            f"matmul (tensor:{n}, tensor:{self.name()}) -> (tensor:{self.name()})",
            f"sum (tensor:{n}, vector<int32>:[0], var<bool>:False) -> (tensor:{self.name()})",
            f"reshape (tensor:{n}, vector<int32>:[-1]) -> (tensor:{self.name()})",
            f"transpose (tensor:{n}, vector<int32>:[1 0]) -> (tensor:{self.name()})",
            f"uniform (var:-1, var:1, var:{r.randint(0, 9)}) -> (tensor:{n})",
            f"copytensor (tensor:{n}) -> (tensor:{self.name()})",
            f"print (tensor:{n}, var<string>:%.3f) -> ()",
            f"save (tensor:{n}, var<string>:fz_file) -> ()",
            "load (var<string>:fz_file) -> ()",
            f"deltensor () -> (tensor:{n})",
            f"renametensor (var<string>:{self.name()}) -> (tensor:{n})",
            f"repeat (tensor:{n}, vector<int32>:[{' '.join(str(r.randint(1, 2)) for _ in range(k))}]) -> "
            f"(tensor:{self.name()})",
            f"argset (var<int32>:{r.randint(0, 4)}) -> (var:fzv)",
            f"vecset (vector<int32>:[{shape}]) -> (vector:fzvec)",
            f"newtensor (vector:fzvec) -> (tensor<float32>:{n})",
            f"relu (tensor:{n}) -> (tensor:{n})",
            f"softmax (tensor:{n}, var:-1) -> (tensor:{self.name()})",
        ])

    def mutate(self, line: str) -> bytes:
        r = self.r
        how = r.randrange(8)
        if how == 0:  # truncated
            return line[: r.randrange(len(line) + 1)].encode()
        if how == 1:  # an unknown op
            return (r.choice(["fzop", "matmull", "MatMul", "_", "new tensor", "a.b.c", "9op"]) + line[line.find(" "):]
                    ).encode() if " " in line else b"fzop"
        if how == 2:  # a long name
            long = nosoak("fz" + r.choice("abcxyz") * r.choice([200, 5000, 30_000, 59_000]))
            return re.sub(r"fz[\w.]*|\b7\b", long, line, count=1).encode()
        if how == 3:  # huge numbers where small ones were
            return re.sub(r"(?<![\w<])-?\d+(\.\d+)?", lambda m: r.choice(HUGE) if r.random() < 0.5 else m.group(0),
                          line).encode()
        if how == 4:  # garbage bytes, some not UTF-8
            data = bytearray(line.encode())
            for _ in range(r.randint(1, 6)):
                data.insert(r.randrange(len(data) + 1), r.randrange(256))
            return bytes(data)
        if how == 5:  # a line of garbage
            if r.random() < 0.5:
                return bytes(r.randrange(256) for _ in range(r.randint(1, 300)))
            return "".join(r.choice(GARBAGE_ALPHABET) for _ in range(r.randint(1, 200))).encode()
        if how == 6:  # a piece dropped or doubled
            parts = re.split(r"(\s|,|\(|\)|->)", line)
            i = r.randrange(len(parts))
            parts[i] = "" if r.random() < 0.5 else parts[i] * 2
            return "".join(parts).encode()
        return line.encode() + r.choice([b" ,", b" ->", b" ()", b"(((", b" -> -> ", b" \xc3\x28", b"\xed\xa0\x80"])

    def line(self) -> tuple[bytes, str]:
        """A line's body, with no newline and no '/' (so that the `// id=N` the fuzzer appends starts the
        metadata), and metadata to follow the id."""
        r = self.r
        text = self.valid_line() if r.random() < 0.4 else self.catalogue_line()
        mutated = r.random() >= 0.45
        body = self.mutate(text) if mutated else text.encode()
        body = body.replace(b"\n", b" ").replace(b"/", b"_").replace(b"id=", b"id_").replace(b"soak", b"so_k")
        meta = []
        if r.random() < 0.1:
            meta.append("author=" + r.choice(["cblas", "miaobyte", "cublas", "", "fz"]))
        if not mutated and text.startswith("newtensor (vector<int32>:[") and r.random() < 0.05:
            meta.append("kind=heap")  # a heap tensor is never sized by a fuzzed number
        if r.random() < 0.1:
            meta.append("benchmark.repeat=" + r.choice(["2", "5", "0", "-1", "abc", "100000000", str(2**64), "1e3"]))
        if r.random() < 0.05:
            meta.append(r.choice(["created_at=1744724799.06", "sent_at=x", "k=v=w", "id2=3"]))
        return (body if body.strip() else b"fz"), " ".join(meta)


class UdpFuzzer(threading.Thread):
    """Datagrams of lines with unique ids; each line must get exactly one well-formed reply with its id."""

    def __init__(self, run: Run, index: int) -> None:
        super().__init__(name=f"udp-fuzz-{index}", daemon=True)
        self.run_ = run
        self.rng = random.Random(run.seed * 1000 + 100 + index)
        self.maker = LineMaker(self.rng)
        self.next_id = (index + 1) * 10**12
        self.done: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> replies, recent datagrams

    def run(self) -> None:
        run, st = self.run_, self.run_.stats
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        try:
            while run.running():
                self.datagram(sock, run, st)
                while len(self.done) > 20_000:
                    self.done.popitem(last=False)
        finally:
            sock.close()

    def datagram(self, sock: socket.socket, run: Run, st: Stats) -> None:
        r = self.rng
        gen = run.daemon.generation
        lines: list[bytes] = []
        expect: dict[int, int] = {}
        zero = 0  # lines sent without an id: answered with id 0
        size = 0
        for _ in range(r.choice([1, 1, 2, 5, 20, 60])):
            body, meta = self.maker.line()
            with_id = r.random() >= 0.03
            suffix = f" // id={self.next_id + 1} {meta}".rstrip().encode() if with_id else b""
            room = MAX_DATAGRAM - size - len(suffix) - 1
            if len(body) > room:
                if lines:
                    break
                body = body[:room].rstrip(b" \t\r") or b"fz"  # a line alone may be cut to fit
            if with_id:
                self.next_id += 1
                expect[self.next_id] = 0
            else:
                zero += 1
            lines.append(body + suffix)
            size += len(body) + len(suffix) + 1
        self.drain(sock, st)
        t0 = time.monotonic()
        sock.sendto(b"\n".join(lines), ("127.0.0.1", run.daemon.udp_port))
        st.add("udp_lines", len(lines))
        st.add("udp_datagrams")
        got_zero = 0
        pending = len(expect) + zero
        sock.settimeout(0.5)
        while pending > 0 and time.monotonic() - t0 < UDP_WAIT_S and not run.stop.is_set():
            try:
                data = sock.recv(1 << 17)
            except TimeoutError:
                continue
            rid = self.check_reply(data, st)
            if rid is None:
                continue
            if rid in expect:
                expect[rid] += 1
                if expect[rid] == 1:
                    pending -= 1
                else:
                    run.report(gen, "udp_duplicate_reply", f"id {rid}: a second reply {short(data)}")
            elif rid == 0:
                got_zero += 1
                pending -= 1  # a line without id, or one whose id the daemon did not read (settled below)
            else:
                self.late(rid, data, st)
        st.latency("udp_datagram_s", time.monotonic() - t0)
        missing = [i for i, n in expect.items() if n == 0]
        if got_zero > zero:  # replies with id 0 for lines that had one
            unread = min(got_zero - zero, len(missing))
            for i in missing[:unread]:
                line = next((ln for ln in lines if ln.endswith(f"id={i}".encode()) or f"id={i} ".encode() in ln), b"")
                run.report(gen, "udp_id_not_echoed", f"answered with id 0: {short(line, 300)}")
                expect[i] = 1
            if got_zero - zero > unread:
                run.report(gen, "udp_duplicate_reply",
                           f"{got_zero - zero - unread} id-0 replies more than lines without id")
            missing = missing[unread:]
        if pending > 0 and not run.stop.is_set():
            lost_lines = [ln for ln in lines if any(f"id={i}".encode() in ln for i in missing[:1])]
            run.report(gen, "udp_unanswered", f"{pending} of {len(lines)} lines not answered within {UDP_WAIT_S:.0f} s "
                     f"(first missing id {missing[:1]}): {short(lost_lines[:1])}")
            if not run.excused(gen):
                st.add("udp_unanswered_lines", pending - 1)
        for i, n in expect.items():
            self.done[i] = n

    def check_reply(self, data: bytes, st: Stats) -> int | None:
        m = REPLY.match(data)
        if m is None:
            st.event("udp_bad_reply", f"reply not in the protocol's form: {short(data)}")
            return None
        if m.group(2) == b"error" and m.group(6) and b"internal error" in m.group(6):
            st.event("internal_error", f"udp: {short(data)}")
        return int(m.group(1))

    def late(self, rid: int, data: bytes, st: Stats) -> None:
        if rid in self.done:
            self.done[rid] += 1
            if self.done[rid] > 1:
                st.event("udp_duplicate_reply", f"id {rid}: a second reply, late {short(data)}")
            else:
                st.add("udp_late_replies")
        else:
            st.event("udp_unknown_reply", f"a reply for an id never sent: {short(data)}")

    def drain(self, sock: socket.socket, st: Stats) -> None:
        sock.settimeout(0.0)
        while True:
            try:
                data = sock.recv(1 << 17)
            except (BlockingIOError, TimeoutError):
                return
            rid = self.check_reply(data, st)
            if rid:
                self.late(rid, data, st)


# -- native fuzzing -------------------------------------------------------------------------------------------------

REQUEST_OPS = ["hello", "run", "fetch", "put", "delete", "admin", "backward", "graph_store", "graph_get",
               "release_on_close", "graph_rm", "graph_drop", "replay", "explain", "ping"]


class FrameMaker:
    def __init__(self, rng: random.Random, lines: LineMaker) -> None:
        self.r = rng
        self.lines = lines

    def value(self, depth: int = 0) -> Any:
        r = self.r
        k = r.randrange(12 if depth < 2 else 8)
        if k == 0:
            return None
        if k == 1:
            return r.choice([True, False])
        if k == 2:
            return r.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 7])
        if k == 3:
            return r.choice([0.5, float("nan"), float("inf"), -0.0, 1e308])
        if k == 4:
            return nosoak("".join(r.choice(GARBAGE_ALPHABET) for _ in range(r.randint(0, 40))))
        if k == 5:
            return r.randbytes(r.randint(0, 64))
        if k == 6:
            return r.choice(FUZZ_NAMES)
        if k == 7:
            return nosoak("fz" + "é" * r.choice([1, 100, 10_000]))
        if k in (8, 9):
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        if k == 10:
            return {self.value(depth + 2) if r.random() < 0.2 else r.choice(FUZZ_NAMES): self.value(depth + 1)
                    for _ in range(r.randint(0, 3))}
        return msgpack.ExtType(r.randint(0, 127), r.randbytes(4))

    def maybe(self, good: Any) -> Any:
        return good if self.r.random() < 0.6 else self.value()

    def program(self) -> Any:
        r = self.r
        if r.random() < 0.5:
            instrs = []
            for _ in range(r.randint(1, 4)):
                text = self.lines.valid_line() if r.random() < 0.7 else self.lines.catalogue_line()
                try:
                    obj = instr_to_obj(parse_text(nosoak(text).split("//")[0])[0])
                    msgpack.packb(obj)  # a number past 64 bits parses, but no frame can carry it
                    instrs.append(obj)
                except (DeepxError, OverflowError):
                    instrs.append(text)
            if r.random() < 0.3:
                instrs[r.randrange(len(instrs))] = self.value()
            return instrs
        return self.value()

    def fields(self, op: str) -> dict[str, Any]:
        r, m = self.r, self.maybe
        name = lambda: m(r.choice(FUZZ_NAMES))  # noqa: E731
        shape = [r.randint(0, 3) for _ in range(r.randint(0, 3))]
        if r.random() < 0.1:
            shape = [r.choice([2**62, -1, 2**63 - 1]), *shape]
        f: dict[str, Any] = {
            "hello": lambda: {"version": m(1), "client": m("soak-fuzz")},
            "run": lambda: {"program": self.program(), "fetch": m([r.choice(FUZZ_NAMES)])},
            "fetch": lambda: {"names": m([r.choice(FUZZ_NAMES) for _ in range(r.randint(0, 3))])},
            "put": lambda: {"name": name(), "dtype": m(r.choice(PRECISIONS)), "shape": m(shape),
                            "data": m(r.randbytes(r.choice([0, 4, 16, 64]))), "heap": m(False), "owner": m("fz")},
            "delete": lambda: {"name": name(), "force": m(r.choice([False, True, "no", 0, None]))},
            "admin": lambda: {"what": m(r.choice(["tensors", "ops", "nodes", "actors", "memory", "graphs", "config",
                                                  "fz"]))},
            "backward": lambda: {"forward": self.program(), "loss": name(), "wrt": m([r.choice(FUZZ_NAMES)]),
                                 "grad_loss": m(None), "prefix": m("fzg."), "names": m({})},
            "graph_store": lambda: {"name": name(), "data": m(r.randbytes(r.randint(0, 200)))},
            "graph_get": lambda: {"name": name()},
            "release_on_close": lambda: {"prefix": r.choice(["fz", "fzr.", "", 7, None, ["fz"]])},
            "graph_rm": lambda: {"name": name()},
            "graph_drop": lambda: {"name": name()},
            "replay": lambda: {"name": name(), "inputs": m({"fz.in0": r.choice(FUZZ_NAMES)}),
                               "outputs": m({"fz.out0": r.choice(FUZZ_NAMES)}), "scalars": m({}),
                               "fetch": m([])},
            "explain": lambda: {"graph": name()} if r.random() < 0.5 else {"program": self.program(), "fetch": m([])},
            "ping": lambda: {},
        }[op]()
        if r.random() < 0.1:
            f[r.choice(["extra", "id2", "op "])] = self.value()
        return f

    def request(self, rid: Any) -> dict[str, Any]:
        r = self.r
        op = r.choice(REQUEST_OPS) if r.random() < 0.9 else self.value()
        req: dict[str, Any] = {"id": rid, "op": op}
        if isinstance(op, str) and op in REQUEST_OPS:
            req.update(self.fields(op))
        return req


def pack(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def recv_frame(sock: socket.socket, deadline: float) -> tuple[str, Any]:
    """('frame', obj), ('eof', None), ('timeout', None) or ('bad', description)."""
    buf = b""
    need = 4
    while len(buf) < need:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(need - len(buf))
        except TimeoutError:
            return "timeout", None
        except OSError as e:
            return ("eof", None) if not buf else ("bad", f"connection failed mid-reply: {e}")
        if not chunk:
            return ("eof", None) if not buf else ("bad", f"connection closed mid-reply after {len(buf)} bytes")
        buf += chunk
        if need == 4 and len(buf) == 4:
            need = 4 + HEADER.unpack(buf)[0]
    try:
        return "frame", msgpack.unpackb(buf[4:], raw=False, strict_map_key=False)
    except Exception as e:
        return "bad", f"reply is not msgpack: {e}"


class NativeFuzzer(threading.Thread):
    """Bad frames, each case on a fresh connection; every complete frame gets exactly one reply with its id."""

    def __init__(self, run: Run, index: int) -> None:
        super().__init__(name=f"native-fuzz-{index}", daemon=True)
        self.run_ = run
        self.rng = random.Random(run.seed * 1000 + 200 + index)
        self.frames = FrameMaker(self.rng, LineMaker(self.rng))
        self.next_id = 1
        self.gen = 0

    def run(self) -> None:
        while self.run_.running():
            try:
                self.case()
            except (OverflowError, TypeError, ValueError) as e:  # a case this fuzzer could not pack: its own bug
                self.run_.stats.event("fuzzer_skipped", f"{type(e).__name__}: {e}")
            except OSError as e:  # the daemon gone (a crash is the monitor's to count)
                self.run_.stats.add("native_fuzz_connect_errors")
                if self.run_.running() and not isinstance(e, (ConnectionRefusedError, FileNotFoundError)):
                    self.run_.report(self.gen, "native_fuzz_oserror", f"{type(e).__name__}: {e}")
                self.run_.sleep(0.2)

    def rid(self) -> int:
        self.next_id += 1
        return self.next_id

    def case(self) -> None:
        r, st, run = self.rng, self.run_.stats, self.run_
        self.gen = gen = run.daemon.generation
        path = run.daemon.address.removeprefix("unix://")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(NATIVE_WAIT_S)
        sock.connect(path)
        st.add("native_connections")
        try:
            kind = r.choice(["bad_length", "short_header", "oversized", "zero_length", "not_msgpack", "not_map",
                             "fields", "fields", "fields", "random_map", "pipelined", "deep", "lying_header",
                             "big_body"])
            ids: list[Any] = []  # the id each reply must carry, in order (None: the daemon cannot know it)
            keeps_serving = True
            half_close = False
            if kind == "bad_length":
                n = r.randint(1, 5000)
                data, ids, keeps_serving, half_close = HEADER.pack(n) + r.randbytes(r.randrange(n)), [None], False, True
            elif kind == "short_header":
                data, ids, keeps_serving, half_close = r.randbytes(r.randint(1, 3)), [None], False, True
            elif kind == "oversized":
                data = HEADER.pack(r.randint(run.max_frame + 1, 2**32 - 1))
                ids, keeps_serving = [None], False
            elif kind == "zero_length":
                data, ids = HEADER.pack(0), [None]
            elif kind == "not_msgpack":
                body = b"\xc1" + r.randbytes(r.randint(0, 100))  # 0xc1: never used by msgpack
                data, ids = HEADER.pack(len(body)) + body, [None]
            elif kind == "not_map":
                data, ids = pack(r.choice([[1, 2], 7, "ping", b"\x00", None, [{"op": "ping"}], 1.5])), [None]
            elif kind == "fields":
                rid = r.choice([self.rid(), self.rid(), f"fz-{self.rid()}"])
                data, ids = pack(self.frames.request(rid)), [rid]
            elif kind == "random_map":
                obj = {self.frames.value(2): self.frames.value() for _ in range(r.randint(0, 5))}
                with contextlib.suppress(TypeError):
                    obj.pop("id", None)
                data, ids = pack(obj), [None]
            elif kind == "pipelined":
                reqs = [self.frames.request(self.rid()) for _ in range(r.randint(2, 6))]
                data, ids = b"".join(pack(q) for q in reqs), [q["id"] for q in reqs]
            elif kind == "deep":
                depth = r.choice([200, 5_000, 100_000])
                body = b"\x81\xa2id\x00" if r.random() < 0.5 else b""
                body += b"\x91" * depth + b"\xc0"
                data, ids = HEADER.pack(len(body)) + body, [None]
            elif kind == "lying_header":  # a msgpack map/array/bin that claims 4G items
                body = r.choice([b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff\xc0", b"\xc6\xff\xff\xff\xffab",
                                 b"\x82\xa2id\x05\xa2op\xdb\xff\xff\xff\xffping"])
                data, ids = HEADER.pack(len(body)) + body, [None]
            else:  # a large frame: a put whose bytes do not match its shape
                data_len = r.choice([1 << 20, 3 << 20])
                rid = self.rid()
                data = pack({"id": rid, "op": "put", "name": r.choice(FUZZ_NAMES), "dtype": "float32",
                             "shape": [r.randint(1, 9)], "data": r.randbytes(64) * (data_len // 64), "heap": False})
                ids = [rid]
            st.add("native_frames", max(1, len(ids)))
            st.add(f"native_frames[{kind}]", max(1, len(ids)))
            t0 = time.monotonic()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(data)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            for want in ids:
                got, reply = recv_frame(sock, t0 + NATIVE_WAIT_S)
                if got == "timeout":
                    run.report(gen, "native_unanswered", f"{kind}: no reply within {NATIVE_WAIT_S:.0f} s to "
                             f"{short(data[:200])}")
                    return
                if got != "frame":
                    run.report(gen, "native_wrong_reply", f"{kind}: {got} {reply or ''} instead of a reply to "
                             f"{short(data[:200])}")
                    return
                self.check(kind, want, reply, data, st)
            st.latency("native_fuzz_reply_s", time.monotonic() - t0)
            if keeps_serving:  # the connection still answers
                rid = self.rid()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(pack({"id": rid, "op": "ping"}))
                got, reply = recv_frame(sock, time.monotonic() + NATIVE_WAIT_S)
                if got != "frame" or reply.get("id") != rid or not reply.get("ok"):
                    run.report(gen, "native_stopped_serving", f"{kind}: a ping after {short(data[:200])} got {got} "
                             f"{short(reply)}")
            else:  # one reply, then the daemon closes (or waits for our close, after a half-close)
                got, reply = recv_frame(sock, time.monotonic() + NATIVE_WAIT_S)
                if got == "frame":
                    run.report(gen, "native_extra_reply",
                               f"{kind}: a second reply {short(reply)} to {short(data[:200])}")
                elif got == "timeout" and not half_close:
                    run.report(gen, "native_not_closed",
                               f"{kind}: the connection stayed open after {short(data[:80])}")
        finally:
            sock.close()

    def check(self, kind: str, want: Any, reply: Any, data: bytes, st: Stats) -> None:
        run, gen = self.run_, self.gen
        if not isinstance(reply, dict) or "ok" not in reply:
            run.report(gen, "native_wrong_reply", f"{kind}: a reply that is no reply map: {short(reply)}")
            return
        if want is not None and reply.get("id") != want:
            run.report(gen, "native_wrong_reply", f"{kind}: reply id {short(reply.get('id'))} for request {want!r}")
        if not reply["ok"] and "internal error" in str(reply.get("error")):
            st.event("internal_error", f"native {kind}: {short(reply.get('error'), 300)} for {short(data[:300])}")
        if not reply["ok"]:
            st.add("native_refused")


# -- load: clients with known answers -------------------------------------------------------------------------------

NOT_FOUND = re.compile(r"not found|no tensor|does not exist|unknown tensor")


class LoadClient(threading.Thread):
    """Puts, runs and fetches its own tensors (names soakc<k>_...), checking every value it gets back."""

    def __init__(self, run: Run, index: int, think: float) -> None:
        super().__init__(name=f"client-{index}", daemon=True)
        self.run_ = run
        self.k = index
        self.think = think
        self.rng = np.random.default_rng(run.seed * 1000 + 1000 + index)
        self.expect: dict[str, np.ndarray] = {}  # what each name holds now
        self.gone: set[str] = set()  # deleted by this client: a fetch must fail
        self.generation = -1
        self.client: NativeClient | None = None
        self.heap = f"soakc{index}_h"

    def name(self, slot: str) -> str:
        return f"soakc{self.k}_{slot}"

    def ints(self, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return self.rng.integers(-4, 5, size=shape).astype(dtype)

    def run(self) -> None:
        run = self.run_
        while run.running():
            try:
                self.connect()
                self.step()
            except DeepxTimeoutError as e:
                run.report(self.generation, "client_timeout", f"client {self.k}: {e}")
                self.forget_all()
            except (DeepxError, OSError) as e:
                if run.running():
                    run.report(self.generation, "client_connection_lost", f"client {self.k}: {short(str(e))}")
                self.forget_all()
                run.sleep(0.5)
            if self.think:
                run.sleep(self.think * self.rng.uniform(0.5, 1.5))
        with contextlib.suppress(DeepxError, OSError):
            if self.client is not None and self.generation == run.daemon.generation:
                self.verify(list(self.expect), final=True)
        if self.client is not None:
            self.client.close()

    def connect(self) -> None:
        if self.client is not None and self.generation != self.run_.daemon.generation:
            self.client.close()
            self.client = None
        if self.client is None:
            if not self.run_.daemon.up.is_set():
                raise DeepxError("deepxd is being started again")
            self.client = NativeClient(self.run_.daemon.address, timeout=CLIENT_TIMEOUT_S, client=f"soak-{self.k}")
            if self.generation != self.run_.daemon.generation:
                self.expect.clear()  # a new daemon: stack tensors did not survive
                self.gone.clear()
                self.generation = self.run_.daemon.generation

    def forget_all(self) -> None:
        """After a timeout or a lost connection the last request's effect is unknown: stop vouching for anything."""
        if self.client is not None:
            self.client.close()
        self.client = None
        self.expect.clear()
        self.gone.clear()

    def op(self) -> None:
        self.run_.stats.add("client_ops")

    def error(self, what: str, e: Exception) -> None:
        msg = re.sub(r"soakc\d+_", "soakc*_", str(e))
        self.run_.stats.event("client_errors", f"{what}: {short(msg, 240)}", keep=6)
        if "internal error" in msg:
            self.run_.stats.event("internal_error", f"client {what}: {short(msg, 300)}")

    def wrong(self, what: str) -> None:
        self.run_.stats.event("wrong_result", f"client {self.k}: {what}")

    def lost(self, what: str) -> None:
        self.run_.stats.event("data_lost", f"client {self.k}: {what}")

    def put(self, name: str, a: np.ndarray, heap: bool = False) -> bool:
        assert self.client is not None
        self.op()
        self.expect.pop(name, None)
        try:
            self.client.put(name, a, heap=heap)
        except DeepxTimeoutError:
            raise
        except DeepxError as e:
            if "lost the connection" in str(e) or "closed the connection" in str(e):
                raise
            self.error("put", e)
            return False
        self.expect[name] = a
        self.gone.discard(name)
        return True

    def step(self) -> None:
        x = self.rng.random()
        if x < 0.2:
            shape = tuple(int(d) for d in self.rng.integers(1, 9, size=self.rng.integers(1, 4)))
            self.put(self.name(f"s{self.rng.integers(4)}"), self.ints(shape, self.rng.choice([np.float32, np.int32,
                                                                                              np.float64])))
        elif x < 0.28:
            self.put(self.heap, self.ints((8, 8)), heap=True)
        elif x < 0.45:
            self.matmul()
        elif x < 0.6:
            self.elementwise()
        elif x < 0.65:
            self.refused_whole()
        elif x < 0.92:
            names = list(self.expect) + list(self.gone)
            if names:
                self.verify(list(self.rng.choice(names, size=min(len(names), self.rng.integers(1, 4)),
                                                 replace=False)))
        else:
            self.delete()

    def matmul(self) -> None:
        m, k, n = (int(d) for d in self.rng.integers(1, 33, size=3))
        batch = (int(self.rng.integers(1, 4)),) if self.rng.random() < 0.25 else ()
        a, b = self.ints((*batch, m, k)), self.ints((*batch, k, n))
        an, bn, on = self.name("ma"), self.name("mb"), self.name(f"o{self.rng.integers(2)}")
        if not (self.put(an, a) and self.put(bn, b)):
            return
        author = self.rng.choice(["", "  // author=cblas", "  // author=miaobyte"])
        self.program(f"matmul (tensor:{an}, tensor:{bn}) -> (tensor:{on}){author}", {on: a @ b})

    def elementwise(self) -> None:
        t, s = self.name("t"), self.name("sum")
        names = [n for n in self.expect if n not in (t, s)]
        if not names:
            return
        x = str(self.rng.choice(names))
        v = self.expect[x]
        o = self.name("o1") if x == self.name("o0") else self.name("o0")
        text = f"mulscalar (tensor:{x}, var:3) -> (tensor:{t})\nadd (tensor:{t}, tensor:{x}) -> (tensor:{o})"
        want = {t: v * v.dtype.type(3), o: v * v.dtype.type(4)}
        if v.ndim >= 1:
            text += f"\nsum (tensor:{o}, vector<int32>:[0], var<bool>:false) -> (tensor:{s})"
            want[s] = (v * v.dtype.type(4)).sum(0, dtype=v.dtype)
        self.program(text, want)

    def program(self, text: str, want: dict[str, np.ndarray]) -> None:
        """Runs `text`, whose outputs `want` says; each output is deleted first (an output that exists with another
        shape is refused, as deepxIR senders make theirs with newtensor)."""
        assert self.client is not None
        for name in want:
            self.drop(name)
        self.op()
        try:
            r = self.client.run(parse_text(text), fetch=list(want))
        except DeepxTimeoutError:
            raise
        except DeepxError as e:
            if "connection" in str(e):
                raise
            self.error("run", e)
            return
        if not r.ok:
            self.error(text.split(" ", 1)[0], DeepxError(r.error or "run failed"))
            return
        for name, w in want.items():
            got = r.tensors.get(name)
            if got is None:
                self.wrong(f"{text.splitlines()[0]}: {name} not in the reply's tensors ({sorted(r.tensors)})")
            elif got.shape != w.shape or got.dtype != w.dtype or not np.array_equal(got, w):
                self.wrong(f"{short(text, 300)}: {name} is {got.dtype}{list(got.shape)} {short(got.ravel()[:8])}, "
                           f"numpy says {w.dtype}{list(w.shape)} {short(w.ravel()[:8])}")
            else:
                self.expect[name] = w
                self.gone.discard(name)

    def drop(self, name: str) -> None:
        assert self.client is not None
        self.op()
        self.expect.pop(name, None)
        self.gone.discard(name)
        self._delete(name, missing_ok=True)

    def _delete(self, name: str, missing_ok: bool) -> bool:
        """A native delete of `name`; whether it went (an error is counted, unless the tensor was just not there
        and `missing_ok`). A lost connection or a timeout is raised."""
        assert self.client is not None
        try:
            self.client.request("delete", name=name, force=False)
        except DeepxTimeoutError:
            raise
        except DeepxError as e:
            if "connection" in str(e):
                raise
            if not (missing_ok and (NOT_FOUND.search(str(e)) or "no tensor named" in str(e))):
                self.error("delete", e)
            return False
        return True

    def refused_whole(self) -> None:
        """A program whose second instruction cannot pass the check: nothing of it may run."""
        x, y = self.name("rx"), self.name("ry")
        a = self.ints((2, 3))
        self.drop(self.name("rz"))
        if not (self.put(x, a) and self.put(y, self.ints((3, 2)))):
            return
        assert self.client is not None
        self.op()
        r = self.client.run(parse_text(f"mulscalar (tensor:{x}, var:5) -> (tensor:{x})\n"
                                       f"add (tensor:{x}, tensor:{y}) -> (tensor:{self.name('rz')})"), fetch=[x])
        if r.ok:
            self.wrong(f"add of shapes (2, 3) and (3, 2) ran (done {r.done})")
            self.expect.pop(x, None)
        elif r.done != 0 or r.error_index not in (1, -1):
            if "shape" in (r.error or "") or "broadcast" in (r.error or "") or "match" in (r.error or ""):
                self.wrong(f"a program refused by the check ran {r.done} instructions (error_index {r.error_index}:"
                           f" {short(r.error)})")
            else:
                self.error("refused program", DeepxError(r.error or ""))
            self.expect.pop(x, None)

    def delete(self) -> None:
        assert self.client is not None
        stack = [n for n in self.expect if n != self.heap]
        if not stack:
            return
        name = str(self.rng.choice(stack))
        self.op()
        self.expect.pop(name)
        if self._delete(name, missing_ok=False):
            self.gone.add(name)

    def verify(self, names: list[str], final: bool = False) -> None:
        assert self.client is not None
        for name in names:
            self.op()
            try:
                got = self.client.fetch(name)[name]
            except DeepxTimeoutError:
                raise
            except DeepxError as e:
                if "connection" in str(e):
                    raise
                if name in self.gone and NOT_FOUND.search(str(e)):
                    continue
                if name in self.expect and NOT_FOUND.search(str(e)):
                    self.lost(f"{name} ({self.expect[name].dtype}{list(self.expect[name].shape)}) is gone: "
                              f"{short(str(e))}{' (final check)' if final else ''}")
                    self.expect.pop(name)
                else:
                    self.error("fetch", e)
                continue
            if name in self.gone:
                self.wrong(f"{name}, deleted, was fetched: {got.dtype}{list(got.shape)}")
                self.gone.discard(name)
                continue
            w = self.expect.get(name)
            if w is not None and (got.shape != w.shape or got.dtype != w.dtype or not np.array_equal(got, w)):
                self.lost(f"{name} changed: {got.dtype}{list(got.shape)} {short(got.ravel()[:8])}, was put as "
                          f"{w.dtype}{list(w.shape)} {short(w.ravel()[:8])}{' (final check)' if final else ''}")
                self.expect.pop(name)


# -- faults ---------------------------------------------------------------------------------------------------------

def victim(address: str, seed: int, prefix: str, release: bool) -> None:
    """A client to be killed mid-request (run as its own process)."""
    rng = np.random.default_rng(seed)
    c = NativeClient(address, timeout=60, client="soak-victim")
    if release:
        c.request("release_on_close", prefix=prefix)
    print("ready", flush=True)
    mode = seed % 3
    i = 0
    while True:
        i += 1
        if mode == 0:  # big puts and products
            a = rng.standard_normal((192, 192), dtype=np.float32)
            c.put(f"{prefix}a{i % 3}", a)
            c.run(parse_text(f"matmul (tensor:{prefix}a{i % 3}, tensor:{prefix}a{i % 3}) -> (tensor:{prefix}b)"),
                  fetch=[f"{prefix}b"])
        elif mode == 1:  # half a frame, then nothing
            body = msgpack.packb({"id": 9, "op": "put", "name": f"{prefix}half", "dtype": "float32",
                                  "shape": [1 << 20], "data": bytes(4 << 20), "heap": False}, use_bin_type=True)
            c.sock.sendall(HEADER.pack(len(body)) + body[: len(body) // 2])
            time.sleep(60)
        else:  # a long program
            c.put(f"{prefix}x", np.ones(4096, np.float32))
            c.run(parse_text("\n".join(f"addscalar (tensor:{prefix}x, var:1) -> (tensor:{prefix}x)"
                                       for _ in range(20_000))))


class Killer(threading.Thread):
    """Starts client processes and SIGKILLs each mid-request."""

    def __init__(self, run: Run, every: float) -> None:
        super().__init__(name="killer", daemon=True)
        self.run_ = run
        self.every = every
        self.rng = random.Random(run.seed * 1000 + 300)
        self.released: list[str] = []  # prefixes of victims that asked release_on_close

    def run(self) -> None:
        n = 0
        while self.run_.running():
            self.run_.sleep(self.every * self.rng.uniform(0.5, 1.5))
            if not self.run_.running() or self.run_.daemon.exited() is not None:
                continue
            n += 1
            gen = self.run_.daemon.generation
            release = self.rng.random() < 0.5
            prefix = f"soakv{'r' if release else 'k'}{n}_"
            proc = subprocess.Popen([sys.executable, __file__, "--victim", self.run_.daemon.address,
                                     "--seed", str(self.run_.seed * 1000 + n), "--victim-prefix", prefix]
                                    + (["--victim-release"] if release else []),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent)
            try:
                ready = self.wait_ready(proc)
                if ready:
                    time.sleep(self.rng.uniform(0.02, 0.6))
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                if ready:
                    self.run_.stats.add("clients_killed")
                    if release:
                        self.released.append(prefix)
                elif self.run_.running():
                    err = proc.stderr.read().decode(errors="replace")[-300:] if proc.stderr else ""
                    self.run_.report(gen, "victim_start_failed", err or "no 'ready' within 20 s")
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                for f in (proc.stdout, proc.stderr):
                    if f:
                        f.close()

    def wait_ready(self, proc: subprocess.Popen) -> bool:
        assert proc.stdout is not None
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(20)
        return bool(got) and got[0].startswith(b"ready")


class Canary(threading.Thread):
    """A heap tensor put at the start; its value must survive everything (checked every 15 s, and after each
    fault)."""

    def __init__(self, run: Run) -> None:
        super().__init__(name="canary", daemon=True)
        self.run_ = run
        self.lock = threading.Lock()

    def run(self) -> None:
        while self.run_.running():
            self.run_.sleep(15)
            if self.run_.running():
                self.check("periodic check", patience=10)

    def put(self) -> None:
        with NativeClient(self.run_.daemon.address, timeout=CLIENT_TIMEOUT_S) as c:
            c.put(CANARY, CANARY_VALUE, heap=True, owner="soak")

    def check(self, why: str, patience: float = 20.0) -> bool:
        """True when the canary reads back whole; errors are retried for `patience` seconds (a plane coming back)."""
        deadline = time.monotonic() + patience
        last = ""
        gen = self.run_.daemon.generation
        with self.lock:
            while not self.run_.excused(gen):
                try:
                    with NativeClient(self.run_.daemon.address, timeout=CLIENT_TIMEOUT_S) as c:
                        got = c.fetch(CANARY)[CANARY]
                        listed = {t.get("name"): t for t in c.admin("tensors")}.get(CANARY)
                    if not np.array_equal(got, CANARY_VALUE) or got.dtype != CANARY_VALUE.dtype:
                        self.run_.stats.event("data_lost", f"canary {why}: value changed to "
                                              f"{short(got.ravel()[:8])}")
                        return False
                    if listed is None or listed.get("kind") != "heap":
                        last = f"the plane's listing says {short(listed)}"
                    else:
                        self.run_.stats.add("canary_checks")
                        return True
                except (DeepxError, OSError) as e:
                    last = str(e)
                if time.monotonic() > deadline:
                    key = "data_lost" if NOT_FOUND.search(last) or "listing" in last else "canary_unreadable"
                    self.run_.report(gen, key, f"canary {why}: {short(last, 300)} (after {patience:.0f} s)")
                    return False
                time.sleep(0.5)
            return False  # the daemon died meanwhile: the monitor counts that


class RedisRestarter(threading.Thread):
    """Stops Redis (SIGTERM, or SIGKILL: the AOF is fsynced on every write) and starts it again on the same port."""

    def __init__(self, run: Run, redis: Redis, times: list[float], canary: Canary) -> None:
        super().__init__(name="redis-restarter", daemon=True)
        self.run_ = run
        self.redis = redis
        self.times = times
        self.canary = canary
        self.rng = random.Random(run.seed * 1000 + 400)

    def run(self) -> None:
        for i, at in enumerate(self.times):
            self.run_.sleep(at - time.monotonic())
            if not self.run_.running():
                return
            sig = signal.SIGTERM if i % 2 == 0 else signal.SIGKILL
            down = self.rng.uniform(0.5, 3.0)
            self.redis.stop(sig)
            time.sleep(down)
            try:
                self.redis.start()
            except SystemExit as e:
                self.run_.stats.event("redis_restart_failed", str(e))
                return
            self.run_.stats.add("redis_restarts")
            self.run_.stats.event("redis_restart_log", f"{sig.name}, down {down:.1f} s", keep=20,
                                  alike=True)
            if self.run_.daemon.exited() is None:
                self.canary.check(f"after Redis restart {i + 1} ({sig.name})")


class Monitor(threading.Thread):
    """Pings (native and UDP) every second with a deadline; counts crashes and starts the daemon again."""

    def __init__(self, run: Run, canary: Canary, redis: Redis | None) -> None:
        super().__init__(name="monitor", daemon=True)
        self.run_ = run
        self.redis = redis
        self.canary = canary
        self.probe_id = 9 * 10**15
        self.client: NativeClient | None = None
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def run(self) -> None:
        run = self.run_
        while run.running():
            t = time.monotonic()
            if self.crashed():
                continue
            self.native_ping()
            self.udp_ping()
            run.sleep(1.0 - (time.monotonic() - t))
        self.udp.close()

    def crashed(self) -> bool:
        run, d = self.run_, self.run_.daemon
        rc = d.exited()
        if rc is None:
            if not d.owned and not os.path.exists(d.address.removeprefix("unix://")):
                run.stats.event("crash", f"the socket {d.address} is gone")
                run.stop.set()
                return True
            return False
        d.up.clear()
        d.crash_counted = True
        sig = f" (signal {signal.Signals(-rc).name})" if rc < 0 and -rc in signal.Signals._value2member_map_ else ""
        run.stats.event("crash", f"deepxd exited with {rc}{sig}; the end of its log:\n{d.tail()}")
        if self.client is not None:
            self.client.close()
            self.client = None
        if run.running() and run.end - time.monotonic() > 20:
            for attempt in range(3):  # Redis may be restarting just now
                deadline = time.monotonic() + 30
                while self.redis is not None and not self.redis.answers() and time.monotonic() < deadline:
                    time.sleep(0.2)
                try:
                    d.start()
                    self.canary.check("after the daemon's restart (adopted)")
                    break
                except RuntimeError as e:
                    if attempt == 2:
                        run.stats.event("restart_failed", short(str(e), 2000))
                        run.stop.set()
        else:
            run.stop.set()
        return True

    def native_ping(self) -> None:
        st, gen = self.run_.stats, self.run_.daemon.generation
        t = time.monotonic()
        try:
            if self.client is None:
                self.client = NativeClient(self.run_.daemon.address, timeout=DEADLINE_S, client="soak-monitor")
            self.client.ping()
            st.latency("ping_native_s", time.monotonic() - t)
            st.add("pings")
        except DeepxTimeoutError:
            self.run_.report(gen, "hang", f"native ping: no answer within {DEADLINE_S:.0f} s")
            st.latency("ping_native_s", time.monotonic() - t)
            self.client = None
        except (DeepxError, OSError) as e:
            if self.run_.running():
                self.run_.report(gen, "ping_failed", f"native ping: {short(str(e))}")
            if self.client is not None:
                self.client.close()
            self.client = None

    def udp_ping(self) -> None:
        st, gen = self.run_.stats, self.run_.daemon.generation
        self.probe_id += 1
        line = f"argset (var<int32>:{self.probe_id % 1000}) -> (var:soak_probe) // id={self.probe_id}"
        t = time.monotonic()
        self.udp.sendto(line.encode(), ("127.0.0.1", self.run_.daemon.udp_port))
        while True:
            self.udp.settimeout(max(0.01, t + DEADLINE_S - time.monotonic()))
            try:
                data = self.udp.recv(1 << 17)
            except TimeoutError:
                self.run_.report(gen, "hang", f"UDP one-liner: no reply within {DEADLINE_S:.0f} s")
                st.latency("ping_udp_s", time.monotonic() - t)
                return
            if data.startswith(f"{self.probe_id} ".encode()):
                st.latency("ping_udp_s", time.monotonic() - t)
                if b" ok//" not in data:
                    st.event("udp_probe_error", short(data))
                return  # an earlier probe's late reply is skipped


# -- the run --------------------------------------------------------------------------------------------------------

def report(run: Run, opts: argparse.Namespace, extra: list[tuple[str, str]]) -> int:
    c, w = run.stats.counts, run.stats.worst
    hangs = c["hang"] + c["udp_unanswered"] + c["udp_unanswered_lines"] + c["native_unanswered"] + c["client_timeout"]
    wrong = (c["wrong_result"] + c["udp_duplicate_reply"] + c["udp_unknown_reply"] + c["udp_bad_reply"]
             + c["native_wrong_reply"] + c["native_extra_reply"])
    lost = c["data_lost"]
    rows = [
        ("inputs tried", f"{c['udp_lines']:,} UDP lines ({c['udp_datagrams']:,} datagrams), {c['native_frames']:,} "
                         f"native frames ({c['native_connections']:,} connections), {c['client_ops']:,} client ops "
                         f"({opts.clients} clients)"),
        ("faults", f"{c['clients_killed']} clients SIGKILLed mid-request, {c['redis_restarts']} Redis restarts"),
        ("crashes", f"{c['crash']}"),
        ("hangs", f"{hangs}  (pings over {DEADLINE_S:.0f} s {c['hang']}, UDP lines unanswered "
                  f"{c['udp_unanswered'] + c['udp_unanswered_lines']}, native frames unanswered "
                  f"{c['native_unanswered']}, client timeouts {c['client_timeout']})"),
        ("wrong results", f"{wrong}  (client values {c['wrong_result']}, UDP duplicate/unknown/malformed replies "
                          f"{c['udp_duplicate_reply']}/{c['udp_unknown_reply']}/{c['udp_bad_reply']}, native wrong/"
                          f"extra replies {c['native_wrong_reply']}/{c['native_extra_reply']})"),
        ("data lost", f"{lost}  (canary checks passed {c['canary_checks']})"),
        ("worst ping", f"native {w.get('ping_native_s', 0) * 1e3:,.0f} ms, UDP one-liner "
                       f"{w.get('ping_udp_s', 0) * 1e3:,.0f} ms ({c['pings']} pings)"),
        ("other", f"client op errors {c['client_errors']}, connections lost {c['client_connection_lost']}, "
                  f"internal errors {c['internal_error']}, native frames refused {c['native_refused']}, "
                  f"native connections not closed {c['native_not_closed']}, stopped serving "
                  f"{c['native_stopped_serving']}, UDP late replies {c['udp_late_replies']}, UDP ids not echoed "
                  f"{c['udp_id_not_echoed']}, daemon log ERROR lines {c['daemon_log_errors']}"),
        *extra,
    ]
    width = max(len(k) for k, _ in rows)
    print()
    print(f"deepxd soak: {opts.minutes:g} min, seed {opts.seed}, {opts.clients} clients")
    print("-" * (width + 100))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 100))
    shown = ["crash", "wrong_result", "data_lost", "udp_duplicate_reply", "udp_unknown_reply", "udp_bad_reply",
             "native_wrong_reply", "native_extra_reply", "hang", "udp_unanswered", "native_unanswered",
             "client_timeout", "native_stopped_serving", "native_not_closed", "internal_error", "client_errors",
             "client_connection_lost", "canary_unreadable", "udp_id_not_echoed", "daemon_log_errors", "ping_failed",
             "udp_probe_error", "victim_start_failed",
             "redis_restart_failed", "restart_failed", "native_fuzz_oserror", "redis_restart_log"]
    for key in shown:
        for ex in run.stats.examples.get(key, []):
            print(f"  {key}: {ex}")
    failed = c["crash"] + wrong + lost
    print("FAILED: crashes, wrong results or data lost" if failed else "passed: no crash, wrong result or data lost")
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to run (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=64, help="concurrent native clients checking values (default 64)")
    ap.add_argument("--think", type=float, default=0.005, help="seconds each client waits between ops")
    ap.add_argument("--kill-every", type=float, default=4.0, help="seconds between client processes SIGKILLed")
    ap.add_argument("--redis-restarts", type=int, default=None, help="Redis restarts (default: 2 a minute)")
    ap.add_argument("--address", help="attach to the deepxd at this unix:// address instead of starting one")
    ap.add_argument("--udp", help="with --address: its deepxIR UDP address, 127.0.0.1:PORT")
    ap.add_argument("--log-level", default="warning", help="the started deepxd's --log-level")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, the AOF)")
    ap.add_argument("--victim", help=argparse.SUPPRESS)
    ap.add_argument("--victim-prefix", help=argparse.SUPPRESS)
    ap.add_argument("--victim-release", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.victim:
        victim(opts.victim, opts.seed, opts.victim_prefix, opts.victim_release)
        return
    if opts.address and not opts.udp:
        ap.error("--address needs --udp (the daemon's deepxIR UDP address)")
    if opts.udp and opts.udp.rsplit(":", 1)[0] not in ("127.0.0.1", "localhost"):
        ap.error("the soak only talks to loopback: --udp 127.0.0.1:PORT")

    duration = opts.minutes * 60
    workdir = None if opts.address else Path(tempfile.mkdtemp(prefix="deepx-soak-"))
    redis: Redis | None = None
    if workdir is not None:
        redis = Redis(workdir / "redis")
        daemon = Deepxd(workdir, f"unix://{workdir}/deepxd.sock", free_port(socket.SOCK_DGRAM), redis.url,
                        opts.log_level)
        try:
            redis.start()
            daemon.start()
        except (RuntimeError, SystemExit) as e:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.proc.kill()
            redis.stop()
            raise SystemExit(f"soak: could not start: {e}") from None
        print(f"soak: deepxd pid {daemon.proc.pid if daemon.proc else '?'} on {daemon.address}, "
              f"udp 127.0.0.1:{daemon.udp_port}, redis {redis.url} (AOF), work directory {workdir}", flush=True)
    else:
        daemon = Deepxd(None, opts.address, int(opts.udp.rsplit(":", 1)[1]), "", "")
        daemon.generation = 1
        daemon.up.set()
        print(f"soak: attached to {daemon.address}, udp {opts.udp} (no Redis restarts, no daemon restarts)",
              flush=True)

    run = Run(daemon, Stats(), threading.Event(), time.monotonic() + duration, opts.seed)
    canary = Canary(run)
    killer = Killer(run, opts.kill_every)
    threads: list[threading.Thread] = [Monitor(run, canary, redis), canary, UdpFuzzer(run, 0), NativeFuzzer(run, 0),
                                       killer]
    threads += [LoadClient(run, k, opts.think) for k in range(opts.clients)]
    if redis is not None:
        n = opts.redis_restarts if opts.redis_restarts is not None else max(1, round(opts.minutes * 2))
        start = time.monotonic()
        threads.append(RedisRestarter(run, redis, [start + duration * (i + 1) / (n + 1) for i in range(n)], canary))
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda *_: run.stop.set())
    extra: list[tuple[str, str]] = []
    try:
        with NativeClient(daemon.address, timeout=CLIENT_TIMEOUT_S) as c:
            run.max_frame = int(c.server.get("max_frame", run.max_frame))
        canary.put()
        for t in threads:
            t.start()
        while run.running():
            run.sleep(1.0)
        run.stop.set()
        deadline = time.monotonic() + CLIENT_TIMEOUT_S + 10
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            run.stats.event("hang", f"threads still waiting on the daemon at the end: {', '.join(stuck[:8])}")
        if daemon.exited() is None:
            canary.check("at the end")
            time.sleep(1.0)
            with contextlib.suppress(DeepxError, OSError), NativeClient(daemon.address, timeout=30) as c:
                rows = c.admin("tensors")
                left = [r["name"] for r in rows if any(str(r.get("name", "")).startswith(p) for p in killer.released)]
                extra.append(("killed clients", f"{len(killer.released)} asked release_on_close; {len(left)} of their "
                              f"tensors still listed 1 s after the run (informational)"))
        if daemon.owned:
            rc = daemon.exited()
            if rc is not None and not daemon.crash_counted:  # after the monitor's last look
                run.stats.event("crash", f"deepxd exited with {rc} during the run's end:\n{daemon.tail()}")
            elif rc is None:
                rc, took = daemon.stop()
                extra.append(("daemon stop", f"SIGTERM -> exit {rc} in {took:.1f} s; {daemon.starts} start(s)"))
                if rc != 0:
                    run.stats.event("crash", f"deepxd did not stop cleanly on SIGTERM (exit {rc}):\n{daemon.tail()}")
            daemon.log_errors(run.stats)
    finally:
        signal.signal(signal.SIGINT, previous)
        run.stop.set()
        if daemon.owned and daemon.exited() is None and daemon.proc is not None:
            daemon.proc.kill()
        if redis is not None:
            redis.stop()
        if workdir is not None and not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(report(run, opts, extra))


if __name__ == "__main__":
    main()
