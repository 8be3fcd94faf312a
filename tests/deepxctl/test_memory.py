"""deepxctl memory against a live deepxd."""

from __future__ import annotations

import json

from tests.deepxctl.conftest import Live, one_line_error


def test_memory_json(live: Live) -> None:
    r = live.ctl("memory", "--format", "json")
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    tensors = {t["name"]: t for t in json.loads(live.ctl("tensors", "ls", "--format", "json").stdout)}
    assert m["tensors"] == len(tensors)
    assert m["total_bytes"] == sum(t["bytes"] for t in tensors.values())
    for group in ("by_node", "by_owner", "by_kind"):
        assert sum(u["bytes"] for u in m[group]) == m["total_bytes"]
        assert sum(u["tensors"] for u in m[group]) == m["tensors"]
        assert [set(u) for u in m[group]] == [{"name", "tensors", "bytes"}] * len(m[group])
    assert {u["name"] for u in m["by_node"]} == {live.node}
    alice = next(u for u in m["by_owner"] if u["name"] == "alice")
    assert alice == {"name": "alice", "tensors": 1, "bytes": 16}
    heap = {h["name"]: h for h in m["heap"]}
    assert heap["w"] == {"name": "w", "refcount": 1, "holders": ["op-cpu"], "bytes": 24, "state": "live",
                         "node": live.node}
    assert heap["v"]["holders"] == ["alice"]
    sizes = [t["bytes"] for t in m["largest"]]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) <= 10
    pool = m["heapmem"]
    assert pool["node"] == live.node and pool["tensors"] >= 2 and pool["segment_bytes"] >= 8192


def test_memory_filter_and_limit(live: Live) -> None:
    m = json.loads(live.ctl("memory", "--format", "json", "--filter", "kind=heap", "--limit", "1").stdout)
    assert [u["name"] for u in m["by_kind"]] == ["heap"]
    assert len(m["largest"]) == 1 and m["largest"][0]["kind"] == "heap"
    one_line_error(live.ctl("memory", "--filter", "nope=1"), code=2)


def test_memory_table(live: Live) -> None:
    r = live.ctl("memory")
    assert r.exit_code == 0, r.output
    for title in ("by node", "by owner", "by kind", "largest", "heap tensors: references", "heapmem on"):
        assert title in r.stdout
    assert "REFCOUNT" in r.stdout and "HOLDERS" in r.stdout


def test_memory_lists_orphaned_segments_and_clean_removes_them_also_under_kv(live: Live) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from deepxd.shm import list_segments

    root = Path(__file__).resolve().parents[2]
    made = subprocess.run([sys.executable, "-c", "from deepxd.shm import Segment, segment_name\n"
                           "print(Segment.create(segment_name('ctl-orphan'), 4096).name)"], capture_output=True,
                          text=True, check=True, timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    stray = made.stdout.strip()
    try:
        for kv in (False, True):
            m = json.loads(live.ctl("memory", "--format", "json", "--detail", kv=kv).stdout)
            row = next(o for o in m["orphans"] if o["name"] == stray)
            assert row == {"name": stray, "pid": int(stray.split("-")[-2]), "node": "ctl-orphan", "bytes": 4096,
                           "size": 4096}
            live_handles = {t["handle"] for t in json.loads(live.ctl("tensors", "ls", "--format", "json",
                                                                     "--detail").stdout) if t["kind"] == "heap"}
            assert not live_handles & {o["name"] for o in m["orphans"]}  # the live daemon's: never orphans
        r = live.ctl("memory", "clean", "--filter", f"name={stray}", "--format", "json", kv=True)
        assert r.exit_code == 0, r.output
        assert [o["name"] for o in json.loads(r.stdout)] == [stray] and stray not in list_segments(stray)
        r = live.ctl("memory", "clean", "--filter", f"name={stray}")
        assert r.exit_code == 0 and r.stdout == "" and "no orphaned segments" in r.stderr
        one_line_error(live.ctl("memory", "clean", "--filter", "nope=1"), code=2)
    finally:
        if stray in list_segments(stray):
            os.unlink(f"/dev/shm/{stray}")
