"""The CUDA compiler choice, on any machine: a clear error for an unknown compiler or a missing NVRTC library.
(Compiling itself is tested on the GPU machine, tests/gpu/test_compile.py.)"""

from __future__ import annotations

import pytest

from deepx_core.errors import DeepxError
from deepxd.kernels.cuda import nvrtc
from deepxd.kernels.cuda._build import choose_compiler


def test_an_unknown_compiler_is_refused_by_name(monkeypatch):
    with pytest.raises(DeepxError, match=r"unknown compiler 'clang'.*nvrtc or nvcc"):
        choose_compiler("clang")
    monkeypatch.setenv("DEEPX_CUDA_COMPILER", "gcc")
    with pytest.raises(DeepxError, match="unknown compiler 'gcc'"):
        choose_compiler()


def test_nvcc_is_chosen_when_asked(monkeypatch):
    monkeypatch.setenv("DEEPX_CUDA_COMPILER", "nvcc")
    assert choose_compiler() == "nvcc"
    assert choose_compiler("NVCC") == "nvcc"


def test_a_missing_nvrtc_names_where_it_looked():
    if nvrtc.available():
        pytest.skip("libnvrtc loads on this machine: nothing is missing")
    with pytest.raises(DeepxError, match=r"libnvrtc.so not found .*DEEPX_NVRTC"):
        choose_compiler("nvrtc")
    assert choose_compiler() == "nvcc"  # the default falls back to nvcc where NVRTC is missing
