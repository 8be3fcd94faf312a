"""Which tensor is which (issue 27, item 3), as the SDK tells it: each tensor's owning session (client name, pid,
host), a parameter's module path and the line that made it, from real SDK clients of a real deepxd, and of an
embedded one (tests/daemon/test_owners.py: the same over the bare native protocol).

Run as a script, this file is one client process: `python test_owners.py ADDRESS NAME` makes a model and a batch on
the daemon at ADDRESS, prints what it made, and keeps its session open until a line comes on its stdin. Its call
sites are lines of this file, marked `# made: ...`.
"""

from __future__ import annotations

import copy
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


def line_of(marker: str) -> int:
    """The line of this file that ends with `# made: <marker>`."""
    lines = HERE.read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.endswith(f"# made: {marker}"))


def client(address: str, name: str) -> None:
    """One client process: a model (two levels of modules) and a batch, a forward pass, then its report on stdout;
    its session stays open until a line comes on stdin."""
    import deepx_sdk as dx
    from deepx_sdk import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU())  # made: encoder
            self.head = nn.Linear(8, 2)  # made: head

        def forward(self, x: Any) -> Any:
            return self.head(self.encoder(x))

    s = dx.connect(address, name=name or None)
    model = Net()
    x = dx.tensor(np.ones((3, 4), np.float32))  # made: batch
    model(x).sum().item()
    print(json.dumps({"pid": os.getpid(), "prefix": s.names.prefix, "x": x.name,
                      "params": {path: p.name for path, p in model.named_parameters()}}), flush=True)
    sys.stdin.readline()
    dx.disconnect()


if __name__ == "__main__":
    client(sys.argv[1], sys.argv[2])
    sys.exit(0)


import pytest  # noqa: E402  (the tests' imports: the client process above needs none of them)
import redis  # noqa: E402

from deepx_core.identity import this_process  # noqa: E402
from tests.daemon.conftest import Daemon  # noqa: E402
from tests.deepxctl.conftest import ctl  # noqa: E402

HOST = this_process()["host"]


