"""deepxIR text: one instruction per line, `name (args) -> (returns) // key=value ...` (docs/deepxir.md, section 1).

An ordinary line is split once on `//`, `->` and `,`. Only where a string value holds one of those separators are
other splits tried, by three rules:

- metadata starts at the leftmost `//` whose suffix is all `key=value` tokens and whose prefix parses;
- the arguments end at the last `->` for which both sides parse (strings in arguments often hold `->`);
- a `var<string>` value swallows the comma pieces after it up to the next typed parameter (`tensor<...>:` ...).

So a string in the last position of a list keeps any `,` `:` `->` `//` `(` `)` it holds. A line that none of the
splits parses raises DeepxParseError with the 1-based line and column of the problem.
"""

from __future__ import annotations

import numbers
import re

from deepx_core.cache import Cache
from deepx_core.errors import DeepxParseError
from deepx_core.ir.dtypes import is_precision
from deepx_core.ir.instr import Instr, Param, Value

__all__ = ["format_param", "format_text", "is_name", "parse_line", "parse_text"]

_HEAD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*)(?=[\s(]|->|$)")
_TYPED = re.compile(r"\s*(tensor|var|vector|listtensor)(?:<([^<>]*)>)?:")
_TYPELIKE = re.compile(r"([A-Za-z_]\w*)\s*(?:<[^<>]*>)?\s*:")
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)
_NAME = re.compile(r"[^\s,()\[\]]+")  # a tensor or stored-vector name; `->` is refused separately
_UNTYPED = re.compile(r"\[[^\[\]()]*\]|[^\s()\[\],:]+")
_TOKEN = re.compile(r"\S+")
_SPACE = re.compile(r"\s")

# the fast path: a line whose lists are parenthesised and whose values hold none of `, : ( ) [ ] < >` (so no `->`),
# and whose metadata is all key=value tokens, splits in one way only; anything else goes to the general parser
_FAST_VALUE = r"(?:[^\s,()\[\]<>:]+|\[[^\[\]()<>,:]*\])"
_FAST_P = rf"(?:tensor|var|vector|listtensor)(?:<[^<>]+>)?:{_FAST_VALUE}"
_FAST_LIST = rf"\s*(?:{_FAST_P}\s*(?:,\s*{_FAST_P}\s*)*)?"
_FAST_LINE = re.compile(
    rf"\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\(({_FAST_LIST})\)\s*->\s*\(({_FAST_LIST})\)\s*"
    r"(?://((?:\s*[^\s=]+=\S*(?!\S))*)\s*)?"
)
_INT_ITEMS = re.compile(r"(?:\s*[+-]?[0-9]+(?![0-9]))*\s*")
_FAST_META = re.compile(r"([^\s=]+)=(\S*)")
_FAST_PARAM = re.compile(rf"(tensor|var|vector|listtensor)(?:<([^<>]*)>)?:({_FAST_VALUE})")

_CATEGORIES = ("tensor", "var", "vector", "listtensor")
_BOOLS = {"true": True, "false": False}
_BUDGET = 64  # split attempts per line: ordinary lines need 1, a line with strings a few
_new_param = Param._make
_tuple_new = tuple.__new__


class _Fail(Exception):
    """A parse failure at a 0-based offset of the line; one candidate split may fail where another succeeds."""

    def __init__(self, message: str, offset: int) -> None:
        self.message = message
        self.offset = offset


class _Exhausted(_Fail):
    """Too many candidate splits: the line is refused instead of searched further."""


def parse_text(text: str) -> list[Instr]:
    """Every instruction of a `\\n`-separated deepxIR text; blank lines are skipped."""
    out = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if line and not line.isspace():
            out.append(parse_line(line, lineno))
    return out


def parse_line(line: str, lineno: int = 1) -> Instr:
    """One deepxIR instruction; DeepxParseError (naming `lineno` and the column) if the line is not one."""
    if line.endswith("\r"):
        line = line[:-1]
    try:
        return _parse(line)
    except _Fail as e:
        op = _OP_NAME.match(line)  # the op, where the problem lies after its name: `add: expected ')' ...`
        message = f"{op.group(1)}: {e.message}" if op is not None and e.offset >= op.end() else e.message
        raise DeepxParseError(message, lineno, e.offset + 1, line) from None


_OP_NAME = re.compile(r"\s*([A-Za-z_]\w*)(?=\s*\()")


