"""batchnorm, groupnorm and their gradient ops, batchnormupdate, and the interpolation ops (interpnearest,
interpbilinear and their gradients) on the CPU kernels, against torch on the CPU in float64 (torch's batch_norm,
group_norm and interpolate, and their autograd), for every float dtype the ops claim, on random inputs of odd sizes;
and their refusals."""

from __future__ import annotations

import importlib
import math
import shutil
import subprocess

import numpy as np
import pytest
from kernel_ref import VEC, T, V, assert_close, executor, f64, ordered, rand, run

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import OPS, stats_dtype

torch = pytest.importorskip("torch")
TF = torch.nn.functional

NORM_SHAPES = [(4, 3, 5, 7), (7, 5), (2, 6, 9), (3, 4, 3, 1, 2), (1, 2, 13, 3)]


def _torch(*arrays: np.ndarray) -> list:
    return [torch.tensor(f64(a), requires_grad=True) for a in arrays]


def _scale(want: np.ndarray) -> np.ndarray:
    """Gradients are sums with cancellation: their error is measured against the largest of them."""
    return np.full(want.shape, np.abs(want).max(initial=0.0))


def _check_norm(name: str, grad: str, dtype: str, shape: tuple[int, ...], rng, groups: int | None = None) -> None:
    n, c = shape[:2]
    x = rand(rng, dtype, shape, -2, 3)
    w, b = rand(rng, dtype, (c,), -1.5, 1.5), rand(rng, dtype, (c,), -1, 1)
    gy = rand(rng, dtype, shape, -1, 1)
    xt, wt, bt = _torch(x, w, b)
    if groups is None:
        y = TF.batch_norm(xt, None, None, wt, bt, training=True, eps=1e-5)
        dims = [0, *range(2, len(shape))]
        ref_mean = xt.detach().mean(dims).numpy()
        ref_var = xt.detach().var(dims, unbiased=False).numpy()
        extra: list = []
    else:
        y = TF.group_norm(xt, groups, wt, bt, eps=1e-5)
        grouped = xt.detach().reshape(n, groups, -1)
        ref_mean, ref_var = grouped.mean(2).numpy(), grouped.var(2, unbiased=False).numpy()
        extra = [V(groups)]
    y.backward(torch.tensor(f64(gy)))
    st = stats_dtype(dtype)
    ex = executor(x=x, w=w, b=b, gy=gy)
    run(ex, name, [T("x", dtype), T("w", dtype), T("b", dtype), *extra, V(1e-5)],
        [T("y", dtype), T("mean", st), T("var", st)])
    assert_close(ex.get("y"), y.detach().numpy(), dtype, scale=np.ones(shape), what=name)
    assert_close(ex.get("mean"), ref_mean, st, scale=np.full(ref_mean.shape, 3.0), what=f"{name} mean")
    assert_close(ex.get("var"), ref_var, st, what=f"{name} var")
    run(ex, grad, [T("x", dtype), T("gy", dtype), T("w", dtype), T("mean", st), T("var", st), *extra,
                           V(1e-5)], [T("dx", dtype), T("dw", dtype), T("db", dtype)])
    for got, want, what in [("dx", xt.grad, "dA"), ("dw", wt.grad, "dweight"), ("db", bt.grad, "dbias")]:
        want = want.numpy()
        assert_close(ex.get(got), want, dtype, scale=_scale(want), what=f"{grad} {what} {shape}")


@pytest.mark.parametrize("dtype", ordered(OPS["batchnorm"].dtypes))
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_batchnorm_and_batchnormgrad_match_torch(rng, dtype, shape):
    _check_norm("batchnorm", "batchnormgrad", dtype, shape, rng)


@pytest.mark.parametrize("dtype", ordered(OPS["batchnormeval"].dtypes))
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_batchnormeval_and_its_gradient_match_torch_s_eval_batch_norm(rng, dtype, shape):
    """Given statistics (torch's running ones, in eval); batchnormgrad with batch false gives its gradients."""
    c = shape[1]
    st = stats_dtype(dtype)
    x, gy = rand(rng, dtype, shape, -2, 3), rand(rng, dtype, shape, -1, 1)
    w, b = rand(rng, dtype, (c,), -1.5, 1.5), rand(rng, dtype, (c,), -1, 1)
    m, v = rand(rng, st, (c,), -1, 1), rand(rng, st, (c,), 0.3, 2)
    xt, wt, bt = _torch(x, w, b)
    y = TF.batch_norm(xt, torch.tensor(f64(m)), torch.tensor(f64(v)), wt, bt, training=False, eps=1e-3)
    y.backward(torch.tensor(f64(gy)))
    ex = executor(x=x, w=w, b=b, m=m, v=v, gy=gy)
    stats = [T("m", st), T("v", st), V(1e-3)]
    run(ex, "batchnormeval", [T("x", dtype), T("w", dtype), T("b", dtype), *stats], [T("y", dtype)])
    assert_close(ex.get("y"), y.detach().numpy(), dtype, scale=np.ones(shape), what="batchnormeval")
    run(ex, "batchnormgrad", [T("x", dtype), T("gy", dtype), T("w", dtype), *stats, V(False)],
        [T("dx", dtype), T("dw", dtype), T("db", dtype)])
    for got, want, what in [("dx", xt.grad, "dA"), ("dw", wt.grad, "dweight"), ("db", bt.grad, "dbias")]:
        want = want.numpy()
        assert_close(ex.get(got), want, dtype, scale=_scale(want), what=f"batchnormgrad batch=false {what}")


