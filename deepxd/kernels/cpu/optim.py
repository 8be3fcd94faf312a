"""Optimizer updates, in place, matching torch.optim's single-tensor (foreach=False) code paths."""

from __future__ import annotations

import math

import numpy as np

from deepxd.kernels.cpu import native
from deepxd.kernels.cpu._util import LOW
from deepxd.kernels.cpu._util import work as _work


def _store(dst: np.ndarray, value: np.ndarray) -> None:
    if value is not dst:
        dst[...] = value


def sgd(param, grad, buf, lr, momentum, dampening, weight_decay, nesterov, step, param_out, buf_out):
    if param.size >= native.UPDATE_MIN and native.sgd(param, grad, buf, lr, momentum, dampening, weight_decay,
                                                      nesterov, step <= 1, param_out, buf_out):
        return  # one pass, the same values as below
    if (momentum and step > 1 and not weight_decay and not nesterov and param_out is param and buf_out is buf
            and param.dtype not in LOW and grad.dtype == param.dtype and buf.dtype == param.dtype):
        # the usual step, in place (the same values as below: buf*m + (1-d)*g, then p - lr*buf), with one temporary;
        # the numbers converted first, so that one too large fails before anything is written
        lr_, momentum_, keep = float(lr), float(momentum), 1 - float(dampening)
        buf *= momentum_
        buf += grad if dampening == 0 else keep * grad
        param -= lr_ * buf
        return
    p, g = _work(param), _work(grad)
    if weight_decay:
        g = g + weight_decay * p
    b = None
    if momentum:
        if step <= 1:
            b = g.copy()
        else:
            b = _work(buf) * momentum
            b += (1 - dampening) * g
        g = g + momentum * b if nesterov else b
    p = p - lr * g
    if b is not None:  # every value computed before any is stored: a failure changes nothing
        _store(buf_out, b)
    _store(param_out, p)


def _adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, decoupled, p_out, m_out, v_out):
    if param.size >= native.UPDATE_MIN and native.adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step,
                                                       decoupled, p_out, m_out, v_out):
        return  # one pass, the same values as below
    p, g = _work(param), _work(grad)
    if weight_decay:
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m1 = _work(m) * beta1 + (1 - beta1) * g
    v1 = _work(v) * beta2 + (1 - beta2) * (g * g)
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    denom = np.sqrt(v1) / math.sqrt(bc2) + eps
    p = p - (lr / bc1) * m1 / denom
    _store(m_out, m1)
    _store(v_out, v1)
    _store(p_out, p)


def adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, p_out, m_out, v_out):
    _adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, False, p_out, m_out, v_out)


def adamw(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, p_out, m_out, v_out):
    _adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, True, p_out, m_out, v_out)
