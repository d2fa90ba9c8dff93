"""Crash-safe writers for every output sparkjax produces (the one place that decides what may be replaced).

**Overwrite rule.** ``overwrite=True`` may only replace a folder sparkjax wrote (it holds :data:`MARKER`,
written last) or an empty folder; never ``""``, ``.``, ``/``, the home folder, the current working directory
or their parents, a non-empty folder without the marker, a file or a symbolic link. A refusal raises
:class:`~sparkjax.errors.ArgumentError` naming the path, before any work; nothing is deleted.

**Crash safety.** :func:`atomic_dir` builds the output in a hidden temp folder beside the destination
(``.NAME.tmp-PID@HOST-XXXXXXXX``) and commits it with one rename or one atomic exchange, so a killed writer
leaves the old output or the new one. Without an exchange the old output is first renamed aside to
``.NAME.old-PID@HOST-XXXXXXXX``; :func:`recover` (run by the next writer) renames it back after a kill and
removes the temps of dead writers that sparkjax owns. I/O failures raise :class:`WriteError` naming the
destination, which is left as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Iterator

from ..errors import ArgumentError, WriteError

PathLike = str | os.PathLike

MARKER = ".sparkjax-output"
"""Marker file written last into every output folder; only marked (or empty) folders may be overwritten."""
_WRITING = ".sparkjax-writing"
"""Written first into a temp folder (removed at commit): marks a half-written folder as sparkjax's own."""

_MARKER_TEXT = (
    "This folder was written by sparkjax. sparkjax replaces it only when asked to overwrite it;\n"
    "it never overwrites a non-empty folder without this file.\n"
)

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (``os.umask`` is not thread-safe)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def _prefix(base: str, kind: str) -> str:
    return f".{base}.{kind}-{os.getpid()}@{_host()}-"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is running (zombies count as dead; unknown counts as alive)."""
    if pid == os.getpid() or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: alive, owned by someone else
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    return True


def _why(e: BaseException) -> str:
    if isinstance(e, WriteError):
        return e.reason
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return f"{type(e).__name__}: {e}"


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_sparkjax_output(path: PathLike) -> bool:
    """Whether ``path`` is a folder that sparkjax wrote (it holds the :data:`MARKER` file)."""
    p = os.fspath(path)
    return os.path.isdir(p) and not os.path.islink(p) and _is_regular(os.path.join(p, MARKER))


def _owned(path: str) -> bool:
    """A folder sparkjax owns: empty, or holding its marker or its in-progress file."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        if not os.listdir(path):
            return True
    except OSError:
        return False
    return _is_regular(os.path.join(path, MARKER)) or _is_regular(os.path.join(path, _WRITING))


def _remove_owned(path: str) -> None:
    """Deletes a folder sparkjax owns, its ownership files last (a half-deleted folder stays recognisable)."""
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        return
    for name in entries:
        if name in (MARKER, _WRITING):
            continue
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.unlink(full)
    for name in (_WRITING, MARKER):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))
    os.rmdir(path)


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _rename2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)``: True when done, False when the OS or file system lacks it."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps the entries ``a`` and ``b``; False when the OS cannot (the caller falls back)."""
    return _rename2(a, b, RENAME_EXCHANGE)


def _rename_new(src: str, dst: str) -> None:
    """Renames ``src`` to ``dst``, which must not exist (refused atomically where the OS allows)."""
    if not _rename2(src, dst, RENAME_NOREPLACE):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.rename(src, dst)


def _protected(dest: str) -> str | None:
    """Why ``dest`` may never be written over (None when it may)."""
    real = os.path.realpath(dest)
    if real == os.path.realpath(os.sep):
        return "the root folder"
    places = []
    with contextlib.suppress(OSError):
        places.append((os.path.realpath(os.getcwd()), "the current working directory"))
    home = os.path.expanduser("~")
    if home and home != "~":
        places.append((os.path.realpath(home), "the home folder"))
    for place, name in places:
        if real == place:
            return name
        if place.startswith(real.rstrip(os.sep) + os.sep):
            return f"a parent of {name} ({place})"
    return None


def _path_arg(path, what: str = "output path") -> str:
    if isinstance(path, bool) or not isinstance(path, (str, bytes, os.PathLike)):
        raise ArgumentError(f"{what}: expected a str or os.PathLike, got {type(path).__name__} {path!r}")
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if p.strip() == "":
        raise ArgumentError(
            f"{what}: empty path {p!r}; it would name the current working directory, give a folder name instead"
        )
    if "\x00" in p:
        raise ArgumentError(f"{what}: {p!r} contains a NUL character")
    return p


def check_destination(path: PathLike, *, overwrite: bool = False, what: str = "output folder") -> str:
    """Applies the overwrite rule to a folder destination and returns its absolute path; raises ArgumentError
    naming the path when it exists and ``overwrite`` is False, or when it may not be replaced."""
    p = _path_arg(path, what)
    if not isinstance(overwrite, bool):
        raise ArgumentError(f"overwrite: expected True or False, got {overwrite!r}")
    dest = os.path.abspath(p)
    reason = _protected(dest)
    if reason is not None:
        raise ArgumentError(f"{what} {p!r} ({dest}) is {reason}; refusing to write over it")
    if not os.path.lexists(dest):
        return dest
    if not overwrite:
        raise ArgumentError(f"{what} {dest} already exists (pass overwrite=True to replace it)")
    if os.path.islink(dest):
        raise ArgumentError(f"{what} {dest} is a symbolic link; refusing to replace it")
    if not os.path.isdir(dest):
        raise ArgumentError(f"{what} {dest} exists and is not a folder (a file?); refusing to replace it")
    try:
        empty = not os.listdir(dest)
    except OSError as e:
        raise ArgumentError(f"{what} {dest} cannot be listed ({_why(e)}); refusing to replace it") from None
    if not empty and not is_sparkjax_output(dest):
        raise ArgumentError(f"{what} {dest} is not empty and was not written by sparkjax (it has no {MARKER} file); "
                            "refusing to replace it: remove it yourself or choose another path")
    return dest


