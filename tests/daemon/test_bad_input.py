"""Bad input an audit found, sent to a real deepxd over UDP and the native socket: each line or request gets exactly
one clear answer naming what was wrong, and the daemon keeps serving (and stops on SIGTERM)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_core.ir.wire import instr_to_obj
from deepx_sdk.client import DeepxTimeoutError, NativeClient
from deepxd.actors.messages import Put, RunProgram
from deepxd.kernels.cpu import MAX_REPEAT
from deepxd.net.reply import MAX_DATAGRAM, TRUNCATED
from tests.compiler.helpers import execute_threads
from tests.daemon.conftest import DEEPXCTL, DEEPXD, Daemon, udp_exchange

REPLY_OK = re.compile(r"^(\d+) ok// recv_at=(\d+) start_at=(\d+) finish_at=(\d+)$")
REPLY_ERR = re.compile(r"^(\d+) error// recv_at=(\d+) start_at=(\d+) finish_at=(\d+) (.+)$", re.DOTALL)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that only need it to answer (each uses tensor names of its own)."""
    d = Daemon(tmp_path_factory.mktemp("bad_input")).start()
    try:
        with d.client() as c:
            c.put("base_s", np.ones(4, np.float32))
            c.put("base_i", np.ones(4, np.int32))
            c.request("udp_share", names=["base_s", "base_i"])  # the UDP tests' operands (docs/daemon.md)
        yield d
    finally:
        assert d.stop() == 0, d.output()


def _udp_raw(port: int, data: bytes, expect: int, timeout: float = 10.0) -> list[bytes]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(data, ("127.0.0.1", port))
        return [s.recvfrom(1 << 17)[0] for _ in range(expect)]


def _request(c: NativeClient, op: str, **fields: object) -> dict:
    """A request with fields of any type, as a client in another language might send them; the raw reply."""
    rid = next(c._ids)
    c.send_frame({"id": rid, "op": op, **fields})
    return c.recv_frame()


# -- benchmark.repeat (one UDP line hung the daemon, and SIGTERM then did not stop it)

