"""Errors of the evaluation harness (all :class:`sparkjax.SparkjaxError`, so the CLI reports them in one line)."""

from __future__ import annotations

from ..errors import SparkjaxError


class EvalError(SparkjaxError, ValueError):
    """A bad evaluation setting: an unknown method, a budget for chain-only methods, an unreadable results file."""


class DatasetError(EvalError):
    """A prompt set that is missing, unreadable, empty or malformed (the message names the file and line)."""


class TokenizerError(EvalError):
    """A tokenizer that cannot be loaded or does not fit the target."""
