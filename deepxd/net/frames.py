"""The native wire: length-prefixed msgpack frames (4-byte big-endian length, then one msgpack map).

Requests carry `id` and `op`; every request gets exactly one reply with the same `id`, `ok`, and either the op's
fields or `error`. Tensor bytes travel as msgpack bin. No pickle.

| op      | request fields                                   | reply fields                                  |
| ------- | ------------------------------------------------ | --------------------------------------------- |
| hello   | version, client                                  | version, node, roles, max_frame               |
| run     | program, fetch (names)                           | done, error, error_index, times, output,      |
|         | (instructions as [name, args, returns, meta]     | tensors                                       |
|         | objects, or each msgpack-packed as bin)          |                                               |
| fetch   | names                                            | tensors {name: {dtype, shape, data}}          |
| put     | name, dtype, shape, data, heap (bool)            | -                                             |
| delete  | name, force                                      | tensor                                        |
| admin   | what (tensors, ops, nodes, actors, memory,       | result                                        |
|         | graphs, config)                                  |                                               |
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from deepx_core.errors import DeepxError

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 30  # 1 GiB


def pack_frame(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes | memoryview) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for bad input
        raise DeepxError(f"malformed frame: not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise DeepxError(f"malformed frame: expected a map, got {type(obj).__name__}")
    return obj
