"""What a cluster costs its storage plane: Redis commands per second of idle nodes, by the number of nodes, and
per training step of the MLP on two nodes, counted by the redis-server itself (INFO commandstats).

1. Idle: N deepxd (N = 2, 4, 8 by default), each saying it runs on a host of its own (peer links over TCP with the
   token) and holding 100 small heap tensors, on one redis-server of the benchmark's own: once every node knows
   every other, the commands the plane serves per second, in all and by command, fitted to a + b N + c N^2 (per
   second), and the peer links each node holds open (links open on demand: none while idle; each is pinged once a
   heartbeat); docs/cluster.md takes the fit to 1,000 nodes. Then the same nodes while one of them runs a new
   program every 0.1 s: what placement reads of the plane (the other nodes, their op statistics), over the idle
   rate. At 2 nodes, a small fetch of node 0's tensor from node 1 over a link opened for it (the nodes run with
   peer_idle_s = 2) against the same over the open link.
2. Training: the MLP of bench/ddp.py (784-512-512-10, batch 256 a rank, SGD with momentum) on one rank connected
   to one of two nodes, and under DistributedDataParallel on two ranks, one per node (the ring over the peer
   links): the commands of a run of S1 steps and of one of S2 steps, less the idle rate over each run's time; the
   difference over S2 - S1 is the plane's cost of a step (the group's formation and the start-up cancel out).

    python bench/plane.py [--nodes 2 4 8] [--seconds 10] [--steps 10 40] [--tensors 100] [--no-training]

Prints the tables and writes bench/results/plane.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cluster import ROOT, Running, cluster, linked  # bench/cluster.py, beside this file
from ddp import run_ranks  # bench/ddp.py, beside this file


def counts(r: Any) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, as the server counts them."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def less(a: dict[str, float], b: dict[str, float], scale: float = 1.0) -> dict[str, float]:
    return {k: a.get(k, 0) - scale * b.get(k, 0) for k in set(a) | set(b)}


def client(running: Running) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=running.redis_port)


def all_known(running: Running) -> None:
    """Until every node knows every other runs (LINK none, or a link)."""
    from deepx_core.client import NativeClient

    nodes = list(running.addresses)
    for node in nodes:
        c = NativeClient(running.addresses[node], timeout=60)
        try:
            for other in nodes:
                if other != node:
                    linked(c, f"bench{os.getpid()}{other}")
        finally:
            c.close()


def open_links(running: Running) -> list[int]:
    """The peer links each node holds open now (its `nodes` rows whose LINK is a link, up or down)."""
    from deepx_core.client import NativeClient

    out = []
    for address in running.addresses.values():
        with NativeClient(address, timeout=60) as c:
            out.append(sum(1 for n in c.admin("nodes") if n.get("link") in ("unix", "tcp", "tls", "down")))
    return out


def put_tensors(running: Running, count: int) -> None:
    """`count` small heap tensors on each node: what the nodes' checks of their records read."""
    from deepx_core.client import NativeClient

    for node, address in running.addresses.items():
        c = NativeClient(address, timeout=60)
        try:
            for i in range(count):
                c.put(f"{node}_t{i}", np.zeros(4, np.float32), heap=True)
        finally:
            c.close()


def cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes `pids` have used (/proc/<pid>/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def idle_rate(running: Running, seconds: float) -> tuple[dict[str, float], float]:
    """Commands per second, by command, while the nodes do nothing but keep alive; and the CPU the nodes used, in
    milliseconds per second a node (their pids from their records: the benchmark's own machine)."""
    r = client(running)
    pids = [int(r.hget(key, "pid") or 0) for key in r.keys(f"benchcluster{os.getpid()}:node:*")]
    r.config_resetstat()
    cpu0, start = cpu_s(pids), time.monotonic()
    time.sleep(seconds)
    got = counts(r)
    spent = time.monotonic() - start
    cpu = (cpu_s(pids) - cpu0) / spent / max(1, len(pids)) * 1e3
    return {k: v / spent for k, v in got.items() if k not in ("info", "config|resetstat", "config")}, cpu


def placing_rate(running: Running, seconds: float, idle: dict[str, float]) -> dict[str, float]:
    """Commands per second, by command, less the idle rate, while one node runs a new program every 0.1 s (each a
    new plan, so each asks placement, which reads the other nodes from the plane at most once a heartbeat)."""
    from deepx_core.client import NativeClient
    from deepx_core.ir import parse_text

    r = client(running)
    with NativeClient(next(iter(running.addresses.values())), timeout=60) as c:
        c.put("x", np.ones(4, np.float32))
        r.config_resetstat()
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds:
            c.run(parse_text(f"addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:p{i})"))
            i += 1
            time.sleep(0.1)
        got = counts(r)
        spent = time.monotonic() - start
    rate = {k: v / spent for k, v in got.items() if k not in ("info", "config|resetstat", "config")}
    return {k: v for k, v in less(rate, idle).items() if abs(v) >= 0.05}


def first_request(running: Running, iters: int) -> dict[str, float] | None:
    """A fetch of node 0's small heap tensor from node 1 over a link opened for it (the last one closed after
    peer_idle_s, IDLE_S here) against the same fetch over the open link: seconds, medians. None where the link
    never closes (a tree with a full mesh)."""
    from deepx_core.client import NativeClient

    first, second = list(running.addresses)[:2]
    name, to = f"{first}_t0", f"bench{os.getpid()}{first}"
    cold, warm = [], []
    with NativeClient(running.addresses[second], timeout=60) as c:
        for _ in range(iters):
            deadline = time.monotonic() + float(IDLE_S) + 10
            while next(n["link"] for n in c.admin("nodes") if n["node"] == to) != "none":
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.1)
            for times in (cold, warm):
                start = time.perf_counter()
                c.fetch(name)
                times.append(time.perf_counter() - start)
    return {"cold_s": float(np.median(cold)), "warm_s": float(np.median(warm))}


