"""The autograd tape: each op whose result requires grad becomes the result's `grad_fn` node, and backward walks
the nodes that reach the loss (graph_of). The graph lives on the tensors, as torch's does."""

from __future__ import annotations

import itertools
import operator
from typing import Any

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param


class Node:
    """One recorded op of the autograd graph (a tensor's `grad_fn`): the instruction, the tensors it read (held, so
    that their values and names stay until the graph is freed) and the node each of them had then. `prev`: the
    node of the same tensor before an in-place write replaced it. A graph lives as long as its tensors do."""

    __slots__ = ("freed", "inputs", "instr", "parents", "prev", "seq")

    def __init__(self, seq: int, instr: Instr, inputs: tuple[Any, ...], parents: tuple[Any, ...],
                 prev: Node | None) -> None:
        self.seq = seq
        self.instr = instr
        self.inputs = inputs
        self.parents = parents
        self.prev = prev
        self.freed = False

    def name(self) -> str:
        return self.instr.name

    def free(self) -> None:
        """What backward does without retain_graph: the tensors are let go; the instruction stays for messages."""
        self.freed = True
        self.inputs = self.parents = ()
        self.prev = None

    def __repr__(self) -> str:
        return f"<grad_fn {self.instr.name}{' (freed)' if self.freed else ''}>"


#: the latest Tape.wrote count of any session: a graph whose nodes all come after it has no write to look for (counts
#: of different sessions' tapes are unrelated, so this is only ever a bound: the largest of them)
_last_write = [-1]


_new_node = object.__new__


class Tape:
    """Where ops whose result requires grad are recorded: each becomes the result's `grad_fn` node. Nothing is kept
    here: a graph that Python no longer references is dropped with its tensors."""

    def __init__(self) -> None:
        self._seq = itertools.count()

    def append(self, entry: tuple[Instr, Any, tuple[Any, ...]]) -> None:
        """Record (instruction, result, inputs): the result's grad_fn becomes the new node."""
        instr, out, inputs = entry
        prev = out.grad_fn
        out.grad_fn = Node(next(self._seq), instr, inputs, tuple([t.grad_fn for t in inputs]),
                           prev if type(prev) is Node else None)

    def made(self, instr: Instr, out: Any, inputs: tuple[Any, ...]) -> None:
        """append(), for a result just made (it has no node yet): the recording hot path (Tensor._op)."""
        n = _new_node(Node)  # (Node's fields set here: no __init__ call)
        n.seq = next(self._seq)
        n.instr = instr
        n.inputs = inputs
        n.parents = tuple([t.grad_fn for t in inputs])
        n.prev = None
        n.freed = False
        out.grad_fn = n

    def wrote(self, t: Any) -> None:
        """An in-place write of `t` that is not on the tape (under no_grad, of a leaf, an optimizer's update): its
        place in the tape's order, so that a backward through nodes recorded before it, which read `t`, sees the
        write (graph_of) and the autograd pass refuses a value it needs that is no longer there, as torch's
        version counter does."""
        t._w = w = next(self._seq)
        if w > _last_write[0]:
            _last_write[0] = w


def graph_of(root: Node, what: str) -> tuple[list[Node], list[Instr], dict[str, Any]]:
    """The recorded graph that reaches `root` (walking back through each node's inputs), for backward: its nodes
    (what backward frees), the forward program to differentiate (those nodes in recording order, plus any later
    in-place write of a value they read, so that the autograd pass refuses a value overwritten since) and the
    leaves that require grad, by name, in recording order. Raises DeepxError on a node freed by an earlier
    backward."""
    seen: set[int] = set()
    path: list[Node] = []
    later: dict[Any, Node] = {}
    stack: list[Any] = [root]
    while stack:
        n = stack.pop()
        if n is None:
            continue
        k = id(n)
        if k in seen:
            continue
        seen.add(k)
        if n.freed:
            raise DeepxError(f"backward: the graph of '{what}' was freed by an earlier backward (at its "
                             f"'{n.instr.name}' op); pass retain_graph=True to the first backward to go through "
                             "it again")
        path.append(n)
        stack += n.parents
        if n.prev is not None:
            stack.append(n.prev)
        seq = n.seq
        for t in n.inputs:
            g = t.grad_fn
            while type(g) is Node and g.seq > seq:
                later[id(g)] = g
                g = g.prev
    path.sort(key=_seq_of)
    if path and _last_write[0] > path[0].seq:  # writes not on the tape, after a node that read the value (Tape.wrote)
        for n in path:
            for t in n.inputs:
                w = getattr(t, "_w", -1)
                if w > n.seq and ("w", t.name, w) not in later:
                    # stands for the write in the order: an identity in place, so that reads after it still reach
                    # the tensor's gradient (a write with no input cut them off: review), while the value before it
                    # is gone
                    p = Param.tensor(t.name, t.dtype)
                    mark = Instr("copytensor", (p,), (p,))
                    later[("w", t.name, w)] = Node(w, mark, (), (), None)
    nodes = path + [g for k, g in later.items() if k not in seen]
    if len(nodes) > len(path):
        nodes.sort(key=_seq_of)
    leaves: dict[str, Any] = {}
    for n in path:
        for t in n.inputs:
            if t.requires_grad and t.grad_fn is None and t.name not in leaves:
                leaves[t.name] = t
    return path, [n.instr for n in nodes], leaves


def read_metas(path: list[Node]) -> dict[str, tuple[Any, str]]:
    """(shape, dtype) of each tensor the nodes of `path` read, by name (a held batch's among them)."""
    return {t.name: (t.shape, t.dtype) for n in path for t in n.inputs}


_seq_of = operator.attrgetter("seq")
