"""CPU kernels (numpy), one module per op family, and the executor that runs checked instructions on them.

The kernel of op `x` is `deepxd.kernels.cpu.<OPS[x].family>.x`. Array kernels take the resolved args (arrays for
tensors, Python values otherwise) then the preallocated outputs; the `life` and `io` families change the set of
tensors or touch files, so they take the executor and the checked instruction.
"""

from __future__ import annotations

import importlib
import logging
import operator
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import from_numpy, to_numpy
from deepx_core.ir.effects import CREATES, DELETES, RENAMES, apply_effect
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import BindCache, Bound, OpDef, PerOp, TensorMeta
from deepx_core.ir.shapes import numel
from deepx_core.ir.text import is_name
from deepx_core.tensorfile import open_directory

log = logging.getLogger(__name__)

# inf and nan follow IEEE rules as in torch; numpy's RuntimeWarnings from our kernels are noise. A module-scoped
# filter costs nothing per call, where np.errstate costs microseconds.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"deepxd\.kernels\.cpu")

#: families whose kernels take (executor, bound instruction): tensor life and files, and the collectives (which hand
#: the instruction to the executor's `collectives`)
STORE_FAMILIES = frozenset({"life", "io", "collective"})


def _kernel(op: OpDef) -> Callable[..., None]:
    if op.family == "expr":  # no kernel of its own: its expression, run as a fused one
        from deepxd.kernels.cpu.fused import expr_kernel

        return expr_kernel(op)
    return getattr(importlib.import_module(f"deepxd.kernels.cpu.{op.family}"), op.name)  # type: ignore[no-any-return]


#: op name -> CPU kernel, for every op in the catalogue
KERNELS: PerOp = PerOp(_kernel)

_NAMES: dict[np.dtype, str] = {}

#: per op, how each arg reaches an array kernel: 0 its value, 1 the named tensor's array, 2 a list of arrays
_ARG_KINDS: PerOp = PerOp(lambda op: tuple(1 if a.kind == "tensor" else 2 if a.kind == "listtensor" else 0
                                            for a in op.args))


#: the most runs that `benchmark.repeat=N` may ask of one instruction (deepxir.md: "run the op N times, for timing").
#: A timing loop needs tens to thousands; a hundred million runs of a small op held the event loop for minutes, with
#: no turn for SIGTERM or any other sender. A larger count is refused, as is one that is not a whole number (0 runs
#: the op once, as 1 does); the op worker also counts the runs when it decides whether a program is heavy.
MAX_REPEAT = 10_000

_WHOLE = re.compile(r"[+-]?[0-9]+")


def repeat_count(instr: Instr) -> int:
    """How many times `instr` runs: its `benchmark.repeat` count (1 where absent or 0); DeepxError naming the op and
    the value where that is not a whole number from 0 to MAX_REPEAT."""
    text = instr.get_meta("benchmark.repeat")
    if text is None:
        return 1
    shown = text if len(text) <= 40 else text[:40] + "..."
    if not _WHOLE.fullmatch(text):
        raise DeepxError(f"{instr.name}: benchmark.repeat={shown!r} is not a whole number of runs; give one from 1 "
                         f"to {MAX_REPEAT}")
    n = int(text)
    if n < 0:
        raise DeepxError(f"{instr.name}: benchmark.repeat={shown} is negative; give a number of runs from 1 to "
                         f"{MAX_REPEAT}")
    if n > MAX_REPEAT:
        raise DeepxError(f"{instr.name}: benchmark.repeat={shown} is more runs than one instruction may ask for (at "
                         f"most {MAX_REPEAT}); send the instruction several times instead")
    return max(n, 1)


def check_instruction(b: Bound) -> None:
    """What the op table's check leaves to the executor, for where an instruction is first checked (never the
    prepared steps of a known program): its `benchmark.repeat` count, and that renametensor's new name is one that
    deepxIR text can write (a tensor that no line could refer to would be stuck)."""
    if b.instr.meta:
        repeat_count(b.instr)
    if b.op.effect.kind is RENAMES:
        for old, new in apply_effect(b).renamed:
            if not is_name(new):
                raise DeepxError(f"{b.op.name}: cannot rename '{old}' to {new!r}: deepxIR text cannot name a tensor "
                                 "with whitespace, ',', '->', brackets or parentheses; choose a name without them")


