"""The one exception type that deepx raises for bad input, everywhere."""

from __future__ import annotations


class DeepxError(Exception):
    """A request that deepx refuses: the message says what was asked, what was wrong and what to do."""


class DeepxParseError(DeepxError):
    """A deepxIR text line that does not parse; carries the 1-based line and column."""

    def __init__(self, message: str, line: int, column: int, text: str = "") -> None:
        self.line = line
        self.column = column
        self.text = text
        super().__init__(f"line {line}, column {column}: {message}")


class DeepxAttributeError(DeepxError, AttributeError):
    """A torch tensor method that deepx does not have: a DeepxError that says so, and an AttributeError, so that
    hasattr() and getattr(x, name, default) answer as for any missing attribute."""
