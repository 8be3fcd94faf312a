"""The cost model and the segments of programs across nodes (deepxd/placement.py), on programs written as text: where
each instruction goes, what moves, what comes back and what is deleted on the peers. The runs through real daemons
are tests/daemon/test_placement.py."""

from __future__ import annotations

from deepx_core.ir import parse_text
from deepx_core.ir.ops import TensorMeta
from deepxd.placement import (
    MIN_CALLS,
    Held,
    Node,
    Step,
    describe,
    inputs,
    moved,
    place,
    placement_view,
    rename,
    segments,
)

MiB = 1 << 20
A, B, C = "a", "b", "c"


def cluster(*, same_host: bool = False, rtt: float = 1e-3, bw: float = 1e9,
            a_ops: frozenset[str] = frozenset({"sum", "mulscalar", "addscalar", "add", "deltensor", "npnorm"}),
            b_mean: dict[str, float] | None = None, a_mean: dict[str, float] | None = None,
            a_worker: str = "op-cpu") -> dict[str, Node]:
    """Node b (here) and node a, on one host or two."""
    return {B: Node(B, "hb", mean_s=b_mean or {}),
            A: Node(A, "hb" if same_host else "ha", a_worker, ops=a_ops, mean_s=a_mean or {}, rtt_s=rtt,
                    bytes_per_s=bw)}


def steps_of(text: str, metas: dict[str, TensorMeta], heap: set[str]) -> list[Step]:
    steps = describe(parse_text(text), metas, heap)
    assert steps is not None
    return steps


F32 = "float32"


def test_a_small_op_on_a_large_heap_tensor_of_another_host_runs_there() -> None:
    text = "sum (tensor<float32>:w, vector<int32>:[0]) -> (tensor<float32>:s)"
    metas = {"w": TensorMeta((4 * MiB, 2), F32)}
    steps = steps_of(text, metas, {"w"})
    held = {"w": Held(32 * MiB, A, heap=True)}
    p = place(steps, B, cluster(), held)
    assert p is not None and p.nodes == [A]
    assert p.moves == [[]] and [(m.tensor, m.src, m.dst, m.nbytes) for m in p.back] == [("s", A, B, 8)]
    assert p.cost_s < p.here_s
    # on one host the tensor is mapped, not moved: it runs here
    assert place(steps, B, cluster(same_host=True), held) is None


def test_a_small_tensor_of_another_host_is_read_here() -> None:
    text = "mulscalar (tensor<float32>:w, var<float32>:2.0) -> (tensor<float32>:o)"
    steps = steps_of(text, {"w": TensorMeta((16,), F32)}, {"w"})
    assert place(steps, B, cluster(), {"w": Held(64, A, heap=True)}) is None  # a round trip costs more


def test_a_result_as_large_as_its_input_is_not_worth_the_trip() -> None:
    """relu of a's large tensor, read here: its result crosses back as the input would have: here."""
    text = "mulscalar (tensor<float32>:w, var<float32>:2.0) -> (tensor<float32>:o)"
    steps = steps_of(text, {"w": TensorMeta((8 * MiB,), F32)}, {"w"})
    assert place(steps, B, cluster(), {"w": Held(32 * MiB, A, heap=True)}) is None


def test_an_op_only_a_peer_serves_goes_there_with_its_input() -> None:
    text = """newtensor (vector<int32>:[4]) -> (tensor<float32>:x)
npnorm (tensor<float32>:x) -> (tensor<float32>:y)
addscalar (tensor<float32>:y, var<float32>:1.0) -> (tensor<float32>:z)"""
    steps = steps_of(text, {}, set())
    assert [(s.op, s.here, s.away) for s in steps] == [("newtensor", True, False), ("npnorm", False, True),
                                                       ("addscalar", True, True)]
    p = place(steps, B, cluster(), {})
    assert p is not None and p.nodes[:2] == [B, A] and p.here_s == float("inf")
    assert [(m.tensor, m.src, m.dst, m.nbytes) for m in p.moves[1]] == [("x", B, A, 16)]
    segs = segments(steps, p.nodes, B, frozenset())
    assert [(s.node, s.start, s.end) for s in segs][:2] == [(B, 0, 1), (A, 1, 2)]
    if p.nodes[2] == B:  # z here: y comes back for it, nothing stays on a
        assert (segs[1].ship, segs[1].back, sorted(segs[1].drop)) == (["x"], ["y"], ["x", "y"])
    else:  # z on a as well: y and z are left at the end, so both come back
        assert (segs[1].ship, segs[1].back, sorted(segs[1].drop)) == (["x"], ["y", "z"], ["x", "y", "z"])
    # no node serves it: None (the program fails here, naming the op)
    assert place(steps, B, cluster(a_ops=frozenset({"sum"})), {}) is None