def test_a_huge_benchmark_repeat_is_refused_and_sigterm_still_stops_the_daemon(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        with d.client() as c:
            c.put("base_s", np.ones(4, np.float32))
            c.request("udp_share", names=["base_s"])
        lines = ["mulscalar (tensor:base_s, var:2) -> (tensor:x) // benchmark.repeat=100000000 id=1",
                 "mulscalar (tensor:base_s, var:2) -> (tensor:x) // benchmark.repeat=-1 id=2",
                 "mulscalar (tensor:base_s, var:2) -> (tensor:x) // id=3 benchmark.repeat=abc",
                 f"addscalar (tensor:base_s, var:1) -> (tensor:base_s) // benchmark.repeat={MAX_REPEAT} id=4"]
        t = time.monotonic()
        replies = udp_exchange(d.udp_port, "\n".join(lines), len(lines), timeout=10)
        assert time.monotonic() - t < 5
        errs = [REPLY_ERR.match(r) for r in replies[:3]]
        assert errs[0] and errs[0].group(1) == "1" and errs[0].group(3) == "0", replies[0]
        assert errs[0].group(5) == (f"mulscalar: benchmark.repeat=100000000 is more runs than one instruction may "
                                    f"ask for (at most {MAX_REPEAT}); send the instruction several times instead")
        assert errs[1] and errs[1].group(1) == "2" and "mulscalar: benchmark.repeat=-1 is negative" in errs[1].group(5)
        assert errs[2] and errs[2].group(1) == "3"
        assert "mulscalar: benchmark.repeat='abc' is not a whole number" in errs[2].group(5)
        assert REPLY_OK.match(replies[3]) and replies[3].startswith("4 ok")
        with d.client() as c:
            assert "x" not in {t["name"] for t in c.admin("tensors")}
            np.testing.assert_array_equal(c.fetch("base_s")["base_s"], np.full(4, 1 + MAX_REPEAT, np.float32))
    finally:
        t = time.monotonic()
        assert d.stop(signal.SIGTERM, timeout=10) == 0, d.output()
        assert time.monotonic() - t < 10


@pytest.mark.parametrize("repeat, heavy", [(1, False), (MAX_REPEAT, True)])
async def test_a_repeated_small_instruction_is_heavy_work_and_leaves_the_event_loop(repeat: int, heavy: bool) -> None:
    """_heavy counted each instruction's elements once, so ten thousand runs of a small op ran on the event loop."""
    import threading

    from deepxd.actors.opcpu import CpuWorker

    worker = CpuWorker(output_log=False)
    worker.start()
    try:
        await worker.ref.ask(Put(name="small", dtype="float32", shape=[16], data=np.ones(16, np.float32).tobytes()))
        threads = execute_threads(worker)
        prog = parse_text(f"addscalar (tensor:small, var:1) -> (tensor:small) // benchmark.repeat={repeat}")
        r = await worker.ref.ask(RunProgram(program=prog, fetch=["small"]))
        assert not r.error
        np.testing.assert_array_equal(r.tensors["small"], np.full(16, 1 + repeat, np.float32))
        assert (threads != {threading.current_thread().name}) == heavy, threads
    finally:
        await worker.stop()


# -- UDP replies: one per line, always

@pytest.mark.parametrize("message", ["x" * 70_000, "é" * 40_000, "x" * 65_430 + "€" * 20, "x" * 65_439])
def test_format_reply_cuts_a_long_message_on_a_character_boundary(message: str) -> None:
    from deepxd.net.reply import format_reply

    reply = format_reply(123, False, 1796138313561, 1796138313562, 1796138313563, message)
    data = reply.encode("utf-8")
    assert len(data) <= MAX_DATAGRAM
    assert reply.startswith("123 error// recv_at=1796138313561 start_at=1796138313562 finish_at=1796138313563 x"
                            if message[0] == "x" else "123 error// recv_at=1796138313561 start_at=1796138313562 "
                            "finish_at=1796138313563 é")
    fits = len(f"123 error// recv_at=1796138313561 start_at=1796138313562 finish_at=1796138313563 {message}"
               .encode()) <= MAX_DATAGRAM
    assert reply.endswith(TRUNCATED) != fits
    if not fits:
        assert len(data) > MAX_DATAGRAM - 4  # cut no shorter than a character needs
        assert set(reply[-len(TRUNCATED) - 1]) <= set(message)  # the last character kept is whole


def test_an_over_long_reply_is_cut_to_fit_one_datagram(shared: Daemon) -> None:
    """The error naming a 65,440-character tensor is longer than a UDP payload can be: sendto failed and the sender
    waited forever. Now the message is cut, the id and the times intact."""
    name = "n" * 65_440
    line = f"addscalar (tensor:{name}, var:1) -> (tensor:y) // id=42"
    assert len(line) < MAX_DATAGRAM
    (reply,) = _udp_raw(shared.udp_port, line.encode(), 1)
    assert len(reply) == MAX_DATAGRAM
    text = reply.decode("utf-8")
    m = REPLY_ERR.match(text)
    assert m and m.group(1) == "42" and int(m.group(2)) > 1.7e12
    assert m.group(5).startswith("addscalar: ") and text.endswith(TRUNCATED)
    # the next line is answered as usual
    assert REPLY_OK.match(udp_exchange(shared.udp_port, "newtensor (vector:[2]) -> (tensor:after_long) // id=43",
                                       1)[0])


def test_a_non_utf8_line_costs_only_its_own_reply(shared: Daemon) -> None:
    """One bad byte used to lose the replies of every line of the datagram."""
    data = (b"newtensor (vector:[2]) -> (tensor:u8_a) // id=1\n"
            b"newtensor (vector:[2]) -> (tensor:u8_\xff) // id=2\n"
            b"\n"
            b"newtensor (vector:[2]) -> (tensor:u8_b) // id=3\n")
    replies = [r.decode("utf-8") for r in _udp_raw(shared.udp_port, data, 3)]
    assert REPLY_OK.match(replies[0]) and replies[0].startswith("1 ok")
    m = REPLY_ERR.match(replies[1])
    assert m and m.group(1) == "2" and m.group(3) == "0"
    bad = data.index(b"\xff")
    line_start = data.index(b"newtensor", 1)
    assert m.group(5) == (f"line 2 is not UTF-8 text: byte {bad - line_start} of the line (byte {bad} of the "
                          "datagram) is 0xff")
    assert REPLY_OK.match(replies[2]) and replies[2].startswith("3 ok")
    with shared.client() as c:
        names = {t["name"] for t in c.admin("tensors")}
    assert {"u8_a", "u8_b"} <= names and not any(n.startswith("u8_\ufffd") for n in names)


# -- kernel failures and names, through the daemon

def test_kernel_failures_say_what_went_wrong_on_both_ways_a_program_runs(shared: Daemon) -> None:
    """The second run of the same program is a known one (prepared steps; explain_failure words the error)."""
    prog = parse_text("addscalar (tensor:base_i, var:18446744073709551615) -> (tensor:base_i)")
    with shared.client() as c:
        errors = [c.run(prog).error for _ in range(2)]
    assert errors[0] == errors[1] == ("instruction 1: addscalar: value 18446744073709551615 does not fit int32 "
                                      "(addscalar('base_i', 18446744073709551615) -> 'base_i')")
    (reply,) = udp_exchange(shared.udp_port, "addscalar (tensor:base_i, var:99999999999999999999999) -> "
                                             "(tensor:base_i) // id=4", 1)
    m = REPLY_ERR.match(reply)
    assert m and m.group(5) == ("addscalar: value 99999999999999999999999 does not fit int32 "
                                "(addscalar('base_i', 99999999999999999999999) -> 'base_i')")
    (reply,) = udp_exchange(shared.udp_port, "constant (var:1e400) -> (tensor:base_i) // id=5", 1)
    m = REPLY_ERR.match(reply)
    assert m and m.group(5) == "constant: value inf does not fit int32 (constant(inf) -> 'base_i')"


# -- what an audit of deepxIR conformance found (twelfth session)

def test_an_id_too_long_for_int_costs_no_reply_and_ids_read_alike_parsed_or_not(shared: Daemon) -> None:
    """A 5,000-digit id raised inside the datagram loop and lost every reply of the datagram; a line that did not
    parse read its id by another rule than one that did (`id=-3` gave 0, `id=12abc` gave 12)."""
    data = ("newtensor (vector:[2]) -> (tensor:id_a) // id=" + "9" * 5000 + "\n"
            "newtensor (vector:[2]) -> (tensor:id_b) // id=2\n").encode()
    replies = [r.decode() for r in _udp_raw(shared.udp_port, data, 2)]
    assert replies[0].startswith("0 ok//") and replies[1].startswith("2 ok//")
    for rid, want in (("-3", "-3"), ("12abc", "0"), ("007", "7")):
        ran, unparsed = udp_exchange(shared.udp_port, f"add (tensor:id_nosuch, tensor:id_nosuch) -> (tensor:id_c) "
                                                      f"// id={rid}\nadd (tensor:id_nosuch tensor:x) -> (tensor:id_c) "
                                                      f"// id={rid}", 2)
        assert ran.startswith(f"{want} error//") and unparsed.startswith(f"{want} error//"), (ran, unparsed)


def test_a_kernels_own_error_names_the_instruction_both_ways_a_program_runs(shared: Daemon) -> None:
    """`div: integer division by zero` named no tensor; now every kernel error ends with the instruction as it
    ran, on the first run and on the known program's prepared steps."""
    with shared.client() as c:
        c.put("dz_a", np.ones(2, np.int32))
        c.put("dz_z", np.zeros(2, np.int32))
        c.put("dz_i", np.array([9]))
        c.request("udp_share", names=["dz_a", "dz_z", "dz_i"])
        prog = parse_text("div (tensor:dz_a, tensor:dz_z) -> (tensor:dz_a)")
        errors = [c.run(prog).error for _ in range(2)]
        want = "instruction 1: div: integer division by zero (div('dz_a', 'dz_z') -> 'dz_a')"
        assert errors[0] == errors[1] == want
        np.testing.assert_array_equal(c.fetch("dz_a")["dz_a"], np.ones(2, np.int32))  # nothing written
    for _ in range(2):  # started and failed: start_at is its start (0 only for an op that never started)
        (reply,) = udp_exchange(shared.udp_port, "div (tensor:dz_a, tensor:dz_z) -> (tensor:dz_a) // id=2", 1)
        m = REPLY_ERR.match(reply)
        assert m and int(m.group(2)) <= int(m.group(3)) <= int(m.group(4)) and int(m.group(3)) > 0, reply
    (reply,) = udp_exchange(shared.udp_port, "add (tensor:dz_a, tensor:base_s) -> (tensor:dz_c) // id=2", 1)
    m = REPLY_ERR.match(reply)
    assert m and m.group(3) == "0", reply  # refused by its check: never started
    (reply,) = udp_exchange(shared.udp_port, "indexselect (tensor:dz_a, tensor:dz_i, var:0) -> (tensor:dz_o) // id=3",
                            1)
    m = REPLY_ERR.match(reply)
    assert m and m.group(5).endswith("(indexselect('dz_a', 'dz_i', 0) -> 'dz_o')"), reply
    (reply,) = udp_exchange(shared.udp_port, "load (var:/no/such/dir/t) -> () // id=4", 1)
    m = REPLY_ERR.match(reply)
    assert m and m.group(5).startswith("load: "), reply
    (reply,) = udp_exchange(shared.udp_port, "add (tensor:dz_a, tensor:dz_a -> (tensor:dz_c) // id=5", 1)
    m = REPLY_ERR.match(reply)
    assert m and "add: expected ')'" in m.group(5), reply


def test_deepxir_forms_the_spec_allows_run(shared: Daemon) -> None:
    """A bool var fills a bool tensor (`var` is a number or true/false); a shape may name a vector vecset stored; an
    output among a list's inputs is replaced, as any other op's; dropout takes p = 1 (torch's: input * 0)."""
    lines = ["newtensor (vector<int32>:[2 2]) -> (tensor<bool>:sp_m)",
             "constant (var<bool>:True) -> (tensor<bool>:sp_m)",
             "newtensor (vector<int32>:[2 2]) -> (tensor<bool>:sp_o)",
             "equalscalar (tensor<bool>:sp_m, var<bool>:False, var<float32>:0) -> (tensor<bool>:sp_o)",
             "vecset (vector<int32>:[2 3]) -> (vector<int32>:sp_shape)",
             "newtensor (vector<int32>:sp_shape) -> (tensor<float32>:sp_t)",
             "vecset (vector<int32>:[4 1]) -> (vector<int32>:x)",  # a name that reads as a literal shape too
             "newtensor (vector<int32>:x) -> (tensor<float32>:sp_x)",
             "newtensor (vector<int32>:[3]) -> (tensor<float32>:sp_e)",
             "arange (var<float32>:1, var<float32>:1) -> (tensor<float32>:sp_e)",
             "concat (listtensor<float32>:[sp_e sp_e], var<int32>:0) -> (tensor<float32>:sp_e)",
             "newtensor (vector<int32>:[3]) -> (tensor<float32>:sp_d)",
             "constant (var<float32>:2.5) -> (tensor<float32>:sp_d)",
             "dropout (var<float32>:1, var<int32>:5) -> (tensor<float32>:sp_d)"]
    replies = udp_exchange(shared.udp_port, "\n".join(f"{line} // id={k}" for k, line in enumerate(lines, 1)),
                           len(lines))
    assert [r.split("//")[0] for r in replies] == [f"{k} ok" for k in range(1, len(lines) + 1)], replies
    with shared.client() as c:
        np.testing.assert_array_equal(c.fetch("sp_m")["sp_m"], np.ones((2, 2), bool))
        np.testing.assert_array_equal(c.fetch("sp_o")["sp_o"], np.zeros((2, 2), bool))
        assert c.fetch("sp_t")["sp_t"].shape == (2, 3) and c.fetch("sp_x")["sp_x"].shape == (4, 1)
        np.testing.assert_array_equal(c.fetch("sp_e")["sp_e"], np.array([1, 2, 3, 1, 2, 3], np.float32))
        np.testing.assert_array_equal(c.fetch("sp_d")["sp_d"], np.zeros(3, np.float32))


def test_names_deepxir_text_cannot_write_are_refused(shared: Daemon) -> None:
    (reply,) = udp_exchange(shared.udp_port, "renametensor (var<string>:a b) -> (tensor:base_s) // id=6", 1)
    m = REPLY_ERR.match(reply)
    assert m and m.group(1) == "6" and "renametensor: cannot rename 'base_s' to 'a b'" in m.group(5)
    with shared.client() as c:
        for name in ("a b c", "x\ny", "t->u", "f(x)", "", "[q]"):
            r = _request(c, "put", name=name, dtype="float32", shape=[1], data=b"\0" * 4)
            assert not r["ok"] and r["error"].startswith("put: 'name' must be a tensor name deepxIR text can write")
        r = _request(c, "put", name="linear_0.weight", dtype="float32", shape=[1], data=b"\0" * 4)
        assert r["ok"], r
        names = {t["name"] for t in c.admin("tensors")}
    assert "base_s" in names and "a b" not in names and "a b c" not in names and "x\ny" not in names


# -- native requests with fields of the wrong type

@pytest.mark.parametrize("fields, message", [
    ({"shape": ["a"]}, "put of 'typed': 'shape' must be a list of whole numbers, got ['a']"),
    ({"shape": [2.5]}, "put of 'typed': 'shape' must be a list of whole numbers, got [2.5]"),
    ({"shape": [True]}, "put of 'typed': 'shape' must be a list of whole numbers, got [True]"),
    ({"shape": [1, None]}, "put of 'typed': 'shape' must be a list of whole numbers, got [1, None]"),
    ({"shape": 4}, "put of 'typed': 'shape' must be a list of whole numbers, got 4"),
    ({"dtype": 5}, "put of 'typed': 'dtype' must be a dtype's name (float32, int64, ...), got 5"),
    ({"data": "abcd"}, "put of 'typed': 'data' must be the tensor's bytes (bin), got str"),
    ({"heap": "no"}, "put of 'typed': 'heap' must be true or false, got 'no'"),
    ({"heap": 1}, "put of 'typed': 'heap' must be true or false, got 1"),
    ({"owner": {"a": 1}}, "put of 'typed': 'owner' must be a string (who holds the tensor), got {'a': 1}"),
    ({"name": 7}, "put: 'name' must be a tensor name deepxIR text can write"),
])
def test_put_fields_of_the_wrong_type_are_refused_not_coerced(shared: Daemon, fields: dict, message: str) -> None:
    req = {"name": "typed", "dtype": "float32", "shape": [1], "data": b"\0" * 4, **fields}
    with shared.client() as c:
        r = _request(c, "put", **req)
        assert not r["ok"] and r["error"].startswith(message), r["error"]
        assert "internal error" not in r["error"]
        assert "typed" not in {t["name"] for t in c.admin("tensors")}
        c.ping()  # the connection keeps serving


def test_run_and_explain_fields_of_the_wrong_type_are_refused(shared: Daemon) -> None:
    prog = [instr_to_obj(i) for i in parse_text("addscalar (tensor:base_s, var:1) -> (tensor:ex_y)")]
    fw = [instr_to_obj(i) for i in parse_text("sum (tensor:base_s, vector:[0], var:False) -> (tensor:ex_l)")]
    with shared.client() as c:
        r = _request(c, "explain", program=prog, fetch=5)
        assert not r["ok"] and r["error"] == "explain: 'fetch' must be a list of tensor names, got 5"
        r = _request(c, "run", program=prog, fetch="ex_y")
        assert not r["ok"] and r["error"] == "run: 'fetch' must be a list of tensor names, got 'ex_y'"
        backward = [instr_to_obj(i) for i in parse_text("backward (tensor:ex_l) -> ()")]
        spec = {"index": 0, "forward": fw, "loss": "ex_l", "wrt": ["base_s"]}
        r = _request(c, "run", program=backward, backwards=[{**spec, "names": [1]}])
        assert not r["ok"] and r["error"] == ("run: backwards[0]: 'names' must map tensor names to tensor names, "
                                              "got [1]")
        r = _request(c, "run", program=backward, backwards=[{**spec, "names": {"base_s": "g s"}}])
        assert not r["ok"] and "gradient name 'g s', which deepxIR text cannot write" in r["error"]
        r = _request(c, "backward", forward=fw, loss="ex_l", wrt=["base_s"], names=[1])
        assert not r["ok"] and r["error"] == "backward: 'names' must map tensor names to tensor names, got [1]"
        assert "internal error" not in r["error"]
        r = _request(c, "explain", program=prog, fetch=["ex_y"])
        assert r["ok"], r


@pytest.mark.parametrize("op, fields, message", [
    ("hello", {"name": 5, "pid": 1, "host": "h"}, "hello: 'name' must be the client program's name (a string), got 5"),
    ("hello", {"name": "a", "pid": "1", "host": "h"},
     "hello: 'pid' must be the client's process id (a positive whole number), got '1'"),
    ("hello", {"name": "a", "pid": True, "host": "h"},
     "hello: 'pid' must be the client's process id (a positive whole number), got True"),
    ("hello", {"name": "a", "pid": 1}, "hello: 'host' must be the client's host name (a string), got None"),
    ("label", {"prefix": 7}, "label: 'prefix' must be a session's tensor-name prefix (a string of 4 characters or "
                             "more), got 7"),
    ("label", {"tensors": ["w"]}, "label: 'tensors' must map tensor names to their labels, got list"),
    ("label", {"tensors": {"w": "0.weight"}}, "label: 'tensors' must map tensor names to maps of labels"),
    ("label", {"tensors": {"w": {"colour": "red"}}}, "label of 'w': 'colour' must be one of parameter, call_site"),
    ("label", {"tensors": {"w": {"parameter": 3}}}, "label of 'w': 'parameter' must be one of parameter, call_site "
                                                    "with a string value, got 3"),
])
def test_hello_and_label_fields_of_the_wrong_type_are_refused(shared: Daemon, op: str, fields: dict,
                                                              message: str) -> None:
    with shared.client() as c:
        r = _request(c, op, **({"version": 1, "client": "t"} if op == "hello" else {}), **fields)
        assert not r["ok"] and r["error"].startswith(message), r["error"]
        c.ping()  # the connection keeps serving


# -- a daemon that does not answer in time

def test_the_client_says_when_the_daemon_did_not_answer_in_time(shared: Daemon) -> None:
    """A stopped daemon (SIGSTOP) accepts the connection and answers nothing: a timeout, not a lost connection."""
    c = NativeClient(shared.address, timeout=0.5)
    assert shared.proc is not None
    os.kill(shared.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(DeepxTimeoutError) as e:
            c.ping()
    finally:
        os.kill(shared.proc.pid, signal.SIGCONT)
        c.close()
    assert isinstance(e.value, DeepxError) and isinstance(e.value, TimeoutError)
    assert str(e.value).startswith(f"deepxd at {shared.address} did not answer within 0.5 s")
    with pytest.raises(DeepxError, match=r"lost the connection|closed"):  # closed: a late reply is not taken
        c.ping()
    with shared.client() as c2:
        c2.ping()


def test_sigterm_while_starting_stops_the_daemon_at_once(tmp_path) -> None:
    """A storage plane that accepts and never answers keeps the start waiting (up to its connect timeout): the first
    SIGTERM stops it then and there, as at any other time."""
    import signal
    import socket
    import subprocess
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    port = silent.getsockname()[1]
    proc = subprocess.Popen([*DEEPXD, "start", "--kv", f"redis://127.0.0.1:{port}/0",
                             "--listen", f"unix://{tmp_path}/d.sock", "--udp", "off"],
                            stderr=subprocess.PIPE, text=True)
    conn = None
    try:
        silent.settimeout(30)
        conn, _ = silent.accept()  # the daemon is connecting to the plane: its start is under way (a slow machine
        # takes more than a second to get there: a fixed sleep sent the signal before its handler was set)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        # at once, or (signalled inside redis-py's handshake, whose read does not always yield to a cancellation)
        # when the handshake gives up: the plane's connect timeout, 2 s (docs/daemon.md, "Stop it"); then the exit,
        # which a loaded machine makes slowly (2.2 s in all with three CPU hogs running: 3.5 s left it little room)
        assert time.monotonic() - started < 2 + 4, err
        assert proc.returncode == 0 and "stopped while starting" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if conn is not None:
            conn.close()
        silent.close()


def test_a_storage_password_never_shows_in_the_log_the_config_or_the_command_line(tmp_path, new_redis_server) -> None:
    """docs/storage.md: the password is given in a file (or DEEPX_KV_PASSWORD), never on the command line, where
    /proc/<pid>/cmdline shows it to every local user; the log and the admin config show it as ***."""
    import signal
    import subprocess
    import time

    import redis as redis_py

    from deepx_sdk.client import NativeClient

    server = new_redis_server()
    redis_py.Redis(port=server.port).config_set("requirepass", "s3cret")
    secret = tmp_path / "redis.pass"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen([*DEEPXD, "start", "--kv", f"redis://127.0.0.1:{server.port}/0", "--kv-password-file",
                             str(secret), "--listen", f"unix://{sock}", "--udp", "off"], stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # until it answers: the socket's file exists a moment before it accepts (a loaded machine)
            try:
                c = NativeClient(f"unix://{sock}")
                break
            except DeepxError:
                assert time.monotonic() < deadline and proc.poll() is None, "deepxd did not come up"
                time.sleep(0.05)
        with c:
            config = c.request("admin", what="config")["result"]
        assert config["kv"] == f"redis://127.0.0.1:{server.port}/0" and config["kv_password"] == "***"
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert b"s3cret" not in f.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "s3cret" not in err


def test_a_password_in_the_kv_flag_is_refused_and_one_from_the_environment_is_redacted(tmp_path) -> None:
    import subprocess

    url = "redis://:s3cret@127.0.0.1:1/0"
    for given in (url, "redis://:s3#cret@127.0.0.1:1/0", "redis://127.0.0.1:1/0?password=s3cret"):
        flag = subprocess.run([*DEEPXD, "config", "--kv", given], capture_output=True, text=True)
        assert flag.returncode == 2 and "/proc/<pid>/cmdline" in flag.stderr and "--kv-password-file" in flag.stderr
        assert "s3" not in flag.stderr
    shown = subprocess.run([*DEEPXD, "config"], capture_output=True, text=True,
                           env={**os.environ, "DEEPX_KV": url, "DEEPX_KV_PASSWORD": "other"})
    assert shown.returncode == 0, shown.stderr
    assert "s3cret" not in shown.stdout and "other" not in shown.stdout
    assert 'kv = "redis://:***@127.0.0.1:1/0"' in shown.stdout and 'kv_password = "***"' in shown.stdout
    loose = tmp_path / "loose.pass"
    loose.write_text("s3cret\n")
    loose.chmod(0o644)
    bad = subprocess.run([*DEEPXD, "config", "--kv", "redis://127.0.0.1:1/0", "--kv-password-file", str(loose)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "can be read by others" in bad.stderr and "chmod 600" in bad.stderr
    for given in (url, "redis://:s3#cret@127.0.0.1:1/0"):
        ctl = subprocess.run([*DEEPXCTL, "--kv", given, "nodes", "ls"], capture_output=True, text=True)
        assert ctl.returncode == 2 and "--kv-password-file" in ctl.stderr and "s3" not in ctl.stderr


def test_deepxctl_reads_a_password_protected_plane_through_a_password_file(tmp_path, new_redis_server) -> None:
    import subprocess

    import redis as redis_py

    server = new_redis_server()
    redis_py.Redis(port=server.port).config_set("requirepass", "s3cret")
    secret = tmp_path / "redis.pass"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    url = f"redis://127.0.0.1:{server.port}/0"
    denied = subprocess.run([*DEEPXCTL, "--kv", url, "nodes", "ls"], capture_output=True, text=True)
    assert denied.returncode == 1 and "needs a password" in denied.stderr
    for how in (["--kv-password-file", str(secret)], []):
        env = {**os.environ, **({} if how else {"DEEPX_KV_PASSWORD": "s3cret"})}
        ok = subprocess.run([*DEEPXCTL, "--kv", url, *how, "nodes", "ls", "--format", "json"], capture_output=True,
                            text=True, env=env)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip().startswith("[")