def recover(path: PathLike) -> list[str]:
    """Repairs what killed writers left beside the destination ``path`` and returns what it did: a missing
    ``path`` whose previous output sits aside as ``.NAME.old-*`` is renamed back, and the temps of dead writers
    that sparkjax owns are deleted."""
    dest = os.path.abspath(_path_arg(path))
    parent, base = os.path.split(dest)
    if not base:
        return []
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    temp = re.compile(re.escape(f".{base}.") + r"(tmp|old)-(\d+)@([A-Za-z0-9._]+)-[a-z0-9_]+")
    host = _host()
    stale: list[tuple[str, str]] = []  # (kind, path) of the temps of dead writers on this host
    for entry in entries:
        m = temp.fullmatch(entry)
        if m and m[3] == host and not _alive(int(m[2])):
            stale.append((m[1], os.path.join(parent, entry)))
    done = []
    if not os.path.lexists(dest):
        olds = [p for kind, p in stale if kind == "old" and is_sparkjax_output(p)]
        olds.sort(key=lambda p: os.lstat(os.path.join(p, MARKER)).st_mtime, reverse=True)
        for p in olds:
            try:
                _rename_new(p, dest)
            except OSError:
                continue
            stale = [(k, q) for k, q in stale if q != p]
            done.append(f"restored {dest} from {p}")
            break
    for _kind, p in stale:
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                if _owned(p):
                    _remove_owned(p)
                    done.append(f"removed {p}")
            elif _is_regular(p):
                os.unlink(p)
                done.append(f"removed {p}")
        except OSError:
            continue
    return done


def _write_failed(dest: str, e: BaseException) -> WriteError:
    reason = _why(e)
    return WriteError(f"{dest}: cannot write the output ({reason}); the destination was left unchanged", reason)


@contextlib.contextmanager
def atomic_file(path: PathLike) -> Iterator[str]:
    """Yields a temp path beside ``path`` (a file, never a folder); renames it onto ``path`` only if the block
    succeeds. I/O errors raise :class:`WriteError` naming ``path``; the temp file is removed."""
    dest = os.path.abspath(_path_arg(path, "output file"))
    if os.path.isdir(dest):
        raise ArgumentError(f"output file {dest} is a folder; refusing to replace it with a file")
    parent, base = os.path.split(dest)
    recover(dest)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_prefix(base, "tmp"), dir=parent)
        os.close(fd)
    except OSError as e:
        raise _write_failed(dest, e) from None
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, dest)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, (OSError, WriteError)):
            raise _write_failed(dest, e) from e
        raise


def _commit(tmp: str, dest: str, overwrite: bool) -> None:
    with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:  # the marker: written last
        f.write(_MARKER_TEXT)
    os.unlink(os.path.join(tmp, _WRITING))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the folder is meant to be shared
    if not os.path.lexists(dest):
        try:
            _rename_new(tmp, dest)
        except FileExistsError:
            raise ArgumentError(f"output folder {dest} appeared while it was being written; not replaced") from None
        return
    check_destination(dest, overwrite=overwrite)  # again: it may have changed while we wrote
    parent, base = os.path.split(dest)
    if _exchange(tmp, dest):
        # ``tmp`` now holds the previous output; make sure it is ours before deleting it
        if not _owned(tmp):
            _exchange(tmp, dest)
            raise ArgumentError(f"output folder {dest} was replaced by other files while it was written; "
                                "left as it is")
        with contextlib.suppress(OSError):
            _remove_owned(tmp)  # a leftover is stale and removed by the next writer
        return
    # no atomic exchange: move the old output aside, move the new one in, delete the old one
    old = tempfile.mkdtemp(prefix=_prefix(base, "old"), dir=parent)
    os.rename(dest, old)
    if not _owned(old):
        os.rename(old, dest)
        raise ArgumentError(f"output folder {dest} was replaced by other files while it was written; left as it is")
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    with contextlib.suppress(OSError):
        _remove_owned(old)


@contextlib.contextmanager
def atomic_dir(path: PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """Yields a temp folder beside ``path``; it becomes ``path`` (with :data:`MARKER`) only if the block succeeds.
    The overwrite rule is applied before the block and again before the commit; I/O errors raise
    :class:`WriteError` naming ``path``; the temp folder is always removed."""
    p = _path_arg(path)
    dest = os.path.abspath(p)
    check_destination(p, overwrite=overwrite)  # before anything is created or cleaned up
    parent, base = os.path.split(dest)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise WriteError(f"{dest}: cannot create the folder {parent} ({_why(e)})", _why(e)) from None
    recover(dest)
    check_destination(p, overwrite=overwrite)
    try:
        tmp = tempfile.mkdtemp(prefix=_prefix(base, "tmp"), dir=parent)
        with open(os.path.join(tmp, _WRITING), "w", encoding="utf-8") as f:
            f.write(f"{os.getpid()}@{_host()}\n")
    except OSError as e:
        with contextlib.suppress(OSError, NameError):
            _remove_owned(tmp)
        raise _write_failed(dest, e) from None
    try:
        yield tmp
        _commit(tmp, dest, overwrite)
    except BaseException as e:
        if os.path.isdir(tmp) and _owned(tmp):
            with contextlib.suppress(OSError):
                _remove_owned(tmp)
        if isinstance(e, (OSError, WriteError)):
            raise _write_failed(dest, e) from e
        raise