@pytest.mark.parametrize("dtype", ordered(OPS["groupnorm"].dtypes))
@pytest.mark.parametrize(("shape", "groups"), [((4, 6, 5, 7), 3), ((3, 5, 9), 5), ((2, 4, 3, 1, 2), 1),
                                               ((5, 6), 2), ((1, 8, 11, 3), 4)])
def test_groupnorm_and_groupnormgrad_match_torch(rng, dtype, shape, groups):
    _check_norm("groupnorm", "groupnormgrad", dtype, shape, rng, groups)


@pytest.mark.parametrize("dtype", ordered(OPS["batchnormupdate"].dtypes))
@pytest.mark.parametrize("momentum", [0.1, 0.0, 1.0, 1 / 3])
def test_batchnormupdate_is_torch_s_running_statistics(rng, dtype, momentum):
    """Three training steps of torch's batch norm and of batchnorm + batchnormupdate: the same running statistics
    (float64: to the last bits torch's own arithmetic leaves)."""
    c = 5
    rm, rv = rand(rng, dtype, (c,), -1, 1), rand(rng, dtype, (c,), 0.5, 2)
    trm, trv = torch.tensor(f64(rm)), torch.tensor(f64(rv))
    st = stats_dtype(dtype)
    ex = executor(rm=rm, rv=rv)
    for step in range(3):
        x = rand(rng, dtype, (3, c, 2, 3), -2, 3)
        TF.batch_norm(torch.tensor(f64(x)), trm, trv, training=True, momentum=momentum)
        ex.put("x", x)
        ex.put("w", np.ones(c, x.dtype))
        ex.put("b", np.zeros(c, x.dtype))
        run(ex, "batchnorm", [T("x", dtype), T("w", dtype), T("b", dtype)], [T("y", dtype), T("m", st), T("v", st)])
        run(ex, "batchnormupdate", [T("rm", dtype), T("rv", dtype), T("m", st), T("v", st), V(momentum), V(18)],
            [T("rm", dtype), T("rv", dtype)])
        assert_close(ex.get("rm"), trm.numpy(), dtype, scale=np.ones(c), what=f"running_mean step {step}")
        assert_close(ex.get("rv"), trv.numpy(), dtype, what=f"running_var step {step}")


def test_batchnormupdate_computes_as_torch_does():
    """The update's arithmetic is torch's own (momentum * mean + (1 - momentum) * running, the unbiased variance
    var * n / (n - 1)), in float64: equal to the last bit on inputs it can represent."""
    rm, rv = np.array([0.3, -1.25]), np.array([1.5, 0.75])
    m, v = np.array([0.1, 2.0]), np.array([0.5, 3.0])
    ex = executor(rm=rm, rv=rv, m=m, v=v)
    run(ex, "batchnormupdate", [T("rm"), T("rv"), T("m"), T("v"), V(0.25), V(8)], [T("rm"), T("rv")])
    np.testing.assert_array_equal(ex.get("rm"), 0.25 * m + 0.75 * rm)
    np.testing.assert_array_equal(ex.get("rv"), 0.25 * (v * 8 / 7) + 0.75 * rv)


INTERP = [  # (N, C, H, W), output size, scale factors (0: none; the size is then floor(in * scale) as torch's)
    ((2, 3, 5, 7), (9, 4), (0, 0)),
    ((1, 2, 4, 3), (10, 7), (2.5, 2.5)),
    ((2, 1, 6, 6), (3, 12), (0.5, 2.0)),
    ((1, 3, 13, 11), (5, 23), (0, 0)),
    ((2, 2, 7, 9), (9, 11), (1.3, 1.3)),  # 9 = 7 * 1.3 rounded down; torch's positions follow 1 / 1.3
    ((1, 1, 3, 8), (3, 8), (1.2, 1.0)),  # sizes that stay are copied, whatever the scale
    ((3, 2, 1, 5), (1, 13), (0, 0)),
]