def _shown(value: Any) -> str:
    """An argument's value as a failure message shows it: short, numbers as deepxIR writes them."""
    if isinstance(value, (list, tuple)):
        text = "[" + " ".join(map(_shown, value)) + "]"
    elif isinstance(value, TensorMeta):
        text = f"{value.dtype}{list(value.shape)}"
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _does_not_fit(b: Bound) -> str | None:
    """'value V does not fit DTYPE' for the first scalar argument that an integer tensor of the instruction (an
    input, else an output) cannot hold: what an OverflowError of a kernel means."""
    dtypes = [m.dtype for m in b.args if isinstance(m, TensorMeta)]
    dtypes += [m.dtype for m in b.outs if m is not None]
    ints = [d for d in dtypes if d.startswith(("int", "uint"))]
    if not ints:
        return None
    try:
        info = np.iinfo(to_numpy(ints[0]))
    except (DeepxError, ValueError):  # a dtype numpy has no iinfo of: the kernel's own words, then
        return None
    for kind, value in zip(_ARG_KINDS.get(b.op.name, ()), b.args):
        if kind != 0 or type(value) not in (int, float):
            continue
        if (type(value) is float and not np.isfinite(value)) or not info.min <= value <= info.max:
            return f"value {_shown(value)} does not fit {ints[0]}"
    return None


#: what a kernel's exception that says nothing meant
_UNSAID: dict[type[BaseException], str] = {IndexError: "an index is out of range", OverflowError: "a value is out of "
                                           "range", FloatingPointError: "a floating-point error"}


def failure_message(b: Bound, e: BaseException) -> str:
    """A kernel's exception in words: the op, what went wrong (never the Python class's name), and the instruction
    as it ran, its tensors by name and its values as themselves: `addscalar: value 1e+30 does not fit int32
    (addscalar('x', 1e+30) -> 'x')`."""
    name = b.op.name
    # an integer output given inf, nan or a number past its range: OverflowError, or ValueError for nan
    overflow = isinstance(e, OverflowError) or (isinstance(e, ValueError) and "NaN" in str(e))
    problem = _does_not_fit(b) if overflow else None
    if problem is None:
        if isinstance(e, KeyError) and e.args:
            problem = f"{e.args[0]!r} not found"
        else:
            problem = " ".join(str(e).split()) or _UNSAID.get(type(e), "the kernel failed")
    return f"{name}: {problem} ({shown_instruction(b)})"


def shown_instruction(b: Bound) -> str:
    """The instruction as it ran, its tensors by name and its values as themselves: `div('a', 'b') -> 'c'`."""
    name = b.op.name
    ins = []
    for kind, value, n in zip(_ARG_KINDS.get(name, ()), b.args, b.names):
        if kind == 1:
            ins.append(repr(n) if n is not None else _shown(value))
        elif kind == 2 and isinstance(n, list):
            ins.append("[" + " ".join(map(repr, n)) + "]")
        else:
            ins.append(_shown(value))
    outs = ", ".join(repr(str(n)) for n in b.out_names)
    return f"{name}({', '.join(ins)}) -> {outs or '()'}"


def worded(b: Bound, e: DeepxError) -> DeepxError:
    """A kernel's own DeepxError (`integer division by zero`, `index 9 out of range`, a tensor file's problem) with
    the op and the instruction as it ran added where its message lacks them."""
    if type(e) is not DeepxError:
        return e
    message, name = str(e), b.op.name
    shown = shown_instruction(b)
    if shown in message:
        return e
    if not message.startswith(f"{name}:"):
        message = f"{name}: {message}"
    return DeepxError(f"{message} ({shown})")


def dtype_name(dt: np.dtype) -> str:
    try:
        return _NAMES[dt]
    except KeyError:
        _NAMES[dt] = from_numpy(dt)
        return _NAMES[dt]


class TensorTable(dict[str, np.ndarray]):
    """name -> array, with `metas` (name -> TensorMeta) kept beside it so that checking an instruction reads shapes
    and dtypes with plain dict lookups. Reads are dict reads; writes keep both in step.

    `version` counts the writes (a name set, replaced or removed): while it stands, every meta is as it was when it
    was read (what lets an op worker run a program it has just run again without comparing the metas it names)."""

    def __init__(self) -> None:
        super().__init__()
        self.metas: dict[str, TensorMeta] = {}
        self.version = 0

    def __setitem__(self, name: str, array: np.ndarray) -> None:
        dt = _NAMES.get(array.dtype)
        meta = TensorMeta(array.shape, dt if dt is not None else dtype_name(array.dtype))  # refuses unknown dtypes
        dict.__setitem__(self, name, array)
        self.metas[name] = meta
        self.version += 1

    def __ior__(self, other: Any) -> TensorTable:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __delitem__(self, name: str) -> None:
        dict.__delitem__(self, name)
        del self.metas[name]
        self.version += 1

    def pop(self, name: str, *default: Any) -> Any:  # type: ignore[override]
        self.metas.pop(name, None)
        self.version += 1
        return dict.pop(self, name, *default)

    def clear(self) -> None:
        dict.clear(self)
        self.metas.clear()
        self.version += 1

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, name: str, array: np.ndarray) -> np.ndarray:  # type: ignore[override]
        if name not in self:
            self[name] = array
        return self[name]

    def popitem(self) -> tuple[str, np.ndarray]:
        name, array = dict.popitem(self)
        self.metas.pop(name, None)
        self.version += 1
        return name, array


