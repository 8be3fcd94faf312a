"""The stored-graph requests of a real deepxd: graph_store, graph_get, replay and explain, with good and bad input;
a refused request leaves the daemon serving."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.graphrecord import GraphRecord
from deepx_core.ir import parse_text
from deepx_sdk import DeepxError
from deepx_sdk.client import decode_tensor
from deepxd.compiler.pipeline import DEFAULT_PASSES

G = "axpb"
PROGRAM = f"""\
mulscalar (tensor<float32>:{G}.in0, var<float32>:2.0) -> (tensor<float32>:{G}.t0)
addscalar (tensor<float32>:{G}.t0, var<float32>:1.0) -> (tensor<float32>:{G}.t1)
deltensor () -> (tensor<float32>:{G}.t0)
mul (tensor<float32>:{G}.t1, tensor<float32>:{G}.in1) -> (tensor<float32>:{G}.out0)
deltensor () -> (tensor<float32>:{G}.t1)"""


def record() -> bytes:
    return GraphRecord(G, parse_text(PROGRAM), [(f"{G}.in0", "float32", (2, 3)), (f"{G}.in1", "float32", (2, 3))],
                       [(f"{G}.out0", "float32", (2, 3))]).pack()


def data(a: np.ndarray) -> dict:
    return {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}


@pytest.fixture
def stored(daemon):
    with daemon.client() as c:
        r = c.request("graph_store", name=G, data=record())
        assert r["instructions"] == 5
        yield c


def test_store_get_and_list(stored) -> None:
    c = stored
    assert c.request("graph_get", name=G)["data"] == record()
    assert c.request("graph_get", name="other")["data"] is None
    assert [g["name"] for g in c.admin("graphs")] == [G]


def test_replay_with_data_and_with_bound_tensors(stored) -> None:
    c = stored
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 3, np.float32)
    r = c.request("replay", name=G, inputs={f"{G}.in0": data(a), f"{G}.in1": data(b)}, outputs={f"{G}.out0": "y"},
                  fetch=["y"])
    np.testing.assert_array_equal(decode_tensor(r["tensors"]["y"]), (2 * a + 1) * b)
    assert r["done"] == 5
    c.put("a", a)
    c.put("b", b)
    c.request("replay", name=G, inputs={f"{G}.in0": "a", f"{G}.in1": "b"}, outputs={f"{G}.out0": "z"})
    np.testing.assert_array_equal(c.fetch("z")["z"], (2 * a + 1) * b)
    # nothing of the graph's own is left behind: its temporaries and data inputs are freed by each replay
    assert sorted(t["name"] for t in c.admin("tensors")) == ["a", "b", "y", "z"]


def test_the_passes_plan_is_what_replays_run(stored) -> None:
    r = stored.request("explain", graph=G)
    assert r["before"].splitlines() == [str(i) for i in parse_text(PROGRAM)]
    assert r["passes"] == list(DEFAULT_PASSES)
    (line,) = r["after"].splitlines()  # one fused instruction
    assert line.startswith("fused (listtensor<float32>:[axpb.in0 axpb.in1]")


@pytest.mark.parametrize("req, message", [
    ({"name": "nope", "inputs": {}, "outputs": {}}, "no graph named 'nope' in the storage plane"),
    ({"name": G, "inputs": {"x": "a"}, "outputs": {}}, "replay of graph 'axpb': it has no input 'x'; its inputs "
                                                        "are axpb.in0 (float32[2, 3]), axpb.in1 (float32[2, 3])"),
    ({"name": G, "inputs": {f"{G}.in0": "a"}, "outputs": {}}, "input 'axpb.in1' is not given"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": data(np.ones((3, 3), np.float32))},
      "outputs": {f"{G}.out0": "y"}}, "input 'axpb.in1' is float32[2, 3]; got float32[3, 3]"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": "wrong"}, "outputs": {f"{G}.out0": "y"}},
     "input tensor 'wrong' is float64[2]; the graph needs float32[2, 3]"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": "missing"}, "outputs": {f"{G}.out0": "y"}},
     "input tensor 'missing' not found"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": "a"}, "outputs": {}}, "missing: 'axpb.out0'"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": "a"}, "outputs": {f"{G}.out0": "y"}, "scalars": {"lr": 1}},
     "it has no scalar 'lr'"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": "a"}, "outputs": {f"{G}.out0": "a"}},
     "output 'axpb.out0' cannot be written to 'a'"),
    ({"name": "../x", "inputs": {}, "outputs": {}}, "graph name '../x' is not valid"),
    ({"name": [1], "inputs": {}, "outputs": {}}, "graph name [1] is not valid"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": "a"}, "outputs": {f"{G}.out0": "y"}, "fetch": [["y"]]},
     "'fetch' must be a list of tensor names"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": {"dtype": "float32", "shape": "ab", "data": b""}},
      "outputs": {f"{G}.out0": "y"}}, "input 'axpb.in1' must be {dtype, shape, data} with shape a list of integers"),
    ({"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": {"dtype": "float32", "shape": [2, 3], "data": "x" * 24}},
      "outputs": {f"{G}.out0": "y"}}, "and data bytes"),
    # the first input is put, the second is refused: the first is freed again (the test checks nothing is left)
    ({"name": G, "inputs": {f"{G}.in0": data(np.ones((2, 3), np.float32)),
                            f"{G}.in1": {"dtype": "float32", "shape": [2, 3], "data": b"abc"}},
      "outputs": {f"{G}.out0": "y"}}, "replay of graph 'axpb': put: 'axpb.in1' is float32[2, 3], which needs 24 bytes"),
])
def test_bad_replays_are_refused_and_the_daemon_serves_on(stored, req, message) -> None:
    c = stored
    a = np.ones((2, 3), np.float32)
    c.put("a", a)
    c.put("wrong", np.ones(2))
    with pytest.raises(DeepxError) as e:
        c.request("replay", **req)
    assert message in str(e.value)
    c.ping()
    c.request("replay", name=G, inputs={f"{G}.in0": "a", f"{G}.in1": "a"}, outputs={f"{G}.out0": "y"})
    np.testing.assert_array_equal(c.fetch("y")["y"], 3 * a)
    assert not [t for t in c.admin("tensors") if t["name"].startswith(f"{G}.")]


def test_a_replay_that_fails_while_running_cleans_up(daemon) -> None:
    prog = parse_text("indexselect (tensor<float32>:g.in0, tensor<int64>:g.in1, var<int32>:0) -> "
                      "(tensor<float32>:g.t0)\n"
                      "mulscalar (tensor<float32>:g.t0, var<float32>:2.0) -> (tensor<float32>:g.out0)\n"
                      "deltensor () -> (tensor<float32>:g.t0)")
    rec = GraphRecord("g", prog, [("g.in0", "float32", (3,)), ("g.in1", "int64", (2,))], [("g.out0", "float32", (2,))])
    with daemon.client() as c:
        c.request("graph_store", name="g", data=rec.pack())
        x = np.array([1, 2, 3], np.float32)
        with pytest.raises(DeepxError, match=r"replay of graph 'g': instruction 1: indexselect: .*out of range"):
            c.request("replay", name="g", inputs={"g.in0": data(x), "g.in1": data(np.array([0, 7]))},
                      outputs={"g.out0": "y"})
        assert c.admin("tensors") == []
        r = c.request("replay", name="g", inputs={"g.in0": data(x), "g.in1": data(np.array([2, 0]))},
                      outputs={"g.out0": "y"}, fetch=["y"])
        np.testing.assert_array_equal(decode_tensor(r["tensors"]["y"]), [6, 2])


@pytest.mark.parametrize("fields, message", [
    ({"name": "a b", "data": b""}, "graph name 'a b' is not valid"),
    ({"name": "g", "data": b"\xc1"}, "graph 'g': not msgpack"),
    ({"name": "g", "data": "text"}, "'data' must be the graph's msgpack bytes"),
])
def test_bad_stores_are_refused(daemon, fields, message) -> None:
    with daemon.client() as c:
        with pytest.raises(DeepxError, match=message):
            c.request("graph_store", **fields)
        assert c.admin("graphs") == []
        c.ping()


def test_a_record_with_an_instruction_missing_its_result_is_refused_by_name(daemon) -> None:
    from deepx_core.ir.instr import Instr

    prog = [*parse_text("mulscalar (tensor<float32>:g.in0, var<float32>:2.0) -> (tensor<float32>:g.out0)"),
            Instr("deltensor", (), ())]
    rec = GraphRecord("g", prog, [("g.in0", "float32", (2,))], [("g.out0", "float32", (2,))])
    with daemon.client() as c:
        c.request("graph_store", name="g", data=rec.pack())
        with pytest.raises(DeepxError, match=r"replay of graph .g.: instruction 2: deltensor: expects 1 returns") as e:
            c.request("replay", name="g", inputs={"g.in0": data(np.ones(2, np.float32))}, outputs={"g.out0": "y"})
        assert "internal error" not in str(e.value), e.value
        c.ping()
        assert c.admin("tensors") == []


def test_replays_with_the_same_bindings_share_one_program() -> None:
    """bind_replay keeps the program of the last bindings: a loop replaying with the same tensors and scalars runs
    one program object (which the worker knows at once); other bindings, or data inputs, get their own."""
    from deepx_core.ir.ops import TensorMeta
    from deepxd.compiler.graphs import bind_replay, plan_graph

    metas = {n: TensorMeta((2, 3), "float32") for n in ("a", "b", "c")}
    plan = plan_graph(G, record(), metas, [], DEFAULT_PASSES)
    inputs, outputs = {f"{G}.in0": "a", f"{G}.in1": "b"}, {f"{G}.out0": "y"}
    first = bind_replay(plan, inputs, outputs, {})
    assert bind_replay(plan, dict(inputs), dict(outputs), {}).program is first.program
    other = bind_replay(plan, {**inputs, f"{G}.in1": "c"}, outputs, {})
    assert other.program is not first.program

    def reads(program) -> set:
        return {v for i in program for p in i.args for v in (p.value if isinstance(p.value, tuple) else (p.value,))}

    assert "c" in reads(other.program) and "c" not in reads(first.program)
    a = np.ones((2, 3), np.float32)
    with_data = bind_replay(plan, {**inputs, f"{G}.in0": data(a)}, outputs, {})
    assert with_data.puts and with_data.program is not other.program


def test_replays_with_the_same_bindings_check_their_inputs_every_time(stored) -> None:
    """After a replay of the same bindings ran, the next asks the worker to run only if the inputs still fit (no
    metas asked first): an input given another shape, or deleted, in between is refused as on the first replay."""
    c = stored
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 3, np.float32)
    c.put("a", a)
    c.put("b", b)
    req = {"name": G, "inputs": {f"{G}.in0": "a", f"{G}.in1": "b"}, "outputs": {f"{G}.out0": "y"}, "fetch": ["y"]}
    for _ in range(3):
        r = c.request("replay", **req)
        np.testing.assert_array_equal(decode_tensor(r["tensors"]["y"]), (2 * a + 1) * b)
        a = a + 1
        c.put("a", a)  # new values under the same name and shape: still the same bindings
    c.put("a", np.ones((3, 2), np.float32))
    with pytest.raises(DeepxError, match=rf"replay of graph '{G}': input tensor 'a' is float32\[3, 2\]; the graph "
                                         r"needs float32\[2, 3\]"):
        c.request("replay", **req)
    c.put("a", a)
    r = c.request("replay", **req)
    np.testing.assert_array_equal(decode_tensor(r["tensors"]["y"]), (2 * a + 1) * b)
    c.run(parse_text("deltensor () -> (tensor<float32>:b)"))
    with pytest.raises(DeepxError, match=rf"replay of graph '{G}': input tensor 'b' not found"):
        c.request("replay", **req)
    c.ping()
    assert sorted(t["name"] for t in c.admin("tensors")) == ["a", "y"]


def test_bindings_that_differ_only_in_the_sign_of_a_zero_bind_apart() -> None:
    from deepx_core.ir.ops import TensorMeta
    from deepxd.compiler.graphs import bind_replay, plan_graph

    rec = GraphRecord(G, parse_text(PROGRAM), [(f"{G}.in0", "float32", (2, 3)), (f"{G}.in1", "float32", (2, 3))],
                      [(f"{G}.out0", "float32", (2, 3))], scalars=[(0, 1, "k")])
    plan = plan_graph(G, rec.pack(), {n: TensorMeta((2, 3), "float32") for n in ("a", "b")}, [], ["off"])
    inputs, outputs = {f"{G}.in0": "a", f"{G}.in1": "b"}, {f"{G}.out0": "y"}
    zero = bind_replay(plan, inputs, outputs, {"k": 0.0})
    negative = bind_replay(plan, inputs, outputs, {"k": -0.0})
    assert negative.program is not zero.program
    assert str(negative.program[0].args[1].value) == "-0.0" and str(zero.program[0].args[1].value) == "0.0"
    assert bind_replay(plan, inputs, outputs, {"k": -0.0}) is negative


def test_new_scalar_values_change_only_their_slots() -> None:
    """A replay with the bindings of one before and new numbers (Adam's step count) is that program with those
    numbers in their slots: the other instructions are the very objects, and a value seen before binds as it did."""
    from deepx_core.ir.ops import TensorMeta
    from deepxd.compiler.graphs import bind_replay, plan_graph

    rec = GraphRecord(G, parse_text(PROGRAM), [(f"{G}.in0", "float32", (2, 3)), (f"{G}.in1", "float32", (2, 3))],
                      [(f"{G}.out0", "float32", (2, 3))], scalars=[(0, 1, "k")])
    plan = plan_graph(G, rec.pack(), {n: TensorMeta((2, 3), "float32") for n in ("a", "b")}, [], ["off"])
    inputs, outputs = {f"{G}.in0": "a", f"{G}.in1": "b"}, {f"{G}.out0": "y"}
    two = bind_replay(plan, inputs, outputs, {"k": 2.0})
    three = bind_replay(plan, inputs, outputs, {"k": 3.0})
    assert three.program[0].args[1].value == 3.0 and two.program[0].args[1].value == 2.0
    assert all(a is b for a, b in zip(three.program[1:], two.program[1:])) and len(three.program) == len(two.program)
    assert three.program[0].args[0] is two.program[0].args[0]
    again = bind_replay(plan, inputs, outputs, {"k": 2.0})
    assert again.program[0].args[1].value == 2.0 and again.program[1:] == two.program[1:]
    assert bind_replay(plan, inputs, outputs, {"k": 2.0}) is again
    with pytest.raises(DeepxError, match="scalar 'k' must be a number"):
        bind_replay(plan, inputs, outputs, {"k": "2"})


def test_graph_drop_lets_go_of_the_plan_and_its_kept_temporaries(daemon) -> None:
    """A replay keeps a graph's temporaries that live to its end allocated for the next one; graph_drop (what the
    SDK sends when a compiled function is collected) deletes them and forgets the plan, and the record stays: a
    later replay plans it again."""
    g = "mmrelu"
    program = parse_text(f"""\
