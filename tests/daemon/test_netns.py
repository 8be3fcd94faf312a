"""Nodes on two "hosts" (issue 23, items 3 and 4): one deepxd runs in a network namespace joined to this one by a
veth pair, with a host name and a /dev/shm of its own (so it can neither reach the other's Unix socket as a peer nor
map its segments: it is another host in all that deepx can tell), both on one redis-server that listens on both
sides. Heap tensors cross over TCP with the token; a node killed with -9 is found dead by the others, whose programs
naming its tensors fail with a clear error while everything else goes on. Skipped, saying why, where `ip netns` is
not permitted (not root, no iproute2, a container without CAP_SYS_ADMIN)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deepx_core.ir import parse_text
from tests.conftest import RedisServer, answers_ping, free_port
from tests.daemon.conftest import DEEPXCTL, Daemon, eventually
from tests.daemon.test_cluster import Cluster
from tests.daemon.test_tcp import TOKEN, token_file

#: heartbeats every half second, and a node dead after 4 s of silence
QUICK = {"DEEPX_HEARTBEAT_S": "0.5", "DEEPX_PEER_TIMEOUT_S": "4"}
OTHER_HOST = "deepx-other-host"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class Netns:
    """Network namespace `name`, joined to this one by a veth pair: this side `host_ip`, the namespace's `ns_ip`."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"deepx-{tag}"
        self.outside, self.inside = f"dxa{tag}", f"dxb{tag}"  # (interface names: 15 characters at most)
        net = f"10.{random.randint(64, 250)}.{random.randint(0, 255)}"
        self.host_ip, self.ns_ip = f"{net}.1", f"{net}.2"
        self.made = False

    def create(self) -> None:
        add = _ip("netns", "add", self.name)
        if add.returncode != 0:
            pytest.skip(f"ip netns is not permitted here: {add.stderr.strip()}")
        self.made = True
        for args in (("link", "add", self.outside, "type", "veth", "peer", "name", self.inside),
                     ("link", "set", self.inside, "netns", self.name),
                     ("addr", "add", f"{self.host_ip}/24", "dev", self.outside),
                     ("link", "set", self.outside, "up"),
                     ("netns", "exec", self.name, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.inside),
                     ("netns", "exec", self.name, "ip", "link", "set", self.inside, "up"),
                     ("netns", "exec", self.name, "ip", "link", "set", "lo", "up")):
            done = _ip(*args)
            if done.returncode != 0:
                pytest.skip(f"ip {' '.join(args)}: {done.stderr.strip()}")
        probe = subprocess.run(self.wrap(["true"]), capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            pytest.skip(f"a process in the namespace cannot have a host name and a /dev/shm of its own: "
                        f"{probe.stderr.strip()}")

    def wrap(self, command: list[str]) -> list[str]:
        """`command` run inside the namespace, as host OTHER_HOST, with a /dev/shm of its own."""
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", 'hostname "$0" && mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"',
                OTHER_HOST, *command]

    def remove(self) -> None:
        """Every process left in the namespace killed, the namespace and the veth pair removed."""
        if not self.made:
            return
        for pid in _ip("netns", "pids", self.name).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", self.name)
        _ip("link", "del", self.outside)  # (gone with its peer already, as a rule)


class SharedRedis(RedisServer):
    """A redis-server on loopback and on `also` (the veth address the namespace reaches)."""

    def __init__(self, workdir: Path, also: str) -> None:
        super().__init__(workdir)
        self.also = also

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", self.also, "--protected-mode", "no",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir), "--logfile",
             str(self.workdir / "redis.log")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually(lambda: answers_ping(self.port), timeout=10, what="redis-server up")


class TwoHosts:
    """Nodes on this host (`here`) and in the namespace (`there`), on one Redis, with one token."""

    def __init__(self, tmp: Path, ns: Netns, redis: SharedRedis) -> None:
        self.tmp, self.ns, self.redis = tmp, ns, redis
        self.cluster = Cluster(tmp, redis.url)
        self.token = token_file(tmp, TOKEN)

    def _start(self, n: int, kv: str, ip: str, wrap: Callable[[list[str]], list[str]] | None,
               env: dict[str, str] | None) -> Daemon:
        folder = self.tmp / f"n{n}"
        folder.mkdir(exist_ok=True)
        c = self.cluster
        d = Daemon(folder, kv=kv, node_id=f"{c.tag}n{n}", udp=False,
                   env={"DEEPX_KV_PREFIX": c.prefix, **QUICK, **(env or {})},
                   extra=["--listen", f"tcp://{ip}:{free_port()}", "--token-file", str(self.token)])
        if wrap is not None:
            d.args = wrap(d.args)
        c.daemons[d.node_id] = d
        return d.start()

    def here(self, n: int, env: dict[str, str] | None = None) -> Daemon:
        return self._start(n, self.redis.url, self.ns.host_ip, None, env)

    def there(self, n: int, env: dict[str, str] | None = None) -> Daemon:
        return self._start(n, f"redis://{self.ns.host_ip}:{self.redis.port}/0", self.ns.ns_ip, self.ns.wrap, env)


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs iproute2's ip and util-linux's unshare")
    ns = Netns()
    redis: SharedRedis | None = None
    hosts: TwoHosts | None = None
    try:
        ns.create()
        redis = SharedRedis(tmp_path / "redis", ns.host_ip)
        redis.start()
        hosts = TwoHosts(tmp_path, ns, redis)
        yield hosts
    finally:
        if hosts is not None:
            hosts.cluster.stop()
        if redis is not None:
            redis.stop()
        ns.remove()


