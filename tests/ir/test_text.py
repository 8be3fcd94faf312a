"""deepxIR text: parse_line / parse_text / format_text against docs/deepxir.md section 1."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepx_core.errors import DeepxParseError
from deepx_core.ir import Instr, Param, Program, format_text, pack_instr, parse_line, parse_text, unpack_instr
from deepx_core.ir import text as text_module
from deepx_core.ir.dtypes import GROUPS, PRECISIONS

F32 = ("float32",)
I32 = ("int32",)


def T(name: str, precisions: tuple[str, ...] = F32) -> Param:
    return Param("tensor", precisions, name)


def V(value: object, precisions: tuple[str, ...]) -> Param:
    return Param("var", precisions, value)  # type: ignore[arg-type]


def S(value: str) -> Param:
    return Param("var", ("string",), value)


def U(raw: str) -> Param:
    return Param("", (), raw)


def typed(x: object) -> object:
    """x with every scalar tagged by its type, so that True != 1 and 1 != 1.0 in comparisons."""
    if isinstance(x, tuple):
        return tuple(typed(v) for v in x)
    if isinstance(x, float) and math.isnan(x):
        return ("float", "nan")
    return (type(x).__name__, x)


def same(a: Instr, b: Instr) -> bool:
    return typed(tuple(a)) == typed(tuple(b))


# --- the examples of docs/deepxir.md, as they arrive on the wire --------------------------------------------------

DOC_EXAMPLES = [
    (
        "newtensor (vector<int32>:[3 4 5]) -> (tensor<float32>:t1) //  created_at=1744724799.0650852",
        Instr("newtensor", (Param("vector", I32, (3, 4, 5)),), (T("t1"),), (("created_at", "1744724799.0650852"),)),
    ),
    (
        "constant (var<int32>:1) -> (tensor<float32>:t1) // author=miaobyte  created_at=1744724799.06512",
        Instr("constant", (V(1, I32),), (T("t1"),), (("author", "miaobyte"), ("created_at", "1744724799.06512"))),
    ),
    (
        "arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:7) // author=miaobyte  created_at=1744724799.07",
        Instr("arange", (V(0, I32), V(1, I32)), (T("7"),), (("author", "miaobyte"), ("created_at", "1744724799.07"))),
    ),
    (
        "addscalar (tensor<float32>:3, var<float32>:0.5) -> (tensor<float32>:3) // author=miaobyte  "
        "created_at=1744724799.09",
        Instr("addscalar", (T("3"), V(0.5, F32)), (T("3"),), (("author", "miaobyte"), ("created_at", "1744724799.09"))),
    ),
    (
        "sum (tensor<float32>:t, vector<int32>:[0 2], var<bool>:False) -> (tensor<float32>:s) // author=miaobyte  "
        "created_at=1744724799.11",
        Instr(
            "sum",
            (T("t"), Param("vector", I32, (0, 2)), V(False, ("bool",))),
            (T("s"),),
            (("author", "miaobyte"), ("created_at", "1744724799.11")),
        ),
    ),
    (
        "concat (listtensor<float32>:[t1 t2 t3], var<int32>:1) -> (tensor<float32>:t) // author=miaobyte  "
        "created_at=1744724799.12",
        Instr(
            "concat",
            (Param("listtensor", F32, ("t1", "t2", "t3")), V(1, I32)),
            (T("t"),),
            (("author", "miaobyte"), ("created_at", "1744724799.12")),
        ),
    ),
    (
        "switch (listtensor<float32>:[9 8], tensor<bool>:10) -> (tensor<float32>:11) // author=miaobyte  "
        "created_at=1744724799.13",
        Instr(
            "switch",
            (Param("listtensor", F32, ("9", "8")), T("10", ("bool",))),
            (T("11"),),
            (("author", "miaobyte"), ("created_at", "1744724799.13")),
        ),
    ),
    (
        "matmul (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) // author=cublas  "
        "created_at=1744724799.14  benchmark.repeat=20",
        Instr(
            "matmul",
            (T("a"), T("b")),
            (T("c"),),
            (("author", "cublas"), ("created_at", "1744724799.14"), ("benchmark.repeat", "20")),
        ),
    ),
    (
        "print (tensor<float32>:t, var<string>:%.4f) -> () // author=miaobyte  created_at=1744724799.15",
        Instr("print", (T("t"), S("%.4f")), (), (("author", "miaobyte"), ("created_at", "1744724799.15"))),
    ),
    (
        "save (tensor<float32>:t, var<string>:/data/t_float32) -> () //  created_at=1744724799.16",
        Instr("save", (T("t"), S("/data/t_float32")), (), (("created_at", "1744724799.16"),)),
    ),
    (
        "deltensor () -> (tensor<float32>:t) //  created_at=1744724799.19",
        Instr("deltensor", (), (T("t"),), (("created_at", "1744724799.19"),)),
    ),
    (
        "add tensor<float32>:a, tensor<float32>:b -> tensor<float32>:c",
        Instr("add", (T("a"), T("b")), (T("c"),)),
    ),
]


@pytest.mark.parametrize(("line", "expected"), DOC_EXAMPLES)
def test_doc_examples_parse(line: str, expected: Instr) -> None:
    got = parse_line(line)
    assert same(got, expected), got
    assert same(text_module._parse_general(line), expected)  # the fast path and the general parser agree
    assert same(parse_line(format_text(got)), expected)


def test_doc_examples_as_one_message() -> None:
    text = "\n".join(line for line, _ in DOC_EXAMPLES)
    got = parse_text(text)
    assert len(got) == len(DOC_EXAMPLES)
    assert all(same(g, e) for g, (_, e) in zip(got, DOC_EXAMPLES))
    assert Program.from_text(text) == Program(e for _, e in DOC_EXAMPLES)


# --- format_text ----------------------------------------------------------------------------------------------------


def test_format_canonical_sender_style() -> None:
    instr = Instr(
        "sum",
        (T("t"), Param("vector", I32, (0, 2)), V(False, ("bool",))),
        (T("s"),),
        (("author", "miaobyte"), ("created_at", "1744724799.11")),
    )
    assert format_text(instr) == (
        "sum (tensor<float32>:t, vector<int32>:[0 2], var<bool>:False) -> (tensor<float32>:s)"
        " // author=miaobyte  created_at=1744724799.11"
    )
    assert str(instr) == format_text(instr)


@pytest.mark.parametrize(
    ("param", "text"),
    [
        (V(True, ("bool",)), "var<bool>:True"),
        (V(False, ()), "var:False"),
        (V(-3, I32), "var<int32>:-3"),
        (V(0.5, F32), "var<float32>:0.5"),
        (V(1e-05, F32), "var<float32>:1e-05"),
        (V(1e16, F32), "var<float32>:1e+16"),
        (V(math.inf, F32), "var<float32>:inf"),
        (V(-math.inf, F32), "var<float32>:-inf"),
        (V(math.nan, F32), "var<float32>:nan"),
        (Param("vector", I32, (3, 4, 5)), "vector<int32>:[3 4 5]"),
        (Param("vector", I32, ()), "vector<int32>:[]"),
        (Param("vector", ("float32",), (0.5, 2)), "vector<float32>:[0.5 2]"),
        (Param("vector", I32, "shape_a"), "vector<int32>:shape_a"),
        (Param("listtensor", F32, ("a", "b")), "listtensor<float32>:[a b]"),
        (Param("listtensor", (), ()), "listtensor:[]"),
        (T("x", ("int64", "int32")), "tensor<int64|int32>:x"),
        (T("x", ()), "tensor:x"),
        (U("a"), "a"),
        (S(""), "var<string>:"),
    ],
)
def test_format_params(param: Param, text: str) -> None:
    assert format_text(Instr("op", (param,))) == f"op ({text}) -> ()"


def test_format_without_meta_has_no_slashes() -> None:
    assert format_text(Instr("deltensor", (), (T("t"),))) == "deltensor () -> (tensor<float32>:t)"


def test_format_numpy_scalars() -> None:
    np = pytest.importorskip("numpy")
    instr = Instr("op", (V(np.float32(0.5), F32), V(np.int64(3), I32), Param("vector", I32, (np.int32(2),))))
    assert format_text(instr) == "op (var<float32>:0.5, var<int32>:3, vector<int32>:[2]) -> ()"


# --- whitespace and parentheses ---------------------------------------------------------------------------------------

ADD = Instr("add", (T("a"), T("b")), (T("c"),), (("id", "3"),))


@pytest.mark.parametrize(
    "line",
    [
        "add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) // id=3",
        "add(tensor<float32>:a,tensor<float32>:b)->(tensor<float32>:c)//id=3",
        "add\t(\ttensor<float32>:a\t,\ttensor<float32>:b\t)\t->\t(\ttensor<float32>:c\t)\t//\tid=3",
        "   add   (  tensor<float32>:a  ,   tensor<float32>:b  )   ->   (  tensor<float32>:c  )   //    id=3   ",
        "add tensor<float32>:a, tensor<float32>:b -> tensor<float32>:c // id=3",
        "add tensor<float32>:a,tensor<float32>:b->tensor<float32>:c//id=3",
        "add (tensor<float32>:a, tensor<float32>:b) -> tensor<float32>:c // id=3",
        "add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) // id=3\r",
    ],
)
def test_whitespace_and_parentheses_are_free(line: str) -> None:
    assert same(parse_line(line), ADD)


@pytest.mark.parametrize(
    ("line", "meta"),
    [
        ("add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c)", ()),
        ("add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) //", ()),
        ("add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) //   ", ()),
        ("add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) // author=", (("author", ""),)),
        (
            "add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) // a=1 b=x=y  url=http://h/p",
            (("a", "1"), ("b", "x=y"), ("url", "http://h/p")),
        ),
    ],
)
def test_metadata(line: str, meta: tuple[tuple[str, str], ...]) -> None:
    got = parse_line(line)
    assert got.meta == meta
    assert got.args == (T("a"), T("b"))


def test_empty_lists() -> None:
    assert parse_line("deltensor () -> (tensor<float32>:t)").args == ()
    assert parse_line("deltensor (   ) -> (tensor<float32>:t)").args == ()
    assert parse_line("deltensor -> (tensor<float32>:t)").args == ()
    assert parse_line("print (tensor<float32>:t) ->").returns == ()
    assert parse_line("noop()->()") == Instr("noop")


# --- values ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("True", True),
        ("TRUE", True),
        ("true", True),
        ("tRuE", True),
        ("False", False),
        ("false", False),
        ("0", 0),
        ("-7", -7),
        ("+7", 7),
        ("3000000000", 3000000000),
        ("0.5", 0.5),
        ("-2.", -2.0),
        (".25", 0.25),
        ("1e-05", 1e-05),
        ("1E5", 100000.0),
        ("1.5e+3", 1500.0),
        ("inf", math.inf),
        ("-Infinity", -math.inf),
        ("counter", "counter"),
        ("lr.base", "lr.base"),
        ("1_000", "1_000"),
    ],
)
def test_var_values(text: str, value: object) -> None:
    (p,) = parse_line(f"constant (var<float32>:{text}) -> (tensor<float32>:t)").args
    assert typed(p.value) == typed(value)


def test_var_nan() -> None:
    (p,) = parse_line("constant (var<float32>:nan) -> (tensor<float32>:t)").args
    assert isinstance(p.value, float) and math.isnan(p.value)


def test_string_vars_stay_strings() -> None:
    args = parse_line("op (var<string>:123, var<string>:True, var<int32|string>:0.5) -> ()").args
    assert [p.value for p in args] == ["123", "True", "0.5"]
    assert all(type(p.value) is str for p in args)


@pytest.mark.parametrize("name", ["7", "0", "linear_0.weight", "model.layers.0.weight", "t-1", "a:b", "/x/y"])
def test_tensor_names_are_strings(name: str) -> None:
    got = parse_line(f"copytensor (tensor<float32>:{name}) -> (tensor<float32>:{name}.copy)")
    assert got.args == (T(name),)
    assert got.returns == (T(f"{name}.copy"),)
    assert type(got.args[0].value) is str


def test_vectors_and_lists() -> None:
    got = parse_line("op (vector<int32>:[], vector<float32>:[1 -2.5  1e3], vector<int32>:shp, listtensor:[]) -> ()")
    assert got.args == (
        Param("vector", I32, ()),
        Param("vector", F32, (1, -2.5, 1000.0)),
        Param("vector", I32, "shp"),
        Param("listtensor", (), ()),
    )
    assert typed(got.args[1].value) == typed((1, -2.5, 1000.0))


def test_precision_groups_and_alternatives() -> None:
    (p,) = parse_line("indexselect (tensor<int64|int32>:i) -> ()").args
    assert p.precisions == ("int64", "int32")
    for group in GROUPS:
        assert parse_line(f"op (tensor<{group}>:x) -> ()").args[0].precisions == (group,)


def test_untyped_params() -> None:
    got = parse_line("add (a, b) -> (c)")
    assert got == Instr("add", (U("a"), U("b")), (U("c"),))
    got = parse_line("rpowscalar (2, tensor<float32>:t, 0.5, [3 4]) -> (c) // id=1")
    assert got.args == (U("2"), T("t"), U("0.5"), U("[3 4]"))
    assert format_text(got) == "rpowscalar (2, tensor<float32>:t, 0.5, [3 4]) -> (c) // id=1"


# --- strings that hold separators -----------------------------------------------------------------------------------


def test_brief_examples() -> None:
    got = parse_line("print (tensor<float32>:t, var<string>:a, b -> c // x) -> () // id=3")
    assert got == Instr("print", (T("t"), S("a, b -> c // x")), (), (("id", "3"),))
    got = parse_line("save (tensor<float32>:t, var<string>:/data/x//y:z) -> ()")
    assert got == Instr("save", (T("t"), S("/data/x//y:z")))


NASTY = [
    "a, b",
    "x:y",
    "a -> b",
    "a->b",
    "x // y",
    "http://h:80/p",
    "f(x)",
    "(",
    ")",
    ") -> (",
    "a), (b",
    "%d, %s",
    ",",
]


@pytest.mark.parametrize("s", NASTY)
@pytest.mark.parametrize("meta", ["", " // id=3", " //"])
def test_string_last_in_args(s: str, meta: str) -> None:
    got = parse_line(f"print (tensor<float32>:t, var<string>:{s}) -> (){meta}")
    assert got.args == (T("t"), S(s))
    assert got.returns == ()
    assert got.meta == ((("id", "3"),) if "id" in meta else ())


@pytest.mark.parametrize("s", [s for s in NASTY if "->" not in s and "//" not in s])
def test_string_last_in_returns(s: str) -> None:
    got = parse_line(f"argset (var<int32>:1) -> (var<string>:{s}) // id=3")
    assert got == Instr("argset", (V(1, I32),), (S(s),), (("id", "3"),))


def test_string_with_arrow_in_returns_when_unambiguous() -> None:
    got = parse_line("argset (var<int32>:1) -> (var<string>:a -> b)")
    assert got.returns == (S("a -> b"),)


@pytest.mark.parametrize("s", NASTY)
def test_string_in_the_middle(s: str) -> None:
    got = parse_line(f"print (var<string>:{s}, tensor<float32>:t, var<string>:{s}) -> (tensor<float32>:u) // id=1")
    assert got == Instr("print", (S(s), T("t"), S(s)), (T("u"),), (("id", "1"),))


def test_string_swallows_untyped_pieces_until_a_typed_param() -> None:
    got = parse_line("op (var<string>:a, b, c, vector<int32>:[1], d) -> ()")
    assert got.args == (S("a, b, c"), Param("vector", I32, (1,)), U("d"))


def test_empty_string() -> None:
    assert parse_line("print (tensor:t, var<string>:) -> ()").args == (T("t", ()), S(""))
    assert parse_line("print (var<string>:, tensor:t) -> ()").args == (S(""), T("t", ()))


# --- several lines --------------------------------------------------------------------------------------------------


def test_parse_text_skips_blank_lines() -> None:
    text = "\n  \nconstant (var<int32>:1) -> (tensor<float32>:t)\r\n\t\r\n\nadd (a, b) -> (c)\n\n"
    assert parse_text(text) == [Instr("constant", (V(1, I32),), (T("t"),)), Instr("add", (U("a"), U("b")), (U("c"),))]
    assert parse_text("") == []
    assert parse_text("\n\n \t\n") == []


def test_error_names_line_and_column() -> None:
    text = "constant (var<int32>:1) -> (tensor<float32>:t)\nadd (tensor<flot32>:a) -> (c)\nfoo () -> ()"
    with pytest.raises(DeepxParseError) as info:
        parse_text(text)
    e = info.value
    assert e.line == 2
    assert e.column == text.splitlines()[1].index("flot32") + 1
    assert "unknown precision 'flot32'" in str(e)
    assert str(e).startswith("line 2, column ")
    assert e.text == "add (tensor<flot32>:a) -> (c)"


ERRORS = [
    ("(tensor:a) -> ()", "expected an op name", 1),
    ("   ", "expected an op name", 4),
    ("1add (a) -> (b)", "expected an op name, got '1add'", 1),
    ("  tensor<float32>:a -> (b)", "expected an op name", 3),
    (
        "add (tensor<float32>:a, tensor<float32>:b) (tensor<float32>:c)",
        "expected '->' between arguments and returns",
        63,
    ),
    ("add", "expected '->'", 4),
    ("add (tensor<flot32>:a) -> (c)", "unknown precision 'flot32'", 13),
    ("add (tensor<float32|bogus>:a) -> (c)", "unknown precision 'bogus'", 21),
    ("add (tensor<>:a) -> (c)", "expected a precision", 13),
    ("newtensor (vector<int32>:[3 4 5) -> (tensor:t)", "unbalanced '['", 26),
    ("newtensor (vector<int32>:3 4 5]) -> (tensor:t)", "unbalanced ']'", 31),
    ("newtensor (vector<int32>:[3, 4]) -> (tensor:t)", "unbalanced '['", 26),
    ("sum (tensor:t, vector<int32>:[0 x]) -> (tensor:s)", "vector item 'x' is not a number", 34),
    ("add (tensor:a, , tensor:b) -> (tensor:c)", "expected a parameter", 16),
    ("add (tensor:a,) -> (tensor:c)", "expected a parameter", 15),
    ("add (a b) -> (c)", "expected ',' between parameters", 7),
    ("add (tensr:a) -> (c)", "unknown parameter category 'tensr'", 6),
    ("add (tensor <float32>:a) -> (c)", "malformed parameter type", 6),
    ("add (tensor:a -> (c)", "expected ')' to close the parameter list", 14),
    ("add (tensor:a tensor:b) -> (c)", "tensor name 'a tensor:b' may not contain", 13),
    ("concat (listtensor:t1 t2) -> (tensor:t)", "expected a tensor list", 20),
    ("concat (listtensor:[t1 (t2)]) -> (tensor:t)", "tensor name '(t2)' may not contain", 25),
    ("add (tensor:) -> (c)", "expected a tensor name", 13),
    ("constant (var<int32>:) -> (tensor:t)", "expected a value", 22),
    ("add (a) -> (b) // not metadata", "expected key=value metadata after '//', got 'not'", 19),
    ("add (a) -> (b) // id=1 x", "got 'x'", 24),
    ("add (a) -> (b) // =1", "got '=1'", 19),
    ("add (a) -> (b c)", "expected ',' between parameters", 14),
]


@pytest.mark.parametrize(("line", "message", "column"), ERRORS)
def test_parse_errors(line: str, message: str, column: int) -> None:
    with pytest.raises(DeepxParseError) as info:
        parse_line(line, 5)
    assert info.value.line == 5
    assert message in str(info.value)
    if column:
        assert info.value.column == column, str(info.value)
    assert 1 <= info.value.column <= len(line) + 1


def test_huge_integer_is_a_parse_error() -> None:
    with pytest.raises(DeepxParseError, match="too long"):
        parse_line(f"constant (var<int32>:{'9' * 5000}) -> (tensor:t)")


ADVERSARIAL_LINES = [
    "op " + "->" * 30000,
    "op (" + "a->b//c=d" * 5000,
    "op () -> (" + "//a=" * 10000,
    "op " + "//a=->" * 8000,
    "op (var<string>:" + ", x" * 20000 + ") -> (" + "//" * 5000,
    "op (" + "var<string>:x->" * 3000 + ") -> ()",
    "op () -> () // " + "a=b=" * 10000 + " x",
    "op (" + "1" * 30000 + "x) -> ()",
    "op (var:" + "1" * 30000 + "x) -> ()",
]


@pytest.mark.timeout(60)  # a hang guard: a regex that backtracks catastrophically takes hours on these
def test_adversarial_lines_are_refused_or_parsed() -> None:
    """Lines built to make a backtracking parser blow up: each is answered (bench/parse.py times them)."""
    for line in ADVERSARIAL_LINES:
        try:
            parse_line(line)
        except DeepxParseError:
            pass


# --- properties -----------------------------------------------------------------------------------------------------

_TYPED_PREFIX = re.compile(r",\s*(tensor|var|vector|listtensor)(<[^<>]*>)?:")
_NUMBERISH = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.I)

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"


def words(first: str, rest: str, max_size: int) -> st.SearchStrategy[str]:
    return st.builds(str.__add__, st.sampled_from(first), st.text(alphabet=rest, max_size=max_size))


op_names = words(_LETTERS, _LETTERS + "0123456789.", 10)
identifiers = words(_LETTERS, _LETTERS + "0123456789.", 8).filter(
    lambda s: s.lower() not in ("true", "false") and not _NUMBERISH.fullmatch(s)
)
tensor_names = st.text(alphabet="abcXYZ0189_.:/<>|=+%-", min_size=1, max_size=10).filter(lambda s: "->" not in s)
precision_names = st.sampled_from([*PRECISIONS, *GROUPS])
precision_lists = st.lists(precision_names, max_size=3).map(tuple)
ints = st.integers(-(2**63), 2**63 - 1)
floats = st.floats(allow_nan=False)
nasty = (
    st.text(alphabet="ab ,:->/()[]<>|=%.\t", max_size=20).map(str.strip).filter(lambda s: not _TYPED_PREFIX.search(s))
)


tensors = st.builds(Param, st.just("tensor"), precision_lists, tensor_names)
scalar_vars = st.builds(
    Param,
    st.just("var"),
    precision_lists.filter(lambda p: "string" not in p),
    st.one_of(st.booleans(), ints, floats, identifiers),
)
vectors = st.builds(
    Param,
    st.just("vector"),
    precision_lists,
    st.one_of(st.lists(st.one_of(ints, floats), max_size=5).map(tuple), identifiers),
)
listtensors = st.builds(Param, st.just("listtensor"), precision_lists, st.lists(tensor_names, max_size=4).map(tuple))
untyped = st.one_of(
    st.text(alphabet="ab19_.%+", min_size=1, max_size=8),
    st.lists(st.integers(-9, 99), max_size=3).map(lambda v: "[" + " ".join(map(str, v)) + "]"),
).map(lambda raw: Param("", (), raw))


def string_vars(in_returns: bool) -> st.SearchStrategy[Param]:
    values = nasty.filter(lambda s: "->" not in s and "//" not in s) if in_returns else nasty
    precisions = precision_lists.map(lambda p: p if "string" in p else ("string", *p))
    return st.builds(Param, st.just("var"), precisions, values)


# (any param, any param but untyped) for the arguments, then for the returns
_CHOICES = {
    returns: (
        st.one_of(tensors, scalar_vars, vectors, listtensors, string_vars(returns), untyped),
        st.one_of(tensors, scalar_vars, vectors, listtensors, string_vars(returns)),
    )
    for returns in (False, True)
}


@st.composite
def param_lists(draw: st.DrawFn, returns: bool) -> tuple[Param, ...]:
    """Params of every category in any order, strings with separators anywhere. Not generated, as the rules cannot
    tell them apart: an untyped param after a string (the string swallows it), and `->` or `//` in a string among
    the returns (the rules read those as the arguments' end or the metadata's start)."""
    any_param, typed_param = _CHOICES[returns]
    out: list[Param] = []
    for _ in range(draw(st.integers(0, 4))):
        after_string = bool(out) and out[-1].category == "var" and "string" in out[-1].precisions
        out.append(draw(typed_param if after_string else any_param))
    return tuple(out)


meta_values = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12)
metas = st.lists(st.tuples(identifiers, meta_values), max_size=3).map(tuple)
instrs = st.builds(Instr, op_names, param_lists(False), param_lists(True), metas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instrs)
def test_format_parse_round_trip(instr: Instr) -> None:
    line = format_text(instr)
    assert same(parse_line(line), instr), line
    assert same(text_module._parse_general(line), instr), line
    assert parse_text(f"\n{line}\n\n{line}") == [instr, instr]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instrs)
def test_text_msgpack_text_chain(instr: Instr) -> None:
    line = format_text(instr)
    back = unpack_instr(pack_instr(parse_line(line)))
    assert same(back, instr)
    assert format_text(back) == line


FRAGMENTS = [
    "add", " ", "\t", "(", ")", ",", "->", "//", ":", "<", ">", "|", "[", "]", "=", "\n", "\r",
    "tensor", "var", "vector", "listtensor", "<float32>", "<string>", "<flot>", ":a", ":7", ":[1 2]", ":[",
    "True", "1e5", "nan", "id=3", "x", "-", "/", "string", "<int32|bool>",
]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=80), st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)))
def test_arbitrary_text_parses_or_raises_parse_error(text: str) -> None:
    try:
        got = parse_text(text)
    except DeepxParseError as e:
        assert e.line >= 1 and e.column >= 1
    else:
        assert isinstance(got, list) and all(isinstance(i, Instr) for i in got)