class Clients:
    def __init__(self, daemon: Daemon, reports: dict[str, dict[str, Any]], redis_url: str, prefix: str) -> None:
        self.daemon = daemon
        self.reports = reports  # the owner deepxctl should show -> what that client made
        self.redis_url = redis_url
        self.prefix = prefix

    def ls(self, *args: str, kv: bool = False) -> Any:
        where = ["--kv", self.redis_url, "--kv-prefix", self.prefix] if kv else ["--address", self.daemon.address]
        r = ctl(*where, "tensors", "ls", "--format", "json", "--limit", "1000", *args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[Clients]:
    """A deepxd on Redis and two client processes of this file: one named by its program (test_owners.py), one
    that names itself bob."""
    tmp = tmp_path_factory.mktemp("owners")
    prefix = f"own{uuid.uuid4().hex[:8]}:"
    d = Daemon(tmp, kv=redis_server.url, env={"DEEPX_KV_PREFIX": prefix}, udp=False).start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DEEPX_CALLSITES": "0"}
    procs = []
    try:
        for name in ("", "bob"):
            procs.append(subprocess.Popen([sys.executable, str(HERE), d.address, name], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=open(tmp / f"client{name}.log", "w"),
                                          text=True, env=env, cwd=tmp))
        reports = {}
        for name, p in zip(("test_owners.py", "bob"), procs):
            line = p.stdout.readline() if p.stdout else ""
            assert line, (tmp / f"client{'' if name != 'bob' else 'bob'}.log").read_text()
            report = json.loads(line)
            reports[f"{name}[{report['pid']}]@{HOST}"] = report
        yield Clients(d, reports, redis_server.url, prefix)
    finally:
        for p in procs:
            if p.poll() is None and p.stdin is not None:
                p.stdin.write("\n")
                p.stdin.flush()
            p.wait(60)
        assert d.stop() == 0, d.output()


def test_each_tensor_shows_the_session_that_made_it(clients: Clients) -> None:
    rows = clients.ls("--detail")
    for owner, report in clients.reports.items():
        mine = [r for r in rows if r["name"].startswith(report["prefix"])]
        # its parameters (heap), its batch (put) and its activations (stack, made by its programs)
        assert {r["kind"] for r in mine} == {"heap", "stack"} and len(mine) > 6
        assert {(r["owner"], r["client"], r["pid"], r["host"]) for r in mine} == {
            (owner, owner.split("[")[0], report["pid"], HOST)}
    assert len({r["pid"] for r in rows}) == 2


def test_parameters_show_their_module_paths(clients: Clients) -> None:
    rows = {r["name"]: r for r in clients.ls()}
    for report in clients.reports.values():
        assert sorted(report["params"]) == ["encoder.0.bias", "encoder.0.weight", "head.bias", "head.weight"]
        for path, name in report["params"].items():
            assert rows[name]["parameter"] == path
        assert rows[report["x"]]["parameter"] == ""  # data, not a parameter


def test_call_sites_point_to_the_line_that_made_them(clients: Clients) -> None:
    rows = {r["name"]: r for r in clients.ls()}
    for report in clients.reports.values():
        for path, name in report["params"].items():
            assert rows[name]["call_site"] == f"{HERE}:{line_of(path.split('.')[0])}", rows[name]
        assert rows[report["x"]]["call_site"] == f"{HERE}:{line_of('batch')}"
        activations = [r for r in rows.values() if r["name"].startswith(report["prefix"]) and r["kind"] == "stack"
                       and r["name"] != report["x"]]
        # every tensor's line needs DEEPX_CALLSITES=1 (test_the_embedded_daemon_shows_the_same)
        assert activations and all(r["call_site"] == "" for r in activations)


def test_group_by_owner_groups_by_session(clients: Clients) -> None:
    groups = clients.ls("--group-by", "owner")
    rows = clients.ls()
    by_owner = {g["owner"]: g for g in groups}
    for owner, report in clients.reports.items():
        mine = [r["name"] for r in rows if r["name"].startswith(report["prefix"])]
        assert [r["name"] for r in by_owner[owner]["rows"]] == mine
        assert by_owner[owner]["tensors"] == len(mine)
    table = ctl("--address", clients.daemon.address, "tensors", "ls", "--group-by", "owner").stdout
    for owner in clients.reports:
        assert f"owner {owner}: " in table


def test_the_plane_records_them_for_other_nodes_and_kv(clients: Clients) -> None:
    """A heap tensor's record in the storage plane carries its session and labels: `--kv` shows them with no daemon
    asked, as another node's listing does."""
    plane = redis.Redis.from_url(clients.redis_url, decode_responses=True)
    from_kv = {r["name"]: r for r in clients.ls("--detail", kv=True)}
    for owner, report in clients.reports.items():
        name = report["params"]["head.weight"]
        record = plane.hgetall(f"{clients.prefix}tensor:{name}")
        assert (record["session"], record["pid"], record["parameter"]) == (owner, str(report["pid"]), "head.weight")
        assert record["call_site"] == f"{HERE}:{line_of('head')}"
        row = from_kv[name]
        assert (row["owner"], row["pid"], row["host"], row["parameter"]) == (owner, report["pid"], HOST,
                                                                             "head.weight")
        assert report["x"] not in from_kv  # a stack tensor: only its daemon knows it


def test_the_table_has_the_columns(clients: Clients) -> None:
    out = ctl("--address", clients.daemon.address, "tensors", "ls").stdout  # a pipe: 240 columns
    assert out.splitlines()[0].split()[5:] == ["OWNER", "PARAMETER", "CALL", "SITE", "NODE"]
    owner, report = next(iter(clients.reports.items()))
    row = next(line for line in out.splitlines() if line.startswith(report["params"]["encoder.0.weight"] + " "))
    assert row.split()[-4:] == [owner, "encoder.0.weight", f"{HERE}:{line_of('encoder')}", clients.daemon.node_id]


def test_the_embedded_daemon_shows_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: the session is this process, its parameters have their paths and lines; a training loop sends
    labels at its first step only."""
    import deepx_sdk as dx
    from deepx_sdk import nn

    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_CALLSITES", raising=False)
    s = dx.connect(name="embedded-test")
    try:
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))  # made: embedded model
        opt = dx.optim.SGD(model.parameters(), lr=0.1)
        x = dx.tensor(np.ones((5, 4), np.float32))  # made: embedded batch
        sent = []
        for _ in range(4):
            opt.zero_grad()
            y = model(x) * 2.0
            loss = (y * y).mean()
            loss.backward()
            opt.step()
            loss.item()
            sent.append(s.labels.requests)
        assert sent[0] >= 1 and sent[1:] == [sent[0]] * 3, sent  # nothing sent after the first step
        rows = embedded_rows(s)
        owner = f"embedded-test[{os.getpid()}]@{HOST}"
        params = dict(model.named_parameters())
        assert {path: rows[p.name]["parameter"] for path, p in params.items()} == {path: path for path in params}
        assert {rows[p.name]["call_site"] for p in params.values()} == {f"{HERE}:{line_of('embedded model')}"}
        assert rows[x.name]["call_site"] == f"{HERE}:{line_of('embedded batch')}"
        assert rows[y.name]["call_site"] == ""  # a result's: DEEPX_CALLSITES=1 (below)
        assert {(t["owner"], t["pid"], t["client"]) for t in rows.values()} == {(owner, os.getpid(), "embedded-test")}
        groups = json.loads(ctl("--address", s.transport.address, "tensors", "ls", "--group-by", "owner",
                                "--format", "json").stdout)
        assert [(g["owner"], g["tensors"]) for g in groups] == [(owner, len(rows))]

        twin = copy.deepcopy(model)  # made: twin
        twin(x).sum().item()  # a copy's parameters are other tensors, labelled at its first call
        half = copy.deepcopy(model)
        half.half()  # made: half
        half(x.half()).sum().item()  # new tensors of the same parameters
        rows = embedded_rows(s)
        for m, marker in ((twin, "twin"), (half, "half")):
            assert {path: (rows[p.name]["parameter"], rows[p.name]["call_site"])
                    for path, p in m.named_parameters()} == {path: (path, f"{HERE}:{line_of(marker)}")
                                                             for path in params}
    finally:
        dx.disconnect()


def test_a_compiled_steps_temporaries_are_its_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored graph's temporaries are named under the graph (`step-<key>.t6`), not the session's prefix: the session
    that stored it owns them."""
    import deepx_sdk as dx
    from deepx_sdk import nn

    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    s = dx.connect(name="compiled")
    try:
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        opt = dx.optim.SGD(model.parameters(), lr=0.1)

        @dx.compile
        def step(x: Any) -> Any:
            opt.zero_grad()
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            return loss

        x = dx.tensor(np.ones((5, 4), np.float32))
        for _ in range(3):
            step(x).item()
        rows = embedded_rows(s)
        graph = [r for r in rows.values() if not r["name"].startswith(s.names.prefix)]  # `<qualname>-<key>.t6`
        assert graph and {r["owner"] for r in rows.values()} == {f"compiled[{os.getpid()}]@{HOST}"}
    finally:
        dx.disconnect()


def test_callsites_on_gives_every_tensor_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepx_sdk as dx

    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.setenv("DEEPX_CALLSITES", "1")
    s = dx.connect()
    try:
        x = dx.tensor(np.arange(6, dtype=np.float32))  # made: callsites x
        y = (x * 2.0).exp()  # made: callsites y
        z = y.sum()  # made: callsites z
        z.item()
        s.recorder.send_labels()  # (results' lines go at most once a second: now, for the listing)
        rows = embedded_rows(s)
        for t, marker in ((x, "x"), (y, "y"), (z, "z")):
            assert rows[t.name]["call_site"] == f"{HERE}:{line_of(f'callsites {marker}')}", rows[t.name]
        assert rows[z.name]["owner"] == f"{this_process()['name']}[{os.getpid()}]@{HOST}"  # the program's name
    finally:
        dx.disconnect()


def embedded_rows(s: Any) -> dict[str, dict[str, Any]]:
    """`deepxctl tensors ls` of an embedded session's daemon (on its private socket), by name."""
    r = ctl("--address", s.transport.address, "tensors", "ls", "--format", "json", "--detail")
    assert r.exit_code == 0, r.output
    return {t["name"]: t for t in json.loads(r.stdout)}
