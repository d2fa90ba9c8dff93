"""The exceptions sparkjax raises for anything a user can get wrong.

Every error names the offending file, key, shape or argument in its message.
All of them derive from :class:`SparkjaxError`, so ``except sparkjax.SparkjaxError``
catches every user-facing failure; the subclasses also derive from the closest
built-in exception so that generic handlers keep working.
"""

from __future__ import annotations


class SparkjaxError(Exception):
    """Base class of every error sparkjax raises on bad input."""


class ConfigError(SparkjaxError, ValueError):
    """A config file or config value is missing, malformed or unsupported."""


class CheckpointError(SparkjaxError, ValueError):
    """A weights file is missing, truncated, or holds missing / unexpected / mis-shaped tensors."""


class IncompatiblePairError(SparkjaxError, ValueError):
    """A drafter does not fit the target it is paired with."""


class ArgumentError(SparkjaxError, ValueError):
    """A function argument is out of range or inconsistent with the others."""


class CostTableError(SparkjaxError, ValueError):
    """A cost table file (``method='auto'``) is unreadable or was measured for another device or shape."""