def format_text(instr: Instr) -> str:
    """The canonical sender form: `name (a, b) -> (c) // k=v  k2=v2`."""
    args = ", ".join(map(format_param, instr.args))
    returns = ", ".join(map(format_param, instr.returns))
    text = f"{instr.name} ({args}) -> ({returns})"
    if instr.meta:
        text += " // " + "  ".join(f"{k}={v}" for k, v in instr.meta)
    return text


def format_param(p: Param) -> str:
    """One parameter as deepxIR writes it: `category<p1|p2>:value`, an untyped one as its raw text."""
    if not p.category:
        return _format_value(p.value)
    if p.precisions:
        return f"{p.category}<{'|'.join(p.precisions)}>:{_format_value(p.value)}"
    return f"{p.category}:{_format_value(p.value)}"


def _format_value(v: Value) -> str:
    if isinstance(v, tuple):
        return "[" + " ".join(map(_format_scalar, v)) + "]"
    return _format_scalar(v)


def _format_scalar(v: object) -> str:
    t = type(v)
    if t is str:
        return v  # type: ignore[return-value]
    if t is bool:
        return "True" if v else "False"
    if t is int:
        return str(v)
    if t is float:
        return repr(v)
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):  # numpy integers
        return str(int(v))
    if isinstance(v, numbers.Real):  # numpy floats: repr(np.float32(0.5)) is not deepxIR
        return repr(float(v))
    return str(v)


# --- parsing -----------------------------------------------------------------------------------------------------


def _parse(line: str) -> Instr:
    m = _FAST_LINE.fullmatch(line)
    if m is not None:
        name, args_text, returns_text, meta_text = m.groups()
        args = _LISTS.get(args_text) or _fast_params(args_text)
        returns = _LISTS.get(returns_text) or _fast_params(returns_text)
        if args is not None and returns is not None:
            meta = tuple(_FAST_META.findall(meta_text)) if meta_text else ()
            return _tuple_new(Instr, (name, args, returns, meta))  # type: ignore[arg-type]
    return _parse_general(line)


# parsed fast-path lists by their text: a training loop sends the same lists every step (Params are immutable)
_LISTS_MAX = 4096
_LISTS: Cache[str, tuple[Param, ...]] = Cache("text.lists", _LISTS_MAX, counted=False)


def _fast_params(text: str) -> tuple[Param, ...] | None:
    """The params of a list that _FAST_LINE matched; None where one needs the general parser's error message."""
    out = []
    for category, raw, value in _FAST_PARAM.findall(text):
        precisions = _PRECISIONS.get(raw or None)
        if precisions is None:
            try:
                precisions = _precisions(raw, 0)
            except _Fail:
                return None
        if category == "tensor":
            v: Value = value
        elif category == "var":
            if "string" in precisions:
                v = value
            elif _INT.fullmatch(value):
                try:
                    v = int(value)
                except ValueError:  # more digits than Python converts: the general parser says so
                    return None
            elif value.lower() in _BOOLS:
                v = _BOOLS[value.lower()]
            elif _FLOAT.fullmatch(value):
                v = float(value)
            else:
                v = value
        elif value[0] != "[":
            if category == "listtensor":
                return None
            v = value
        elif category == "vector" and _INT_ITEMS.fullmatch(value, 1, len(value) - 1):
            try:
                v = tuple(map(int, value[1:-1].split()))
            except ValueError:
                return None
        elif category == "vector":
            items: list[int | float] = []
            for item in value[1:-1].split():
                if _INT.fullmatch(item):
                    try:
                        items.append(int(item))
                    except ValueError:
                        return None
                elif _FLOAT.fullmatch(item):
                    items.append(float(item))
                else:
                    return None
            v = tuple(items)
        else:
            v = tuple(value[1:-1].split())
        out.append(_tuple_new(Param, (category, precisions, v)))
    result = tuple(out)
    if len(text) <= 256:
        _LISTS.put(text, result)
    return result


def _parse_general(line: str) -> Instr:
    m = _HEAD.match(line)
    if m is None:
        stripped = line.lstrip()
        offset = len(line) - len(stripped)
        got = stripped.split(None, 1)[0] if stripped else ""
        raise _Fail(f"expected an op name, got {got!r}" if got else "expected an op name", offset)
    name = m.group(1)
    pos = m.end()
    budget = [_BUDGET]
    i = line.find("//", pos)
    if i == -1:
        return Instr(name, *_body(line, pos, len(line), budget))
    if line.find("//", i + 1) == -1:  # one `//`: the metadata separator, unless its suffix is not metadata
        candidates = [i] if _is_meta(line, i + 2) else []
    else:
        candidates = _meta_candidates(line, pos)
    first: _Fail | None = None
    for i in candidates:
        _spend(budget, i)
        try:
            args, returns = _body(line, pos, i, budget)
        except _Exhausted:
            raise
        except _Fail as e:
            first = first or e
            continue
        return Instr(name, args, returns, _meta(line, i + 2))
    try:
        return Instr(name, *_body(line, pos, len(line), budget))
    except _Exhausted:
        raise
    except _Fail as e:
        if first is not None:
            raise first from None
        last = line.rfind("//")
        if e.offset > last:  # the text after the last `//` is neither a value nor metadata
            for m in _TOKEN.finditer(line, last + 2):
                token = m.group()
                if token[0] == "=" or "=" not in token:
                    raise _Fail(f"expected key=value metadata after '//', got {token!r}", m.start()) from None
        raise


