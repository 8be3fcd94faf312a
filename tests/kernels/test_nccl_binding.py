"""The host side of the NCCL binding (deepxd/kernels/cuda/nccl.py), checked without a GPU or NCCL.

- ncclConfig_t is passed in its NCCL 2.17 layout: the offsets below are nccl.h's (NCCL 2.17 to 2.32 keep them, later
  fields being appended), NCCL_CONFIG_INITIALIZER's magic, version and "undefined" values, and `blocking` 0.
- A library that is not an NCCL of 2.14 or later (libc here: none of NCCL's functions) counts as NCCL not loading,
  with a DeepxError saying what it lacks, instead of an AttributeError that would fail op-cuda's start (its worker
  asks whether NCCL loads when it opens: DeviceInfo).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from deepx_core.errors import DeepxError
from deepxd.kernels.cuda import nccl


def test_the_config_struct_has_nccl_h_s_layout_and_initializer() -> None:
    offsets = {name: getattr(nccl._Config, name).offset for name, _ in nccl._Config._fields_}
    assert offsets == {"size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20, "minCTAs": 24,
                       "maxCTAs": 28, "netName": 32, "splitShare": 40}
    c = nccl._config(blocking=False)
    assert (c.size, c.magic, c.version, c.blocking) == (ctypes.sizeof(nccl._Config), 0xCAFEBEEF, 21700, 0)
    assert c.cgaClusterSize == c.minCTAs == c.maxCTAs == c.splitShare == -(2**31) and c.netName is None
    assert ctypes.sizeof(nccl.UniqueId) == 128
    # ncclDataType_t and ncclRedOp_t as nccl.h numbers them
    assert nccl.DTYPES == {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
                           "float32": 7, "float64": 8, "bfloat16": 9}
    assert nccl.OPS == {"sum": 0, "product": 1, "max": 2, "min": 3, "mean": 4}


def test_a_library_that_is_not_nccl_counts_as_nccl_not_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = ctypes.util.find_library("c")
    if not libc:
        pytest.skip("no libc found by name here")
    monkeypatch.setenv("DEEPX_NCCL", libc)
    monkeypatch.setattr(nccl, "_lib", None)
    monkeypatch.setattr(nccl, "_missing", None)
    with pytest.raises(DeepxError, match=r"NCCL: .* lacks ncclGetVersion, .*ncclCommInitRankConfig.*: deepx needs "
                                         r"NCCL 2.14 or later"):
        nccl.library()
    why = nccl.available()
    assert why is not None and "NCCL 2.14 or later" in why
