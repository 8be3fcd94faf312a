"""tensors ls in natural order of names, and --group-by (issue 27, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from deepxctl.schema import natural_key
from tests.daemon.conftest import Daemon
from tests.deepxctl.conftest import ctl


def test_natural_key_orders_numbers_by_value() -> None:
    names = ["t10", "t2", "t1", "x56145a57_5", "x56145a57_12", "step-t17", "step-t9", "a"]
    assert sorted(names, key=natural_key) == ["a", "step-t9", "step-t17", "t1", "t2", "t10", "x56145a57_5",
                                              "x56145a57_12"]


def test_tensors_ls_natural_order_and_group_by_owner(tmp_path: Path) -> None:
    d = Daemon(tmp_path, udp=False).start()
    try:
        with d.client() as c:
            for name in ("t10", "t2", "t1"):
                c.put(name, np.zeros(4, np.float32), heap=True, owner="alice")
            c.put("w", np.zeros(64, np.float32), heap=True, owner="bob")
        rows = json.loads(ctl("--address", d.address, "tensors", "ls", "--format", "json").stdout)
        assert [r["name"] for r in rows] == ["t1", "t2", "t10", "w"]
        groups = json.loads(ctl("--address", d.address, "tensors", "ls", "--group-by", "owner", "--format",
                                "json").stdout)
        assert [(g["owner"], g["tensors"], g["bytes"]) for g in groups] == [("bob", 1, 256), ("alice", 3, 48)]
        assert [r["name"] for r in groups[1]["rows"]] == ["t1", "t2", "t10"]
        table = ctl("--address", d.address, "tensors", "ls", "--group-by", "owner").stdout
        assert table.index("owner bob: 1 tensors, 256 B") < table.index("owner alice: 3 tensors, 48 B")
        assert table.index("t2 ") < table.index("t10 ")
    finally:
        assert d.stop() == 0, d.output()