class CpuExecutor:
    """Tensors, variables and vectors held in this process, and the numpy kernels that work on them.

    `run(instr)` checks the instruction (nothing changes when it is refused) and executes it. Outputs that do not
    exist yet are created; an output that is also an input and changes shape gets a new buffer.
    """

    def __init__(self, *, io_roots: Iterable[str | os.PathLike[str]] | None = None,
                 output: Callable[[str], None] | None = None) -> None:
        self.tensors = TensorTable()
        # transposes are views of their operand's buffer (a matmul then reads it transposed, as BLAS likes, with no
        # copy): view name -> the name whose buffer it shares, and that name -> its views. `shared` holds both
        # kinds of name: before anything writes a shared buffer in place, unshare() gives the views copies
        self.view_of: dict[str, str] = {}
        self.views: dict[str, list[str]] = {}
        self.shared: dict[str, None] = {}
        # transposes of heap tensors: copies laid out as their operand is (a straight copy, and BLAS reads them
        # transposed); before anything writes one in place, unshare() makes it row-major, as kernels expect outputs
        self.strided: dict[str, None] = {}
        # names whose array must stay the same object (heap tensors: shared memory); never made views
        self.pinned: Any = ()
        # id() of the transposes, in the program running, whose result is deleted later in it (set by the op
        # worker): only those become views. A result that outlives its program is mostly a gradient that an
        # optimizer reads elementwise, which a view would make strided
        self.transient: Any = ()
        # the Env lookup that checking reads, bound to the metas dict's get: C speed
        self.meta: Callable[[str], TensorMeta | None] = self.tensors.metas.get
        self.plans = BindCache()
        self.variables: dict[str, Any] = {}
        self.vectors: dict[str, tuple[Any, ...]] = {}
        self.io_roots = None if io_roots is None else [Path(r).resolve() for r in io_roots]
        self.output: Callable[[str], None] = output or (lambda text: log.info("%s", text))
        # what runs the collective family (deepxd/comm.py, set by the op worker; None: none here), and the
        # collectives the worker started ahead of their place in the program running, by id() of their instruction
        self.collectives: Any = None
        self.launched: dict[int, Any] = {}

    # -- the Env that instructions are checked against
    def var(self, name: str) -> Any:
        return self.variables.get(name)

    def vector(self, name: str) -> tuple[Any, ...] | None:
        return self.vectors.get(name)

    # -- running
    def run(self, instr: Instr) -> None:
        b = self.plans.bind(instr, self)
        check_instruction(b)
        self.execute(b)

    def run_all(self, instrs: Sequence[Instr]) -> None:
        for instr in instrs:
            self.run(instr)

    def prepare(self, b: Bound) -> Callable[[], None]:
        """A call that does what execute(b) does, with what can be decided once decided: for a program that runs
        again and again unchanged. Kernel errors come out as they are (explain_failure words them)."""
        name = b.op.name
        kernel = KERNELS[name]
        kinds = _ARG_KINDS[name]
        if name == "fused":
            run_fused = self._prepare_fused(b)
            if run_fused is not None:
                return run_fused
        if name == "fusedcolsum":
            run_colsum = self._prepare_fusedcolsum(b)
            if run_colsum is not None:
                return run_colsum
        if (b.op.effect.kind in (DELETES, CREATES) or name == "reshape") and not b.instr.meta:
            quick = self._prepare_bookkeeping(b)
            if quick is not None:
                return quick
        if (b.op.family in STORE_FAMILIES or name in ("reshape", "transpose") or b.instr.meta or 2 in kinds
                or not b.outs or any(m is None for m in b.outs)):
            return lambda: self.execute(b)
        if len(b.outs) > 1:
            return self._prepare_outputs_held(b, kernel, kinds)
        tensors = self.tensors
        metas = tensors.metas
        out, meta = str(b.out_names[0]), b.outs[0]
        assert meta is not None  # checked above
        npdt = to_numpy(meta.dtype)
        shape = meta.shape
        shared, unshare = self.shared, self.unshare

        def get(n: str) -> np.ndarray | None:
            if shared and n in shared:
                unshare(n)
            return tensors.get(n)

        def target() -> tuple[np.ndarray, bool]:
            o = get(out)
            if o is not None and metas[out] == meta:
                return o, False
            return np.empty(shape, npdt), True

        direct = _direct_ufunc(b)
        if direct is not None and kinds == (1, 1):
            uf, (x, y) = direct, b.names

            def run_ufunc2() -> None:
                o = get(out)
                if o is not None and metas[out] == meta:
                    uf(tensors[x], tensors[y], out=o)
                else:
                    o = np.empty(shape, npdt)
                    uf(tensors[x], tensors[y], out=o)
                    tensors[out] = o

            return run_ufunc2
        if direct is not None and kinds == (1, 0):
            uf, x, v = direct, b.names[0], b.args[1]

            def run_ufunc_scalar() -> None:
                o = get(out)
                if o is not None and metas[out] == meta:
                    uf(tensors[x], v, out=o)
                else:
                    o = np.empty(shape, npdt)
                    uf(tensors[x], v, out=o)
                    tensors[out] = o

            return run_ufunc_scalar
        if kinds == (1, 1):
            x, y = b.names

            def run2() -> None:
                o = get(out)
                if o is not None and metas[out] == meta:
                    kernel(tensors[x], tensors[y], o)
                else:
                    o = np.empty(shape, npdt)
                    kernel(tensors[x], tensors[y], o)
                    tensors[out] = o

            return run2
        if kinds == (1,):
            (x,) = b.names

            def run1() -> None:
                o = get(out)
                if o is not None and metas[out] == meta:
                    kernel(tensors[x], o)
                else:
                    o = np.empty(shape, npdt)
                    kernel(tensors[x], o)
                    tensors[out] = o

            return run1
        if kinds == (1, 0):
            (x, _), v = b.names, b.args[1]

            def run_scalar() -> None:
                o = get(out)
                if o is not None and metas[out] == meta:
                    kernel(tensors[x], v, o)
                else:
                    o = np.empty(shape, npdt)
                    kernel(tensors[x], v, o)
                    tensors[out] = o

            return run_scalar
        spec = tuple((k == 1, n if k == 1 else v) for k, v, n in zip(kinds, b.args, b.names))

        def run() -> None:
            o, fresh = target()
            kernel(*[tensors[x] if t else x for t, x in spec], o)
            if fresh:
                tensors[out] = o

        return run

    def _prepare_sgd(self, b: Bound, spec: tuple[tuple[bool, Any], ...], wanted: list[tuple[str, Any]],
                     kernel: Callable[..., None]) -> Callable[[], None] | None:
        """An sgd update in place on the native loop, its numbers converted once (native.sgd_call); the kernel where
        the loop declines. None where the loop would never run."""
        from deepxd.kernels.cpu import native

        meta = b.args[0]
        if meta is None or any(m is None or m != meta for _, m in wanted):
            return None
        n = numel(meta.shape)
        numbers = [v for _, v in spec[3:]]
        lr, momentum, dampening, weight_decay, nesterov, step = numbers
        try:
            call = native.sgd_call(to_numpy(meta.dtype), n, lr, momentum, dampening, weight_decay, nesterov,
                                   step <= 1)
        except (TypeError, ValueError, OverflowError):  # the kernel words it
            return None
        if call is None:
            return None
        tensors, metas, shared = self.tensors, self.tensors.metas, self.shared
        (p_out, p_meta), (b_out, b_meta) = wanted
        p, g, buf = (x for _, x in spec[:3])

        def run_sgd() -> None:
            if shared and (p_out in shared or b_out in shared):
                self.execute(b)
                return
            if metas.get(p_out) != p_meta or metas.get(b_out) != b_meta:
                self.execute(b)
                return
            po, bo = tensors[p_out], tensors[b_out]
            pa, ga, ba = tensors[p], tensors[g], tensors[buf]
            if not call(pa, ga, ba, po, bo):
                kernel(pa, ga, ba, *numbers, po, bo)

        return run_sgd

    def _prepare_adam(self, b: Bound, spec: tuple[tuple[bool, Any], ...], wanted: list[tuple[str, Any]],
                      kernel: Callable[..., None]) -> Callable[[], None] | None:
        """An adam or adamw update in place on the native loop, its numbers converted once (native.adam_call), as
        _prepare_sgd; the kernel where the loop declines. None where the loop would never run."""
        from deepxd.kernels.cpu import native

        meta = b.args[0]
        if meta is None or any(m is None or m != meta for _, m in wanted):
            return None
        p, g, m, v = (x for _, x in spec[:4])
        if [n for n, _ in wanted] != [p, m, v]:  # (the op's rule makes them so)
            return None
        numbers = [x for _, x in spec[4:]]
        decoupled = b.op.name == "adamw"
        call = native.adam_call(to_numpy(meta.dtype), numel(meta.shape), *numbers, decoupled)
        if call is None:
            return None
        tensors, metas, shared = self.tensors, self.tensors.metas, self.shared
        held = [b]  # the instruction as last renumbered: execute's way runs it

        def run_adam() -> None:
            if shared and (p in shared or m in shared or v in shared):
                self.execute(held[0])
                return
            if metas.get(p) != meta or metas.get(m) != meta or metas.get(v) != meta:
                self.execute(held[0])
                return
            pa, ga, ma, va = tensors[p], tensors[g], tensors[m], tensors[v]
            if not call(pa, ga, ma, va):
                kernel(pa, ga, ma, va, *numbers, pa, ma, va)

        names, op = b.names, b.op

        def renumber(new: Bound) -> bool:
            if new.op is not op or (new.names is not names and new.names != names):
                return False
            values = [x for x in new.args[4:]]
            if not call.renumber(*values, decoupled):
                return False
            numbers[:] = values
            held[0] = new
            return True

        run_adam.renumber = renumber  # type: ignore[attr-defined]  # (OpWorker._prepare_again: a step count)
        return run_adam

    def _prepare_outputs_held(self, b: Bound, kernel: Callable[..., None], kinds: tuple[int, ...]
                              ) -> Callable[[], None]:
        """An op with several outputs (the optimizer updates, written in place every step): the kernel called on
        the held outputs directly while each exists with its shape and dtype and none is a view or viewed; execute's
        way otherwise."""
        tensors, metas, shared = self.tensors, self.tensors.metas, self.shared
        outs = [str(n) for n in b.out_names]
        wanted = list(zip(outs, b.outs))
        spec = tuple((k == 1, n if k == 1 else v) for k, v, n in zip(kinds, b.args, b.names))
        if b.op.name == "sgd" and kinds[:3] == (1, 1, 1) and 1 not in kinds[3:]:
            quick = self._prepare_sgd(b, spec, wanted, kernel)
            if quick is not None:
                return quick
        if b.op.name in ("adam", "adamw") and kinds[:4] == (1, 1, 1, 1) and 1 not in kinds[4:]:
            quick = self._prepare_adam(b, spec, wanted, kernel)
            if quick is not None:
                return quick

        def run_held() -> None:
            if shared and any(n in shared for n in outs):
                self.execute(b)
                return
            held = []
            for n, m in wanted:
                if metas.get(n) != m:
                    self.execute(b)
                    return
                held.append(tensors[n])
            kernel(*[tensors[x] if t else x for t, x in spec], *held)

        return run_held

    def _prepare_bookkeeping(self, b: Bound) -> Callable[[], None] | None:
        """deltensor, reshape and newtensor, which a training step has dozens of, without execute's dispatch:
        straight to the table for tensors that are neither views nor viewed (not in `shared`, which names both sides
        of every view) and, for newtensor, not there yet; execute's way otherwise."""
        tensors, metas, shared = self.tensors, self.tensors.metas, self.shared
        out = str(b.out_names[0])
        kind = b.op.effect.kind
        if kind is DELETES:

            def run_delete() -> None:
                if out in shared:
                    self.execute(b)
                else:
                    del tensors[out]

            return run_delete
        if kind is CREATES:  # newtensor (a backward's seed, every step)
            made = b.outs[0]
            if made is None:
                return None
            dims, npdt = made.shape, to_numpy(made.dtype)

            def run_new() -> None:
                if out in tensors or out in shared:
                    self.execute(b)  # kept (with a warning) or replaced, as the kernel decides
                else:
                    tensors[out] = np.zeros(dims, npdt)

            return run_new
        x, meta = b.names[0], b.outs[0]
        if not isinstance(x, str) or meta is None:
            return None
        shape = meta.shape

        def run_reshape() -> None:
            if x in shared or out in shared:
                self.execute(b)
            elif x == out:  # in place: a view of its own buffer
                tensors[out] = tensors[x].reshape(shape)
            else:
                o = tensors.get(out)
                if o is not None and metas[out] == meta:
                    o[...] = tensors[x].reshape(shape)
                else:
                    tensors[out] = np.array(tensors[x].reshape(shape), copy=True)

        return run_reshape

    def _prepare_fused(self, b: Bound) -> Callable[[], None] | None:
        """A fused instruction on one block of float32 or float64, its operands of the output's shape and dtype:
        the expression's tape called directly, on register buffers made once (the kernel's checks and allocations
        cost more than a short tape on a small tensor). None where the general kernel is needed."""
        from deepxd.kernels.cpu import fused as fused_kernels
        from deepxd.kernels.cpu import native

        meta = b.outs[0]
        ins = b.names[0]
        backend = fused_kernels.backend()
        if (backend not in ("native", "numpy") or meta is None or b.instr.meta
                or meta.dtype not in ("float32", "float64") or not isinstance(ins, list)
                or any(m is None or m.dtype != meta.dtype for m in b.args[0])):
            return None
        n = numel(meta.shape)
        # the tape on registers made once: operands of the output's shape, one block
        small = n <= fused_kernels.BLOCK and all(m.shape == meta.shape for m in b.args[0])
        if n == 0 or (not small and backend != "native"):
            return None
        cdt = to_numpy(meta.dtype)
        plan = fused_kernels.compile_expr(str(b.args[1]), len(ins))
        consts = tuple(cdt.type(c) for c in plan.constants)
        regs = [np.empty(n, cdt) for _ in range(plan.registers)] if small else []
        tape = plan.run
        tensors = self.tensors
        metas = tensors.metas
        get = tensors.get
        out = str(b.out_names[0])
        shape = meta.shape
        flat = len(shape) == 1
        general = KERNELS["fused"]
        expr = b.args[1]
        # the native loop with the checks that depend on shapes made now (native.fused_call)
        compiled = (native.fused_call(plan, [m.shape for m in b.args[0]], cdt, shape) if backend == "native"
                    else None)

        def run() -> None:
            if self.shared and out in self.shared:
                self.unshare(out)
            have = get(out)
            fresh = have is None or metas[out] != meta
            o = np.empty(shape, cdt) if fresh or have is None else have
            arrays = [tensors[x] for x in ins]
            if compiled is not None and compiled(arrays, o):
                pass
            elif small and all(map(_C_CONTIGUOUS, arrays)):
                if flat:
                    tape(arrays, consts, regs, o)
                else:  # one block: every input is read before the last step writes the output
                    tape([a.reshape(-1) for a in arrays], consts, regs, o.reshape(-1))
            else:
                general(arrays, expr, o)
            if fresh:
                tensors[out] = o

        return run

    def _prepare_fusedcolsum(self, b: Bound) -> Callable[[], None] | None:
        """fusedcolsum on the native loop with the checks that depend on shapes made once (native.fused_call): a
        ReLU's gradient and its bias's, every training step. The kernel where the loop declines (not compiled yet,
        an operand it cannot read). None where the general way is needed."""
        from deepxd.kernels.cpu import fused as fused_kernels
        from deepxd.kernels.cpu import native

        meta, sums_meta = b.outs
        ins = b.names[0]
        if (meta is None or sums_meta is None or b.instr.meta or not isinstance(ins, list)
                or any(m is None or m.dtype != meta.dtype for m in b.args[0])):
            return None
        npdt, shape = to_numpy(meta.dtype), meta.shape
        plan = fused_kernels.compile_expr(str(b.args[1]), len(ins))
        compiled = native.fused_call(plan, [m.shape for m in b.args[0]], npdt, shape, with_sums=True)
        tensors, metas = self.tensors, self.tensors.metas
        out, total = str(b.out_names[0]), str(b.out_names[1])
        kernel, expr, keepdims = KERNELS["fusedcolsum"], b.args[1], b.args[2]

        def run() -> None:
            if self.shared:
                for n in (out, total):
                    if n in self.shared:
                        self.unshare(n)
            have, have_sums = tensors.get(out), tensors.get(total)
            o = have if have is not None and metas[out] == meta else np.empty(shape, npdt)
            s = have_sums if have_sums is not None and metas[total] == sums_meta else np.empty(sums_meta.shape, npdt)
            arrays = [tensors[x] for x in ins]
            if not (fused_kernels.backend() == "native" and s.flags.c_contiguous
                    and compiled(arrays, o, s.reshape(-1))):
                kernel(arrays, expr, keepdims, o, s)
            if o is not have:
                tensors[out] = o
            if s is not have_sums:
                tensors[total] = s

        return run

    def explain_failure(self, b: Bound, e: BaseException) -> None:
        """Raise the DeepxError that execute(b) makes of a kernel's exception `e`; return if it makes none."""
        name = b.op.name
        if isinstance(e, DeepxError):
            raise worded(b, e) from None
        if isinstance(e, MemoryError):
            sizes = ", ".join(f"'{n}' {m.dtype}{list(m.shape)}" for n, m in zip(b.out_names, b.outs) if m is not None)
            raise DeepxError(f"{name}: out of memory (outputs {sizes})") from None
        if isinstance(e, (ValueError, TypeError, IndexError, OverflowError, KeyError, FloatingPointError)):
            raise DeepxError(failure_message(b, e)) from None

    def unshare(self, name: str) -> None:
        """Before `name`'s buffer is written in place (or freed, or renamed): a view named `name` gets a buffer of its
        own, and the views of `name`'s buffer get copies (a strided copy is made row-major instead: its views keep
        the old buffer to themselves)."""
        self._release(name, copy_views=True)

    def _forget_view(self, name: str) -> None:
        """`name` is deleted or gets a new buffer: its old buffer is left to its views (a heap tensor's views get
        copies instead: its shared memory is given back)."""
        self._release(name, copy_views=name in self.pinned)

    def _release(self, name: str, copy_views: bool) -> None:
        tensors, shared = self.tensors, self.shared
        shared.pop(name, None)
        if self.strided and self.strided.pop(name, 0) is None:
            a = tensors.get(name)
            if a is not None and copy_views:
                tensors[name] = np.ascontiguousarray(a)
            copy_views = False  # the views keep the old buffer, which nothing writes any more
        base = self.view_of.pop(name, None)
        if base is not None:
            others = self.views.get(base)
            if others is not None:
                others.remove(name)
                if not others:
                    del self.views[base]
                    if base not in self.strided:
                        shared.pop(base, None)
            a = tensors.get(name)
            if a is not None and copy_views:
                tensors[name] = a.copy()
        mine = self.views.pop(name, None)
        if mine is not None:
            for v in mine:
                self.view_of.pop(v, None)
                shared.pop(v, None)
                a = tensors.get(v)
                if a is not None and copy_views:
                    if name not in self.pinned:
                        tensors[v] = a.copy()
                        continue
                    # a heap tensor's (a weight's transpose still alive when an optimizer writes the weight): laid
                    # out as the view is, a straight copy, not a strided one; BLAS reads it transposed as it read
                    # the view, and it is made row-major before anything writes it in place
                    c = tensors[v] = a.copy(order="K")
                    if not c.flags.c_contiguous:
                        self.strided[v] = None
                        shared[v] = None

    def _transpose_view(self, b: Bound) -> bool:
        """transpose as a view of its operand where its result dies in the program, as a straight copy laid out as
        a heap operand is; False: run the kernel (a row-major copy)."""
        src, out = b.names[0], str(b.out_names[0])
        if out == src or out in self.pinned or src not in self.tensors:
            return False
        if out in self.shared:
            self._forget_view(out)  # its old buffer is left to its other holders; the name gets the view
        base = self.view_of.get(src, src)
        a = self.tensors[src]
        # a heap tensor's transpose is always a view (a weight's, in x @ W.T): the SDK deletes it before an
        # optimizer writes the weight in place, and one still alive then gets a straight copy (see _release)
        if base not in self.pinned and id(b) not in self.transient:
            return False
        self.tensors[out] = a.transpose(b.args[1])
        self.view_of[out] = base
        self.views.setdefault(base, []).append(out)
        self.shared[out] = None
        self.shared[base] = None
        return True

    def execute(self, b: Bound) -> None:
        """Run an instruction already checked by `bind` against this executor's current state."""
        name = b.op.name
        kernel = KERNELS[name]
        try:
            if self.shared:  # views: see unshare
                change = apply_effect(b)
                for n in change.deleted:
                    self._forget_view(n)
                for n in (*change.writes, *(n for pair in change.renamed for n in pair)):
                    if n in self.shared:
                        self.unshare(n)
            if name == "transpose" and self._transpose_view(b):
                return
            if b.op.family in STORE_FAMILIES:
                kernel(self, b)
                return
            if name == "reshape" and b.out_names[0] == b.names[0]:
                self.tensors[b.names[0]] = self.tensors[b.names[0]].reshape(b.outs[0].shape)  # type: ignore[union-attr]
                return
            tensors = self.tensors
            args = [tensors[n] if k == 1 else value if k == 0 else [tensors[x] for x in n]
                    for k, value, n in zip(_ARG_KINDS[name], b.args, b.names)]
            metas = tensors.metas
            outs = []
            fresh = False
            for n, meta in zip(b.out_names, b.outs):
                if metas.get(n) == meta:
                    outs.append(tensors[n])
                else:
                    assert meta is not None
                    outs.append(np.empty(meta.shape, to_numpy(meta.dtype)))
                    fresh = True
            if b.instr.meta:
                for _ in range(repeat_count(b.instr)):
                    kernel(*args, *outs)
            else:
                kernel(*args, *outs)
            if fresh:
                for n, arr in zip(b.out_names, outs):
                    if tensors.get(n) is not arr:
                        tensors[n] = arr
        except DeepxError as e:
            raise worded(b, e) from None
        except MemoryError:
            sizes = ", ".join(f"'{n}' {m.dtype}{list(m.shape)}" for n, m in zip(b.out_names, b.outs) if m is not None)
            raise DeepxError(f"{name}: out of memory (outputs {sizes})") from None
        except (ValueError, TypeError, IndexError, OverflowError, KeyError, FloatingPointError) as e:
            raise DeepxError(failure_message(b, e)) from None

    @contextmanager
    def io_dir(self, op: str, tensor: str, path: str, create: bool = False) -> Iterator[tuple[int, str, str]]:
        """(descriptor, file name, directory) of the directory `path`'s files are in: the directory resolved (.. and
        links), refused outside every io root, then opened by that resolved path with no link followed
        (tensorfile.open_directory), so a link swapped in after the check is refused; `create`: made if missing.
        The files are opened relative to the descriptor, never through a link (deepx_core/tensorfile.py)."""
        if not path:
            raise DeepxError(f"{op}: empty path")
        p = Path(path).expanduser()
        if p.name in ("", ".", ".."):
            raise DeepxError(f"{op} of '{tensor}': path {path} names a directory; give the tensor file's base path")
        where = p.parent.resolve()
        if self.io_roots is not None and not any(where.is_relative_to(r) for r in self.io_roots):
            roots = ", ".join(str(r) for r in self.io_roots)
            raise DeepxError(f"{op} of '{tensor}': path {path} is outside the allowed io roots ({roots})")
        try:
            fd = open_directory(where, create=create)
        except DeepxError as e:
            raise DeepxError(f"{op} of '{tensor}': path {path}: {e}") from None
        try:
            yield fd, p.name, str(where)
        finally:
            os.close(fd)

    def put(self, name: str, array: np.ndarray) -> None:
        """Store `array` (any dtype deepx knows) as tensor `name`."""
        dtype_name(array.dtype)
        if name in self.shared:
            self._forget_view(name)  # the name gets a new buffer; views of the old one keep it
        self.tensors[name] = np.array(array, order="C", copy=True)  # ours: a caller's later reshape cannot desync

    def get(self, name: str) -> np.ndarray:
        try:
            return self.tensors[name]
        except KeyError:
            raise DeepxError(f"tensor '{name}' not found") from None


