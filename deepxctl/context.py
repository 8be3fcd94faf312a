"""Where a command's answers come from: the daemon at --address (native socket), or the storage plane at --kv."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import click

from deepxctl.term import CtlError

if TYPE_CHECKING:
    from deepx_core.client import NativeClient


class Source(Protocol):
    where: str
    answered_by: str  # the header line of a listing: which daemon (node, pid, socket) or plane answered

    def query(self, what: str) -> Any: ...
    def heapmem(self) -> dict[str, Any] | None: ...
    def close(self) -> None: ...


class DaemonSource:
    """A deepxd, over its native socket; admin queries answer everything."""

    def __init__(self, address: str, timeout: float, *, default: bool = False, **remote: Any) -> None:
        from deepx_core.client import NativeClient

        self.address = address
        self.where = f"deepxd at {address}"
        self.client: NativeClient = NativeClient(address, timeout=timeout, client="deepxctl", **remote)
        # which daemon answered: another process's may own the default socket
        self.answered_by = (f"deepxd {self.node} (pid {self.client.server.get('pid', '?')}) at {address}"
                            + (" (the default socket; --address or DEEPX_ADDRESS picks another)" if default else ""))

    @property
    def node(self) -> str:
        return str(self.client.server.get("node", "?"))

    def query(self, what: str) -> Any:
        return self.client.admin(what)

    def heapmem(self) -> dict[str, Any] | None:
        pool = self.query("memory").get("heapmem")
        return pool or None

    def close(self) -> None:
        self.client.close()


class Ctl:
    """The global options and the one connection a command opens (closed when the command ends)."""

    def __init__(self, address: str | None, kv: str | None, kv_prefix: str, timeout: float, *,
                 kv_password_file: str | None = None, token_file: str | None = None, tls: bool = False,
                 tls_cafile: str | None = None) -> None:
        self._address = address
        self.token_file = token_file
        self.tls = tls
        self.tls_cafile = tls_cafile
        self.kv = kv
        self.kv_password_file = kv_password_file
        self.kv_prefix = kv_prefix
        self.timeout = timeout
        self._daemon: DaemonSource | None = None
        self.answered_by = ""  # the source the command used, once it has one (term shows it above a listing)

    @property
    def address(self) -> str:
        """--address, else DEEPX_ADDRESS, else the default socket (resolved only when a command needs it); a usage
        error (exit code 2) where it is not a unix:// or tcp:// URL."""
        if not self._address:
            from deepx_core.paths import default_address

            self._address = default_address()
        if not self._address.startswith(("unix://", "tcp://")):
            hint = f"unix://{self._address}" if self._address.startswith("/") else "unix:///path/to/deepxd.sock"
            raise CtlError(f"--address {self._address!r} is not a daemon address: give its native socket as {hint} "
                           "or its TCP listener as tcp://HOST:PORT (deepxIR over UDP to udp://host:port goes through "
                           "`deepxctl ir --udp HOST:PORT`)", exit_code=2)
        return self._address

    def remote(self) -> dict[str, Any]:
        """NativeClient's arguments for a tcp:// address: the token (--token-file, else DEEPX_TOKEN, which the client
        reads itself) and TLS; none for the Unix socket, which asks no token."""
        if not self.address.startswith("tcp://"):
            return {}
        out: dict[str, Any] = {}
        if self.token_file:
            from deepx_core.auth import read_secret_file

            out["token"] = read_secret_file(self.token_file, "--token-file", "token")
        if self.tls or self.tls_cafile:
            out["tls"] = True
            out["cafile"] = self.tls_cafile
        return out

    def source(self) -> Source:
        """The storage plane when --kv is given, else the daemon."""
        if self.kv:
            from deepxctl.plane import PlaneSource

            password = None
            if self.kv_password_file:
                from deepxd.kv.base import read_password_file

                password = read_password_file(self.kv_password_file)
            plane = PlaneSource(self.kv, self.kv_prefix, password=password)
            self.answered_by = plane.answered_by
            return plane
        return self.daemon()

    def daemon(self, why: str = "") -> DaemonSource:
        """The daemon; refused under --kv for what only a running daemon knows (`why` names it)."""
        if self.kv:
            raise CtlError(f"{why or 'this command'} need a running deepxd, which --kv does not reach; drop --kv "
                           "and give --address")
        if self._daemon is None:
            default = not self._address
            self._daemon = DaemonSource(self.address, self.timeout, default=default, **self.remote())
            self.answered_by = self._daemon.answered_by
            click.get_current_context().call_on_close(self.close)
        return self._daemon

    def close(self) -> None:
        if self._daemon is not None:
            self._daemon.close()
            self._daemon = None
