"""The msgpack form of instructions: what deepx's own frames carry.

- Param: `[category, "p1|p2", value]`, a tuple value (vector, tensor list) as an array
- Instr: `[name, [param, ...], [param, ...], [[key, value], ...]]`
- program: `{"v": 1, "instrs": [instr, ...]}`

Decoding checks every shape and type, and a malformed payload raises DeepxError, never anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import is_precision
from deepx_core.ir.instr import CATEGORIES, Instr, Param, Scalar, Value

__all__ = [
    "PROGRAM_VERSION",
    "instr_from_obj",
    "instr_to_obj",
    "pack_instr",
    "pack_program",
    "unpack_instr",
    "unpack_program",
]

PROGRAM_VERSION = 1

_SCALARS = (bool, int, float, str)


def instr_to_obj(instr: Instr) -> list:
    """The plain msgpack-ready form of an instruction, for frames that embed instructions."""
    try:
        return [
            instr.name,
            [_param_to_obj(p) for p in instr.args],
            [_param_to_obj(p) for p in instr.returns],
            [[k, v] for k, v in instr.meta],
        ]
    except (AttributeError, TypeError, ValueError) as e:
        raise DeepxError(f"cannot encode {instr!r} as an instruction: {e}") from None


def instr_from_obj(obj: Any) -> Instr:
    """The instruction that `instr_to_obj` encoded; DeepxError naming what is wrong otherwise."""
    if not isinstance(obj, (list, tuple)) or len(obj) != 4:
        raise DeepxError(f"instruction: expected [name, args, returns, meta], got {_show(obj)}")
    name, args, returns, meta = obj
    if not isinstance(name, str) or not name:
        raise DeepxError(f"instruction: the op name must be a non-empty string, got {_show(name)}")
    return Instr(name, _params_from_obj(name, "argument", args), _params_from_obj(name, "return", returns),
                 _meta(name, meta) if meta else ())


def pack_instr(instr: Instr) -> bytes:
    obj = instr_to_obj(instr)
    try:
        return _pack(obj)
    except DeepxError as e:  # an int beyond 64 bits: said with the op and the instruction, as the daemon says its own
        values = [v for p in (*instr.args, *instr.returns)
                  for v in (p.value if isinstance(p.value, (list, tuple)) else (p.value,))]
        big = [v for v in values if type(v) is int and not -2**63 <= v < 2**64]
        what = f"value {big[0]} does not fit in 64 bits (the wire's integers)" if big else str(e)
        from deepx_core.ir.text import format_text

        raise DeepxError(f"{instr.name}: {what} ({format_text(instr)})") from None


def unpack_instr(data: bytes) -> Instr:
    return instr_from_obj(_unpack(data))


# Both ends of a native connection keep the instructions they have packed or unpacked: a training step sends the
# same instructions every time, and a repeated instruction then costs one dict lookup on each side, and decodes to
# the very same Instr object (which lets the daemon's bind cache match it by identity).
_CACHE_MAX = 1 << 16
_PACKED: Cache[Instr, bytes] = Cache("wire.packed", _CACHE_MAX, counted=False)
_UNPACKED: Cache[bytes, Instr] = Cache("wire.unpacked", _CACHE_MAX, counted=False)


def pack_instr_cached(instr: Instr) -> bytes:
    """pack_instr, remembered."""
    try:
        data = _PACKED.get(instr)
    except TypeError:  # lists inside
        return pack_instr(instr)
    if data is None:
        data = _PACKED.put(instr, pack_instr(instr))
    return data


def unpack_instr_cached(data: bytes) -> Instr:
    """unpack_instr, remembered: equal bytes give the same Instr object."""
    instr = _UNPACKED.get(data)
    if instr is None:
        instr = unpack_instr(data)
        _UNPACKED.put(bytes(data), instr)
    return instr


def pack_program(instrs: Sequence[Instr]) -> bytes:
    return _pack({"v": PROGRAM_VERSION, "instrs": [instr_to_obj(i) for i in instrs]})


def unpack_program(data: bytes) -> list[Instr]:
    obj = _unpack(data)
    if not isinstance(obj, dict):
        raise DeepxError(f"program: expected a map {{'v': 1, 'instrs': [...]}}, got {_show(obj)}")
    version = obj.get("v")
    if type(version) is not int or version != PROGRAM_VERSION:
        raise DeepxError(f"program: unsupported version {_show(version)}; this deepx reads version {PROGRAM_VERSION}")
    instrs = obj.get("instrs")
    if not isinstance(instrs, list):
        raise DeepxError(f"program: 'instrs' must be a list of instructions, got {_show(instrs)}")
    out = []
    for k, item in enumerate(instrs):
        try:
            out.append(instr_from_obj(item))
        except DeepxError as e:
            raise DeepxError(f"program instruction {k}: {e}") from None
    return out


def _pack(obj: object) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # an int beyond 64 bits, a type msgpack lacks
        raise DeepxError(f"cannot encode as msgpack: {e}") from None


def _unpack(data: bytes) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DeepxError(f"expected msgpack bytes, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:  # bad, truncated or extra bytes
        raise DeepxError(f"malformed msgpack payload: {type(e).__name__}: {e}") from None


def _param_to_obj(p: Param) -> list:
    value = p.value
    if isinstance(value, tuple):
        return [p.category, "|".join(p.precisions), [_plain(v) for v in value]]
    return [p.category, "|".join(p.precisions), _plain(value)]


def _plain(v: object) -> Scalar:
    if isinstance(v, _SCALARS):
        return v
    item = getattr(v, "item", None)  # numpy scalars
    if item is not None:
        v = item()
        if isinstance(v, _SCALARS):
            return v
    raise DeepxError(f"cannot encode a {type(v).__name__} value; use bool, int, float, str or a tuple of them")


# decoded params by (category, precisions, value type, value): a program repeats its params, and a training loop
# repeats its programs, so most params decode with one dict lookup instead of full validation
_PARAMS_MAX = 1 << 16
_PARAMS: Cache[tuple[Any, ...], Param] = Cache("wire.params", _PARAMS_MAX, counted=False)


def _params_from_obj(op: str, side: str, obj: Any) -> tuple[Param, ...]:
    if not isinstance(obj, (list, tuple)):
        raise DeepxError(f"{op}: the {side}s must be a list of parameters, got {_show(obj)}")
    out = []
    for k, p in enumerate(obj):
        key = None
        if type(p) is list and len(p) == 3:
            v = p[2]
            tv = type(v)
            if tv is str or tv is int or tv is bool or (tv is float and v != 0.0):
                key = (p[0], p[1], tv, v)
            elif tv is list and all(type(x) is int or type(x) is str for x in v):  # shapes, tensor lists
                key = (p[0], p[1], tv, *v)  # (floats and bools left out: == would mix 0, 0.0, -0.0 and False)
        if key is not None:
            try:
                hit = _PARAMS.get(key)
            except TypeError:  # unhashable items: decode the long way
                hit, key = None, None
            if hit is not None:
                out.append(hit)
                continue
        param = _param_from_obj(op, f"{side} {k}", p)
        if key is not None:
            _PARAMS.put(key, param)
        out.append(param)
    return tuple(out)


def _param_from_obj(op: str, where: str, obj: Any) -> Param:
    if not isinstance(obj, (list, tuple)) or len(obj) != 3:
        raise DeepxError(f"{op} {where}: expected [category, precisions, value], got {_show(obj)}")
    category, precisions, value = obj
    if not isinstance(category, str) or category not in CATEGORIES:
        raise DeepxError(
            f"{op} {where}: unknown category {_show(category)}; expected one of tensor, var, vector, listtensor or ''"
        )
    if not isinstance(precisions, str):
        raise DeepxError(f"{op} {where}: precisions must be a string like 'float32|int32', got {_show(precisions)}")
    precs = tuple(precisions.split("|")) if precisions else ()
    for p in precs:
        if not is_precision(p):
            raise DeepxError(f"{op} {where}: unknown precision {p!r}")
    return Param(category, precs, _value(op, where, category, value))


def _value(op: str, where: str, category: str, value: Any) -> Value:
    if isinstance(value, (list, tuple)):  # msgpack arrays: vectors and tensor lists
        items = tuple(value)
        if category == "listtensor":
            ok = all(isinstance(v, str) and v for v in items)
        elif category == "vector":
            ok = all(type(v) in (int, float) for v in items)
        else:
            ok = category == "" and all(isinstance(v, _SCALARS) for v in items)
        if ok:
            return items
        what = {"listtensor": "a list of tensor names", "vector": "a list of numbers"}.get(category, "a scalar")
        raise DeepxError(f"{op} {where}: a {category or 'untyped'} value is {what}, got {_show(value)}")
    if category == "tensor" or category == "vector":
        if isinstance(value, str) and value:
            return value
        raise DeepxError(f"{op} {where}: a {category} value is a name (a non-empty string), got {_show(value)}")
    if category == "listtensor" or not isinstance(value, _SCALARS):
        what = "a list of tensor names" if category == "listtensor" else "a bool, int, float or string"
        raise DeepxError(f"{op} {where}: a {category or 'untyped'} value is {what}, got {_show(value)}")
    return value


def _meta(op: str, obj: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(obj, (list, tuple)):
        raise DeepxError(f"{op}: metadata must be a list of [key, value] pairs, got {_show(obj)}")
    out = []
    for pair in obj:
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(s, str) for s in pair)
            or not pair[0]
        ):
            raise DeepxError(
                f"{op}: metadata entries are [key, value] string pairs with a non-empty key, got {_show(pair)}"
            )
        out.append((pair[0], pair[1]))
    return tuple(out)


def _show(obj: object) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."
