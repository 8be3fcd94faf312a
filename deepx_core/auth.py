"""A daemon's TCP door: a shared token, proved by an HMAC challenge and answer in the connection's first exchange,
never sent itself. The daemon (deepxd/net/native.py) and the client (deepx_core/client.py) both speak it from here.

    daemon -> client   {id: 0, ok: true, op: "challenge", auth: "hmac-sha256", nonce: 32 random bytes}
    client -> daemon   {id: 0, op: "auth", answer: HMAC(token, CLIENT_CONTEXT + nonce), nonce: 32 random bytes}
    daemon -> client   {id: 0, ok: true, answer: HMAC(token, SERVER_CONTEXT + client's nonce + daemon's nonce)}
                       or {id: 0, ok: false, error: ...}, and the connection closed

A listener without a token (loopback only) sends `auth: "none"` and no nonce. docs/decisions/0026-tcp-token.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from deepx_core.errors import DeepxError

AUTH = "hmac-sha256"
NONCE_BYTES = 32
#: what each side's answer is about: different for the two sides, so that a daemon's answer cannot be sent back to it
CLIENT_CONTEXT = b"deepx native protocol 1: the client holds the token\0"
SERVER_CONTEXT = b"deepx native protocol 1: the daemon holds the token\0"
#: fewer characters than this can be guessed offline from one challenge and its answer seen on the wire
MIN_TOKEN_CHARS = 16


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_answer(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), CLIENT_CONTEXT + nonce, hashlib.sha256).digest()


def server_answer(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), SERVER_CONTEXT + client_nonce + server_nonce, hashlib.sha256).digest()


def answer_matches(expected: bytes, got: object) -> bool:
    """Whether `got` is the expected answer, compared in constant time."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)


def check_token(token: str, what: str = "token") -> str:
    """The token, refused where too short to resist guessing."""
    if len(token) < MIN_TOKEN_CHARS:
        raise DeepxError(f"{what}: the token has {len(token)} characters, too few to resist guessing (at least "
                         f"{MIN_TOKEN_CHARS}); make one with `openssl rand -hex 32`")
    return token


def read_secret_file(path: str, what: str, secret: str = "secret") -> str:
    """A secret (a token, a password) from a file: its first line, without the line end. A file that others can
    read is refused, as ssh refuses such a private key. `what` names the setting in errors, `secret` the secret."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise DeepxError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DeepxError(f"{what}: {path} is not a regular file")
        if st.st_mode & 0o077:
            raise DeepxError(f"{what}: {path} can be read by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                             f"chmod 600 {path}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(4096)
    finally:
        os.close(fd)
    line = raw.decode("utf-8", "replace").splitlines()[0] if raw.strip() else ""
    if not line:
        raise DeepxError(f"{what}: {path} is empty; its first line is the {secret}")
    return line


def token_from_env() -> str | None:
    """A client's token from the environment: DEEPX_TOKEN, else the file DEEPX_TOKEN_FILE names; None for neither."""
    token = os.environ.get("DEEPX_TOKEN", "").strip()
    if token:
        return token
    path = os.environ.get("DEEPX_TOKEN_FILE", "").strip()
    return read_secret_file(path, "DEEPX_TOKEN_FILE", "token") if path else None
