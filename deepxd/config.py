"""One typed configuration: defaults < config file (TOML) < DEEPX_* environment variables < command-line flags."""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepx_core.auth import check_token, read_secret_file
from deepx_core.errors import DeepxError
from deepx_core.paths import default_socket, tcp_address

ALL_ROLES = ("registry", "heapmem", "scheduler", "op-cpu", "op-cuda")


@dataclass
class Config:
    node_id: str = ""  # default: the host name
    roles: list[str] = field(default_factory=list)  # default: every role this machine can run
    kv: str = "memory"  # memory | memory:///path/file | redis://host:port/db
    kv_password: str = ""  # a Redis password (config file or DEEPX_KV_PASSWORD; never a flag: docs/storage.md)
    kv_password_file: str = ""  # a file whose first line is the Redis password (mode 0600)
    kv_prefix: str = "deepx:"
    kv_fsync: str = "everysec"  # always | everysec | no (embedded store persisted to a file)
    # unix:///path (default: under the user's runtime directory; always one) and at most one tcp://HOST:PORT
    listen: list[str] = field(default_factory=list)
    token: str = ""  # what TCP clients prove they hold (config file or DEEPX_TOKEN; never a flag: docs/daemon.md)
    token_file: str = ""  # a file (mode 0600) whose first line is the token
    tls_cert: str = ""  # a PEM certificate (chain): the TCP listener speaks TLS
    tls_key: str = ""  # its private key (PEM)
    udp: str = "127.0.0.1:9090"  # HOST:PORT, or off
    udp_remote: int = 0  # 1: allow UDP on an address that is not loopback (it is unauthenticated: docs/daemon.md)
    io_roots: list[str] = field(default_factory=list)  # default: the working directory and the temp directory
    max_frame_bytes: int = 1 << 30
    heartbeat_s: float = 2.0
    # another node silent this long (no heartbeat in the plane, nothing over its peer link) is dead (docs/cluster.md)
    peer_timeout_s: float = 10.0
    # a peer link no request used this long is closed (links open on demand: docs/cluster.md, "Peer links")
    peer_idle_s: float = 60.0
    host: str = ""  # the host this node says it runs on (default: the host name); nodes of one host map each other
    # where a program's instructions run: cost (on other nodes' workers where the cost model says it pays, docs/
    # cluster.md) or local (every instruction on this node's worker)
    placement: str = "cost"
    peer_bandwidth_mbs: float = 1000.0  # a peer link's bandwidth (MB/s) that placement assumes until it measures one
    tls_cafile: str = ""  # PEM CA certificates that sign other nodes' TLS listeners (default: tls_cert, else system's)
    inline_elements: int = 1 << 16  # programs writing more elements than this run off the event loop; -1: none
    heap_pool_bytes: int = -1  # freed segments kept for reuse; -1: heap_pool_default() of /dev/shm's size
    restart_max: int = 3
    restart_window_s: float = 60.0
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    # compiler passes run on every program, in this order (deepxd/compiler); "off" alone: none
    passes: list[str] = field(default_factory=lambda: ["transpose_products", "simplify", "cse", "dce", "fuse",
                                                       "fuse_colsum", "fold_transpose"])
    fuse_min_elements: int = 0  # fuse only ops whose result has this many elements (0: measured best, docs/compiler.md)
    cuda_device: int = -1  # one GPU for op-cuda (as cuda_devices = [N]); -1: not set
    # the GPUs op-cuda runs on, one worker each ("0,1"; the first also holds the heap tensors); empty: cuda_device
    # where set, else every visible GPU (docs/distributed.md, "Several GPUs in one daemon")
    cuda_devices: list[str] = field(default_factory=list)
    cuda_tf32: int = 0  # 1: op-cuda runs float32 matmul on TF32 tensor cores (faster, 10-bit mantissa products)
    cuda_warm: int = 1  # 1: op-cuda compiles its kernel modules not yet on disk in background threads at start
    cuda_graphs: int = 1  # 1: op-cuda replays a program that repeats as CUDA graphs (one launch, not one per op)
    native_kernels: int = 1  # 1: op-cpu compiles some kernels with the machine's C compiler, where there is one
    blas: str = "auto"  # op-cpu's matmul: auto (MKL where installed, else numpy's BLAS), mkl or numpy (blas.py)

    def resolved(self) -> Config:
        """A copy with every default filled in and every value checked."""
        c = dataclasses.replace(self)
        c.node_id = c.node_id or socket.gethostname()
        c.host = c.host or socket.gethostname()
        if c.kv_password_file and not c.kv_password:
            from deepxd.kv.base import read_password_file

            c.kv_password = read_password_file(c.kv_password_file)
        c.listen = listen_addresses(c.listen)
        if c.token_file and not c.token:
            c.token = read_secret_file(c.token_file, "token_file", "token")
        tcp = c.tcp_listen
        if tcp is not None:
            if c.token:
                check_token(c.token)
            host, _ = tcp_address(tcp, "listen")
            if not is_loopback(host) and not c.token:
                raise DeepxError(f"listen: {tcp} is not a loopback address, and no token is set: anyone who can "
                                 "reach the port could use this daemon. Give a token (--token-file FILE, "
                                 "DEEPX_TOKEN_FILE or DEEPX_TOKEN; make one with `openssl rand -hex 32`), or listen "
                                 "on 127.0.0.1 (docs/daemon.md, 'who can do what')")
        if bool(c.tls_cert) != bool(c.tls_key):
            raise DeepxError("tls_cert and tls_key go together: give both (--tls-cert FILE --tls-key FILE), or "
                             "neither")
        if c.tls_cert and tcp is None:
            raise DeepxError("tls_cert: TLS is for a TCP listener, and none is asked for (--listen tcp://HOST:PORT)")
        c.io_roots = c.io_roots or [os.getcwd(), tempfile.gettempdir()]
        c.roles = c.roles or default_roles()
        bad = [r for r in c.roles if r not in ALL_ROLES]
        if bad:
            raise DeepxError(f"unknown role {', '.join(bad)}; roles are {', '.join(ALL_ROLES)}")
        c.roles = with_needed_roles(c.roles)
        if c.cuda_device < -1:
            raise DeepxError(f"cuda_device: {c.cuda_device} is not a GPU's ordinal: give 0 or more, or -1 for every "
                             "visible GPU (or name them with cuda_devices)")
        devices: list[int] = []
        for d in c.cuda_devices:
            text = str(d).strip().removeprefix("cuda:")
            if not text.isdigit():
                raise DeepxError(f"cuda_devices: {d!r} is not a GPU's ordinal (give them as 0,1 or cuda:0,cuda:1)")
            if int(text) in devices:
                raise DeepxError(f"cuda_devices: GPU {text} is named twice")
            devices.append(int(text))
        if not devices and c.cuda_device >= 0:
            devices = [c.cuda_device]
        c.cuda_devices = [str(d) for d in devices]
        if c.kv_fsync not in ("always", "everysec", "no"):
            raise DeepxError(f"kv_fsync: {c.kv_fsync!r} must be always, everysec or no")
        if c.udp != "off":
            host, _ = udp_address(c.udp)
            if not is_loopback(host) and not c.udp_remote:
                raise DeepxError(f"udp: {c.udp} is not a loopback address, and deepxIR over UDP has no "
                                 "authentication: anyone who can reach the port could run programs on the tensors UDP "
                                 "clients made. Ask for it with --udp-remote 1 (udp_remote = 1, DEEPX_UDP_REMOTE=1), "
                                 "or keep 127.0.0.1 (docs/daemon.md, 'who can do what')")
        if c.heap_pool_bytes < 0:
            from deepxd.shm import shm_total_bytes

            c.heap_pool_bytes = heap_pool_default(shm_total_bytes())
        if c.heartbeat_s <= 0:
            raise DeepxError(f"heartbeat_s: {c.heartbeat_s} must be > 0")
        if c.peer_timeout_s < 2 * c.heartbeat_s:
            raise DeepxError(f"peer_timeout_s: {c.peer_timeout_s} s is less than two heartbeats (heartbeat_s = "
                             f"{c.heartbeat_s}): a live node would be taken for dead between two of its heartbeats")
        if not c.peer_idle_s > 0:
            raise DeepxError(f"peer_idle_s: {c.peer_idle_s} must be > 0 (seconds a peer link may stay unused)")
        c.placement = c.placement.strip().lower()
        if c.placement not in ("cost", "local"):
            raise DeepxError(f"placement: {c.placement!r} must be cost (other nodes' workers where the cost model "
                             "says it pays) or local (every instruction here)")
        if not c.peer_bandwidth_mbs > 0:
            raise DeepxError(f"peer_bandwidth_mbs: {c.peer_bandwidth_mbs} must be > 0 (MB/s)")
        if c.max_frame_bytes < 1024:
            raise DeepxError(f"max_frame_bytes: {c.max_frame_bytes} is too small (at least 1024)")
        c.blas = c.blas.strip().lower()
        if c.blas not in ("auto", "mkl", "numpy"):
            raise DeepxError(f"blas: {c.blas!r} must be auto, mkl or numpy")
        if c.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise DeepxError(f"log_level: {c.log_level!r} must be debug, info, warning or error")
        from deepxd.compiler.pipeline import check_passes

        c.passes = check_passes(c.passes)
        if c.fuse_min_elements < 0:
            raise DeepxError(f"fuse_min_elements: {c.fuse_min_elements} must be >= 0")
        return c

    def shown(self) -> dict[str, Any]:
        """The settings as a mapping for people to read (`deepxd config`, the admin query): never a password."""
        from deepxd.kv.base import redact

        out = dataclasses.asdict(self)
        out["kv"] = redact(self.kv)
        if self.kv_password:
            out["kv_password"] = "***"
        if self.token:
            out["token"] = "***"
        return out

    @property
    def socket_path(self) -> str:
        """The native Unix socket's path (of a resolved config)."""
        return next(a for a in self.listen if a.startswith("unix://")).removeprefix("unix://")

    @property
    def tcp_listen(self) -> str | None:
        """The tcp://HOST:PORT listener, if any."""
        return next((a for a in self.listen if a.startswith("tcp://")), None)