def _interp_reference(mode: str, x: np.ndarray, gy: np.ndarray, size, scales, align_corners):
    xt = torch.tensor(f64(x), requires_grad=True)
    how = {"size": size} if not scales[0] else {"scale_factor": scales}
    extra = {"align_corners": align_corners} if mode == "bilinear" else {}
    y = TF.interpolate(xt, mode=mode, **how, **extra)
    assert tuple(y.shape[2:]) == tuple(size)
    y.backward(torch.tensor(f64(gy)))
    return y.detach().numpy(), xt.grad.numpy()


@pytest.mark.parametrize("dtype", ordered(OPS["interpnearest"].dtypes))
@pytest.mark.parametrize(("shape", "size", "scales"), INTERP)
def test_interpnearest_and_its_gradient_match_torch(rng, dtype, shape, size, scales):
    x = rand(rng, dtype, shape, -2, 2)
    gy = rand(rng, dtype, (*shape[:2], *size), -1, 1)
    want_y, want_dx = _interp_reference("nearest", x, gy, size, scales, None)
    ex = executor(x=x, gy=gy)
    sh, sw = (V(float(s)) for s in scales)
    run(ex, "interpnearest", [T("x", dtype), VEC(size), sh, sw], [T("y", dtype)])
    run(ex, "interpnearestgrad", [T("gy", dtype), VEC(shape), sh, sw], [T("dx", dtype)])
    np.testing.assert_array_equal(f64(ex.get("y")), want_y)  # a copy of the values: exact
    assert_close(ex.get("dx"), want_dx, dtype, scale=_scale(want_dx), what="interpnearestgrad")


@pytest.mark.parametrize("dtype", ordered(OPS["interpbilinear"].dtypes))
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize(("shape", "size", "scales"), INTERP)
def test_interpbilinear_and_its_gradient_match_torch(rng, dtype, align_corners, shape, size, scales):
    x = rand(rng, dtype, shape, -2, 2)
    gy = rand(rng, dtype, (*shape[:2], *size), -1, 1)
    want_y, want_dx = _interp_reference("bilinear", x, gy, size, scales, align_corners)
    ex = executor(x=x, gy=gy)
    sh, sw = (V(float(s)) for s in scales)
    run(ex, "interpbilinear", [T("x", dtype), VEC(size), V(align_corners), sh, sw], [T("y", dtype)])
    run(ex, "interpbilineargrad", [T("gy", dtype), VEC(shape), V(align_corners), sh, sw], [T("dx", dtype)])
    assert_close(ex.get("y"), want_y, dtype, scale=np.full(want_y.shape, 2.0), what="interpbilinear")
    assert_close(ex.get("dx"), want_dx, dtype, scale=_scale(want_dx), what="interpbilineargrad")


def test_interpolation_positions_are_torch_s_to_the_bit_in_float32(rng):
    """float32 positions as torch's compiled code finds them (its multiply-add rounded once): the weights of every
    output, read off the resize of each unit image, are torch's exactly."""
    for n_in, n_out in [(7, 4), (5, 13), (17, 36), (3, 29), (28, 11)]:
        eye = np.eye(n_in, dtype=np.float32).reshape(n_in, 1, 1, n_in)
        want = TF.interpolate(torch.tensor(eye), size=(1, n_out), mode="bilinear", align_corners=False).numpy()
        ex = executor(x=eye)
        run(ex, "interpbilinear", [T("x", "float32"), VEC((1, n_out)), V(False)], [T("y", "float32")])
        np.testing.assert_array_equal(ex.get("y"), want)


@pytest.mark.parametrize(("name", "args", "message"), [
    ("batchnorm", [T("x"), T("w"), T("w3")], r"'w3' is float32\[3\]; expected float32\[4\]"),
    ("batchnorm", [T("v"), T("w"), T("w")], "needs at least 2 dims"),
    ("groupnorm", [T("x"), T("w"), T("w"), V(3)], "4 channels of 'x' do not split into groups=3"),
    ("batchnormgrad", [T("x"), T("w"), T("w"), T("w"), T("w")], "the gradient 'w' is float32"),
    ("batchnormupdate", [T("w"), T("w"), T("w"), T("w"), V(1.5), V(4)], "momentum=1.5 must be in"),
    ("batchnormupdate", [T("w"), T("w"), T("w"), T("w"), V(0.1), V(1)], "count=1 values per channel"),
    ("interpnearest", [T("x"), VEC((0, 3))], "sizes should be greater than 0"),
    ("interpnearest", [T("v"), VEC((2, 3))], "must be 4-D"),
    ("interpbilinear", [T("x"), VEC((2, 3)), V(False), V(-1.0)], "scale_h=-1.0 must be a finite scale factor"),
    ("interpbilineargrad", [T("x"), VEC((3, 4, 2, 2))], "they must agree in N and C"),
])
def test_the_new_ops_refuse_what_does_not_fit(name, args, message):
    ex = executor(x=np.zeros((2, 4, 3, 3), np.float32), w=np.zeros(4, np.float32), w3=np.zeros(3, np.float32),
                  v=np.zeros(4, np.float32))
    outs = {"batchnormupdate": [T("w"), T("w")]}.get(name, [T("o"), T("m"), T("s")] if "norm" in name else [T("o")])
    with pytest.raises(DeepxError, match=message):
        run(ex, name, args, outs)