def _is_meta(line: str, start: int) -> bool:
    for token in line[start:].split():
        if token[0] == "=" or "=" not in token:
            return False
    return True


def _meta(line: str, start: int) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(token.split("=", 1)) for token in line[start:].split())  # type: ignore[misc]


def _meta_candidates(line: str, pos: int) -> list[int]:
    """Offsets of every `//` after `pos` whose suffix is all key=value tokens, left to right, in linear time."""
    tokens = [(m.start(), m.end()) for m in _TOKEN.finditer(line, pos)]
    first = 0  # tokens before the last non key=value token can hold no candidate
    for k in range(len(tokens) - 1, -1, -1):
        s, e = tokens[k]
        if line[s] == "=" or line.find("=", s, e) == -1:
            first = k
            break
    out = []
    for s, e in tokens[first:]:
        i = line.find("//", s, e)
        last_eq = line.rfind("=", s, e)
        while i != -1:
            rest = i + 2  # the rest of this token after `//` is a key=value token, or empty
            if rest == e or (line[rest] != "=" and last_eq > rest):
                out.append(i)
            i = line.find("//", i + 1, e)
    return out


def _spend(budget: list[int], offset: int) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise _Exhausted(
            "too many '->' and '//' inside values to tell arguments, returns and metadata apart; "
            "shorten the strings or move them out of the instruction",
            offset,
        )


def _body(line: str, start: int, end: int, budget: list[int]) -> tuple[tuple[Param, ...], tuple[Param, ...]]:
    j = line.rfind("->", start, end)
    if j == -1:
        raise _Fail("expected '->' between arguments and returns", len(line[:end].rstrip()))
    first: _Fail | None = None
    while j != -1:
        _spend(budget, j)
        try:
            return _params(line, start, j), _params(line, j + 2, end)
        except _Fail as e:
            first = first or e
        j = line.rfind("->", start, j + 1)
    assert first is not None
    raise first


def _params(line: str, start: int, end: int) -> tuple[Param, ...]:
    """A parameter list, with or without its parentheses."""
    seg = line[start:end]
    s = seg.strip()
    if not s:
        return ()
    offset = start + len(seg) - len(seg.lstrip())
    if s[0] == "(":
        if s[-1] != ")":
            raise _Fail("expected ')' to close the parameter list", offset + len(s))
        s = s[1:-1]
        offset += 1
        if not s or s.isspace():
            return ()
    pieces = s.split(",")
    n = len(pieces)
    out = []
    k = 0
    while k < n:
        piece = pieces[k]
        m = _TYPED.match(piece)
        if m is None:
            out.append(_untyped(piece, offset))
            offset += len(piece) + 1
            k += 1
            continue
        category = m.group(1)
        precisions = _precisions(m.group(2), offset + m.start(2))
        if category == "var" and "string" in precisions:
            j = k + 1
            while j < n and _TYPED.match(pieces[j]) is None:
                j += 1
            text = ",".join(pieces[k:j]) if j > k + 1 else piece
            out.append(_new_param(("var", precisions, text[m.end() :].strip())))
            offset += len(text) + 1
            k = j
            continue
        value = piece[m.end() :]
        voffset = offset + m.end()
        if category == "tensor":
            v: Value = _name(value, voffset, "tensor name")
        elif category == "var":
            v = _scalar(value, voffset)
        elif category == "vector":
            v = _vector(value, voffset)
        else:
            v = _listtensor(value, voffset)
        out.append(_new_param((category, precisions, v)))
        offset += len(piece) + 1
        k += 1
    return tuple(out)


_PRECISIONS: dict[str | None, tuple[str, ...]] = {None: ()}


