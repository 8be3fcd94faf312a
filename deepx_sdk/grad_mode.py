"""Gradient recording on and off, as torch's: `no_grad`, `enable_grad`, `set_grad_enabled`, `inference_mode` and
`is_grad_enabled`. Each works as a context manager and as a decorator, with or without parentheses
(`@dx.no_grad` and `@dx.no_grad()`), and applies to the current session."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from deepx_sdk.session import Session, session


class _GradMode:
    """Sets the session's grad_enabled to `mode` on entry and puts back what it was on exit."""

    mode = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls)
        if cls._takes_function and len(args) == 1 and not kwargs and callable(args[0]):
            self.__init__()  # type: ignore[misc]  # used bare as a decorator (@dx.no_grad): its defaults
            return self._wrap(args[0])
        return self

    _takes_function = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._saved: list[tuple[Session, bool]] = []

    def __enter__(self) -> None:
        s = session()
        self._saved.append((s, s.grad_enabled))
        s.grad_enabled = self.mode

    def __exit__(self, *exc: Any) -> None:
        s, before = self._saved.pop()
        s.grad_enabled = before

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self._wrap(fn)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        args = self._args()

        @functools.wraps(fn)
        def run(*a: Any, **k: Any) -> Any:
            with type(self)(*args):
                return fn(*a, **k)

        return run

    def _args(self) -> tuple[Any, ...]:
        return ()


class no_grad(_GradMode):
    """Operations inside record no gradient information."""

    mode = False


class enable_grad(_GradMode):
    """Gradients recorded again inside a no_grad block."""

    mode = True


class inference_mode(_GradMode):
    """no_grad (mode=True), or nothing changed (mode=False), as torch's; deepx has no separate inference tensors."""

    def __init__(self, mode: bool = True) -> None:
        super().__init__()
        self._on = bool(mode)

    def __enter__(self) -> None:
        s = session()
        self._saved.append((s, s.grad_enabled))
        if self._on:
            s.grad_enabled = False

    def _args(self) -> tuple[Any, ...]:
        return (self._on,)


class set_grad_enabled(_GradMode):
    """Turn gradient recording on or off: at once when called (`dx.set_grad_enabled(False)`), and back to what it
    was at the end of a `with` block or a decorated call, as torch's."""

    _takes_function = False

    def __init__(self, mode: bool) -> None:
        super().__init__()
        s = session()
        self._before = (s, s.grad_enabled)
        self._mode = bool(mode)
        s.grad_enabled = self._mode

    def __enter__(self) -> None:
        self._saved.append(self._before)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        s, before = self._before
        s.grad_enabled = before  # decorating does not change the mode; each call does
        return super()._wrap(fn)

    def _args(self) -> tuple[Any, ...]:
        return (self._mode,)


def is_grad_enabled() -> bool:
    return session().grad_enabled