def test_batchnormupdate_writes_in_place_only():
    ex = executor(rm=np.zeros(3, np.float32), rv=np.ones(3, np.float32), m=np.ones(3, np.float32),
                  v=np.ones(3, np.float32))
    with pytest.raises(DeepxError, match="updates in place; return 'x' should be 'rm'"):
        run(ex, "batchnormupdate", [T("rm"), T("rv"), T("m"), T("v"), V(0.1), V(4)], [T("x"), T("rv")])


def test_batch_statistics_of_an_empty_batch_are_nan():
    ex = executor(x=np.zeros((0, 3, 2), np.float32), w=np.ones(3, np.float32), b=np.zeros(3, np.float32))
    run(ex, "batchnorm", [T("x"), T("w"), T("b")], [T("y"), T("m"), T("v")])
    assert ex.get("y").shape == (0, 3, 2)
    assert all(math.isnan(v) for v in ex.get("m"))


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the modules are compiled on a GPU machine")
@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("module", ["norm", "resize", "reduce"])
def test_the_cuda_modules_compile(module, dtype, tmp_path):
    """The CUDA kernels of these ops (deepxd/kernels/cuda/norm.py, resize.py; cumprod's in reduce.py) compile for
    sm_90 as the executor compiles them; tests/gpu/test_kernels.py runs them against the CPU kernels."""
    mod = importlib.import_module(f"deepxd.kernels.cuda.{module}")
    path = tmp_path / f"{module}.cu"
    path.write_text(mod.source(dtype))
    done = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-o", str(tmp_path / "m.cubin"),
                           str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert OPS["batchnorm"].family == "norm" and OPS["interpbilinear"].family == "resize"


@pytest.mark.parametrize("name", ["batchnorm", "groupnorm"])
def test_results_written_over_their_inputs_are_right(rng, name):
    """A result named as an input (the kernels compute in their output's buffer): the same values as fresh names."""
    x, gy = rand(rng, "float64", (3, 4, 5), -2, 2), rand(rng, "float64", (3, 4, 5), -1, 1)
    w, b = rand(rng, "float64", (4,), 0.5, 1.5), rand(rng, "float64", (4,), -1, 1)
    extra = [V(2)] if name == "groupnorm" else []
    fresh = executor(x=x, w=w, b=b, gy=gy)
    run(fresh, name, [T("x"), T("w"), T("b"), *extra], [T("y"), T("m"), T("v")])
    run(fresh, f"{name}grad", [T("x"), T("gy"), T("w"), T("m"), T("v"), *extra], [T("dx"), T("dw"), T("db")])
    over = executor(x=x, w=w, b=b, gy=gy, x2=x)
    run(over, name, [T("x"), T("w"), T("b"), *extra], [T("x"), T("m"), T("v")])
    np.testing.assert_array_equal(over.get("x"), fresh.get("y"))
    for target in ("gy", "x2"):  # dA over the gradient (read after dA is first written), or over the input
        ex = executor(x=x, w=w, b=b, gy=gy, x2=x)
        run(ex, name, [T("x"), T("w"), T("b"), *extra], [T("y"), T("m"), T("v")])
        run(ex, f"{name}grad", [T("x2"), T("gy"), T("w"), T("m"), T("v"), *extra], [T(target), T("dw"), T("db")])
        np.testing.assert_allclose(ex.get(target), fresh.get("dx"), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["interpnearestgrad", "interpbilineargrad"])
def test_an_interpolation_gradient_written_over_its_gradient_is_right(rng, name):
    """dA named as G (a resize that keeps the size: the same shape), as computed under a fresh name."""
    gy = rand(rng, "float32", (2, 3, 5, 6), -1, 1)
    args = [VEC((2, 3, 5, 6)), *([V(True)] if "bilinear" in name else []), V(1.2), V(0.0)]
    fresh = executor(gy=gy)
    run(fresh, name, [T("gy"), *args], [T("dx")])
    over = executor(gy=gy)
    run(over, name, [T("gy"), *args], [T("gy")])
    np.testing.assert_array_equal(over.get("gy"), fresh.get("dx"))
