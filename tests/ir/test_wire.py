"""The msgpack codec of instructions: exact encoding, round trips, and DeepxError for every malformed payload."""

from __future__ import annotations

import math
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepx_core.errors import DeepxError
from deepx_core.ir import (
    Instr,
    Param,
    Program,
    format_text,
    pack_instr,
    pack_program,
    parse_line,
    unpack_instr,
    unpack_program,
)
from deepx_core.ir.dtypes import GROUPS, PRECISIONS
from deepx_core.ir.wire import instr_from_obj, instr_to_obj

SUM = Instr(
    "sum",
    (Param("tensor", ("float32",), "t"), Param("vector", ("int32",), (0, 2)), Param("var", ("bool",), False)),
    (Param("tensor", ("float32",), "s"),),
    (("author", "miaobyte"), ("created_at", "1744724799.11")),
)
CONCAT = Instr(
    "concat",
    (Param("listtensor", ("float32", "int32"), ("t1", "t2")), Param("var", ("int32",), 1)),
    (Param("tensor", (), "t"),),
)
PRINT = Instr("print", (Param("tensor", ("float32",), "t"), Param("var", ("string",), "a, b -> c // x")), (), ())
UNTYPED = Instr("add", (Param("", (), "a"), Param("", (), "b")), (Param("", (), "c"),))


def typed(x: object) -> object:
    if isinstance(x, tuple):
        return tuple(typed(v) for v in x)
    if isinstance(x, float) and math.isnan(x):
        return ("float", "nan")
    return (type(x).__name__, x)


def test_encoding_shape() -> None:
    assert instr_to_obj(SUM) == [
        "sum",
        [["tensor", "float32", "t"], ["vector", "int32", [0, 2]], ["var", "bool", False]],
        [["tensor", "float32", "s"]],
        [["author", "miaobyte"], ["created_at", "1744724799.11"]],
    ]
    assert instr_to_obj(CONCAT)[1][0] == ["listtensor", "float32|int32", ["t1", "t2"]]
    assert instr_to_obj(CONCAT)[2] == [["tensor", "", "t"]]
    assert msgpack.unpackb(pack_instr(SUM), raw=False) == instr_to_obj(SUM)


@pytest.mark.parametrize("instr", [SUM, CONCAT, PRINT, UNTYPED, Instr("noop")])
def test_round_trip(instr: Instr) -> None:
    back = unpack_instr(pack_instr(instr))
    assert back == instr
    assert typed(tuple(back)) == typed(tuple(instr))
    assert isinstance(back.args, tuple) and all(isinstance(p, Param) for p in back.args)
    assert instr_from_obj(instr_to_obj(instr)) == instr


def test_tuples_come_back_as_tuples_and_bools_as_bools() -> None:
    back = unpack_instr(pack_instr(SUM))
    assert back.args[1].value == (0, 2) and isinstance(back.args[1].value, tuple)
    assert back.args[2].value is False
    assert isinstance(back.meta, tuple) and back.meta[0] == ("author", "miaobyte")


def test_program_round_trip() -> None:
    instrs = [SUM, CONCAT, PRINT, UNTYPED]
    data = pack_program(instrs)
    assert msgpack.unpackb(data, raw=False)["v"] == 1
    assert unpack_program(data) == instrs
    assert Program.unpack(Program(instrs).pack()) == Program(instrs)
    assert unpack_program(pack_program([])) == []


def test_numpy_scalars_encode_as_plain_numbers() -> None:
    instr = Instr("op", (Param("var", ("float32",), np.float32(0.5)), Param("vector", ("int32",), (np.int64(3),))))
    back = unpack_instr(pack_instr(instr))
    assert typed(back.args[0].value) == ("float", 0.5)
    assert typed(back.args[1].value) == (("int", 3),)


