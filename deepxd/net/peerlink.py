"""A peer link's bulk read: another node's heap tensor, read in bounded chunks over a native connection
(deepx_core.client.NativeClient: a Unix socket, or TCP with the token's challenge both ways), several requests in
flight, each reply's bytes received straight into the destination array.

    -> {id, op: "peer_read", name, handle, ctime, offset, length}     (length <= CHUNK_MAX)
    <- {id, ok: true, offset, data: <length bytes>}                   (`data` last: see recv_chunk)

The receiver checks each reply's fields and reads its bytes into place without a copy of its own; a reply that is
not the expected chunk is read whole and unpacked (an error, or a peer that packed it otherwise).
"""

from __future__ import annotations

import socket
from collections import deque
from typing import Any

import msgpack
import numpy as np

from deepx_core.client import NativeClient
from deepx_core.errors import DeepxError
from deepxd.net.frames import HEADER

#: bytes per chunk: large enough that a request's round trip is small beside its copy, small enough to bound frames
CHUNK_BYTES = 4 << 20
#: the largest chunk a serving node reads for one request
CHUNK_MAX = 16 << 20
#: chunk requests in flight on one connection: the peer sends the next while this side copies one in
WINDOW = 4
#: a chunk reply's fields before its bytes are fewer than this
_FIELDS_MAX = 256


def bin_header(n: int) -> bytes:
    """msgpack's header of a bin of `n` bytes."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


#: a reply whose last field is a buffer this large goes out without being packed into its frame (split_frame)
LARGE_BIN = 1 << 16
#: ... in slices this large, each sent (or buffered) before the next: Python 3.11's transport, which sends from the
#: front of one buffer and deletes what went, moved the rest of a 4 MiB buffer after every send
SLICE_BYTES = 256 << 10


def split_frame(reply: dict[str, Any]) -> tuple[bytes, memoryview] | None:
    """A reply whose last value (followed into the last value of a map, as a fetch's `tensors` and their `data`) is
    a buffer of LARGE_BIN bytes or more, as its frame's head (the length, what comes before the buffer, the bin's
    header) and that buffer, to be written one after the other: the frame is the same as pack_frame's, without the
    copy into it. None for any other reply."""
    path: list[tuple[dict[str, Any], Any]] = []
    value: Any = reply
    while isinstance(value, dict) and value:
        key = next(reversed(value))
        path.append((value, key))
        value = value[key]
    if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) < LARGE_BIN:
        return None
    view = memoryview(value)
    if not view.c_contiguous:
        return None
    view = view.cast("B")
    emptied: Any = b""
    for mapping, key in reversed(path):  # the same maps, the buffer replaced by an empty bin
        emptied = {**mapping, key: emptied}
    fields = msgpack.packb(emptied, use_bin_type=True)  # (ends with the empty bin: c4 00)
    header = bin_header(len(view))
    return HEADER.pack(len(fields) - 2 + len(header) + len(view)) + fields[:-2] + header, view


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise DeepxError("the peer closed the connection")
        got += k


def recv_chunk(sock: socket.socket, dest: memoryview, rid: int, offset: int) -> None:
    """One chunk reply into `dest`: its fields read and checked, then its bytes straight into place."""
    head = bytearray(HEADER.size)
    _recv_into(sock, memoryview(head))
    (n,) = HEADER.unpack(head)
    want = len(dest)
    if n > want + _FIELDS_MAX + 4096:
        raise DeepxError(f"a reply of {n} bytes came for a chunk of {want}: refused (frames are bounded)")
    header = bin_header(want)
    k = n - want
    if len(header) < k < _FIELDS_MAX:
        prefix = bytearray(k)
        _recv_into(sock, memoryview(prefix))
        if prefix.endswith(header):
            try:  # the fields, with the bin emptied: a map whose `data` is b""
                fields = msgpack.unpackb(bytes(prefix[:-len(header)]) + b"\xc4\x00", raw=False)
            except Exception:
                fields = None
            if (isinstance(fields, dict) and fields.get("ok") is True and fields.get("id") == rid
                    and fields.get("offset") == offset and fields.get("data") == b""):
                _recv_into(sock, dest)
                return
        rest = bytearray(n - k)
        _recv_into(sock, memoryview(rest))
        body = bytes(prefix) + bytes(rest)
    else:
        buf = bytearray(n)
        _recv_into(sock, memoryview(buf))
        body = bytes(buf)
    try:
        reply: Any = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:
        raise DeepxError(f"a chunk reply is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise DeepxError(str(reply.get("error") if isinstance(reply, dict) else reply) or "peer_read failed")
    data = reply.get("data")
    if reply.get("id") != rid or reply.get("offset") != offset or not isinstance(data, bytes) or len(data) != want:
        raise DeepxError(f"the peer answered the chunk at {offset} with another one")
    dest[:] = data


def read_chunks(client: NativeClient, name: str, handle: str, ctime: str, dest: np.ndarray,
                chunk: int = CHUNK_BYTES) -> None:
    """Fill `dest` (a flat uint8 array) with the bytes of heap tensor `name` (its segment `handle`, made at `ctime`:
    a tensor of that name made again meanwhile is refused by the peer) of the node at the other end of `client`,
    WINDOW chunk requests in flight. Blocking; DeepxError naming what went wrong (the connection is then unusable)."""
    total = int(dest.nbytes)
    view = memoryview(dest.data).cast("B")
    offsets = range(0, total, chunk)
    pending: deque[tuple[int, int, int]] = deque()
    sent = 0
    try:
        while sent < len(offsets) or pending:
            while sent < len(offsets) and len(pending) < WINDOW:
                offset = offsets[sent]
                length = min(chunk, total - offset)
                sent += 1
                client.send_frame({"id": sent, "op": "peer_read", "name": name, "handle": handle, "ctime": ctime,
                                   "offset": offset, "length": length})
                pending.append((sent, offset, length))
            rid, offset, length = pending.popleft()
            recv_chunk(client.sock, view[offset:offset + length], rid, offset)
    except TimeoutError:
        raise DeepxError(f"{client.address} sent nothing for {client.sock.gettimeout()} s in the middle of the "
                         "transfer") from None
    except OSError as e:
        raise DeepxError(f"lost the connection to {client.address}: {e.strerror or e}") from None
