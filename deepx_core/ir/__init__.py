"""deepxIR: instructions as values (Param, Instr, Program), their text form and their msgpack form."""

from deepx_core.ir import dtypes
from deepx_core.ir.effects import Change, Effect, apply_effect
from deepx_core.ir.instr import Instr, Param, Program
from deepx_core.ir.ops import OPS, Bound, OpDef, SymbolicEnv, TensorMeta, bind, check_program
from deepx_core.ir.text import format_text, parse_line, parse_text
from deepx_core.ir.wire import pack_instr, pack_program, unpack_instr, unpack_program

__all__ = [
    "OPS",
    "Bound",
    "Change",
    "Effect",
    "Instr",
    "OpDef",
    "Param",
    "Program",
    "SymbolicEnv",
    "TensorMeta",
    "apply_effect",
    "bind",
    "check_program",
    "dtypes",
    "format_text",
    "pack_instr",
    "pack_program",
    "parse_line",
    "parse_text",
    "unpack_instr",
    "unpack_program",
]