def test_nan_survives() -> None:
    back = unpack_instr(pack_instr(Instr("op", (Param("var", ("float32",), math.nan),))))
    assert math.isnan(back.args[0].value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "instr",
    [
        Instr("op", (Param("var", ("int64",), 2**70),)),
        Instr("op", (Param("var", ("int64",), object()),)),  # type: ignore[arg-type]
        "not an instruction",
    ],
)
def test_unencodable_raises_deepx_error(instr: object) -> None:
    with pytest.raises(DeepxError):
        pack_instr(instr)  # type: ignore[arg-type]


def packed(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


GOOD = instr_to_obj(SUM)

MALFORMED = [
    (b"", "malformed msgpack"),
    (b"\xc1", "malformed msgpack"),
    (pack_instr(SUM)[:-3], "malformed msgpack"),
    (pack_instr(SUM) + b"\x00", "malformed msgpack"),
    (b"\x92\xa3abc", "malformed msgpack"),
    (b"\x81\x01\x02", "malformed msgpack"),  # a map with an int key
    (b"\x91\xa2\xff\xfe", "malformed msgpack"),  # invalid utf-8
    (packed(None), "expected [name, args, returns, meta]"),
    (packed({"name": "add"}), "expected [name, args, returns, meta]"),
    (packed(["add", [], []]), "expected [name, args, returns, meta]"),
    (packed([1, [], [], []]), "op name"),
    (packed(["", [], [], []]), "op name"),
    (packed([b"add", [], [], []]), "op name"),
    (packed(["add", "x", [], []]), "arguments must be a list"),
    (packed(["add", [], {}, []]), "returns must be a list"),
    (packed(["add", [["tensor", "float32"]], [], []]), "argument 0: expected [category, precisions, value]"),
    (packed(["add", [["tensr", "float32", "a"]], [], []]), "unknown category"),
    (packed(["add", [["tensor", ["float32"], "a"]], [], []]), "precisions must be a string"),
    (packed(["add", [["tensor", "float32|flot", "a"]], [], []]), "unknown precision 'flot'"),
    (packed(["add", [["tensor", "float32", 7]], [], []]), "a tensor value is a name"),
    (packed(["add", [["tensor", "float32", ""]], [], []]), "a tensor value is a name"),
    (packed(["add", [["tensor", "float32", ["a"]]], [], []]), "a tensor value is a scalar"),
    (packed(["add", [["listtensor", "float32", "a"]], [], []]), "list of tensor names"),
    (packed(["add", [["listtensor", "float32", ["a", 1]]], [], []]), "list of tensor names"),
    (packed(["add", [["vector", "int32", [1, "x"]]], [], []]), "list of numbers"),
    (packed(["add", [["vector", "int32", [1, True]]], [], []]), "list of numbers"),
    (packed(["add", [["vector", "int32", [[1]]]], [], []]), "list of numbers"),
    (packed(["add", [["var", "int32", None]], [], []]), "a bool, int, float or string"),
    (packed(["add", [["var", "int32", b"raw"]], [], []]), "a bool, int, float or string"),
    (packed(["add", [["var", "int32", {"a": 1}]], [], []]), "a bool, int, float or string"),
    (packed(["add", [], [["tensor", "float32", None]], []]), "return 0"),
    (packed(["add", [], [], {"id": "1"}]), "metadata must be a list"),
    (packed(["add", [], [], [["id"]]]), "metadata entries"),
    (packed(["add", [], [], [["id", 1]]]), "metadata entries"),
    (packed(["add", [], [], [["", "1"]]]), "metadata entries"),
    (msgpack.packb(msgpack.ExtType(5, b"x")), "expected [name, args, returns, meta]"),
]


@pytest.mark.parametrize(("data", "message"), MALFORMED)
def test_malformed_instr_raises_deepx_error(data: bytes, message: str) -> None:
    with pytest.raises(DeepxError) as info:
        unpack_instr(data)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (packed([GOOD]), "expected a map"),
        (packed({"instrs": [GOOD]}), "unsupported version None"),
        (packed({"v": 2, "instrs": [GOOD]}), "unsupported version 2"),
        (packed({"v": True, "instrs": [GOOD]}), "unsupported version True"),
        (packed({"v": 1}), "'instrs' must be a list"),
        (packed({"v": 1, "instrs": [GOOD, ["add"]]}), "program instruction 1"),
        (b"\x82\xa1v\x01", "malformed msgpack"),
    ],
)
def test_malformed_program_raises_deepx_error(data: bytes, message: str) -> None:
    with pytest.raises(DeepxError) as info:
        unpack_program(data)
    assert message in str(info.value)


