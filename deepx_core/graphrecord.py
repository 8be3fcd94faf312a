"""A stored graph's record: what `dx.compile` captures and the scheduler replays, as msgpack in the plane under
`graph:<name>` (docs/graphs.md):

    {"v": 1, "instrs": [...], "inputs": [[name, dtype, shape], ...], "outputs": [[name, dtype, shape], ...],
     "scalars": [[instruction, arg, key], ...], "state": [name, ...], "signature": str, "returns": spec,
     "source": str}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgpack

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr
from deepx_core.ir.wire import instr_from_obj, instr_to_obj

GRAPH_VERSION = 1
VALID_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\Z")


def check_graph_name(name: Any) -> str:
    if not isinstance(name, str) or not VALID_NAME.match(name):
        raise DeepxError(f"graph name {name!r} is not valid: use 1-200 letters, digits, '_', '.' or '-', not "
                         "starting with '.' or '-'")
    return name


@dataclass
class GraphRecord:
    """A stored graph: its program (graph-private tensor names: `<name>.in<k>`, `<name>.out<k>`, `<name>.t<k>`;
    state tensors such as parameters keep their names) and what a replay binds."""

    name: str
    instrs: list[Instr]
    inputs: list[tuple[str, str, tuple[int, ...]]]  # (graph name, dtype, shape)
    outputs: list[tuple[str, str, tuple[int, ...]]]
    scalars: list[tuple[int, int, str]] = field(default_factory=list)  # (instruction, arg, key) a replay sets
    state: list[str] = field(default_factory=list)  # tensors from outside that the graph reads or updates
    signature: str = ""
    returns: Any = None  # how the outputs make the function's return value (see _spec)
    source: str = ""  # the function's qualified name

    def pack(self) -> bytes:
        return msgpack.packb({
            "v": GRAPH_VERSION, "instrs": [instr_to_obj(i) for i in self.instrs],
            "inputs": [[n, d, list(s)] for n, d, s in self.inputs],
            "outputs": [[n, d, list(s)] for n, d, s in self.outputs],
            "scalars": [list(s) for s in self.scalars], "state": list(self.state), "signature": self.signature,
            "returns": self.returns, "source": self.source}, use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes, name: str) -> GraphRecord:
        """Decode a stored graph; DeepxError naming the graph and the problem when it is not one."""
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise DeepxError(f"graph {name!r}: not msgpack ({why})") from None
        if not isinstance(obj, dict) or obj.get("v") != GRAPH_VERSION or not isinstance(obj.get("instrs"), list):
            raise DeepxError(f"graph {name!r}: expected a map {{'v': {GRAPH_VERSION}, 'instrs': [...], ...}}")
        try:
            instrs = [instr_from_obj(o) for o in obj["instrs"]]

            def metas(key: str) -> list[tuple[str, str, tuple[int, ...]]]:
                return [(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in obj.get(key) or []]

            scalars = [(int(i), int(j), str(k)) for i, j, k in obj.get("scalars") or []]
            rec = cls(name, instrs, metas("inputs"), metas("outputs"), scalars, [str(s) for s in obj.get("state")
                                                                                 or []],
                      str(obj.get("signature", "")), obj.get("returns"), str(obj.get("source", "")))
        except DeepxError as e:
            raise DeepxError(f"graph {name!r}: {e}") from None
        except (TypeError, ValueError) as e:
            raise DeepxError(f"graph {name!r}: malformed record ({e})") from None
        for i, j, k in rec.scalars:
            if not (0 <= i < len(instrs) and 0 <= j < len(instrs[i].args) and instrs[i].args[j].category == "var"):
                raise DeepxError(f"graph {name!r}: scalar {k!r} points at instruction {i} arg {j}, which is not a var")
        problem = returns_problem(rec.returns, len(rec.outputs))
        if problem:
            raise DeepxError(f"graph {name!r}: its returns {problem}")
        return rec


def returns_problem(spec: Any, outputs: int) -> str:
    """What is wrong with a stored graph's returns spec (what _spec makes: None, an output's index, or
    {"tuple"|"list": [spec...]} or {"dict": [[key, spec]...]}), for `outputs` outputs; "" where nothing is."""
    if spec is None:
        return ""
    if type(spec) is int:
        return "" if 0 <= spec < outputs else f"name output {spec}, of {outputs}"
    if isinstance(spec, dict) and len(spec) == 1:
        kind, items = next(iter(spec.items()))
        if kind in ("tuple", "list") and isinstance(items, list):
            return next((p for p in (returns_problem(x, outputs) for x in items) if p), "")
        if kind == "dict" and isinstance(items, list) and all(isinstance(x, list) and len(x) == 2 for x in items):
            return next((p for p in (returns_problem(v, outputs) for _, v in items) if p), "")
    return f"hold {str(spec)[:60]!s}, which is not a returns spec"
