"""deepxd/net/peerlink.py: a reply's large trailing buffer written without its copy into the frame (the same bytes
as pack_frame's), and a chunk received in place, or read whole where the peer packed it otherwise or refused."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepxd.net.frames import pack_frame
from deepxd.net.peerlink import LARGE_BIN, recv_chunk, split_frame


def test_a_split_frame_is_the_packed_frame() -> None:
    data = np.arange(LARGE_BIN, dtype=np.uint8)
    chunk = {"id": 3, "ok": True, "offset": 4096, "data": data.data}
    fetch = {"id": 4, "ok": True, "tensors": {"a": {"dtype": "float32", "shape": [2], "data": b"12345678"},
                                              "w": {"dtype": "uint8", "shape": [LARGE_BIN], "data": data.data}}}
    for reply in (chunk, fetch):
        split = split_frame(reply)
        assert split is not None
        head, view = split
        assert head + bytes(view) == pack_frame(reply)
    assert split_frame({"id": 1, "ok": True, "offset": 0, "data": b"small"}) is None
    assert split_frame({"id": 1, "ok": True, "data": bytes(LARGE_BIN), "offset": 0}) is None  # not last
    assert split_frame({}) is None


def received(reply: dict, want: int, rid: int = 1, offset: int = 0) -> np.ndarray:
    """`reply` sent as a frame down a socket pair, received as the chunk (rid, offset) of `want` bytes."""
    a, b = socket.socketpair()
    dest = np.zeros(want, np.uint8)
    sender = threading.Thread(target=a.sendall, args=(pack_frame(reply),))
    sender.start()
    try:
        recv_chunk(b, memoryview(dest.data).cast("B"), rid, offset)
    finally:
        sender.join()
        a.close()
        b.close()
    return dest


def test_a_chunk_is_received_in_place_or_read_whole() -> None:
    data = np.random.default_rng(0).integers(0, 255, 70000, dtype=np.uint8)
    np.testing.assert_array_equal(received({"id": 1, "ok": True, "offset": 0, "data": data.tobytes()}, 70000), data)
    # packed in another order: read whole, and still the chunk
    np.testing.assert_array_equal(received({"data": data.tobytes(), "id": 1, "offset": 0, "ok": True}, 70000), data)
    np.testing.assert_array_equal(received({"id": 1, "ok": True, "offset": 0, "data": b"abc"}, 3),
                                  np.frombuffer(b"abc", np.uint8))
    with pytest.raises(DeepxError, match="changed while it was read"):
        received({"id": 1, "ok": False, "error": "heapmem: heap tensor 'w' changed while it was read"}, 70000)
    with pytest.raises(DeepxError, match="answered the chunk at 0 with another one"):
        received({"id": 1, "ok": True, "offset": 4, "data": data.tobytes()}, 70000)
