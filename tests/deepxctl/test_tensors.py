"""deepxctl tensors ls / show / rm against a live deepxd."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import redis
import yaml

from deepx_core.identity import this_process
from tests.deepxctl.conftest import ME, Live, one_line_error, wait_for


def rows_by_name(result) -> dict[str, dict]:
    assert result.exit_code == 0, result.output
    return {r["name"]: r for r in json.loads(result.stdout)}


def test_ls_json_field_by_field(live: Live) -> None:
    """OWNER: the session that made a tensor (this process's client put x and w, and its program made y), or the
    name a client gave (v, put with owner='alice')."""
    rows = rows_by_name(live.ctl("tensors", "ls", "--format", "json"))
    unlabelled = {"parameter": "", "call_site": "", "node": live.node}
    assert rows["x"] == {"name": "x", "kind": "stack", "dtype": "float32", "shape": [2, 3], "bytes": 24,
                         "owner": ME, **unlabelled}
    assert rows["w"] == {"name": "w", "kind": "heap", "dtype": "float32", "shape": [3, 2], "bytes": 24,
                         "owner": ME, **unlabelled}
    assert rows["v"] == {"name": "v", "kind": "heap", "dtype": "int32", "shape": [4], "bytes": 16,
                         "owner": "alice", **unlabelled}
    assert rows["y"]["kind"] == "stack" and rows["y"]["shape"] == [2, 2] and rows["y"]["owner"] == ME


def test_ls_detail_adds_references(live: Live) -> None:
    rows = rows_by_name(live.ctl("tensors", "ls", "--format", "json", "--detail"))
    w = rows["w"]
    assert (w["state"], w["device"], w["refcount"], w["holders"]) == ("live", "cpu", 1, ["op-cpu"])
    assert w["handle"].startswith("deepx-")
    x = rows["x"]
    assert (x["state"], x["refcount"], x["holders"], x["handle"]) == ("live", None, [], "")
    me = this_process()
    for r in (w, x, rows["v"]):  # the session, field by field
        assert (r["client"], r["pid"], r["host"]) == (me["name"], me["pid"], me["host"])


def test_ls_table_and_yaml_have_the_same_fields(live: Live) -> None:
    table = live.ctl("tensors", "ls")
    assert table.exit_code == 0
    header = table.stdout.splitlines()[0].split()
    assert header == ["NAME", "KIND", "DTYPE", "SHAPE", "BYTES", "OWNER", "PARAMETER", "CALL", "SITE", "NODE"]
    line = next(ln for ln in table.stdout.splitlines() if ln.split()[:1] == ["w"])
    assert line.split() == ["w", "heap", "float32", "[3,", "2]", "24", "B", ME, live.node]
    data = yaml.safe_load(live.ctl("tensors", "ls", "--format", "yaml").stdout)
    assert " ".join(k.upper().replace("_", " ") for k in data[0]).split() == header  # call_site: CALL SITE


def test_ls_filters_and_limit(live: Live) -> None:
    heap = rows_by_name(live.ctl("tensors", "ls", "--format", "json", "--filter", "kind=heap"))
    assert set(heap) >= {"w", "v"} and all(r["kind"] == "heap" for r in heap.values())
    both = rows_by_name(live.ctl("tensors", "ls", "--format", "json", "--filter", "kind=heap",
                                 "--filter", "owner=alice"))
    assert set(both) == {"v"}
    not_alice = rows_by_name(live.ctl("tensors", "ls", "--format", "json", "--filter", "owner!=alice"))
    assert "v" not in not_alice and "x" in not_alice
    shaped = rows_by_name(live.ctl("tensors", "ls", "--format", "json", "--filter", "shape=[2, 3]"))
    assert "x" in shaped and "w" not in shaped
    assert set(rows_by_name(live.ctl("tensors", "ls", "--format", "json", "--filter", "shape=3,2"))) == {"w"}
    limited = live.ctl("tensors", "ls", "--format", "json", "--limit", "1")
    assert len(json.loads(limited.stdout)) == 1
    assert "showing 1 of" in limited.stderr


def test_bad_filters_are_one_line(live: Live) -> None:
    assert "expected KEY=VALUE" in one_line_error(live.ctl("tensors", "ls", "--filter", "kind"), code=2)
    msg = one_line_error(live.ctl("tensors", "ls", "--filter", "colour=red"), code=2)
    assert "'colour'" in msg and "known: name, kind" in msg
    one_line_error(live.ctl("ops", "ls", "--filter", "=x"), code=2)


def test_show_json_has_metadata_and_values(live: Live) -> None:
    r = live.ctl("tensors", "show", "v", "--format", "json")
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)
    assert (v["name"], v["kind"], v["dtype"], v["shape"], v["bytes"]) == ("v", "heap", "int32", [4], 16)
    assert (v["owner"], v["refcount"], v["holders"], v["state"]) == ("alice", 1, ["alice"], "live")
    assert v["preview"] == "[ 1 -2  3  4]"
    assert v["stats"] == {"numel": 4, "min": -2.0, "max": 4.0, "mean": 1.5, "nonfinite": 0}


def test_show_table(live: Live) -> None:
    r = live.ctl("tensors", "show", "x")
    assert r.exit_code == 0, r.output
    assert "float32" in r.stdout and "[2, 3]" in r.stdout and "min=0" in r.stdout and "max=5" in r.stdout
    assert "[[0. 1. 2.]\n [3. 4. 5.]]" in r.stdout
    assert "refcount" not in r.stdout  # a stack tensor has none
    r = live.ctl("tensors", "show", "x", "--no-values")
    assert "[[0." not in r.stdout and "values not fetched" in r.stderr


def test_show_unknown_tensor(live: Live) -> None:
    msg = one_line_error(live.ctl("tensors", "show", "no-such-tensor"))
    assert "no tensor named 'no-such-tensor'" in msg


def test_rm_stack_and_heap(live: Live) -> None:
    with live.daemon.client() as c:
        c.put("tmp_stack", np.zeros((8,), np.float64))
        c.put("tmp_heap", np.zeros((4, 4), np.float32), heap=True)
    r = live.ctl("tensors", "rm", "tmp_stack")
    assert r.exit_code == 0 and r.stdout.startswith("deleted stack tensor 'tmp_stack' (64 B)")
    r = live.ctl("tensors", "rm", "tmp_heap", "--format", "json")
    assert json.loads(r.stdout) == {"name": "tmp_heap", "kind": "heap", "bytes": 64, "node": live.node,
                                    "forced": False}
    names = rows_by_name(live.ctl("tensors", "ls", "--format", "json"))
    assert "tmp_stack" not in names and "tmp_heap" not in names
    assert "no tensor named 'tmp_stack'" in one_line_error(live.ctl("tensors", "rm", "tmp_stack"))
    plane = redis.Redis.from_url(live.redis_url)
    assert not plane.exists(f"{live.prefix}tensor:tmp_heap")


def test_rm_refuses_a_heap_tensor_others_hold_unless_forced(live: Live) -> None:
    with live.daemon.client() as c:
        c.put("shared", np.ones((16,), np.float32), heap=True)
    # another process takes a reference through the lifecycle list, as an SDK process does
    plane = redis.Redis.from_url(live.redis_url)
    plane.rpush(f"{live.prefix}tensor_lifecycle", msgpack.packb({"cmd": "get", "name": "shared", "holder": "trainer"}))

    def refs():
        rows = rows_by_name(live.ctl("tensors", "ls", "--format", "json", "--detail", "--filter", "name=shared"))
        return rows["shared"] if rows["shared"]["refcount"] == 2 else None

    row = wait_for(refs, what="the second reference")
    assert row["holders"] == ["op-cpu", "trainer"]
    msg = one_line_error(live.ctl("tensors", "rm", "shared"))
    assert "still referenced 2 times" in msg and "op-cpu, trainer" in msg and "force" in msg
    assert "shared" in rows_by_name(live.ctl("tensors", "ls", "--format", "json"))
    r = live.ctl("tensors", "rm", "shared", "--force")
    assert r.exit_code == 0, r.output
    assert "(forced)" in r.stdout
    assert "shared" not in rows_by_name(live.ctl("tensors", "ls", "--format", "json"))
    with live.daemon.client() as c:  # the name is free again, and a new tensor does not see the old bytes
        c.put("shared", np.full((16,), 7, np.float32), heap=True)
        assert (c.fetch("shared")["shared"] == 7).all()
    assert live.ctl("tensors", "rm", "shared").exit_code == 0