__all__ = ["DIRECT_UFUNCS", "KERNELS", "MAX_REPEAT", "STORE_FAMILIES", "CpuExecutor", "check_instruction", "dtype_name",
           "failure_message", "repeat_count", "to_numpy", "transient_transposes"]


_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")

#: ops whose kernel, for a float32 or float64 output and operands of that dtype (and a Python int or float scalar),
#: is exactly one ufunc call into the output (see elementwise.py and nn.py): prepared calls make it directly
DIRECT_UFUNCS: dict[str, np.ufunc] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum, "min": np.minimum,
    "addscalar": np.add, "subscalar": np.subtract, "mulscalar": np.multiply, "divscalar": np.divide,
    "maxscalar": np.maximum, "minscalar": np.minimum,
}


def _direct_ufunc(b: Bound) -> np.ufunc | None:
    uf = DIRECT_UFUNCS.get(b.op.name)
    meta = b.outs[0] if b.outs else None
    if uf is None or meta is None or meta.dtype not in ("float32", "float64"):
        return None
    for k, v in zip(_ARG_KINDS[b.op.name], b.args):
        if k == 1 and (not isinstance(v, TensorMeta) or v.dtype != meta.dtype or v.shape != meta.shape):
            return None  # broadcasting or another dtype: the kernel's way
        if k == 0 and type(v) not in (int, float):
            return None
    return uf


def transient_transposes(bounds: Sequence[Bound]) -> set[int]:
    """id() of each transpose in `bounds` whose result the program deletes (and does not write again before)."""
    dying: set[Any] = set()
    out: set[int] = set()
    for b in reversed(bounds):
        if b.op.effect.kind is DELETES:
            dying.add(b.out_names[0])
            continue
        if b.op.name == "transpose" and b.out_names and b.out_names[0] in dying:
            out.add(id(b))
        for n in b.out_names:
            dying.discard(n)
    return out