def nodes(d: Daemon) -> dict[str, dict[str, Any]]:
    with d.client() as c:
        return {n["node"]: n for n in c.admin("nodes")}


def deepxctl(d: Daemon, *args: str) -> Any:
    done = subprocess.run([*DEEPXCTL, "--address", d.address, *args, "--format", "json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_heap_tensors_cross_between_hosts_over_tcp(two_hosts: TwoHosts) -> None:
    a, b = two_hosts.here(1), two_hosts.there(2)
    w = np.random.default_rng(1).standard_normal((700, 1000)).astype(np.float32)  # 2.8 MB
    program = parse_text("mulscalar (tensor<float32>:wa, var<float32>:2.0) -> (tensor<float32>:doubled)")
    with a.client() as ca, b.client() as cb:
        assert cb.server["node"] == b.node_id
        ca.put("wa", w, heap=True)
        np.testing.assert_array_equal(cb.run(program, fetch=["doubled"]).raise_for_error().tensors["doubled"], w * 2)
        np.testing.assert_array_equal(cb.fetch("wa")["wa"], w)
        cb.put("wb", np.arange(5, dtype=np.int32), heap=True)
        r = ca.run(parse_text("addscalar (tensor<int32>:wb, var<int32>:10) -> (tensor<int32>:o)"), fetch=["o"])
        np.testing.assert_array_equal(r.raise_for_error().tensors["o"], np.arange(5) + 10)
        bad = cb.run(parse_text("mulscalar (tensor<float32>:wa, var<float32>:2.0) -> (tensor<float32>:wa)"))
        assert not bad.ok and f"tensor 'wa' is a heap tensor of node {a.node_id}, on another host" in bad.error
        np.testing.assert_array_equal(ca.fetch("wa")["wa"], w)  # unchanged

    shown = deepxctl(b, "tensors", "show", "wa")  # deepxctl on b, of a's tensor: values streamed to b
    assert (shown["node"], shown["shape"], shown["stats"]["numel"]) == (a.node_id, [700, 1000], w.size)
    assert shown["stats"]["max"] == pytest.approx(float(w.max()))
    row = eventually(lambda: (n := nodes(b)[a.node_id])["link"] == "tcp" and n, what="b linked to a over TCP")
    assert row["state"] == "running" and row["host"] != OTHER_HOST
    assert row["addresses"]["tcp"] == f"tcp://{two_hosts.ns.host_ip}:{row['addresses']['tcp'].rsplit(':', 1)[1]}"
    assert nodes(a)[b.node_id]["host"] == OTHER_HOST
    removed = deepxctl(b, "tensors", "rm", "wa")
    assert (removed["name"], removed["node"]) == ("wa", a.node_id)
    assert not two_hosts.cluster.r.exists(two_hosts.cluster.key("tensor:wa"))
    for d in (b, a):
        assert d.stop() == 0, d.output()


def test_a_node_killed_with_9_is_found_dead_and_the_others_go_on(two_hosts: TwoHosts) -> None:
    a, c, b = two_hosts.here(1), two_hosts.here(3), two_hosts.there(2)
    with a.client() as ca, b.client() as cb, c.client() as cc:
        cb.put("wb", np.ones(3, np.float32), heap=True)
        ca.put("wa", np.full(3, 2, np.float32), heap=True)
        cc.put("wc", np.full(3, 5, np.float32), heap=True)
        uses_b = parse_text("addscalar (tensor<float32>:wb, var<float32>:1.0) -> (tensor<float32>:o)")
        np.testing.assert_array_equal(ca.run(uses_b, fetch=["o"]).raise_for_error().tensors["o"], [2, 2, 2])
    assert b.proc is not None
    b.proc.kill()  # kill -9 of the node on the other host
    b.proc.wait()
    with a.client() as ca, c.client() as cc:
        at_once = ca.run(uses_b)  # its listener is gone: refused at once, before it is found dead
        assert not at_once.ok and "'wb'" in at_once.error and b.node_id in at_once.error, at_once.error
        for d in (a, c):
            eventually(lambda d=d: nodes(d)[b.node_id]["state"] == "dead", what=f"{d.node_id} found b dead")  # type: ignore[misc]
        dead = ca.run(uses_b)
        assert f"tensor 'wb' is a heap tensor of node {b.node_id}, which is dead" in dead.error, dead.error
        assert {t["name"]: t["state"] for t in cc.admin("tensors")}["wb"] == "unreachable"
        # the others go on: their own tensors, and each other's on this host
        r = ca.run(parse_text("add (tensor<float32>:wa, tensor<float32>:wc) -> (tensor<float32>:s)"), fetch=["s"])
        np.testing.assert_array_equal(r.raise_for_error().tensors["s"], [7, 7, 7])
        np.testing.assert_array_equal(cc.fetch("wa")["wa"], [2, 2, 2])

    b = two_hosts.there(2)  # started again: it rejoins, its heap tensors lost with its memory
    eventually(lambda: nodes(a)[b.node_id]["state"] == "running", what="a sees b again")
    with a.client() as ca, b.client() as cb:
        lost = ca.run(uses_b)
        assert f"tensor 'wb' is a heap tensor of node {b.node_id}, lost there" in lost.error, lost.error
        cb.put("wb", np.full(3, 9, np.float32), heap=True)
        np.testing.assert_array_equal(ca.run(uses_b, fetch=["o"]).raise_for_error().tensors["o"], [10, 10, 10])
    for d in (b, c, a):
        assert d.stop() == 0, d.output()


def test_a_link_cut_and_restored(two_hosts: TwoHosts) -> None:
    """The veth pair down: the node on the other host falls silent (its link, and its heartbeat, which no longer
    reaches Redis) and is found dead; up again, it is alive again and its tensors are read as before."""
    a, b = two_hosts.here(1), two_hosts.there(2)
    uses_b = parse_text("mulscalar (tensor<float32>:wb, var<float32>:3.0) -> (tensor<float32>:o)")
    with a.client() as ca, b.client() as cb:
        cb.put("wb", np.arange(4, dtype=np.float32), heap=True)
        np.testing.assert_array_equal(ca.run(uses_b, fetch=["o"]).raise_for_error().tensors["o"], [0, 3, 6, 9])
    eventually(lambda: nodes(a)[b.node_id]["link"] == "tcp", what="a linked to b")
    assert _ip("link", "set", two_hosts.ns.outside, "down").returncode == 0
    try:
        eventually(lambda: (n := nodes(a)[b.node_id])["state"] == "dead" and n["link"] == "down",
                   what="a found b dead, its link down")
        with a.client() as ca:
            cut = ca.run(uses_b)
            assert not cut.ok and "'wb'" in cut.error and b.node_id in cut.error, cut.error
            ca.put("still", np.ones(2, np.float32))  # a goes on
    finally:
        assert _ip("link", "set", two_hosts.ns.outside, "up").returncode == 0
    eventually(lambda: (n := nodes(a)[b.node_id])["state"] == "running" and n["link"] == "tcp", timeout=90,
               what="b alive again for a")
    with a.client() as ca:
        np.testing.assert_array_equal(ca.run(uses_b, fetch=["o"]).raise_for_error().tensors["o"], [0, 3, 6, 9])
    for d in (b, a):
        assert d.stop() == 0, d.output()


def test_a_program_on_b_reading_a_large_tensor_of_a_runs_where_it_lies(two_hosts: TwoHosts) -> None:
    """Programs across nodes (issue 23, item 5): a sum of a's 16 MiB heap tensor sent to b in the namespace runs on
    a's host (on a, or on c, which maps a's segment: the link with the shorter round trip), and only the sum
    crosses back over the veth pair; sent to c, it runs on c over a's segment, mapped (nothing moves); the values
    are the same."""
    a, c, b = two_hosts.here(1), two_hosts.here(3), two_hosts.there(2)
    w = np.random.default_rng(3).standard_normal((2048, 2048)).astype(np.float32)
    program = parse_text("sum (tensor<float32>:w, vector<int32>:[0 1], var<bool>:false) -> (tensor<float32>:s)")
    with a.client() as ca, b.client() as cb, c.client() as cc:
        ca.put("w", w, heap=True)
        eventually(lambda: nodes(b)[a.node_id]["link"] in ("none", "tcp"), what="b knows a")
        eventually(lambda: nodes(c)[a.node_id]["link"] in ("none", "unix"), what="c knows a")
        there = cb.run(program, fetch=["s"]).raise_for_error()
        assert there.placement is not None
        (row,) = there.placement["instructions"]
        assert row["node"] in (a.node_id, c.node_id) and row["worker"] == "op-cpu" and not row["moved"], row
        assert there.placement["bytes"] == 4
        same = cc.run(program, fetch=["s"]).raise_for_error()
        assert same.placement is None  # mapped: run on c, as on one node
        want = float(w.sum(dtype=np.float64))
        assert float(there.tensors["s"]) == pytest.approx(want, rel=1e-4)
        assert float(same.tensors["s"]) == pytest.approx(want, rel=1e-4)
    for d in (b, c, a):
        assert d.stop() == 0, d.output()
