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
import threading
from typing import Any

import msgpack

from deepx_core.errors import DeepxError

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 30  # 1 GiB


_packers = threading.local()


def pack_frame(obj: dict[str, Any]) -> bytes:
    """One frame: its header and `obj` packed, by a packer kept per thread (msgpack.packb makes one, with its
    buffer, per call: twice the time of a reply's packing)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    body = packer.pack(obj)
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes | memoryview) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for bad input
        raise DeepxError(f"malformed frame: not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise DeepxError(f"malformed frame: expected a map, got {type(obj).__name__}")
    return obj