def test_a_chain_on_a_large_remote_tensor_stays_there_and_its_temporaries_are_deleted_there() -> None:
    text = """mulscalar (tensor<float32>:w, var<float32>:2.0) -> (tensor<float32>:t)
sum (tensor<float32>:t, vector<int32>:[0]) -> (tensor<float32>:s)
deltensor () -> (tensor<float32>:t)
addscalar (tensor<float32>:s, var<float32>:1.0) -> (tensor<float32>:o)"""
    steps = steps_of(text, {"w": TensorMeta((8 * MiB,), F32)}, {"w"})
    p = place(steps, B, cluster(), {"w": Held(32 * MiB, A, heap=True)})
    assert p is not None and p.nodes[:3] == [A, A, A]  # t never crosses: it is deleted where it lives
    segs = segments(steps, p.nodes, B, frozenset({"w"}))
    a = segs[0]
    assert (a.node, a.start, a.ship) == (A, 0, [])
    assert "t" not in a.back and "t" not in a.drop  # deleted by the program, there
    assert "s" in a.back or p.nodes[3] == A


def test_a_temporary_read_by_a_later_segment_on_the_peer_stays_there() -> None:
    """x goes to a once; y, made on a, is read on a again after an instruction here: it stays on a between."""
    text = """npnorm (tensor<float32>:x) -> (tensor<float32>:y)
addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:x2)
npnorm (tensor<float32>:y) -> (tensor<float32>:z)"""
    metas = {"x": TensorMeta((4,), F32)}
    steps = steps_of(text, metas, set())
    nodes = [A, B, A]
    segs = segments(steps, nodes, B, frozenset())
    first, last = segs[0], segs[2]
    assert (first.ship, first.back, first.drop) == (["x"], ["y"], ["x"])  # y: left at the end, and read on a again
    assert (last.ship, last.reuse, last.back, sorted(last.drop)) == ([], ["y"], ["z"], ["y", "z"])


def test_a_worker_of_another_kind_clearly_faster_at_an_op_gets_it_and_noise_does_not_count() -> None:
    """a's op-cuda against b's op-cpu: its mean counts where it is clearly apart; two op-cpu workers' means never
    (what sets them apart is their machines' load)."""
    text = "mul (tensor<float32>:x, tensor<float32>:x) -> (tensor<float32>:y)"
    steps = steps_of(text, {"x": TensorMeta((256,), F32)}, set())
    held = {"x": Held(1024, B)}
    ops = frozenset({"mul"})
    fast = cluster(a_ops=ops, b_mean={"mul": 0.5}, a_mean={"mul": 0.01}, a_worker="op-cuda")
    p = place(steps, B, fast, held)
    assert p is not None and p.nodes == [A]
    assert place(steps, B, cluster(a_ops=ops, b_mean={"mul": 0.5}, a_mean={"mul": 0.01}), held) is None  # one kind
    close = cluster(a_ops=ops, b_mean={"mul": 0.5}, a_mean={"mul": 0.3}, a_worker="op-cuda")  # under 2x: noise
    assert place(steps, B, close, held) is None
    unknown = cluster(a_ops=ops, a_mean={"mul": 0.01}, a_worker="op-cuda")  # nothing known here: no evidence
    assert place(steps, B, unknown, held) is None


def test_writes_of_heap_tensors_and_reads_of_variables_stay_here() -> None:
    text = """mulscalar (tensor<float32>:w, var<float32>:2.0) -> (tensor<float32>:w)
mulscalar (tensor<float32>:w, var<float32>:lr) -> (tensor<float32>:o)"""
    steps = describe(parse_text(text), {"w": TensorMeta((4,), F32)}, {"w"})
    assert steps is None or all(not s.away for s in steps)


def test_inputs_and_rename() -> None:
    program = parse_text("""add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c)
npnorm (tensor<float32>:c, tensor<float32>:d) -> (tensor<float32>:e)""")
    assert inputs(program) == ["a", "b", "d"]
    renamed = rename(program[0], lambda n: n if n == "a" else f"_dx.b.{n}")
    assert [p.value for p in renamed.args] == ["a", "_dx.b.b"] and renamed.returns[0].value == "_dx.b.c"
    other = rename(program[1], lambda n: f"T{n}")  # an op of another node: by its params' categories
    assert [p.value for p in other.args] == ["Tc", "Td"] and other.returns[0].value == "Te"


def test_op_statistics_are_news_to_placement_only_where_what_it_reads_moved() -> None:
    """A node's registry gives its op statistics a new version in the `nodes` index only where placement would read
    something new: an op run for the first time or the MIN_CALLS-th, a mean moved by DRIFT (1.25x) or more."""
    def view(**ops: tuple[int, float]) -> dict[str, float | None]:
        return placement_view({op: {"calls": c, "seconds": s, "bytes": 0} for op, (c, s) in ops.items()})

    first = view(add=(1, 1e-3))
    assert first == {"add": None} and moved({}, first)
    assert not moved(first, view(add=(MIN_CALLS - 1, 7e-3)))  # more calls, still too few for a mean
    eight = view(add=(MIN_CALLS, MIN_CALLS * 1e-3))
    assert eight == {"add": 1e-3} and moved(first, eight)
    assert not moved(eight, view(add=(100, 100 * 1.2e-3)))  # 1.2x: noise to a model that wants 2x
    assert moved(eight, view(add=(100, 100 * 1.3e-3)))
    assert moved(eight, view(add=(100, 100 * 0.7e-3)))
    assert moved(eight, view(add=(MIN_CALLS, MIN_CALLS * 1e-3), mul=(1, 1e-3)))  # another op
