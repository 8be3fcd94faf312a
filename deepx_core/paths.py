"""Where a deepxd listens by default, shared by the daemon, the SDK and deepxctl."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from deepx_core.errors import DeepxError


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/deepx, else <tmp>/deepx-<uid>: a private directory (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "deepx"
    return Path(tempfile.gettempdir()) / f"deepx-{os.getuid()}"


def default_socket() -> str:
    return str(runtime_dir() / "deepxd.sock")


def default_address() -> str:
    """DEEPX_ADDRESS, else the default socket as a unix:// URL."""
    return os.environ.get("DEEPX_ADDRESS") or f"unix://{default_socket()}"


def tcp_address(address: str, what: str = "address") -> tuple[str, int]:
    """The host and port of `tcp://HOST:PORT` (an IPv6 host in brackets: `tcp://[::1]:7070`); port 0 asks for a
    free one (a listener's)."""
    hint = f"{what}: {address!r} must be tcp://HOST:PORT (tcp://127.0.0.1:7070, tcp://[::1]:7070)"
    if not address.startswith("tcp://"):
        raise DeepxError(hint)
    host, sep, port = address.removeprefix("tcp://").rstrip("/").rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise DeepxError(f"{hint}: an IPv6 host goes in brackets")
    try:
        p = int(port)
    except ValueError:
        raise DeepxError(hint) from None
    if not sep or not host or not 0 <= p < 65536:
        raise DeepxError(hint)
    return host, p


def private_socket_dir() -> Path:
    """The runtime directory, made if need be; where another user took it (a squatted /tmp/deepx-<uid>), a fresh
    private temporary directory instead, as ssh-agent makes one (an embedded session's socket has no fixed name that
    clients guess: its pid is in it)."""
    d = runtime_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_socket_dir(d)
        return d
    except (OSError, DeepxError) as e:
        fresh = Path(tempfile.mkdtemp(prefix=f"deepx-{os.getuid()}-"))
        logging.getLogger(__name__).warning("%s cannot hold a private socket (%s); using %s", d, e, fresh)
        return fresh


def check_socket_dir(directory: str | os.PathLike[str], *, uid: int | None = None) -> None:
    """Refuse a socket's directory that another user could use to take the socket over: one owned by another user
    than `uid` (this process's) or root, or one that group or others can write without the sticky bit (as in /tmp,
    where nobody may remove or rename another's file). A link to a directory is judged by the link's owner and by
    the directory's (a link's own mode means nothing)."""
    uid = os.geteuid() if uid is None else uid
    path = str(directory)
    hint = "choose --listen unix:///a/private/dir/deepxd.sock"
    for st, what in _dir_stats(path):
        if st.st_uid not in (uid, 0):
            raise DeepxError(f"socket directory {path}: {what} belongs to uid {st.st_uid}, not to this user "
                             f"(uid {uid}) or root, so its owner could take over the socket; remove it, or {hint}")
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode) and mode & 0o022 and not mode & stat.S_ISVTX:
            who = "others" if mode & 0o002 else "its group"
            raise DeepxError(f"socket directory {path}: {what} can be written by {who} (mode {mode:04o}), who "
                             f"could replace the socket; chmod 700 {path}, or {hint}")


def _dir_stats(path: str) -> list[tuple[os.stat_result, str]]:
    try:
        link = os.lstat(path)
        if not stat.S_ISLNK(link.st_mode):
            if not stat.S_ISDIR(link.st_mode):
                raise DeepxError(f"socket directory {path} is not a directory")
            return [(link, "the directory")]
        target = os.stat(path)
    except FileNotFoundError:
        raise DeepxError(f"socket directory {path} does not exist") from None
    if not stat.S_ISDIR(target.st_mode):
        raise DeepxError(f"socket directory {path} is not a directory")
    return [(link, "the link"), (target, "the directory it links to")]
