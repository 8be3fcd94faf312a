"""deepxctl caches ls against a live deepxd: every cache of the daemon's process, with its hits."""

from __future__ import annotations

import json

from deepx_core.ir.text import parse_text
from tests.deepxctl.conftest import Live

STEP = parse_text("add (tensor:x, tensor:x) -> (tensor:cache_t)\nmul (tensor:cache_t, tensor:x) -> (tensor:cache_u)\n"
                  "deltensor () -> (tensor:cache_t)")


def test_caches_ls_shows_the_worker_and_scheduler_caches_with_their_hits(live: Live) -> None:
    def rows() -> dict[tuple[str, str], dict]:
        r = live.ctl("caches", "ls", "--format", "json")
        assert r.exit_code == 0, r.output
        return {(c["cache"], c["owner"]): c for c in json.loads(r.stdout)}

    before = rows()
    with live.daemon.client() as c:
        for _ in range(5):
            c.run(STEP).raise_for_error()
    after = rows()
    plans = after["scheduler.plans", "scheduler"]
    assert plans["capacity"] == 256 and 1 <= plans["size"] <= 256
    # the same step five times: the first two planned (the second finds cache_u, which the first made: another
    # state), the next three by the second's plan (each a lookup that hit)
    assert plans["hits"] - before.get(("scheduler.plans", "scheduler"), {"hits": 0})["hits"] >= 3
    assert 0 < plans["hit_rate"] <= 1
    assert ("scheduler.rewrites", "scheduler") in after and ("scheduler.backwards", "scheduler") in after
    assert not any(name.startswith("worker.") for name, _ in after)  # a worker keeps its part on the plan
    unpacked = after["wire.unpacked", ""]  # an interning table: what it made counts, not its lookups
    assert unpacked["hits"] is None and unpacked["hit_rate"] is None and unpacked["misses"] >= 1
    assert all(c["node"] == live.node for c in after.values())
    assert all(0 <= c["size"] <= c["capacity"] for c in after.values())
    owned = json.loads(live.ctl("caches", "ls", "--format", "json", "--filter", "owner!=").stdout)  # docs/deepxctl.md
    assert owned and all(c["owner"] for c in owned) and len(owned) < len(after)
    table = live.ctl("caches", "ls", "--filter", "cache=scheduler.plans").stdout.splitlines()
    assert table[0].split() == ["NODE", "CACHE", "OWNER", "SIZE", "CAPACITY", "HITS", "MISSES", "HIT", "RATE",
                                "EVICTIONS"]
    assert len(table) == 3 and "scheduler" in table[2] and table[2].rstrip().split()[-2].endswith("%")


def test_caches_ls_needs_a_daemon(live: Live) -> None:
    r = live.ctl("caches", "ls", kv=True)
    assert r.exit_code != 0 and "caches ls need a running deepxd" in r.output
