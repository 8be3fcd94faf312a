"""deepxctl graphs ls / show: none stored yet, then programs written into the plane as a compiler would."""

from __future__ import annotations

import json

import pytest
import redis

from deepx_sdk.ir import parse_text
from deepx_sdk.ir.wire import pack_program
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
    assert g["after"] == g["before"] and g["passes"] == []
    table = live.ctl("graphs", "show", "mlp", kv=kv)
    assert table.stdout.splitlines()[0] == f"graph mlp: 3 instructions, {len(stored)} bytes"
    assert "newtensor (vector<int32>:[2 3]) -> (tensor<float32>:a) // id=1" in table.stdout
    assert "does not decode" in one_line_error(live.ctl("graphs", "show", "broken", kv=kv))
