"""The ring: how the ranks of a process group move a collective's bytes between their daemons (deepxd/comm.py runs
it on each rank's daemon).

Rank r reads from rank r-1 only, over one peer link (a native connection to r-1's daemon), and r+1 reads from r.
Each rank's part of a collective is a `Schedule`: the units (a run of elements of one of its arrays) it publishes
for r+1, each once the receives it depends on are done, and the units it receives from r-1, each combined into place
(a reduction) or copied there. The units of r's receives are those r-1 publishes, in the same order, because both
are worked out by the same function from the same sizes.

- all_reduce is a reduce-scatter then an all-gather around the ring: the elements are cut into `world` segments;
  in N-1 steps each rank adds the segment coming from r-1 into its own and passes on the sum, after which rank r
  holds segment r+1 summed over every rank; in N-1 more steps those sums go round. Each rank sends and receives
  2(N-1)/N of the data, whatever N.
- reduce_scatter is the first half (shifted so that rank r ends with segment r), all_gather the second half (rank
  r starting with its own tensor as segment r), broadcast a chain from the source, each rank passing on what it
  received.
- Segments are cut into chunks of at most CHUNK_BYTES (and at the ends of the arrays of a bucket), so that the
  steps pipeline: r asks for up to WINDOW chunks ahead, and r-1 answers each as soon as it is ready, while r
  combines the one before.

A unit published is read by r+1 straight from the array (no copy); r must not write that memory again before r+1
has it, so a receive that overwrites a published unit first waits for it to be served (`wait`), and a collective
ends only once r+1 has everything (its last request, one past the last unit, says so).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from deepx_core.errors import DeepxError

#: the largest unit, in bytes: large enough that a request's round trip is small beside its copy, small enough that
#: the steps pipeline (a rank combines one chunk while the next arrives)
CHUNK_BYTES = 1 << 20
#: receives requested ahead of the one being combined
WINDOW = 4


@dataclass(frozen=True)
class Unit:
    """Elements start..stop of array `array` (of the collective's arrays, flat)."""

    array: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class Schedule:
    """One rank's part of a collective: what it publishes (each available once `pub_dep[i]` receives are done) and
    what it receives (each combined in place where `combine[j]`, else copied; first waiting until `wait[j]` of its
    publishes have been served)."""

    pubs: list[Unit] = field(default_factory=list)
    pub_dep: list[int] = field(default_factory=list)
    recvs: list[Unit] = field(default_factory=list)
    combine: list[bool] = field(default_factory=list)
    wait: list[int] = field(default_factory=list)


def chunks(sizes: Sequence[int], parts: int, chunk: int) -> list[list[Unit]]:
    """The elements of arrays of `sizes`, taken as one run, cut into `parts` segments as even as can be (the first
    ones one element longer), and each segment into units of at most `chunk` elements within one array."""
    total = sum(sizes)
    base, extra = divmod(total, parts)
    bounds = [j * base + min(j, extra) for j in range(parts + 1)]
    ends = np.cumsum([0, *sizes]).tolist()
    out: list[list[Unit]] = []
    for j in range(parts):
        lo, hi = bounds[j], bounds[j + 1]
        units: list[Unit] = []
        for a in range(len(sizes)):
            s, e = max(lo, ends[a]), min(hi, ends[a + 1])
            for k in range(s, e, chunk):
                units.append(Unit(a, k - ends[a], min(k + chunk, e) - ends[a]))
        out.append(units)
    return out


def _steps(segs: list[list[Unit]], steps: Sequence[tuple[int, int, bool]]) -> Schedule:
    """A schedule of `steps` (per step: the segment published, the segment received, whether it is combined): a
    publish depends on the last receive into its memory; a receive waits for every publish of its memory before."""
    sched = Schedule()
    last_recv: dict[tuple[int, int], int] = {}
    published: dict[tuple[int, int], int] = {}
    dep = 0
    for pub, recv, combine in steps:
        for c, u in enumerate(segs[pub]):
            dep = max(dep, last_recv.get((pub, c), 0))
            published[pub, c] = len(sched.pubs) + 1
            sched.pubs.append(u)
            sched.pub_dep.append(dep)
        for c, u in enumerate(segs[recv]):
            sched.recvs.append(u)
            sched.combine.append(combine)
            sched.wait.append(published.get((recv, c), 0))
            last_recv[recv, c] = len(sched.recvs)
    return sched


def all_reduce(sizes: Sequence[int], world: int, rank: int, chunk: int) -> Schedule:
    segs = chunks(sizes, world, chunk)
    n = world
    rs = [((rank - s) % n, (rank - s - 1) % n, True) for s in range(n - 1)]
    ag = [((rank + 1 - s) % n, (rank - s) % n, False) for s in range(n - 1)]
    return _steps(segs, rs + ag)


def reduce_scatter(size: int, world: int, rank: int, chunk: int) -> Schedule:
    """Rank r ends with segment r (block r) combined over every rank."""
    segs = chunks([size], world, chunk)
    n = world
    return _steps(segs, [((rank - s - 1) % n, (rank - s - 2) % n, True) for s in range(n - 1)])


def all_gather(size: int, world: int, rank: int, chunk: int) -> Schedule:
    """Each rank starts with its own block (segment r) in place; every rank ends with every block."""
    segs = chunks([size], world, chunk)
    n = world
    return _steps(segs, [((rank - s) % n, (rank - s - 1) % n, False) for s in range(n - 1)])


def broadcast(sizes: Sequence[int], world: int, rank: int, src: int, chunk: int) -> Schedule:
    """A chain from `src`: each rank after it receives every unit from the rank before and passes it on (the last one
    keeps it: its successor is the source)."""
    units = [u for seg in chunks(sizes, 1, chunk) for u in seg]
    d = (rank - src) % world
    sched = Schedule()
    if world == 1:
        return sched
    if d:
        sched.recvs = list(units)
        sched.combine = [False] * len(units)
        sched.wait = [0] * len(units)
    if d < world - 1:
        sched.pubs = list(units)
        sched.pub_dep = [0] * len(units) if d == 0 else list(range(1, len(units) + 1))
    return sched


#: how a reduction combines two values (mean: the sum, divided once the ring is done)
COMBINE: dict[str, Callable[..., Any]] = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
                                          "product": np.multiply}


