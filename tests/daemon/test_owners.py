"""Who made each tensor (deepxd/owners.py), told by real client processes over the native protocol: the session its
`hello` names, the tensors it put, made by program, or named under the prefix it gave, and the labels it sent.

Run as a script, this file is one client process: `python test_owners.py ADDRESS NAME PREFIX` puts a heap and a
stack tensor, runs a program that makes a third, labels the heap tensor, prints what it made and waits for a line on
its stdin. PREFIX "1": it gives the daemon its tensors' prefix first (as the SDK does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]


def client(address: str, name: str, prefixed: bool) -> None:
    from deepx_core.client import NativeClient
    from deepx_core.ir import parse_text

    tag = f"p{os.getpid()}_"
    with NativeClient(address, name=name or None) as c:
        if prefixed:
            c.request("label", prefix=tag)
        c.put(f"{tag}w", np.ones((2, 3), np.float32), heap=True)
        c.put(f"{tag}x", np.ones(3, np.float32))
        c.run(parse_text(f"mulscalar (tensor:{tag}x, var:2) -> (tensor:{tag}y)")).raise_for_error()
        c.request("label", tensors={f"{tag}w": {"parameter": "0.weight", "call_site": "train.py:3"}})
        print(json.dumps({"pid": os.getpid(), "tag": tag}), flush=True)
        sys.stdin.readline()


if __name__ == "__main__":
    client(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
    sys.exit(0)


import pytest  # noqa: E402  (the tests' imports: the client process above needs none of them)
import redis  # noqa: E402

from deepx_core.identity import this_process  # noqa: E402
from tests.daemon.conftest import Daemon  # noqa: E402
from tests.deepxctl.conftest import ctl  # noqa: E402

HOST = this_process()["host"]


@pytest.fixture(scope="module")
def two_clients(tmp_path_factory: pytest.TempPathFactory,
                redis_server: Any) -> Iterator[tuple[Daemon, dict[str, dict[str, Any]], str, str]]:
    """A deepxd on Redis and two client processes: one named by its program (test_owners.py) that gives no prefix,
    one that calls itself bob and gives one."""
    tmp = tmp_path_factory.mktemp("owners")
    prefix = f"own{uuid.uuid4().hex[:8]}:"
    d = Daemon(tmp, kv=redis_server.url, env={"DEEPX_KV_PREFIX": prefix}, udp=False).start()
    procs = []
    try:
        for name, prefixed in (("", "0"), ("bob", "1")):
            procs.append(subprocess.Popen([sys.executable, str(HERE), d.address, name, prefixed],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)}))
        reports = {}
        for name, p in zip(("test_owners.py", "bob"), procs):
            assert p.stdout is not None
            report = json.loads(p.stdout.readline())
            reports[f"{name}[{report['pid']}]@{HOST}"] = report
        yield d, reports, redis_server.url, prefix
    finally:
        for p in procs:
            if p.poll() is None and p.stdin is not None:
                p.stdin.write("\n")
                p.stdin.flush()
            p.wait(60)
        assert d.stop() == 0, d.output()


def ls(d: Daemon, *args: str) -> Any:
    r = ctl("--address", d.address, "tensors", "ls", "--format", "json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_each_clients_tensors_show_its_session(two_clients: Any) -> None:
    d, reports, _, _ = two_clients
    rows = {r["name"]: r for r in ls(d, "--detail")}
    for owner, report in reports.items():
        tag = report["tag"]
        for name in ("w", "x", "y"):  # put heap, put stack, made by its program
            r = rows[f"{tag}{name}"]
            assert (r["owner"], r["client"], r["pid"], r["host"]) == (owner, owner.split("[")[0], report["pid"],
                                                                       HOST), r
        assert (rows[f"{tag}w"]["parameter"], rows[f"{tag}w"]["call_site"]) == ("0.weight", "train.py:3")
        assert (rows[f"{tag}x"]["parameter"], rows[f"{tag}x"]["call_site"]) == ("", "")


def test_group_by_owner_groups_by_session(two_clients: Any) -> None:
    d, reports, _, _ = two_clients
    groups = {g["owner"]: g for g in ls(d, "--group-by", "owner")}
    for owner, report in reports.items():
        assert [r["name"] for r in groups[owner]["rows"]] == [f"{report['tag']}{n}" for n in ("w", "x", "y")]


def test_a_heap_tensors_plane_record_carries_its_session_and_labels(two_clients: Any) -> None:
    _, reports, url, prefix = two_clients
    plane = redis.Redis.from_url(url, decode_responses=True)
    for owner, report in reports.items():
        record = plane.hgetall(f"{prefix}tensor:{report['tag']}w")
        assert {k: record.get(k) for k in ("session", "client", "pid", "host", "parameter", "call_site")} == {
            "session": owner, "client": owner.split("[")[0], "pid": str(report["pid"]), "host": HOST,
            "parameter": "0.weight", "call_site": "train.py:3"}
    r = ctl("--kv", url, "--kv-prefix", prefix, "tensors", "ls", "--format", "json")
    from_kv = {t["name"]: t for t in json.loads(r.stdout)}
    for owner, report in reports.items():
        assert (from_kv[f"{report['tag']}w"]["owner"], from_kv[f"{report['tag']}w"]["parameter"]) == (owner,
                                                                                                     "0.weight")


def test_a_client_that_says_nothing_of_itself_leaves_the_worker_as_owner(two_clients: Any) -> None:
    from deepx_core.client import NativeClient

    d = two_clients[0]
    with NativeClient(d.address, hello=False) as c:
        c.request("hello", version=1, client="old")  # as a client from before hello said who it is
        c.put("anon", np.zeros(2, np.float32))
    rows = {r["name"]: r for r in ls(d, "--detail")}
    assert (rows["anon"]["owner"], rows["anon"]["pid"], rows["anon"]["client"]) == ("op-cpu", None, "")
