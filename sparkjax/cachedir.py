"""The user's cache folder: measured cost tables (``costs/``) and JAX's persistent compilation cache (``xla/``).

The folder is ``$SPARKJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/sparkjax``, else ``~/.cache/sparkjax``;
``SPARKJAX_CACHE_DIR=off`` turns both caches off. The environment is read when a cache is used, never at
import time. Everything in it can be deleted at any time: it is rebuilt on the next run.
"""

from __future__ import annotations

import os
import pathlib

import jax

OFF = "off"  # the value of SPARKJAX_CACHE_DIR that disables caching
XLA_MIN_COMPILE_SECONDS = 0.5  # programs that compile faster than this are not written to the compilation cache


def cache_dir() -> pathlib.Path | None:
    """The cache folder (not created), or None when ``SPARKJAX_CACHE_DIR=off``."""
    chosen = os.environ.get("SPARKJAX_CACHE_DIR", "").strip()
    if chosen.lower() == OFF:
        return None
    if chosen:
        return pathlib.Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache") / "sparkjax"


def subdir(name: str) -> pathlib.Path | None:
    """``name`` under the cache folder, created; None when caching is off or the folder cannot be made."""
    root = cache_dir()
    if root is None:
        return None
    path = root / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path


def enable_compilation_cache() -> str | None:
    """Points JAX's persistent compilation cache at ``xla/`` under the cache folder and returns its path; a folder
    (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) or minimum compile time already chosen is kept. With caching
    off nothing is changed and None is returned (unless a folder was already chosen)."""
    current = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if current:
        return current
    path = subdir("xla")
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", XLA_MIN_COMPILE_SECONDS)
    return str(path)
