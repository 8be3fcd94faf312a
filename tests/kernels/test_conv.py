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
    _check(rng, dtype, geo)


CHUNKED = [  # geometries of odd sizes, cut into chunks of several sizes below
    (3, 3, 11, 9, 5, 3, 3, (1, 1), (1, 1), (1, 1), 1),
    (3, 4, 10, 13, 6, 3, 2, (2, 3), (2, 1), (1, 2), 2),
    (2, 6, 9, 7, 6, 2, 3, (1, 2), (0, 3), (3, 1), 3),  # padding wider than the kernel's reach
    (5, 1, 8, 8, 4, 3, 3, (1, 1), (1, 1), (1, 1), 1),  # one input channel
    (2, 4, 7, 7, 4, 3, 3, (2, 2), (1, 1), (1, 1), 4),  # depthwise
]


@pytest.mark.parametrize("native_loops", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("cols", [1, "half", "two", 1 << 20], ids=["row", "half-image", "two-images", "batch"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("geo", CHUNKED)
def test_conv2d_chunks_match_torch(rng, monkeypatch, dtype, geo, cols, native_loops):
    """Chunks of one row, of part of an image (uneven), of two images (the last one short) and of the whole batch,
    on the native im2col and col2im and on numpy's: every boundary gives torch's result."""
    from deepxd.kernels.cpu import conv, native

    oh, ow = _out_shape(geo)[2:]
    size = {"half": oh * ow // 2 + 1, "two": 2 * oh * ow}.get(cols, cols)
    monkeypatch.setattr(conv, "CHUNK_BYTES", 0)
    monkeypatch.setattr(conv, "MIN_COLS", size)
    monkeypatch.setattr(conv, "_direct_fits", lambda *a: False)  # im2col, not the direct loops
    monkeypatch.setattr(conv, "GW_MIN_POSITIONS", 1 << 40)
    if not native_loops:
        monkeypatch.setattr(native, "_enabled", False)
    elif not native.available():
        pytest.skip("no C compiler: native im2col cannot be built")
    _check(rng, dtype, geo)


DIRECT = [  # geometries for the direct loops: strides, dilation, output channels past a block of 8 or 4
    (3, 4, 11, 9, 8, 3, 3, (1, 1), (1, 1), (1, 1), 1),
    (2, 5, 12, 10, 11, 3, 2, (2, 1), (1, 2), (2, 1), 1),
    (2, 4, 9, 13, 5, 2, 3, (3, 2), (2, 1), (1, 2), 1),
    (1, 2, 8, 8, 4, 1, 1, (1, 1), (0, 0), (1, 1), 1),
    (2, 3, 9, 7, 6, 2, 3, (1, 2), (0, 3), (3, 1), 1),  # padding wider than the kernel's reach: gradinput on im2col
    (4, 6, 26, 25, 9, 5, 5, (1, 1), (2, 2), (1, 1), 1),  # several images summed at a time in the weight's gradient
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("geo", DIRECT)
def test_conv2d_direct_loops_match_torch(rng, monkeypatch, dtype, geo):
    """The direct loops (no im2col) for every op that takes them here, against torch."""
    from deepxd.kernels.cpu import conv, native

    if not native.available():
        pytest.skip("no C compiler: the direct loops cannot be built")
    monkeypatch.setattr(conv, "DIRECT_KEPT", 0.0)
    monkeypatch.setattr(conv, "GW_MIN_POSITIONS", 0)
    monkeypatch.setattr(conv, "_GW_CACHE", 1 << 12)
    ran: list[str | None] = []

    def spied(name: str):
        f = getattr(conv, name)

        def spy(*args):
            r = f(*args)
            ran.append(name if r is not None and r is not False else None)
            return r
        return spy

    for name in ("_direct", "_direct_gw"):
        monkeypatch.setattr(conv, name, spied(name))
    _check(rng, dtype, geo)
    if conv._native() is not None:
        _, c, _, _, _, kh, kw, stride, (ph, pw), (dh, dw), _ = geo
        gradinput = stride == (1, 1) and c >= 4 and dh * (kh - 1) >= ph and dw * (kw - 1) >= pw
        assert ran.count("_direct") == 1 + gradinput
        assert "_direct_gw" in ran


def test_conv2d_direct_weight_gradient_gives_the_same_bits_split_or_not(rng, monkeypatch):
    """Images summed in fixed runs, the runs' sums added in order: threads or none, the same result."""
    from deepxd.kernels.cpu import conv, native

    if conv._native() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setattr(conv, "GW_MIN_POSITIONS", 0)
    x = rng.standard_normal((7, 4, 20, 20))
    gy = rng.standard_normal((7, 5, 20, 20))
    got = []
    for on in (True, False):
        monkeypatch.setattr(native, "_split_on", on)
        got.append(conv._direct_gw(x, gy, 3, 3, (1, 1), (1, 1), (1, 1)))
    assert got[0] is not None
    np.testing.assert_array_equal(got[0], got[1])


def test_conv2d_direct_weight_gradient_of_an_infinite_input_matches_torch(rng, monkeypatch):
    """An infinity in the input: the direct weight's gradient would multiply it by the zeros past each row (a NaN
    torch does not make), so im2col takes it."""
    from deepxd.kernels.cpu import conv

    monkeypatch.setattr(conv, "GW_MIN_POSITIONS", 0)
    geo = (2, 3, 6, 6, 4, 3, 3, (1, 1), (0, 0), (1, 1), 1)
    x = rand(rng, "float64", (2, 3, 6, 6), -1, 1)
    x[0, 0, 0, 5] = np.inf  # read only by output column 3 of tap j = 2
    gy = rand(rng, "float64", _out_shape(geo), -1, 1)
    wt = rand(rng, "float64", (4, 3, 3, 3), -1, 1)
    ex = executor(x=x, gy=gy)
    geometry = [VEC((1, 1)), VEC((0, 0)), VEC((1, 1)), V(1)]
    run(ex, "conv2dgradweight", [T("x", "float64"), T("gy", "float64"), VEC(wt.shape), *geometry],
        [T("dw", "float64")])
    want = _reference(x, wt, gy, geo)[2]
    np.testing.assert_array_equal(np.isfinite(ex.get("dw")), np.isfinite(want))


@pytest.mark.parametrize(("min_cols", "want"), [
    (1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]),  # a row each
    (6, [(0, 1), (1, 3), (3, 4), (4, 6)]),  # two rows fit: each image in two parts of about equal size
    (9, [(0, 3), (3, 6)]),  # an image fills MIN_COLS: one each
    (1 << 20, [(0, 6)]),  # the batch
])
def test_conv2d_chunks_cut_rows_or_whole_images(monkeypatch, min_cols, want):
    from deepxd.kernels.cpu import conv

    monkeypatch.setattr(conv, "CHUNK_BYTES", 0)
    monkeypatch.setattr(conv, "MIN_COLS", min_cols)
    g = conv._Geometry((2, 2, 3, 3), (4, 2, 1, 1), (1, 1), (0, 0), (1, 1), 1, 3, 3)  # 2 images of 3 rows of 3
    assert list(g.chunks(8)) == want


def _check(rng, dtype, geo):
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


POOLS = [  # (N, C, H, W, kh, kw, stride, dilation)
    (2, 3, 7, 6, 3, 2, (2, 1), (1, 2)),
    (1, 2, 6, 6, 2, 2, (2, 2), (1, 1)),
    (2, 1, 5, 5, 3, 3, (1, 1), (1, 1)),  # overlapping windows
    (3, 2, 9, 4, 1, 1, (3, 2), (1, 1)),
]


def _pool_out(geo: tuple) -> tuple[int, ...]:
    n, c, h, w, kh, kw, (sh, sw), (dh, dw) = geo
    return n, c, (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1


@pytest.mark.parametrize("dtype", ordered(OPS["maxpool2d"].dtypes))
@pytest.mark.parametrize("geo", POOLS)
def test_pooling_ops_and_their_gradients_match_torch(rng, dtype, geo):
    _check_pool(rng, dtype, geo, ties=False)


@pytest.mark.parametrize("native_loops", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("geo", [*POOLS, (1, 2, 5, 600, 2, 3, (1, 2), (1, 1)), (4, 16, 33, 34, 3, 3, (2, 2), (1, 1)),
                                 (2, 64, 20, 20, 2, 3, (1, 2), (2, 1))], ids=lambda g: "x".join(map(str, g[:6])))
def test_pooling_loops_match_torch(rng, monkeypatch, dtype, geo, ties, native_loops):
    """The native pooling loops (rows of 299 outputs: more than a block of POOL_BLOCK; threads split by plane on the
    last two geometries) and numpy's strided views: torch's values, and with ties (inputs from a handful of values)
    the gradient to each window's first maximum, as torch's."""
    from deepxd.kernels.cpu import conv, native

    monkeypatch.setattr(conv, "POOL_SPLIT_MIN", 1 << 15)
    if not native_loops:
        monkeypatch.setattr(native, "_enabled", False)
    elif not native.available():
        pytest.skip("no C compiler: the native pooling loops cannot be built")
    _check_pool(rng, dtype, geo, ties)


def _check_pool(rng, dtype: str, geo: tuple, ties: bool) -> None:
    n, c, h, w, kh, kw, stride, dilation = geo
    if ties:
        x = rng.integers(-2, 3, (n, c, h, w)).astype(dtype)
    else:
        x = rand(rng, dtype, (n, c, h, w), -1, 1)
    gy = rand(rng, dtype, _pool_out(geo), -1, 1)
    xt = torch.tensor(f64(x), requires_grad=True)
    y_max = torch.nn.functional.max_pool2d(xt, (kh, kw), stride, 0, dilation)
    (dx_max,) = torch.autograd.grad(y_max, xt, torch.tensor(f64(gy)))
    ones = torch.ones((c, 1, kh, kw), dtype=torch.float64)
    y_sum = torch.nn.functional.conv2d(xt, ones, stride=stride, dilation=dilation, groups=c)
    (dx_sum,) = torch.autograd.grad(y_sum, xt, torch.tensor(f64(gy)))
    ex = executor(x=x, gy=gy)
    geometry = [VEC((kh, kw)), VEC(stride), VEC(dilation)]
    run(ex, "maxpool2d", [T("x", dtype), *geometry], [T("ymax", dtype)])
    run(ex, "maxpool2dgrad", [T("x", dtype), T("gy", dtype), *geometry], [T("dmax", dtype)])
    run(ex, "sumpool2d", [T("x", dtype), *geometry], [T("ysum", dtype)])
    run(ex, "sumpool2dgrad", [T("gy", dtype), VEC(x.shape), *geometry], [T("dsum", dtype)])
    np.testing.assert_array_equal(f64(ex.get("ymax")), y_max.detach().numpy())  # a maximum is one of the values
    assert_close(ex.get("dmax"), dx_max.numpy(), dtype, scale=np.full(x.shape, kh * kw), what="maxpool2dgrad")
    assert_close(ex.get("ysum"), y_sum.detach().numpy(), dtype, scale=np.full(gy.shape, kh * kw), what="sumpool2d")
    assert_close(ex.get("dsum"), dx_sum.numpy(), dtype, scale=np.full(x.shape, kh * kw), what="sumpool2dgrad")


def test_maxpool2d_propagates_nan_and_its_gradient_goes_to_the_first_maximum():
    x = np.array([[[[1.0, 3.0, 3.0], [np.nan, 0.0, 2.0]]]], np.float32)
    ex = executor(x=x, gy=np.array([[[[10.0, 20.0]]]], np.float32))
    run(ex, "maxpool2d", [T("x", "float32"), VEC((2, 2)), VEC((1, 1)), VEC((1, 1))], [T("y", "float32")])
    run(ex, "maxpool2dgrad", [T("x", "float32"), T("gy", "float32"), VEC((2, 2)), VEC((1, 1)), VEC((1, 1))],
        [T("dx", "float32")])
    y = ex.get("y")
    assert np.isnan(y[0, 0, 0, 0]) and y[0, 0, 0, 1] == 3.0
    np.testing.assert_array_equal(ex.get("dx"), [[[[0.0, 20.0, 0.0], [10.0, 0.0, 0.0]]]])


@pytest.mark.parametrize("native_loops", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_maxpool2d_with_nans_matches_torch(rng, monkeypatch, dtype, native_loops):
    """A third of the inputs NaN, so that windows hold none, one or several: NaN wins the forward, and the gradient
    goes to the window's last NaN, as torch's."""
    from deepxd.kernels.cpu import native

    if not native_loops:
        monkeypatch.setattr(native, "_enabled", False)
    elif not native.available():
        pytest.skip("no C compiler: the native pooling loops cannot be built")
    geo = (2, 3, 9, 8, 3, 2, (2, 1), (1, 2))
    x = rng.integers(-2, 3, geo[:4]).astype(dtype)
    x[rng.random(x.shape) < 1 / 3] = np.nan
    gy = rand(rng, dtype, _pool_out(geo), -1, 1)
    xt = torch.tensor(f64(x), requires_grad=True)
    y = torch.nn.functional.max_pool2d(xt, geo[4:6], geo[6], 0, geo[7])
    (dx,) = torch.autograd.grad(y, xt, torch.tensor(f64(gy)))
    ex = executor(x=x, gy=gy)
    geometry = [VEC(geo[4:6]), VEC(geo[6]), VEC(geo[7])]
    run(ex, "maxpool2d", [T("x", dtype), *geometry], [T("y", dtype)])
    run(ex, "maxpool2dgrad", [T("x", dtype), T("gy", dtype), *geometry], [T("dx", dtype)])
    np.testing.assert_array_equal(f64(ex.get("y")), y.detach().numpy())
    assert_close(ex.get("dx"), dx.numpy(), dtype, scale=np.full(x.shape, 6), what="maxpool2dgrad")


def test_pooling_refuses_what_does_not_fit():
    ex = executor(x=np.zeros((1, 1, 2, 2), np.float32), gy=np.zeros((1, 1, 2, 2), np.float32))
    with pytest.raises(DeepxError, match="maxpool2d: the input's spatial size 2 is smaller than the window"):
        run(ex, "maxpool2d", [T("x", "float32"), VEC((3, 3)), VEC((1, 1)), VEC((1, 1))], [T("y", "float32")])
    with pytest.raises(DeepxError, match=r"sumpool2dgrad: the gradient 'gy' has shape \(1, 1, 2, 2\)"):
        run(ex, "sumpool2dgrad", [T("gy", "float32"), VEC((1, 1, 2, 2)), VEC((2, 2)), VEC((1, 1)), VEC((1, 1))],
            [T("dx", "float32")])
    with pytest.raises(DeepxError, match="stride must be two ints of at least 1"):
        run(ex, "sumpool2d", [T("x", "float32"), VEC((1, 1)), VEC((0, 1)), VEC((1, 1))], [T("y", "float32")])
