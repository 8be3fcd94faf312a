"""Who may name which tensor: deepxIR over UDP reaches only the tensors UDP made and those shared with it
(docs/daemon.md, "who can do what"; docs/decisions/0001-udp-trust.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from deepx_core.ir.effects import apply_effect
from deepx_core.ir.instr import Instr
from deepxd.actors.messages import Metas

if TYPE_CHECKING:
    from deepxd.actors.base import ActorRef
    from deepxd.actors.worker import OpWorker
    from deepxd.kv.base import KV


def tensor_names(instr: Instr) -> tuple[list[str], list[str]]:
    """The tensors an instruction names: those it reads (args, a tensor list read as bind reads it: `[01 u]` names
    tensor '1') and those it writes, makes, deletes or renames away (returns, and the tensor a `load` without
    returns names after its file). An unknown op names none: it is refused before it runs."""
    change = apply_effect(instr)
    return list(change.reads), [*change.writes, *change.deleted, *(old for old, _ in change.renamed)]


class UdpScope:
    """The tensors UDP clients may name: those made over UDP (`made`), and those a native client shared (`shared`:
    `udp_share`, `deepxctl tensors share`). Any other tensor of the daemon, a native session's or a heap tensor of
    the plane, is refused to UDP as if it were another's: UDP has no credentials to tell its senders apart. The
    scheduler checks a UDP program and runs it in one message (no other program between). A name UDP made is taken
    back when another client's program or request writes, makes or deletes it (UDP cannot claim the names a native
    user will use); a shared one only when it is revoked or deleted (docs/decisions/0001-udp-trust.md)."""

    def __init__(self, worker: Callable[[], ActorRef[OpWorker]], kv: KV | None) -> None:
        self.worker = worker
        self.kv = kv
        self.made: set[str] = set()
        self.shared: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.made or self.shared)

    def __contains__(self, name: str) -> bool:
        return name in self.made or name in self.shared

    def reaches(self, instr: Instr) -> bool:
        """Whether every tensor `instr` names is UDP's (made over UDP, or shared): refuse() would let it run without
        looking anything up. False says only that refuse() must be asked."""
        change = apply_effect(instr)
        for group in (change.reads, change.created, change.written, change.deleted):
            for n in group:
                if n not in self.made and n not in self.shared:
                    return False
        return all(old in self for old, _ in change.renamed)

    async def refuse(self, instr: Instr) -> str | None:
        """Why `instr` may not run for a UDP sender, None when it may."""
        reads, writes = tensor_names(instr)
        outside = [n for n in dict.fromkeys((*reads, *writes)) if n not in self]
        if not outside:
            return None
        taken = await self.existing(outside)
        if not taken:
            return None
        names = ", ".join(f"'{n}'" for n in taken)
        return (f"{instr.name}: tensor {names} was not made over UDP and is not shared with UDP clients (deepxIR "
                "over UDP is unauthenticated: it reaches only the tensors UDP made, and those its owner shares with "
                "`deepxctl tensors share NAME`; docs/daemon.md, 'who can do what')")

    async def existing(self, names: list[str]) -> list[str]:
        """Those of `names` that are tensors of this daemon (its worker's, or heap tensors of the plane)."""
        found = set(await self.worker().ask(Metas(names=names)))  # an error refuses the line: fail closed
        if self.kv is not None:
            for n in names:
                if n not in found and await self.kv.exists(f"tensor:{n}"):
                    found.add(n)
        return [n for n in names if n in found]

    def ran(self, instr: Instr) -> None:
        """Record what a UDP instruction that ran did to the set of tensors."""
        change = apply_effect(instr)
        self.deleted(change.deleted)
        for old, new in change.renamed:
            self.deleted([old])
            self.made.add(new)
        self.made.update(n for n in change.writes if n not in self.shared)

    def deleted(self, names: Iterable[str]) -> None:
        """Tensors deleted (by anyone): their names are free again."""
        for n in names:
            self.made.discard(n)
            self.shared.discard(n)

    def written_by_another(self, program: Sequence[Instr]) -> None:
        """A native client's program, as it goes to the worker (a backward expanded: its gradients are in it): the
        names UDP made that it writes, makes or deletes, and the shared ones it deletes or renames away, are no
        longer UDP's."""
        for instr in program:
            change = apply_effect(instr)
            self.deleted(change.deleted)
            for old, new in change.renamed:
                self.deleted([old])
                self.made.discard(new)
            self.made.difference_update(change.writes)

    def taken_back(self, names: Iterable[str]) -> None:
        """Names another client made anew (a native put, a replay's outputs): no longer made by UDP."""
        self.made.difference_update(names)

    def share(self, names: list[str], shared: bool) -> None:
        if shared:
            self.shared.update(names)
        else:
            self.shared.difference_update(names)