def listen_addresses(given: list[str]) -> list[str]:
    """The native listeners: the Unix socket first (the default one where none is given: deepxctl on this machine
    and a second daemon's node-id check reach the daemon through it), then at most one tcp://HOST:PORT."""
    unix = [a for a in given if a.startswith("unix://")]
    tcp = [a for a in given if a.startswith("tcp://")]
    other = [a for a in given if a not in unix and a not in tcp]
    if other:
        raise DeepxError(f"listen: {other[0]!r} must be unix:///path/to/socket or tcp://HOST:PORT")
    if len(unix) > 1 or len(tcp) > 1:
        twice = unix if len(unix) > 1 else tcp
        raise DeepxError(f"listen: {' and '.join(twice)}: a daemon listens on one Unix socket and at most one TCP "
                         "address (tcp://0.0.0.0:PORT for every interface)")
    for a in tcp:
        tcp_address(a, "listen")
    return [unix[0] if unix else f"unix://{default_socket()}", *tcp]


HEAP_POOL_MAX = 256 << 20


def heap_pool_default(shm_bytes: int | None) -> int:
    """A quarter of /dev/shm (`shm_bytes`), at most HEAP_POOL_MAX: Docker gives a container 64 MB there, which a
    256 MiB pool of freed segments could fill, leaving nothing for live tensors. Unknown size: HEAP_POOL_MAX."""
    return HEAP_POOL_MAX if not shm_bytes else min(HEAP_POOL_MAX, shm_bytes // 4)


def cuda_available() -> bool:
    try:
        import pycuda.driver as drv
    except Exception:
        return False
    try:
        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


def cuda_count() -> int:
    """How many CUDA devices this process sees (0 where none answers)."""
    try:
        import pycuda.driver as drv

        drv.init()
        return int(drv.Device.count())
    except Exception:
        return 0


def default_roles() -> list[str]:
    """Every role this machine can run: op-cuda only where its worker is built and a GPU answers."""
    import importlib.util

    roles = ["registry", "heapmem", "scheduler", "op-cpu"]
    if importlib.util.find_spec("deepxd.actors.opcuda") is not None and cuda_available():
        roles.append("op-cuda")
    return roles


def with_needed_roles(roles: list[str]) -> list[str]:
    """`roles` plus what an op worker needs to be reached: programs come through the scheduler, and operators' queries
    (deepxctl) through the registry. So `--role=heapmem,op-cuda` runs registry, heapmem, scheduler and op-cuda."""
    if not any(r in roles for r in ("op-cpu", "op-cuda")):
        return list(roles)
    return [*roles, *(r for r in ("registry", "scheduler") if r not in roles)]


def udp_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    try:
        p = int(port)
        if not 0 <= p < 65536 or not host:
            raise ValueError
    except ValueError:
        raise DeepxError(f"udp: {text!r} must be HOST:PORT or off") from None
    return host.strip("[]"), p


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is only this machine's: 127.0.0.0/8, ::1 or localhost."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(name: str, value: Any, source: str) -> Any:
    f = _FIELDS[name]
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("list"):
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise ValueError
            return [str(v) for v in value]
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise DeepxError(f"{source}: {name} = {value!r} is not a valid {kind}") from None


def load_config(path: str | None = None, env: dict[str, str] | None = None, **flags: Any) -> Config:
    """Defaults, then the TOML file (its [deepxd] table, or top-level keys), then DEEPX_<NAME> variables, then
    flags that are not None."""
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            raise DeepxError(f"config file {path} not found") from None
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise DeepxError(f"config file {path}: {e}") from None
        table = doc.get("deepxd", doc)
        for k, v in table.items():
            key = k.replace("-", "_")
            if key not in _FIELDS:
                raise DeepxError(f"config file {path}: unknown setting {k!r}")
            values[key] = _coerce(key, v, f"config file {path}")
    values.update(environment_settings(_FIELDS, env))
    for key, v in flags.items():
        if key == "kv" and isinstance(v, str) and _has_password(v):
            raise DeepxError("--kv: the URL carries a password, which every local user can read in "
                             "/proc/<pid>/cmdline; give it with --kv-password-file FILE (mode 0600), DEEPX_KV_PASSWORD "
                             "or kv_password in the config file, and the URL without it (docs/storage.md)")
        if v is not None and v != () and v != []:
            values[key] = _coerce(key, list(v) if isinstance(v, tuple) else v, f"--{key.replace('_', '-')}")
    if values.get("kv_password") and values.get("kv_password_file"):
        raise DeepxError("kv_password and kv_password_file are both set: give the password once")
    if values.get("token") and values.get("token_file"):
        raise DeepxError("token and token_file are both set (in the config file, DEEPX_TOKEN, DEEPX_TOKEN_FILE or "
                         "--token-file): give the token once")
    return Config(**values)


def environment_settings(keys: Iterable[str], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The DEEPX_<NAME> values of these settings that are set, checked."""
    environ: Mapping[str, str] = os.environ if env is None else env
    out: dict[str, Any] = {}
    for key in keys:
        raw = environ.get(f"DEEPX_{key.upper()}")
        if raw:
            out[key] = _coerce(key, raw, f"DEEPX_{key.upper()}")
    return out


def _has_password(url: str) -> bool:
    from deepxd.kv.base import url_password

    return url_password(url) is not None


def default_config_file() -> str | None:
    """DEEPX_CONFIG, else ./config/deepxd.toml when it exists."""
    p = os.environ.get("DEEPX_CONFIG")
    if p:
        return p
    local = Path("config/deepxd.toml")
    return str(local) if local.exists() else None