def _precisions(raw: str | None, offset: int) -> tuple[str, ...]:
    try:
        return _PRECISIONS[raw]
    except KeyError:
        pass
    assert raw is not None
    out = []
    for part in raw.split("|"):
        p = part.strip()
        if not p:
            raise _Fail("expected a precision inside '<>'", offset)
        if not is_precision(p):
            raise _Fail(f"unknown precision {p!r}", offset + len(part) - len(part.lstrip()))
        out.append(p)
        offset += len(part) + 1
    result = tuple(out)
    if len(_PRECISIONS) < 512:
        _PRECISIONS[raw] = result
    return result


def _lead(text: str) -> int:
    return len(text) - len(text.lstrip())


def is_name(name: str) -> bool:
    """Whether deepxIR text can name a tensor (or a stored vector) `name`: not empty, and no whitespace, `,`, `->`,
    brackets or parentheses. The parser's own rule, for what arrives by other ways (a native put, renametensor's
    string) and would otherwise make a tensor that no line of text could ever refer to."""
    return _NAME.fullmatch(name) is not None and "->" not in name


def _name(text: str, offset: int, what: str) -> str:
    v = text.strip()
    if is_name(v):
        return v
    offset += _lead(text)
    if not v:
        raise _Fail(f"expected a {what}", offset)
    raise _Fail(f"{what} {v!r} may not contain spaces, ',', '->', brackets or parentheses", offset)


def _scalar(text: str, offset: int) -> bool | int | float | str:
    v = text.strip()
    if _INT.fullmatch(v):
        try:
            return int(v)
        except ValueError:  # more digits than Python converts
            raise _Fail(f"integer {v[:20]}... is too long", offset + _lead(text)) from None
    b = _BOOLS.get(v.lower())
    if b is not None:
        return b
    if _FLOAT.fullmatch(v):
        return float(v)
    if not v:
        raise _Fail("expected a value", offset + _lead(text))
    return v


def _number(item: str, offset: int) -> int | float:
    if _INT.fullmatch(item):
        try:
            return int(item)
        except ValueError:
            raise _Fail(f"integer {item[:20]}... is too long", offset) from None
    if _FLOAT.fullmatch(item):
        return float(item)
    raise _Fail(f"vector item {item!r} is not a number", offset)


def _items(text: str, offset: int, what: str) -> list[tuple[str, int]] | None:
    """The space-separated items of `[a b c]` with their offsets; None when `text` has no brackets."""
    v = text.strip()
    offset += _lead(text)
    if not v or v[0] != "[":
        if "]" in v:
            raise _Fail("unbalanced ']'", offset + v.index("]"))
        return None
    if v[-1] != "]" or v.count("[") > 1 or v.count("]") > 1:
        if v.count("]") > v.count("["):
            raise _Fail("unbalanced ']'", offset + v.rindex("]"))
        raise _Fail(f"unbalanced '[' in {what}", offset)
    return [(m.group(), offset + 1 + m.start()) for m in _TOKEN.finditer(v, 1, len(v) - 1)]


def _vector(text: str, offset: int) -> tuple[int | float, ...] | str:
    items = _items(text, offset, "vector")
    if items is None:
        return _name(text, offset, "vector name")
    return tuple(_number(item, o) for item, o in items)


def _listtensor(text: str, offset: int) -> tuple[str, ...]:
    items = _items(text, offset, "tensor list")
    if items is None:
        raise _Fail("expected a tensor list '[name name ...]'", offset + _lead(text))
    return tuple(_name(item, o, "tensor name") for item, o in items)


def _untyped(piece: str, offset: int) -> Param:
    v = piece.strip()
    if v and _UNTYPED.fullmatch(v) and "->" not in v and "//" not in v:
        return _new_param(("", (), v))
    offset += _lead(piece)
    if not v:
        raise _Fail("expected a parameter", offset)
    m = _TYPELIKE.match(v)
    if m is not None:
        word = m.group(1)
        if word in _CATEGORIES:
            raise _Fail(f"malformed parameter type {v[: m.end()]!r}; write e.g. 'tensor<float32>:name'", offset)
        raise _Fail(f"unknown parameter category {word!r}; expected tensor, var, vector or listtensor", offset)
    if "[" in v and "]" not in v:
        raise _Fail("unbalanced '['", offset + v.index("["))
    if "]" in v and "[" not in v:
        raise _Fail("unbalanced ']'", offset + v.index("]"))
    space = _SPACE.search(v)
    if space is not None and "[" not in v[: space.start()]:
        raise _Fail("expected ',' between parameters", offset + space.start())
    for bad in ("->", "//", "(", ")", ":", "[", "]"):
        if bad in v:
            raise _Fail(f"unexpected {bad!r} in untyped parameter {v!r}", offset + v.index(bad))
    raise _Fail(f"malformed parameter {v!r}", offset)
