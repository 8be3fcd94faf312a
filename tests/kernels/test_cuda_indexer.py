"""The CUDA indexers' host side, without a GPU: the magic-number divisors of FOR_COORDS divide exactly, and a strided
copy widens its items only where every pointer and stride allows (tests/gpu/test_kernels.py runs the kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from deepxd.kernels.cuda._src import MAXD, NARROW_LIMIT, divisors
from deepxd.kernels.cuda.shape import _widened


def _divide(r: int, packed: int) -> int:
    """The kernel's division: (umulhi(r, magic) + r) >> shift, in 32-bit unsigned arithmetic."""
    magic, shift = packed & 0xFFFFFFFF, packed >> 32
    return ((((r * magic) >> 32) + r) & 0xFFFFFFFF) >> shift


@pytest.mark.parametrize("seed", range(4))
def test_the_magic_divisors_divide_every_index_below_2_to_the_31_exactly(seed):
    rng = np.random.default_rng(seed)
    sizes = [1, 2, 3, 7, 64, 100, 127, 128, 129, 1000, 65535, 65536, 65537, NARROW_LIMIT - 1,
             *(int(v) for v in rng.integers(1, NARROW_LIMIT, 200)), *(int(v) for v in rng.integers(1, 5000, 200))]
    for size in sizes:
        (packed, *rest) = divisors([size], size)
        assert rest == [0] * (MAXD - 1)
        assert 0 < packed & 0xFFFFFFFF and packed >> 32 < 32
        rs = [0, 1, size - 1, size, size + 1, NARROW_LIMIT - 1, *(int(v) for v in rng.integers(0, NARROW_LIMIT, 50))]
        for r in rs:
            if r < NARROW_LIMIT:
                assert _divide(r, packed) == r // size, (size, r)


def test_an_index_that_may_reach_2_to_the_31_divides_in_64_bits():
    assert divisors([4, 8], NARROW_LIMIT) == [0] * MAXD  # the kernel reads zeros as "divide in 64 bits"
    assert divisors([4, 8], NARROW_LIMIT - 1)[0] != 0


def test_a_copy_whose_inner_rows_are_contiguous_on_both_sides_moves_wider_items():
    # a head split of float32: (b, t, h, 64) -> (b, h, t, 64), collapsed to (b, h, t, 64) with these strides
    shape, sd, ss = [2, 4, 8, 64], [2048, 512, 64, 1], [2048, 64, 256, 1]
    assert _widened(4, shape, sd, ss, 4096, 8192) == (16, [2, 4, 8, 16], [512, 128, 16, 1], [512, 16, 64, 1])
    # a pointer only 8-byte aligned: 8-byte items
    assert _widened(4, shape, sd, ss, 4096 + 8, 8192)[0] == 8
    # inner rows of an odd length, a strided inner dim, a stride not a multiple of the wider item: as they were
    assert _widened(4, [2, 63], [63, 1], [1, 2], 0, 0) == (4, [2, 63], [63, 1], [1, 2])
    assert _widened(4, [3, 8], [1, 3], [8, 1], 0, 0) == (4, [3, 8], [1, 3], [8, 1])
    assert _widened(4, [3, 8], [10, 1], [8, 1], 0, 0)[0] == 8
    # items already 8 bytes wide: 16 where the row holds an even count
    assert _widened(8, [5, 4], [4, 1], [8, 1], 0, 0) == (16, [5, 2], [2, 1], [4, 1])
