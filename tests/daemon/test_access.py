"""UdpScope's bookkeeping of the names UDP made, as each instruction's effect says (deepxd/access.py)."""

from __future__ import annotations

from deepx_core.ir.text import parse_text
from deepxd.access import UdpScope, tensor_names


def _scope() -> UdpScope:
    return UdpScope(lambda: None, None)  # type: ignore[arg-type,return-value]  (no worker asked here)


def test_the_names_an_instruction_names_by_its_signature():
    concat, rename, delete, load, setter = parse_text(
        "concat ([01 u], 0) -> (c)\n"  # untyped: the signature decides; a tensor list as bind reads it
        "renametensor (var<string>:new) -> (tensor:old)\n"
        "deltensor () -> (tensor:gone)\n"
        "load (var<string>:/data/w.x) -> ()\n"
        "argset (var<float32>:1) -> (var<string>:lr)")
    assert tensor_names(concat) == (["1", "u"], ["c"])
    assert tensor_names(rename) == ([], ["old"])
    assert tensor_names(delete) == ([], ["gone"])
    assert tensor_names(load) == ([], ["w.x"])
    assert tensor_names(setter) == ([], [])


def test_udp_owns_what_it_makes_and_loses_what_it_deletes_or_renames_away():
    scope = _scope()
    scope.share(["w"], True)
    for instr in parse_text("newtensor (vector<int32>:[2]) -> (tensor<float32>:a)\n"
                            "copytensor (tensor:a) -> (tensor:w)\n"  # written, still only shared
                            "renametensor (var<string>:b) -> (tensor:a)\n"
                            "load (var<string>:/data/f.x) -> ()\n"
                            "deltensor () -> (tensor:f.x)"):
        scope.ran(instr)
    assert scope.made == {"b"} and scope.shared == {"w"}


def test_another_clients_program_takes_back_what_it_writes_deletes_or_renames():
    scope = _scope()
    scope.made.update({"a", "b", "c", "d"})
    scope.share(["s"], True)
    scope.written_by_another(parse_text("addscalar (tensor:x, var:1) -> (tensor:a)\n"
                                        "deltensor () -> (tensor:s)\n"
                                        "renametensor (var<string>:c) -> (tensor:b)"))
    assert scope.made == {"d"} and scope.shared == set()