matmul (tensor<float32>:{g}.in0, tensor<float32>:{g}.in1) -> (tensor<float32>:{g}.t0)
relu (tensor<float32>:{g}.t0) -> (tensor<float32>:{g}.out0)
deltensor () -> (tensor<float32>:{g}.t0)""")
    rec = GraphRecord(g, program, [(f"{g}.in0", "float32", (2, 3)), (f"{g}.in1", "float32", (3, 2))],
                      [(f"{g}.out0", "float32", (2, 2))]).pack()
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3) - 2, np.ones((3, 2), np.float32)
    with daemon.client() as c:
        c.request("graph_store", name=g, data=rec)
        c.put("a", a)
        c.put("b", b)

        def replay(out: str) -> None:
            c.request("replay", name=g, inputs={f"{g}.in0": "a", f"{g}.in1": "b"}, outputs={f"{g}.out0": out})
            np.testing.assert_array_equal(c.fetch(out)[out], np.maximum(a @ b, 0))

        replay("y")
        assert f"{g}.t0" in {t["name"] for t in c.admin("tensors")}  # kept for the next replay
        r = c.request("graph_drop", name=g)
        assert (r["planned"], r["deleted"]) == (True, 1)
        assert {t["name"] for t in c.admin("tensors")} == {"a", "b", "y"}
        assert c.request("graph_drop", name=g)["planned"] is False  # twice: nothing more
        replay("z")  # planned again from the plane
        with pytest.raises(DeepxError, match="graph name"):
            c.request("graph_drop", name="a b")
