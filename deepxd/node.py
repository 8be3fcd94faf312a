"""A deepxd node: the storage plane, the actors for the chosen roles, the transports, and one shutdown path.

`Node.serve()` = `start()` -> wait for a stop request -> `shutdown()`: transports stop accepting, in-flight
programs drain (up to `drain_timeout_s`), actors stop in reverse order (heapmem unlinks every segment), the socket
file is removed. The first SIGINT/SIGTERM starts that; a second forces the exit.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import json
import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

from deepx_core.errors import DeepxError
from deepx_core.identity import shm_identity
from deepxd.actors.base import Actor, ActorRef, RestartPolicy, Supervisor
from deepxd.actors.messages import Flush, Sync
from deepxd.comm import Collectives
from deepxd.config import Config, is_loopback, udp_address
from deepxd.executors import Executors
from deepxd.kv.base import KV, open_kv, redact
from deepxd.owners import Owners
from deepxd.peers import Peers, index_node

if TYPE_CHECKING:
    from deepxd.actors.worker import OpWorker

log = logging.getLogger(__name__)

#: the op-cuda worker of the session whose request runs now, where it chose one of several GPUs (its connection's
#: `place`: deepxd/net/native.py sets it for each of that connection's requests); "": the node's first worker
PLACED: contextvars.ContextVar[str] = contextvars.ContextVar("deepx_placed", default="")

#: how often a start that waits for an actor's start (heapmem's recovery of many heap records) says so in the log
STARTING_LOG_S = 10.0


class Node:
    def __init__(self, config: Config, *, freeze_gc: bool = False) -> None:
        self.freeze_gc = freeze_gc
        self.config = config.resolved()
        self.kv: KV | None = None
        self.supervisor = Supervisor(RestartPolicy(self.config.restart_max, self.config.restart_window_s))
        self.refs: dict[str, ActorRef[Any]] = {}
        self.servers: list[Any] = []
        self.udp: Any = None  # the UdpServer, when deepxIR over UDP is on
        self.addresses: dict[str, str] = {}  # where it listens, as the registry records it
        self.udp_scope: Any = None  # what UDP senders may name (deepxd/access.py), when it is on
        self.owners = Owners()  # who made which tensor, and the labels clients gave (deepxd/owners.py)
        self.peers: Peers | None = None  # the other nodes and the links to them (deepxd/peers.py), once started
        self.comm: Collectives | None = None  # the collectives of process groups' programs (deepxd/comm.py)
        # op-cuda's workers, one per GPU, the first (named op-cuda) the default; each with a scheduler of its own
        self.cuda_workers: dict[str, ActorRef[Any]] = {}
        self.gpus: dict[str, dict[str, Any]] = {}  # worker name -> its device, PCI bus id, whether NCCL loads
        # executors of other processes registered here (deepxd/executors.py)
        self.executors = Executors(self.config.node_id, shm=shm_identity(), max_frame=self.config.max_frame_bytes)
        self.stopping = asyncio.Event()
        self._signals = 0
        self.started = asyncio.Event()

    # -- start
    async def start(self) -> None:
        c = self.config
        if c.kv.startswith("memory"):
            self.kv = open_kv(c.kv, prefix=c.kv_prefix, fsync=c.kv_fsync)
        else:
            self.kv = open_kv(c.kv, prefix=c.kv_prefix, password=c.kv_password or None)
        await self.kv.connect()
        self.peers = Peers(self.kv, c.node_id, host=c.host, token=c.token, tls_cafile=c.tls_cafile or c.tls_cert,
                           heartbeat_s=c.heartbeat_s, timeout_s=c.peer_timeout_s, idle_s=c.peer_idle_s)
        self.comm = Collectives(self)
        try:
            await self._refuse_a_live_namesake()
            await self._start_actors()
            if not c.kv.startswith("memory"):  # a plane others can share: the peers that run, known before it serves
                await self.peers.start()
            await self._start_transports()
        except BaseException:
            await self.shutdown()
            raise
        if self.freeze_gc:  # the daemon's own process only: an embedded node must not freeze its host's objects
            gc.freeze()  # what start-up built lives as long as the node: keep it out of every collection
        log.info("deepxd node %s up: roles %s, listening on %s%s, storage %s", c.node_id, ",".join(c.roles),
                 " and ".join(c.listen), "" if c.udp == "off" else f" and udp://{c.udp}", redact(c.kv))
        self.started.set()

    async def _start_actors(self) -> None:
        from deepxd.actors.opcpu import CpuWorker
        from deepxd.actors.registry import Registry
        from deepxd.actors.scheduler import Scheduler

        c = self.config
        assert self.kv is not None and self.peers is not None
        roles = set(c.roles)
        workers: dict[str, ActorRef[OpWorker]] = {}
        cpu_blas = ""  # the library op-cpu's matmul runs on, for the node record
        cudas = await self._start_cuda() if "op-cuda" in roles else []  # before heapmem, so it stops after it
        cuda = cudas[0] if cudas else None
        if cuda is not None:
            workers.update(self.cuda_workers)
        if "heapmem" in roles:
            from deepxd.actors.heapmem import HeapMemory

            heapmem = HeapMemory(self.kv, c.node_id, pool_bytes=c.heap_pool_bytes,
                                 device=cuda.device_heap if cuda is not None else None,  # with op-cuda: on the GPU
                                 devices={w.device: w.device_heap for w in cudas},  # each worker's on its own
                                 peers=self.peers, owners=self.owners)
            self.refs["heapmem"] = self.peers.heapmem = self.supervisor.start(heapmem)
            for w in cudas:  # (each worker's heap tensors on its own GPU: docs/distributed.md, "Several GPUs")
                w.heapmem = self.refs["heapmem"]
        if "op-cpu" in roles:
            from deepxd.kernels.cpu import blas, native

            blas.set_mode(c.blas)  # loads MKL now, before anything the process imports later brings an OpenMP
            log.info("op-cpu: matmul on %s", blas.describe())
            cpu_blas = blas.short()
            native.set_enabled(bool(c.native_kernels))
            cc = native.compiler() if c.native_kernels else None
            log.info("op-cpu: native kernels %s", f"on (compiled by {cc}, kept in {native.cache_dir()})" if cc
                     else "off (native_kernels = 0)" if not c.native_kernels else "off (no C compiler found)")
            workers["op-cpu"] = self.refs["op-cpu"] = self.supervisor.start(
                CpuWorker(heapmem=self.refs.get("heapmem") if cuda is None else None, io_roots=c.io_roots,
                          inline_elements=c.inline_elements, peers=self.peers, comm=self.comm))
        if "heapmem" in roles:
            heapmem.viewers = list(workers.values())  # told when a heap tensor they may view is freed
        if "scheduler" in roles:
            if c.udp != "off":
                from deepxd.access import UdpScope

                self.udp_scope = UdpScope(self.worker, self.kv)
            self.executors.heapmem = self.refs.get("heapmem")
            across = None
            if not c.kv.startswith("memory") and c.placement == "cost" and workers:  # a plane others can share
                from deepxd.placement import Across

                across = Across(self.kv, self.peers, c.node_id, worker="op-cuda" if "op-cuda" in workers else "op-cpu",
                                heapmem=self.refs.get("heapmem"), bytes_per_s=c.peer_bandwidth_mbs * 1e6,
                                heartbeat_s=c.heartbeat_s)
            cpu_only = {k: v for k, v in workers.items() if k == "op-cpu"}
            for i, (wname, wref) in enumerate(self.cuda_workers.items() or [("", None)]):
                # one scheduler per GPU: a session placed on another GPU sends its programs to that one's; the first
                # places programs across nodes and serves other nodes' segments
                mine = {**cpu_only, "op-cuda": wref} if wref is not None else workers
                sname = "scheduler" if i == 0 else f"scheduler:{wname.partition(':')[2]}"
                self.refs[sname] = self.supervisor.start(Scheduler(mine, name=sname, config=c,
                                                                   udp_scope=self.udp_scope if i == 0 else None,
                                                                   executors=self.executors,
                                                                   across=across if i == 0 else None,
                                                                   node_id=c.node_id))
        # the others first: the registry's start writes the node record `running`, which a second daemon of this id
        # reads as this one's (its socket opened a moment later), and heapmem's start can take seconds
        await self._until_started()
        if "registry" in roles:
            addresses = self.addresses = {"unix": f"unix://{c.socket_path}",
                                          **({"tcp": c.tcp_listen} if c.tcp_listen else {}),
                                          **({"udp": c.udp} if c.udp != "off" else {})}
            self.refs["registry"] = self.supervisor.start(Registry(
                self.kv, c.node_id, roles=c.roles, addresses=addresses, workers=workers,
                heapmem=self.refs.get("heapmem"), actors=self.actor_rows, heartbeat_s=c.heartbeat_s,
                devices=[*(["cpu"] if "op-cpu" in workers else []),
                         *(str(g["device"]) for g in self.gpus.values())],
                blas=cpu_blas, scheduler=self.refs.get("scheduler"), owners=self.owners, peers=self.peers,
                tls=bool(c.tls_cert), executors=self.executors))
            await self._until_started()
            await self.refs["registry"].ask(Flush())  # fails start-up now if the plane cannot be written

    async def _until_started(self) -> None:
        """Until every actor's first on_start has ended (returned, or raised: its supervisor has it then), so that
        the daemon serves nothing before: heapmem goes through the plane's heap records as it starts (adopting what
        a daemon that died left, marking the rest lost), and a listing answered before it ended showed the records
        as the last daemon left them (with 3,000 on Redis, most still `stopped`). Said in the log every
        STARTING_LOG_S while it lasts."""
        waits = {asyncio.ensure_future(a.start_ended.wait()): a.name for a in self.supervisor.actors.values()
                 if not a.start_ended.is_set()}
        t0 = time.monotonic()
        try:
            while waits:
                done, _ = await asyncio.wait(waits, timeout=STARTING_LOG_S)
                for task in done:
                    del waits[task]
                if waits:
                    log.info("still starting after %.0f s: %s", time.monotonic() - t0,
                             ", ".join(sorted(waits.values())))
        finally:
            for task in waits:
                task.cancel()

    async def _refuse_a_live_namesake(self) -> None:
        """Stop start-up where a deepxd of this node id runs on this machine (its process alive and its socket
        answering), or on another host (its heartbeat fresh): two daemons of one id on one plane overwrite each
        other's node record, and the one left running was then listed stopped, at the other's address. A record left
        by a daemon that died is taken over."""
        assert self.kv is not None and self.peers is not None
        record = await self.kv.hgetall(f"node:{self.config.node_id}")
        if not record or record.get("state") != "running":
            return
        if not self.peers.same_host(record):  # another host's: alive while its heartbeat is fresh
            if await self.peers.why_dead(self.config.node_id, record) is None:
                raise DeepxError(f"node id '{self.config.node_id}' is in use by a running deepxd on host "
                                 f"{record.get('host', '?')} (pid {record.get('pid', '?')}) on this storage plane: "
                                 "give this daemon another one (--node-id, DEEPX_NODE_ID)")
            return  # its heartbeat stopped: its record is this daemon's now
        try:
            pid = int(record.get("pid", 0))
            address = str(json.loads(record.get("addresses", "{}")).get("unix", ""))
        except (TypeError, ValueError):
            return
        if pid <= 0 or pid == os.getpid() or not address.startswith("unix://"):
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # died (kill -9): its record is this daemon's now
        except PermissionError:
            pass  # another user's process: alive
        path = address.removeprefix("unix://")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(path)
            except OSError:
                return  # its pid was reused, or it is stopping: no daemon answers there
        raise DeepxError(f"node id '{self.config.node_id}' is in use by a running deepxd (pid {pid}, listening on "
                         f"{address}) on this storage plane: give this daemon another one (--node-id, "
                         "DEEPX_NODE_ID)")

    async def _start_cuda(self) -> list[Any]:
        """op-cuda's workers, one per GPU (`cuda_devices`, else every visible one), each executor made (and its GPU
        asked) now, so that a GPU that does not answer stops start-up with one line. The first is `op-cuda`, the
        others `op-cuda:<ordinal>`: on one GPU, one worker named as always."""
        from deepxd.config import cuda_available, cuda_count

        c = self.config
        if not cuda_available():
            raise DeepxError("op-cuda: no usable CUDA GPU here (PyCUDA is not installed, or no device answers); "
                             "start without op-cuda")
        from deepxd.actors.messages import DeviceInfo
        from deepxd.actors.opcuda import CudaWorker

        devices = [int(d) for d in c.cuda_devices] or list(range(cuda_count()))
        out = []
        for i, device in enumerate(devices):
            name = "op-cuda" if i == 0 else f"op-cuda:{device}"
            worker = CudaWorker(name, io_roots=c.io_roots, device=device, tf32=bool(c.cuda_tf32),
                                warm=bool(c.cuda_warm) and i == 0, graphs=bool(c.cuda_graphs), comm=self.comm)
            ref = self.refs[name] = self.cuda_workers[name] = self.supervisor.start(worker)
            try:
                await ref.ask(Sync())
                self.gpus[name] = await ref.ask(DeviceInfo())
            except DeepxError as e:
                raise DeepxError(f"op-cuda: the CUDA worker could not start on cuda:{device}: {e}") from None
            except Exception as e:
                raise DeepxError(f"op-cuda: the CUDA worker could not start on cuda:{device}: "
                                 f"{type(e).__name__}: {e}") from None
            out.append(worker)
        if len(out) > 1:
            log.info("op-cuda: %d workers, one per GPU (%s); a session runs on the first unless it chooses another "
                     "(dx.connect(device=...), or init_process_group by its local rank)", len(out),
                     ", ".join(f"{n} on {g['device']}" for n, g in self.gpus.items()))
        return out

    def place(self, device: Any, local_rank: Any = None) -> str:
        """The op-cuda worker a session asks for: `device` "cuda:N" (or N), or "auto" with `local_rank` (the GPU of
        that index among this node's, modulo their number). DeepxError naming the GPUs there are."""
        names = list(self.cuda_workers)
        if device == "auto":
            if not names:
                return ""
            if type(local_rank) is not int or local_rank < 0:
                raise DeepxError(f"place: 'local_rank' must be a whole number >= 0, got {local_rank!r}")
            return names[local_rank % len(names)]
        text = str(device)
        for name, g in self.gpus.items():
            if text in (g["device"], g["device"].removeprefix("cuda:")):
                return name
        if text == "cpu" and "op-cpu" in self.refs and not names:
            return ""
        have = ", ".join(g["device"] for g in self.gpus.values()) or "none (no op-cuda here)"
        raise DeepxError(f"place: device {text!r} is not one of this daemon's GPUs ({have}); start it with "
                         "--role op-cuda, or name the GPUs with cuda_devices")

    def worker(self) -> ActorRef[OpWorker]:
        """The op worker that holds the tensors of the session whose request runs now: its GPU's where it chose one
        of several (PLACED), else op-cuda when it runs, else op-cpu (as the scheduler places programs)."""
        placed = PLACED.get()
        r = (self.refs.get(placed) if placed else None) or self.refs.get("op-cuda") or self.refs.get("op-cpu")
        if r is None:
            raise DeepxError(f"no op worker runs on node {self.config.node_id} (roles: {','.join(self.config.roles)})")
        return r

    async def _start_transports(self) -> None:
        from deepxd.net.native import NativeServer
        from deepxd.net.udp import start_udp

        c = self.config
        if c.udp != "off":  # first: a client that can connect to the native socket finds UDP serving too
            host, port = udp_address(c.udp)
            self.udp = await start_udp(self, host, port)
            self.servers.append(self.udp)
            if port == 0:  # --udp HOST:0, a free port: the one given is what the log and `nodes ls` show
                sock = self.udp.transport.get_extra_info("socket") if self.udp.transport else None
                if sock is not None:
                    c.udp = f"{host}:{sock.getsockname()[1]}"
                    await self._publish_address("udp", c.udp)
            if not is_loopback(host):  # allowed only with udp_remote (Config.resolved)
                log.warning("deepxIR over UDP listens on %s:%d, which is not a loopback address: it is "
                            "unauthenticated, and anyone who can reach the port can run programs on the tensors UDP "
                            "made or was shared (docs/daemon.md, 'who can do what')", host, port)
        tcp = c.tcp_listen
        if tcp is not None:
            server = NativeServer(self, tcp, max_frame=c.max_frame_bytes, token=c.token,
                                  tls=(c.tls_cert, c.tls_key) if c.tls_cert else None)
            await server.start()
            self.servers.append(server)
            if server.address != tcp:  # port 0: the one taken
                c.listen = [server.address if a == tcp else a for a in c.listen]
                await self._publish_address("tcp", server.address)
            if not c.token:  # allowed on loopback only (Config.resolved)
                log.warning("native: %s asks no token: every user of this machine can use this daemon through it "
                            "(give --token-file; docs/daemon.md, 'who can do what')", server.address)
            else:
                log.info("native: %s asks for the token%s", server.address, ", over TLS" if c.tls_cert else "")
        # last: a client that can connect to the Unix socket finds every other listener serving too
        native = NativeServer(self, f"unix://{c.socket_path}", max_frame=c.max_frame_bytes)
        await native.start()
        self.servers.append(native)

    async def _publish_address(self, kind: str, address: str) -> None:
        """Where a listener given port 0 listens: in the registry's record (which shares this dict), written now."""
        self.addresses[kind] = address
        if "registry" in self.refs and self.kv is not None:
            async with self.kv.batch() as b:
                b.hset(f"node:{self.config.node_id}", {"addresses": json.dumps(self.addresses)})
                index_node(b, self.config.node_id)

    # -- what transports call
    def ref(self, role: str) -> ActorRef[Any]:
        placed = PLACED.get()
        if placed and role in ("scheduler", "op-cuda"):  # a session on another GPU: its scheduler, its worker
            role = placed if role == "op-cuda" else f"scheduler:{placed.partition(':')[2]}"
        r = self.refs.get(role)
        if r is None:
            raise DeepxError(f"role '{role}' does not run on node {self.config.node_id} (roles: "
                             f"{','.join(self.config.roles)})")
        return r

    def actor_rows(self) -> list[dict[str, Any]]:
        rows = []
        now = time.perf_counter()
        for a in self.supervisor.actors.values():
            a_: Actor = a
            doing = a_.doing
            device = getattr(a_, "device", "") if a_.role in ("op-cpu", "op-cuda") else ""  # an op worker's
            rows.append({"name": a_.name, "role": a_.role, "device": device, "state": a_.state, "doing": doing,
                         "doing_s": round(now - a_.doing_since, 6) if doing else None,
                         "mailbox": a_.mailbox.qsize(),
                         "handled": a_.stats.handled, "errors": a_.stats.errors, "restarts": a_.stats.restarts,
                         "busy_s": round(a_.stats.busy_s, 6), "last_error": a_.stats.last_error})
        return rows + self.executors.rows()

    # -- run until asked to stop
    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            # a signal while starting (a storage plane that is slow to answer, say) stops the start, too
            starting = asyncio.ensure_future(self.start())
            stop = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                try:
                    await starting
                except BaseException as e:  # cancelled, or it failed on its way out
                    log.debug("start cancelled: %r", e)
                log.info("stopped while starting")
            else:
                starting.result()  # a failed start raises here
                await stop
        finally:
            await self.shutdown()
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("received %s: draining in-flight programs, then stopping (send it again to force)", sig.name)
            self.stopping.set()
        else:
            log.warning("received %s again: forcing exit", sig.name)
            self._force_cleanup()
            os._exit(1)

    def _force_cleanup(self) -> None:
        for s in self.servers:
            try:
                s.force_close()
            except Exception as e:
                log.debug("force close: %s", e)
        hm = self.supervisor.actors.get("heapmem")
        if hm is not None and hasattr(hm, "unlink_all"):
            hm.unlink_all()

    async def shutdown(self) -> None:
        if getattr(self, "_shut", False):
            return
        self._shut = True
        for s in self.servers:
            await s.stop_accepting()
        scheds = [a for a in self.supervisor.actors.values() if a.role == "scheduler"]
        if scheds:
            try:
                await asyncio.wait_for(asyncio.gather(*(a.stop(drain=True) for a in scheds)),
                                       self.config.drain_timeout_s)
            except TimeoutError:
                log.warning("in-flight programs did not finish within %.0f s; stopping anyway",
                            self.config.drain_timeout_s)
        for s in self.servers:
            await s.close()
        await self.executors.close()
        await self.supervisor.stop_all(drain=True)
        if self.comm is not None:
            await self.comm.stop()
        if self.peers is not None:
            await self.peers.stop()
        if self.kv is not None:
            await self.kv.close()
        log.info("deepxd node %s stopped", self.config.node_id)
