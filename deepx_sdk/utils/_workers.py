"""DataLoader worker processes: each reads samples, collates them with numpy, and registers the batch's arrays as heap
tensors on the daemon ahead of the training loop, which gets tensor handles by name (no copy through this process).

The workers are forked (the dataset object is inherited, never pickled) and talk to the loader over two pipes each,
length-prefixed msgpack frames: tasks `{"batch": k, "indices": [...], "base": name}` in, results
`{"batch": k, "tree": ..., "leaves": [[name, dtype, shape], ...]}` or `{"batch": k, "error": text}` out. A worker
connects to the daemon on its own (the loader session's address and token), puts each array with `heap=True`, and
the loader's handles delete those tensors when collected, like any result. Batch k goes to worker k % N, so each
worker's results come back in order and the loader yields batches in the sampler's order.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import random
import select
import signal
import struct
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import from_numpy

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_serial = itertools.count()


def _write(fd: int, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _read(fd: int) -> Any:
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    return None if body is None else msgpack.unpackb(body, raw=False)


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 65536


def numpy_collate(samples: list[Any]) -> Any:
    """A batch from samples, on the host: arrays and numbers stacked (Python floats as float64, ints as int64, as
    torch's default_collate), tuples, lists and dicts field by field, strings as lists."""
    first = samples[0]
    if isinstance(first, (np.ndarray, np.generic, int, float, bool)):
        out = np.stack([np.asarray(s) for s in samples])
        if out.dtype == object:
            raise DeepxError(f"DataLoader workers: samples of types {sorted({type(s).__name__ for s in samples})} "
                             "cannot be batched on the host into one array")
        return out
    if isinstance(first, str):
        return list(samples)
    if isinstance(first, dict):
        return {k: numpy_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise DeepxError("default_collate: the samples have different numbers of fields")
        fields = [numpy_collate(list(column)) for column in zip(*samples)]
        return tuple(fields) if isinstance(first, tuple) else fields
    raise DeepxError(f"DataLoader workers: a sample of type {type(first).__name__} cannot be batched on the host; "
                     "a dataset read by workers (num_workers > 0) gives numpy arrays and numbers (deepx tensors live "
                     "on the daemon: use num_workers=0 for them)")


def _flatten(batch: Any, leaves: list[np.ndarray]) -> Any:
    """The batch's structure with each array replaced by its index in `leaves`."""
    if isinstance(batch, np.ndarray):
        leaves.append(np.ascontiguousarray(batch))
        return {"leaf": len(leaves) - 1}
    if isinstance(batch, tuple):
        return {"tuple": [_flatten(b, leaves) for b in batch]}
    if isinstance(batch, list):
        if all(isinstance(b, str) for b in batch):
            return {"value": batch}
        return {"list": [_flatten(b, leaves) for b in batch]}
    if isinstance(batch, dict):
        return {"dict": [[str(k), _flatten(v, leaves)] for k, v in batch.items()]}
    if isinstance(batch, (np.generic, int, float, bool)):
        leaves.append(np.asarray(batch))
        return {"leaf": len(leaves) - 1}
    if isinstance(batch, str):
        return {"value": batch}
    raise DeepxError(f"DataLoader workers: collate_fn gave a {type(batch).__name__}; it must give numpy arrays, "
                     "numbers, strings, and tuples, lists or dicts of them")


def _unflatten(tree: dict[str, Any], leaves: list[Any]) -> Any:
    if "leaf" in tree:
        return leaves[tree["leaf"]]
    if "tuple" in tree:
        return tuple(_unflatten(t, leaves) for t in tree["tuple"])
    if "list" in tree:
        return [_unflatten(t, leaves) for t in tree["list"]]
    if "dict" in tree:
        return {k: _unflatten(t, leaves) for k, t in tree["dict"]}
    return tree["value"]


def _worker(wid: int, dataset: Any, collate: Callable[[list[Any]], Any], address: str, remote: dict[str, Any],
            tasks: int, results: int, others: list[int], seed: int, init_fn: Callable[[int], None] | None) -> None:
    """A worker process's life (forked): connect, then batches until told to stop or the loader goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training loop's to handle; it stops us
    del others
    # every descriptor the loader's process had (its daemon connection, other workers' pipes, an embedded daemon's
    # sockets) but this worker's two pipes and the standard streams: a loader that goes reaches each worker as end of
    # file, and nothing of the parent's is written to from here
    keep = sorted((tasks, results))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, _max_fd())
    from deepx_core.client import NativeClient

    np.random.seed((seed + wid) % 2**32)
    random.seed(seed + wid)
    client = NativeClient(address, client="deepx_sdk", name=f"dataloader worker {wid}", **remote)
    if init_fn is not None:
        init_fn(wid)
    while True:
        task = _read(tasks)
        if task is None or task.get("stop"):
            break
        specs: list[list[Any]] = []
        try:
            batch = collate([dataset[int(i)] for i in task["indices"]])
            leaves: list[np.ndarray] = []
            tree = _flatten(batch, leaves)
            for k, arr in enumerate(leaves):
                name = f"{task['base']}f{k}"
                client.put(name, arr, heap=True)
                specs.append([name, from_numpy(arr.dtype), list(arr.shape)])
            _write(results, {"batch": task["batch"], "tree": tree, "leaves": specs})
        except Exception as e:
            _write(results, {"batch": task["batch"], "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc(), "leaves": specs})  # those put: the loader deletes them
    client.close()


class WorkerPool:
    """The worker processes of one DataLoader iteration (or of its life, with persistent_workers)."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any], num_workers: int, prefetch: int,
                 timeout: float, init_fn: Callable[[int], None] | None, seed: int) -> None:
        from deepx_sdk.session import session

        transport = session().transport
        address = getattr(transport, "address", "")
        if not (address.startswith("unix://") or address.startswith("tcp://")):
            raise DeepxError(f"DataLoader: num_workers > 0 needs a native connection to the daemon (an embedded one, "
                             f"unix:// or tcp://); this session is connected over {address or 'another transport'}")
        try:
            ctx = multiprocessing.get_context("fork")
        except ValueError:
            raise DeepxError("DataLoader: num_workers > 0 forks worker processes, which this platform cannot; use "
                             "num_workers=0") from None
        self.prefetch = prefetch
        self.timeout = timeout
        self.tag = f"dl{os.getpid()}x{next(_serial)}b"
        self.procs: list[Any] = []
        self.task_fds: list[int] = []
        self.result_fds: list[int] = []
        remote = dict(getattr(transport, "remote", {}) or {})
        try:
            for wid in range(num_workers):
                task_r, task_w = os.pipe()
                res_r, res_w = os.pipe()
                p = ctx.Process(target=_worker, name=f"deepx-dataloader-{wid}", daemon=True,
                                args=(wid, dataset, collate, address, remote, task_r, res_w,
                                      [task_w, res_r, *self.task_fds, *self.result_fds], seed, init_fn))
                p.start()
                os.close(task_r)
                os.close(res_w)
                self.procs.append(p)
                self.task_fds.append(task_w)
                self.result_fds.append(res_r)
        except BaseException:
            self.close()
            raise
        self.sent = 0  # batches handed to workers in all iterations so far
        self.closed = False

    def batches(self, chosen: Sequence[np.ndarray], wrap: Callable[[str, str, tuple[int, ...]], Any]
                ) -> Iterator[Any]:
        """The batches of these index lists, in order; `wrap(name, dtype, shape)` makes a handle of a heap tensor."""
        n = len(self.procs)
        base = self.sent
        self.sent += len(chosen)
        ahead = 0

        def send(k: int) -> None:
            try:
                _write(self.task_fds[(base + k) % n], {"batch": base + k, "indices": [int(i) for i in chosen[k]],
                                                       "base": f"{self.tag}{base + k}"})
            except BrokenPipeError:  # the worker is gone: reading its next result says so, naming it
                pass

        for k in range(min(len(chosen), self.prefetch * n)):
            send(k)
            ahead = k + 1
        received = 0
        try:
            for k in range(len(chosen)):
                msg = self._receive((base + k) % n)
                received += 1
                if msg.get("batch") != base + k:
                    raise DeepxError(f"DataLoader worker {(base + k) % n} answered batch {msg.get('batch')} for batch "
                                     f"{base + k}: the pool is out of step")
                if ahead < len(chosen):
                    send(ahead)
                    ahead += 1
                if "error" in msg:
                    for name, dtype, shape in msg.get("leaves", ()):
                        wrap(name, dtype, tuple(shape))  # put before the failure: let go, so deleted
                    raise DeepxError(f"DataLoader worker {(base + k) % n} failed on batch {k}: {msg['error']}\n"
                                     f"{msg['trace']}")
                leaves = [wrap(name, dtype, tuple(shape)) for name, dtype, shape in msg["leaves"]]
                yield _unflatten(msg["tree"], leaves)
        finally:
            # batches sent but not read (a loop left early): read them, so the pipes stay in step, and let their
            # handles go (which deletes their heap tensors)
            gone: set[int] = set()
            for k in range(received, ahead):
                wid = (base + k) % n
                if wid in gone:
                    continue
                try:
                    msg = self._receive(wid)
                except DeepxError:  # a dead worker: the others' batches are still read, and deleted
                    gone.add(wid)
                    continue
                for name, dtype, shape in msg.get("leaves", ()):
                    wrap(name, dtype, tuple(shape))

    def _receive(self, wid: int) -> Any:
        fd, proc = self.result_fds[wid], self.procs[wid]
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                msg = _read(fd)
                if msg is not None:
                    return msg
                proc.join(1.0)
                raise DeepxError(f"DataLoader worker {wid} (pid {proc.pid}) exited unexpectedly (exit code "
                                 f"{proc.exitcode})")
            if not proc.is_alive():
                raise DeepxError(f"DataLoader worker {wid} (pid {proc.pid}) exited unexpectedly (exit code "
                                 f"{proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise DeepxError(f"DataLoader timed out after {self.timeout} s waiting for worker {wid} "
                                 f"(pid {proc.pid})")

    def close(self) -> None:
        if getattr(self, "closed", False):
            return
        self.closed = True
        for fd in self.task_fds:
            try:
                _write(fd, {"stop": True})
            except OSError:
                pass
            os.close(fd)
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                log.warning("DataLoader worker %s (pid %s) did not stop; terminating it", p.name, p.pid)
                p.terminate()
                p.join(5.0)
        for fd in self.result_fds:
            os.close(fd)
        self.task_fds, self.result_fds = [], []