def as_bytes(a: np.ndarray) -> memoryview:
    """A flat array's bytes, without a copy (any dtype: ml_dtypes' too)."""
    return memoryview(a.view(np.uint8).data).cast("B") if a.size else memoryview(b"")


class Link(Protocol):
    """What the engine needs of the connection to rank r-1's daemon (deepxd/comm.py's PeerLink): send a request
    frame; receive the reply to request `rid`, unit `unit`, straight into `dest` (peerlink's chunk replies)."""

    def send(self, frame: dict[str, Any]) -> None: ...

    def receive(self, rid: int, unit: int, dest: memoryview) -> None: ...


def run(sched: Schedule, arrays: Sequence[np.ndarray], combine: Callable[..., Any] | None, link: Link | None,
        request: dict[str, Any], publish: Callable[[int], None], wait_served: Callable[[int], None]) -> None:
    """Run this rank's part of a collective: `arrays` (flat, one dtype) are written in place. `request`: the fields
    of each read of rank r-1 (`unit` added); `publish(n)`: the first n publishes are ready for r+1; `wait_served(n)`:
    returns once r+1 has the first n. Blocking; DeepxError where the link fails or r-1 answers with an error."""
    pubs, deps = sched.pubs, sched.pub_dep
    ready = 0

    def advance(done: int) -> None:
        nonlocal ready
        k = ready
        while k < len(pubs) and deps[k] <= done:
            k += 1
        if k != ready:
            ready = k
            publish(k)

    advance(0)
    recvs = sched.recvs
    if recvs:
        if link is None:
            raise DeepxError("the ring has no link to the rank before this one")
        scratch = np.empty(max(u.size for u in recvs), arrays[0].dtype)
        asked = 0
        inflight: deque[int] = deque()
        for j, u in enumerate(recvs):
            while asked < len(recvs) and len(inflight) < WINDOW:
                link.send({**request, "id": asked + 1, "unit": asked})
                inflight.append(asked)
                asked += 1
            wait_served(sched.wait[j])
            dest = arrays[u.array][u.start:u.stop]
            if sched.combine[j]:
                assert combine is not None
                got = scratch[:u.size]
                link.receive(j + 1, j, as_bytes(got))
                combine(dest, got, out=dest)
            else:
                link.receive(j + 1, j, as_bytes(dest))
            inflight.popleft()
            advance(j + 1)
        n = len(recvs)  # one past the last unit: everything arrived (rank r-1 may write its arrays again)
        link.send({**request, "id": n + 1, "unit": n})
        link.receive(n + 1, n, memoryview(b""))
    advance(len(recvs))
    wait_served(len(pubs))
