"""A `backward` instruction inside a program (what the SDK records for a repeated `loss.backward()`): the scheduler
expands it in place into the backward program of its forward graph, so that forward, backward and optimizer go as
one program. The results equal the separate backward request's; a backward that cannot be derived fails at its own
instruction after the forward before it ran; malformed requests are refused with a clear message."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.text import parse_text
from deepxd.actors.messages import Backward, Fetch, Put, Run
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.scheduler import Scheduler
from deepxd.config import Config

FORWARD = """
    matmul (tensor<float64>:x, tensor<float64>:w) -> (tensor<float64>:h)
    tanh (tensor<float64>:h) -> (tensor<float64>:t)
    sum (tensor<float64>:t, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
"""
UPDATE = ("sgd (tensor<float64>:w, tensor<float64>:gw, tensor<float64>:buf, var<float64>:0.1, var<float64>:0.0, "
          "var<float64>:0.0, var<float64>:0.0, var<bool>:false, var<int32>:1) "
          "-> (tensor<float64>:w, tensor<float64>:buf)")


class Node:
    def __init__(self) -> None:
        self.worker = CpuWorker(output_log=False)
        self.scheduler = Scheduler({"op-cpu": self.worker.ref}, config=Config())

    async def start(self, rng: np.random.Generator) -> Node:
        self.worker.start()
        self.scheduler.start()
        self.x = rng.standard_normal((4, 3))
        self.w = rng.standard_normal((3, 2))
        for name, a in (("x", self.x), ("w", self.w), ("buf", np.zeros((3, 2)))):
            await self.worker.ref.ask(Put(name=name, dtype="float64", shape=list(a.shape), data=a.tobytes()))
        return self

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.worker.stop()


@pytest.fixture
async def node(rng: np.random.Generator) -> AsyncIterator[Node]:
    n = await Node().start(rng)
    yield n
    await n.stop()


def _marker(names: dict[str, str]) -> Instr:
    return Instr("backward", (Param.tensor("loss", "float64"),),
                 tuple(Param.tensor(n, "float64") for n in names.values()))


def _spec(index: int, **over: object) -> dict[str, object]:
    spec: dict[str, object] = {"index": index, "forward": parse_text(FORWARD.strip()), "loss": "loss", "wrt": ["w"],
                               "grad_loss": None, "prefix": "g0_", "names": {"w": "gw"}}
    spec.update(over)
    return spec


def _expected_grad(n: Node) -> np.ndarray:
    h = n.x @ n.w
    return n.x.T @ (1 - np.tanh(h) ** 2)


async def test_a_backward_instruction_runs_forward_backward_and_update_as_one_program(node: Node) -> None:
    program = [*parse_text(FORWARD.strip()), _marker({"w": "gw"}), *parse_text(UPDATE)]
    r = await node.scheduler.ref.ask(Run(program=program, fetch=["loss", "gw"], backwards=[_spec(3)]))
    assert not r.error and r.done == len(program)
    np.testing.assert_allclose(r.tensors["gw"], _expected_grad(node), rtol=1e-12)
    np.testing.assert_allclose(r.tensors["loss"], np.tanh(node.x @ node.w).sum(), rtol=1e-12)
    np.testing.assert_allclose(node.worker.ex.get("w"), node.w - 0.1 * _expected_grad(node), rtol=1e-12)
    assert len(r.times_us) == 2 * len(program)  # times speak of the program sent, one pair per instruction
    # only the gradient named is left of the backward's tensors
    assert not any(n.startswith("g0_") for n in node.worker.ex.tensors)


async def test_the_expansion_of_a_repeated_program_is_remembered(node: Node) -> None:
    program = [*parse_text(FORWARD.strip()), _marker({"w": "gw"}), *parse_text(UPDATE),
               *parse_text("deltensor () -> (tensor<float64>:gw)")]
    for k in range(4):  # the first run makes h, t and loss: the second sees other tensors, the third the same
        r = await node.scheduler.ref.ask(Run(program=program, fetch=[], backwards=[_spec(3)]))
        assert not r.error
        # from the third run on, by the plan of the second (see test_fast_path.py)
        assert node.scheduler.plan_hits == max(0, k - 1)
    # the same program against tensors of another shape expands again, and still matches numpy
    x = np.ones((5, 3))
    await node.worker.ref.ask(Put(name="x", dtype="float64", shape=[5, 3], data=x.tobytes()))
    await node.scheduler.ref.ask(Run(program=parse_text("\n".join(
        f"deltensor () -> (tensor<float64>:{n})" for n in ("h", "t", "loss")))))
    hits = node.scheduler.plan_hits
    w = node.worker.ex.get("w").copy()
    r = await node.scheduler.ref.ask(Run(program=program[:4], fetch=["gw"], backwards=[_spec(3)]))
    assert not r.error and node.scheduler.plan_hits == hits
    np.testing.assert_allclose(r.tensors["gw"], x.T @ (1 - np.tanh(x @ w) ** 2), rtol=1e-12)


async def test_a_backward_that_cannot_be_derived_fails_at_its_instruction_after_the_forward_ran(node: Node) -> None:
    forward = [*parse_text(FORWARD.strip())]
    program = [*forward, _marker({"w": "gw"}), *parse_text(UPDATE)]
    spec = _spec(3)  # a forward graph through argmax, which has no gradient
    spec["forward"] = [*forward[:2], *parse_text(
        "argmax (tensor<float64>:t, var<int32>:1, var<bool>:false) -> (tensor<int64>:loss)")]
    r = await node.scheduler.ref.ask(Run(program=program, fetch=[], backwards=[spec]))
    assert r.error_index == 3 and r.done == 3
    assert r.error.startswith("instruction 4: backward: ") and "loss" in r.error
    assert "loss" in node.worker.ex.tensors and "gw" not in node.worker.ex.tensors  # the forward ran, not the update
    np.testing.assert_array_equal(node.worker.ex.get("w"), node.w)


async def test_a_forward_refused_before_the_backward_fails_where_it_is_refused(node: Node) -> None:
    program = [*parse_text("matmul (tensor<float64>:x, tensor<float64>:x) -> (tensor<float64>:h)"),
               _marker({"w": "gw"})]
    r = await node.scheduler.ref.ask(Run(program=program, fetch=[], backwards=[_spec(1)]))
    assert r.error_index == 0 and "matmul" in r.error and "gw" not in node.worker.ex.tensors


@pytest.mark.parametrize(("index", "over", "message"), [
    (0, {}, "index 0 is not a backward instruction"),
    (3, {"wrt": "w"}, "malformed request"),
    (3, {"forward": ["matmul"]}, "malformed request"),
    (3, {"names": {"w": "x"}}, "'x' is a tensor of the forward graph"),
    (3, {"names": {"v": "gv"}}, "one name for each of wrt"),
])
async def test_malformed_backward_requests_are_refused_and_nothing_runs(node: Node, index: int, over: dict,
                                                                       message: str) -> None:
    program = [*parse_text(FORWARD.strip()), _marker({"w": "gw"})]
    r = await node.scheduler.ref.ask(Run(program=program, fetch=[], backwards=[_spec(index, **over)]))
    assert message in r.error
    if index == 3:
        assert r.error_index == 3 and r.done == 3  # the forward before it ran
    else:
        assert "loss" not in node.worker.ex.tensors  # refused before anything ran


async def test_a_backward_instruction_without_its_request_is_an_unknown_op(node: Node) -> None:
    program = [*parse_text(FORWARD.strip()), _marker({"w": "gw"})]
    r = await node.scheduler.ref.ask(Run(program=program, fetch=[]))
    assert r.error == "instruction 4: op 'backward' not found" and r.error_index == 3



SCALED = """
    argset (var<float64>:VALUE) -> (var<string>:alpha)
    matmul (tensor<float64>:x, tensor<float64>:w) -> (tensor<float64>:h)
    mulscalar (tensor<float64>:h, var<float64>:alpha) -> (tensor<float64>:s)
    sum (tensor<float64>:s, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
"""


async def test_a_forward_that_reads_a_variable_by_name_has_its_backward(node: Node) -> None:
    """A forward reading `alpha` (argset's) by name: its backward takes alpha's value, in the backward request and
    in a backward instruction; a new value of alpha gives a new backward, not a remembered one (found open in an
    earlier session: the derivation knew no variables)."""
    forward = parse_text(SCALED.replace("VALUE", "1.5").strip())[1:]
    await node.scheduler.ref.ask(Run(program=parse_text(SCALED.replace("VALUE", "1.5").strip()), fetch=[]))
    out = await node.scheduler.ref.ask(Backward(forward=forward, loss="loss", wrt=["w"], prefix="gb_"))
    grad = (await node.worker.ref.ask(Fetch(names=[out["grads"]["w"]])))[out["grads"]["w"]]
    np.testing.assert_allclose(grad, 1.5 * node.x.T @ np.ones((4, 2)), rtol=1e-12)
    for value in (1.5, 1.5, -2.0):  # the same program twice, then alpha changed by the program itself
        program = [*parse_text(SCALED.replace("VALUE", str(value)).strip()), _marker({"w": "gw"}),
                   *parse_text("deltensor () -> (tensor<float64>:h)\ndeltensor () -> (tensor<float64>:s)")]
        spec = _spec(len(program) - 3, forward=forward)
        r = await node.scheduler.ref.ask(Run(program=program, fetch=["gw"], backwards=[spec]))
        assert not r.error, r.error
        np.testing.assert_allclose(r.tensors["gw"], value * node.x.T @ np.ones((4, 2)), rtol=1e-12)


async def test_a_variable_its_forward_read_set_again_before_the_backward_is_refused(node: Node) -> None:
    """The derivation would take the variable's new value, not the one the forward used (found in review): the
    backward instruction fails, naming the variable, after the instructions before it ran."""
    forward = parse_text(SCALED.replace("VALUE", "1.5").strip())[1:]
    program = [*parse_text(SCALED.replace("VALUE", "1.5").strip()),
               *parse_text("argset (var<float64>:-2.0) -> (var<string>:alpha)"), _marker({"w": "gw"})]
    r = await node.scheduler.ref.ask(Run(program=program, fetch=[], backwards=[_spec(5, forward=forward)]))
    assert r.error and "instruction 6: backward: variable 'alpha', which its forward reads by name, is set again" \
        in r.error
    assert r.done == 5
    np.testing.assert_allclose(node.worker.ex.get("loss"), 1.5 * (node.x @ node.w).sum(), rtol=1e-12)


async def test_a_program_that_reads_a_variable_by_name_is_expanded_afresh(node: Node) -> None:
    """Its expansion was remembered by the metas before it alone (found in review): a later vecset of the shape it
    reshapes by got the backward derived for the old shape."""
    await node.worker.ref.ask(Put(name="xr", dtype="float64", shape=[6], data=np.arange(6.0).tobytes()))
    await node.worker.ref.ask(Put(name="w6", dtype="float64", shape=[6], data=np.ones(6).tobytes()))
    body = ("reshape (tensor<float64>:xr, vector<int32>:shp) -> (tensor<float64>:xs)\n"
            "mul (tensor<float64>:xs, tensor<float64>:w6) -> (tensor<float64>:hs)\n"
            "sum (tensor<float64>:hs, vector<int32>:[], var<bool>:false) -> (tensor<float64>:ls)")
    forward = parse_text(body)[1:]
    marker = Instr("backward", (Param.tensor("ls", "float64"),), (Param.tensor("gw6", "float64"),))
    tail = parse_text("deltensor () -> (tensor<float64>:xs)\ndeltensor () -> (tensor<float64>:hs)\n"
                      "deltensor () -> (tensor<float64>:ls)\ndeltensor () -> (tensor<float64>:gw6)")
    for shp in ("[6]", "[1 6]", "[1 6]", "[6]"):
        await node.scheduler.ref.ask(Run(program=parse_text(f"vecset (vector<int32>:{shp}) -> (vector:shp)")))
        program = [*parse_text(body), marker, *tail]
        spec = {"index": 3, "forward": forward, "loss": "ls", "wrt": ["w6"], "grad_loss": None, "prefix": "g_",
                "names": {"w6": "gw6"}}
        r = await node.scheduler.ref.ask(Run(program=program[:4], fetch=["gw6"], backwards=[spec]))
        assert not r.error, r.error
        assert r.tensors["gw6"].shape == (6,)
        np.testing.assert_allclose(r.tensors["gw6"], np.arange(6.0), rtol=1e-12)
        await node.scheduler.ref.ask(Run(program=tail))
    assert not any(plan.backwards for bucket in node.scheduler.plans.values() for plan in bucket)  # none kept
