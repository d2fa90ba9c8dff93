"""The user's cache folder: where it is, ``off``, and JAX's persistent compilation cache in it (never over a
folder already chosen)."""

from __future__ import annotations

import jax
import pytest

from sparkjax import cachedir


@pytest.fixture
def jax_cache_unset(monkeypatch):
    """JAX's compilation cache folder unset for the test (the suite's own is restored afterwards)."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cachedir.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("SPARKJAX_CACHE_DIR")
    assert cachedir.cache_dir() == tmp_path / "xdg" / "sparkjax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cachedir.cache_dir() == tmp_path / "home" / ".cache" / "sparkjax"
    for off in ("off", "OFF", " off "):
        monkeypatch.setenv("SPARKJAX_CACHE_DIR", off)
        assert cachedir.cache_dir() is None and cachedir.subdir("costs") is None
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", str(tmp_path / "mine"))
    assert cachedir.subdir("costs") == tmp_path / "mine" / "costs" and (tmp_path / "mine" / "costs").is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", str(tmp_path / "file"))
    assert cachedir.subdir("costs") is None  # a folder that cannot be made: no cache, no error


def test_the_compilation_cache_goes_into_the_folder(monkeypatch, tmp_path, jax_cache_unset):
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", "off")
    assert cachedir.enable_compilation_cache() is None and jax.config.jax_compilation_cache_dir is None
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", str(tmp_path))
    path = cachedir.enable_compilation_cache()
    assert path == str(tmp_path / "xla") and jax.config.jax_compilation_cache_dir == path
    assert jax.config.jax_persistent_cache_min_compile_time_secs == cachedir.XLA_MIN_COMPILE_SECONDS
    assert cachedir.enable_compilation_cache() == path  # once: the next call keeps it


def test_a_compilation_cache_already_chosen_is_kept(monkeypatch, tmp_path, jax_cache_unset):
    monkeypatch.setenv("SPARKJAX_CACHE_DIR", str(tmp_path / "sjx"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert cachedir.enable_compilation_cache() == str(tmp_path / "theirs") == jax.config.jax_compilation_cache_dir
    assert not (tmp_path / "sjx").exists()