def training_run(running: Running, kind: str, steps: int, idle: dict[str, float]) -> dict[str, float]:
    """The commands of one training run of `steps` steps (the ranks' start included), less the idle nodes' own."""
    r = client(running)
    addresses = list(running.addresses.values())
    r.config_resetstat()
    start = time.monotonic()
    run_ranks("train", "ring", None, addresses[:1] if kind == "one rank" else addresses, 1, steps)
    spent = time.monotonic() - start
    got = {k: float(v) for k, v in counts(r).items() if k not in ("info", "config|resetstat", "config")}
    return less(got, idle, spent)


def fit(ns: list[int], totals: list[float]) -> list[float]:
    """a, b, c of a + b N + c N^2 (least squares; exact for three node counts); a line where the N^2 term comes out
    below zero (noise about a linear cost)."""
    for degree in range(min(2, len(ns) - 1), 0, -1):
        coeffs = [float(x) for x in np.polyfit(np.array(ns, float), np.array(totals, float), degree)[::-1]]
        if coeffs[-1] >= 0 or degree == 1:
            return coeffs + [0.0] * (2 - degree)
    raise SystemExit("fit: give at least two node counts")


#: peer_idle_s of the benchmark's nodes: short, so that first_request finds its link closed soon (idle nodes have
#: none whatever it is)
IDLE_S = "2"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DEEPX_PEER_IDLE_S", IDLE_S)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seconds", type=float, default=10.0, help="how long each idle count runs")
    ap.add_argument("--steps", type=int, nargs=2, default=[10, 40], metavar=("S1", "S2"))
    ap.add_argument("--tensors", type=int, default=100, help="heap tensors put on each node before the idle count")
    ap.add_argument("--no-training", action="store_true", help="only the idle counts")
    opts = ap.parse_args()
    s1, s2 = opts.steps
    if not 0 < s1 < s2:
        raise SystemExit(f"--steps: give two step counts, the first smaller ({s1} {s2})")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "idle": {}, "links": {}, "training": {}}
    for n in opts.nodes:
        layout = tuple((f"n{i}", f"bench-host-{i}", "cost") for i in range(n))
        with tempfile.TemporaryDirectory(prefix="deepx-bench-plane-") as tmp, cluster(Path(tmp), layout) as running:
            all_known(running)
            put_tensors(running, opts.tensors)
            time.sleep(2 * 2.0)  # two heartbeats (heartbeat_s = 2): every node's watch has seen every other
            idle, cpu = idle_rate(running, opts.seconds)
            links = open_links(running)
            results["idle"][n] = idle
            results["links"][n] = links
            results.setdefault("cpu_ms_per_s", {})[n] = cpu
            placing = placing_rate(running, opts.seconds, idle)
            results.setdefault("placing", {})[n] = placing
            print(f"{n} nodes, idle: {sum(idle.values()):8.1f} commands/s ({sum(idle.values()) / n:.1f} a node), "
                  f"links a node {sum(links) / n:.1f} (max {max(links)}), CPU a node {cpu:.2f} ms/s: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(idle.items(), key=lambda kv: -kv[1])), flush=True)
            print(f"{n} nodes, one placing new plans: {sum(placing.values()):8.1f} commands/s more: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(placing.items(), key=lambda kv: -kv[1])), flush=True)
            if n == 2:
                cold = first_request(running, 7)
                results["first_request"] = cold
                print("a fetch of a small tensor of another node: " + (
                    f"over a link opened for it {cold['cold_s'] * 1e3:.2f} ms, over the open link "
                    f"{cold['warm_s'] * 1e3:.2f} ms ({cold['cold_s'] / cold['warm_s']:.2f}x)" if cold
                    else "links never close here (a full mesh)"), flush=True)
            if n == 2 and not opts.no_training:
                for kind in ("one rank", "two ranks (DDP, ring)"):
                    short, long = (training_run(running, kind, s, idle) for s in (s1, s2))
                    per_step = {k: v / (s2 - s1) for k, v in less(long, short).items()}
                    results["training"][kind] = {"per_step": per_step, "run_of_s1": short}
                    print(f"MLP, {kind}: {sum(per_step.values()):6.1f} commands per step ("
                          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])
                                      if abs(v) >= 0.05)
                          + f"); a run of {s1} steps with its start: {sum(short.values()):.0f}", flush=True)
    ns = sorted(results["idle"])
    if len(ns) >= 2:
        a, b, c = fit(ns, [sum(results["idle"][n].values()) for n in ns])
        results["fit"] = {"a": a, "b": b, "c": c}
        print(f"idle commands/s ~ {a:.2f} + {b:.2f} N + {c:.3f} N^2: 100 nodes {a + 100 * b + 1e4 * c:,.0f}/s, "
              f"1,000 nodes {a + 1e3 * b + 1e6 * c:,.0f}/s")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "plane.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
