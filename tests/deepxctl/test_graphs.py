"""deepxctl graphs ls / show: none stored yet, then programs written into the plane as a compiler would, and a
graph stored as dx.compile stores one, shown before and after the passes (--passes)."""

from __future__ import annotations

import json

import pytest
import redis

from deepx_core.ir import parse_text
from deepx_core.ir.wire import pack_program
from deepxd.compiler.pipeline import DEFAULT_PASSES
from tests.deepxctl.conftest import Live, one_line_error

PROGRAM = """\
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:a) // id=1
arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:a) // id=2
mulscalar (tensor<float32>:a, var<float32>:2.5) -> (tensor<float32>:b)"""


def test_no_graphs_yet(live: Live) -> None:
    r = live.ctl("graphs", "ls")
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0].split() == ["NAME", "INSTRUCTIONS", "BYTES", "OPS"]
    assert "no graphs" in r.stderr
    assert json.loads(live.ctl("graphs", "ls", "--format", "json").stdout) == []
    assert "no graph named 'mlp'" in one_line_error(live.ctl("graphs", "show", "mlp"))


@pytest.fixture
def stored(live: Live):
    plane = redis.Redis.from_url(live.redis_url)
    data = pack_program(parse_text(PROGRAM))
    plane.set(f"{live.prefix}graph:mlp", data)
    plane.set(f"{live.prefix}graph:broken", b"\xc1not msgpack")
    yield data
    plane.delete(f"{live.prefix}graph:mlp", f"{live.prefix}graph:broken")


@pytest.mark.parametrize("kv", [False, True], ids=["daemon", "plane"])
def test_stored_graphs(live: Live, stored: bytes, kv: bool) -> None:
    rows = {g["name"]: g for g in json.loads(live.ctl("graphs", "ls", "--format", "json", "--detail", kv=kv).stdout)}
    assert rows["mlp"] == {"name": "mlp", "instructions": 3, "bytes": len(stored),
                           "ops": ["newtensor", "arange", "mulscalar"], "error": ""}
    assert rows["broken"]["instructions"] == 0 and "malformed msgpack" in rows["broken"]["error"]
    r = live.ctl("graphs", "show", "mlp", "--format", "json", kv=kv)
    g = json.loads(r.stdout)
    assert g["before"] == [str(i) for i in parse_text(PROGRAM)]
    assert g["before"][2] == "mulscalar (tensor<float32>:a, var<float32>:2.5) -> (tensor<float32>:b)"
    assert "after" not in g and "passes" not in g
    g = json.loads(live.ctl("graphs", "show", "mlp", "--passes", "--format", "json", kv=kv).stdout)
    assert g["after"] == g["before"] and g["passes"] == list(DEFAULT_PASSES)  # nothing ends in it
    table = live.ctl("graphs", "show", "mlp", kv=kv)
    assert table.stdout.splitlines()[0] == f"graph mlp: 3 instructions, {len(stored)} bytes"
    assert "newtensor (vector<int32>:[2 3]) -> (tensor<float32>:a) // id=1" in table.stdout
    assert "does not decode" in one_line_error(live.ctl("graphs", "show", "broken", kv=kv))


G = "axpb"
COMPILED = f"""\
mulscalar (tensor<float32>:{G}.in0, var<float32>:2.0) -> (tensor<float32>:{G}.t0)
addscalar (tensor<float32>:{G}.t0, var<float32>:1.0) -> (tensor<float32>:{G}.t1)
deltensor () -> (tensor<float32>:{G}.t0)
mul (tensor<float32>:{G}.t1, tensor<float32>:w) -> (tensor<float32>:{G}.out0)
deltensor () -> (tensor<float32>:{G}.t1)"""


@pytest.fixture
def compiled(live: Live):
    from deepx_core.graphrecord import GraphRecord

    data = GraphRecord(G, parse_text(COMPILED), [(f"{G}.in0", "float32", (3, 2))],
                       [(f"{G}.out0", "float32", (3, 2))], state=["w"]).pack()
    with live.daemon.client() as c:
        c.request("graph_store", name=G, data=data)
    yield data
    redis.Redis.from_url(live.redis_url).delete(f"{live.prefix}graph:{G}")


def test_show_passes_of_a_compiled_graph(live: Live, compiled: bytes) -> None:
    r = live.ctl("graphs", "show", G, "--passes")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[:2] == [f"graph {G}: 5 instructions, {len(compiled)} bytes", "-- before the passes --"]
    assert lines[2:7] == COMPILED.splitlines()
    assert lines[7] == f"-- after the passes ({', '.join(DEFAULT_PASSES)}): 1 instructions --"
    # the daemon knows w (a heap tensor of the fixture), so the whole chain fuses into one instruction
    assert lines[8] == ("fused (listtensor<float32>:[axpb.in0 w], var<string>:(in0 * 2.0 + 1.0) * in1) -> "
                        "(tensor<float32>:axpb.out0)")
    # without --passes: the stored program only
    assert live.ctl("graphs", "show", G).stdout.splitlines()[1:] == COMPILED.splitlines()
    # from the plane alone the passes run here: w is unknown there, so the program stays as stored, and a note says
    # why
    r = live.ctl("graphs", "show", G, "--passes", "--format", "json", kv=True)
    g = json.loads(r.stdout)
    assert g["after"] == g["before"] == COMPILED.splitlines()
    assert "drop --kv" in r.stderr


def test_graphs_rm_deletes_the_record_and_the_plan(live: Live, stored: bytes) -> None:
    """Every run of a compiled script stores graphs under new names, so a plane that lives on grew without bound and
    nothing could delete a graph: `graphs rm` does, with the daemon's plan of it."""
    shown = live.ctl("graphs", "show", "mlp", "--passes")  # plans it on the daemon
    assert shown.exit_code == 0, shown.output
    r = live.ctl("graphs", "rm", "mlp")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("deleted graph 'mlp'") and "its plan" in r.stdout
    assert redis.Redis.from_url(live.redis_url).get(f"{live.prefix}graph:mlp") is None
    names = [g["name"] for g in json.loads(live.ctl("graphs", "ls", "--format", "json").stdout)]
    assert "mlp" not in names and "broken" in names
    assert "no graph named 'mlp'" in one_line_error(live.ctl("graphs", "rm", "mlp"))
    assert "graphs rm need a running deepxd" in one_line_error(live.ctl("--kv", live.redis_url, "graphs", "rm",
                                                                        "broken"))
