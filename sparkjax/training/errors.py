"""Errors of the training code (all :class:`sparkjax.SparkjaxError`, so the CLI reports them in one line)."""

from __future__ import annotations

from ..errors import SparkjaxError


class TrainingError(SparkjaxError, ValueError):
    """A bad training setting: a learning rate or step count that makes no sense, a resume that does not fit."""


class DataError(TrainingError):
    """Training data that is missing, unreadable or malformed (the message names the file and line)."""
