"""The reply line of deepxIR over UDP (docs/deepxir.md: one reply per line), with nothing else imported: deepxd's UDP
transport and `deepxctl ir` (whose commands must import little) write the very same lines."""

from __future__ import annotations

__all__ = ["MAX_DATAGRAM", "TRUNCATED", "format_reply"]

#: the largest reply datagram: the largest UDP payload over IPv4 (65,535 less 20 bytes of IP header and 8 of UDP
#: header). sendto refuses a larger one (EMSGSIZE), and the sender, waiting for its reply, would hang
MAX_DATAGRAM = 65507
#: the end of a reply message cut to fit MAX_DATAGRAM (an error naming a very long tensor name, say)
TRUNCATED = "... (truncated)"


def format_reply(rid: int, ok: bool, recv_ms: int, start_ms: int, finish_ms: int, message: str = "") -> str:
    """One reply line; an error's message made one line, and cut (on a character boundary, ending with TRUNCATED)
    where the reply would not fit one datagram: the id and times always arrive whole."""
    head = f"{rid} {'ok' if ok else 'error'}// recv_at={recv_ms} start_at={start_ms} finish_at={finish_ms}"
    if ok:
        return head
    reply = f"{head} {' '.join(message.split())}"
    if len(reply) * 4 <= MAX_DATAGRAM:  # four UTF-8 bytes a character at most: it fits
        return reply
    data = reply.encode("utf-8", "replace")
    if len(data) <= MAX_DATAGRAM:
        return reply
    # a character cut in two at the end is dropped ("ignore" drops only the broken tail: the rest is whole UTF-8)
    return data[: MAX_DATAGRAM - len(TRUNCATED)].decode("utf-8", "ignore") + TRUNCATED