def test_not_bytes_is_a_deepx_error() -> None:
    with pytest.raises(DeepxError, match="expected msgpack bytes"):
        unpack_instr("add () -> ()")  # type: ignore[arg-type]
    assert unpack_instr(bytearray(pack_instr(SUM))) == SUM
    assert unpack_instr(memoryview(pack_instr(SUM))) == SUM


# --- properties: msgpack carries any string, so these generate far wider values than the text tests ------------------

precisions = st.lists(st.sampled_from([*PRECISIONS, *GROUPS]), max_size=3).map(tuple)
names = st.text(min_size=1, max_size=12)
numbers = st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False))
params = st.one_of(
    st.builds(Param, st.just("tensor"), precisions, names),
    st.builds(Param, st.just("var"), precisions, st.one_of(st.booleans(), numbers, st.text(max_size=20))),
    st.builds(Param, st.just("vector"), precisions, st.one_of(st.lists(numbers, max_size=5).map(tuple), names)),
    st.builds(Param, st.just("listtensor"), precisions, st.lists(names, max_size=4).map(tuple)),
    st.builds(Param, st.just(""), st.just(()), st.text(max_size=12)),
)
instrs = st.builds(
    Instr,
    st.text(min_size=1, max_size=12),
    st.lists(params, max_size=4).map(tuple),
    st.lists(params, max_size=3).map(tuple),
    st.lists(st.tuples(st.text(min_size=1, max_size=8), st.text(max_size=8)), max_size=3).map(tuple),
)


@settings(max_examples=100, deadline=None)
@given(instrs)
def test_pack_unpack_round_trip(instr: Instr) -> None:
    back = unpack_instr(pack_instr(instr))
    assert typed(tuple(back)) == typed(tuple(instr))
    assert instr_from_obj(instr_to_obj(instr)) == instr


@settings(max_examples=30, deadline=None)
@given(st.lists(instrs, max_size=5))
def test_program_pack_unpack_round_trip(program: list[Instr]) -> None:
    assert unpack_program(pack_program(program)) == program


def _decode_or_deepx_error(decode: Callable[[bytes], object], data: bytes) -> None:
    try:
        decode(data)
    except DeepxError:
        pass


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64), instrs.map(pack_instr).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n]))
    )
)
def test_arbitrary_bytes_decode_or_raise_deepx_error(data: bytes) -> None:
    _decode_or_deepx_error(unpack_instr, data)
    _decode_or_deepx_error(unpack_program, data)


json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(), st.text(max_size=5), st.binary(max_size=3)),
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(st.one_of(json_like, st.lists(json_like, min_size=4, max_size=4)))
def test_arbitrary_objects_decode_or_raise_deepx_error(obj: object) -> None:
    _decode_or_deepx_error(unpack_instr, packed(obj))
    _decode_or_deepx_error(unpack_program, packed({"v": 1, "instrs": [obj]}))
    try:
        instr_from_obj(obj)
    except DeepxError:
        pass


def test_text_survives_msgpack() -> None:
    line = "print (tensor<float32>:t, var<string>:a, b -> c // x) -> () // id=3"
    assert format_text(unpack_instr(pack_instr(parse_line(line)))) == format_text(parse_line(line))


def test_decoded_vectors_keep_the_types_of_their_numbers() -> None:
    """The decoder remembers parameters; a vector (0,) decoded first must not stand in for (0.0,) or
    (-0.0,), which compare equal to it."""
    for v in [(0,), (0.0,), (-0.0,), (1,), (1.0,), (2, 2.0)]:
        instr = Instr("constant", (Param("vector", (), v),), ())
        back = unpack_instr(pack_instr(instr)).args[0].value
        assert [(type(x), str(x)) for x in back] == [(type(x), str(x)) for x in v]
