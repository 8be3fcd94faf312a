"""conv2d and its gradient ops (conv2dgradinput, conv2dgradweight) on the CPU kernels, against torch's conv2d and its
autograd in float64 on the CPU, for every float dtype the ops claim, on random geometries (stride, padding,
dilation, groups); and their refusals."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_ref import VEC, T, V, assert_close, executor, f64, ordered, rand, run

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import OPS

torch = pytest.importorskip("torch")

GEOMETRIES = [  # (N, C, H, W, O, kh, kw, stride, padding, dilation, groups)
    (2, 3, 7, 6, 4, 3, 2, (1, 1), (1, 0), (1, 1), 1),
    (2, 4, 9, 8, 6, 3, 3, (2, 1), (1, 2), (2, 1), 2),
    (1, 4, 5, 5, 4, 1, 1, (1, 1), (0, 0), (1, 1), 4),  # depthwise 1x1
    (3, 2, 6, 9, 2, 2, 3, (3, 2), (2, 1), (1, 2), 1),
]


def _reference(x: np.ndarray, w: np.ndarray, gy: np.ndarray, geo: tuple) -> tuple[np.ndarray, ...]:
    stride, padding, dilation, groups = geo[7:]
    xt = torch.tensor(f64(x), requires_grad=True)
    wt = torch.tensor(f64(w), requires_grad=True)
    y = torch.nn.functional.conv2d(xt, wt, stride=stride, padding=padding, dilation=dilation, groups=groups)
    y.backward(torch.tensor(f64(gy)))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


def _out_shape(geo: tuple) -> tuple[int, ...]:
    n, _, h, w, o, kh, kw, (sh, sw), (ph, pw), (dh, dw), _ = geo
    return n, o, (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1


@pytest.mark.parametrize("dtype", ordered(OPS["conv2d"].dtypes))
@pytest.mark.parametrize("geo", GEOMETRIES)
def test_conv2d_and_its_gradient_ops_match_torch(rng, dtype, geo):
    n, c, h, w, o, kh, kw, stride, padding, dilation, groups = geo
    x = rand(rng, dtype, (n, c, h, w), -1, 1)
    wt = rand(rng, dtype, (o, c // groups, kh, kw), -1, 1)
    gy = rand(rng, dtype, _out_shape(geo), -1, 1)
    want_y, want_dx, want_dw = _reference(x, wt, gy, geo)
    ex = executor(x=x, w=wt, gy=gy)
    geometry = [VEC(stride), VEC(padding), VEC(dilation), V(groups)]
    run(ex, "conv2d", [T("x", dtype), T("w", dtype), *geometry], [T("y", dtype)])
    run(ex, "conv2dgradinput", [T("gy", dtype), T("w", dtype), VEC(x.shape), *geometry], [T("dx", dtype)])
    run(ex, "conv2dgradweight", [T("x", dtype), T("gy", dtype), VEC(wt.shape), *geometry], [T("dw", dtype)])
    terms = c // groups * kh * kw  # each result a sum of this many products of values in [-1, 1]
    assert_close(ex.get("y"), want_y, dtype, scale=np.full(want_y.shape, terms), what="conv2d")
    assert_close(ex.get("dx"), want_dx, dtype, scale=np.full(want_dx.shape, o * kh * kw), what="conv2dgradinput")
    assert_close(ex.get("dw"), want_dw, dtype, scale=np.full(want_dw.shape, gy[0, 0].size * n),
                 what="conv2dgradweight")


@pytest.mark.parametrize(("args", "message"), [
    (((2, 3, 5, 5), (4, 2, 3, 3), 1), "groups=1 do not fit"),
    (((2, 4, 5, 5), (4, 2, 3, 3), 3), "groups=3 do not fit"),
    (((2, 3, 2, 2), (4, 3, 3, 3), 1), "smaller than the kernel"),
    (((2, 3, 5), (4, 3, 3, 3), 1), "must be 4-D"),
])
def test_conv2d_refuses_what_does_not_fit(rng, args, message):
    xs, ws, groups = args
    ex = executor(x=np.zeros(xs, np.float32), w=np.zeros(ws, np.float32))
    with pytest.raises(DeepxError, match=message):
        run(ex, "conv2d", [T("x", "float32"), T("w", "float32"), VEC((1, 1)), VEC((0, 0)), VEC((1, 1)), V(groups)],
            [T("y", "float32")])


def test_conv2d_gradient_ops_refuse_a_gradient_of_the_wrong_shape(rng):
    ex = executor(gy=np.zeros((2, 4, 3, 3), np.float32), w=np.zeros((4, 3, 3, 3), np.float32))
    with pytest.raises(DeepxError, match="conv2dgradinput: the gradient 'gy' has shape"):
        run(ex, "conv2dgradinput", [T("gy", "float32"), T("w", "float32"), VEC((2, 3, 6, 6)), VEC((1, 1)),
                                    VEC((0, 0)), VEC((1, 1)), V(1)], [T("dx", "float32")])
