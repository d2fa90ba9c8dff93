"""The safetensors format: a validating, memory-mapped reader, an atomic writer, sharded folders.

:class:`SafetensorsFile` opens regular files only and validates the whole header on open (known dtype,
non-negative integer shape, offsets of exactly the tensor's size, inside the data section, not overlapping);
every failure is a :class:`~sparkjax.errors.CheckpointError` naming the path and the key.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import struct
from typing import Any

import ml_dtypes
import numpy as np

from ..config import open_regular, read_json
from ..errors import ArgumentError, CheckpointError
from .atomic import atomic_file

PathLike = str | os.PathLike

_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_FLOAT_DTYPES = tuple(np.dtype(_ST_DTYPES[k]) for k in ("F32", "BF16", "F16", "F64"))  # a parameter's only dtypes
_MAX_HEADER = 100 * 1024 * 1024  # the format's cap on the JSON header


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsFile:
    """A memory-mapped safetensors file with a validated header (see the module docstring)."""

    def __init__(self, path: PathLike):
        self.path = str(path)
        with open_regular(self.path, CheckpointError, "safetensors file") as f:
            try:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (header of {n} bytes, file {size})")
                if n > _MAX_HEADER:
                    raise CheckpointError(f"{self.path}: safetensors header of {n} bytes exceeds the 100 MB limit")
                header = json.loads(f.read(n))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: unreadable safetensors header ({e})") from None
            except RecursionError:
                raise CheckpointError(f"{self.path}: unreadable safetensors header (nested too deeply)") from None
            if not isinstance(header, dict):
                raise CheckpointError(f"{self.path}: malformed safetensors header (not a JSON object)")
            metadata = header.pop("__metadata__", None)
            if metadata is not None and not isinstance(metadata, dict):
                raise CheckpointError(f"{self.path}: malformed safetensors header ('__metadata__' is not an object)")
            self.metadata = metadata or {}
            self._base = 8 + n
            data_size = size - self._base
            self.entries = {key: self._entry(key, e, data_size) for key, e in header.items()}
            spans = sorted((begin, end, key) for key, (_, _, begin, end) in self.entries.items() if end > begin)
            for (_, prev_end, prev), (begin, _, key) in zip(spans, spans[1:], strict=False):
                if begin < prev_end:
                    raise CheckpointError(f"{self.path}: tensors '{prev}' and '{key}' overlap in the data section "
                                          f"(byte {begin} < {prev_end})")
            try:
                self._map = np.memmap(f, dtype=np.uint8, mode="r") if size > self._base else None
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.path}: cannot map the file ({e})") from None

    def _entry(self, key: str, e: Any, data_size: int) -> tuple[Any, tuple[int, ...], int, int]:
        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{self.path}: malformed header entry for key '{key}': {what}")

        if not isinstance(e, dict):
            raise bad(f"expected an object, got {type(e).__name__}")
        name, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(name, str) or name not in _ST_DTYPES:
            raise bad(f"unsupported dtype {name!r:.40} (supported: {', '.join(_ST_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"'shape' must be a list of non-negative integers, got {shape!r:.80}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
            raise bad(f"'data_offsets' must be two integers, got {offsets!r:.80}")
        dtype = _ST_DTYPES[name]
        begin, end = offsets
        count = math.prod(shape)  # Python ints: no overflow
        if not 0 <= begin <= end or end - begin != count * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{self.path}: key '{key}' has inconsistent data offsets [{begin}, {end}) for "
                                  f"{name} shape {shape} ({count * np.dtype(dtype).itemsize} bytes)")
        if end > data_size:
            raise CheckpointError(
                f"{self.path}: truncated safetensors file: key '{key}' ends at byte {self._base + end}, "
                f"file has {self._base + data_size}"
            )
        return dtype, tuple(shape), begin, end

    def keys(self) -> list[str]:
        return list(self.entries)

    def _lookup(self, key: str) -> tuple[Any, tuple[int, ...], int, int]:
        try:
            return self.entries[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor '{key}'") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self._lookup(key)[1]

    def dtype(self, key: str) -> np.dtype:
        return np.dtype(self._lookup(key)[0])

    def get(self, key: str) -> np.ndarray:
        dtype, shape, begin, end = self._lookup(key)
        if self._map is None:  # only empty tensors in the file
            return np.zeros(shape, dtype)
        raw = self._map[self._base + begin : self._base + end]
        return raw.view(dtype).reshape(shape)

    def read(self, key: str) -> np.ndarray:
        """Tensor ``key`` as a copy; its pages of the mapping are released afterwards (``MADV_DONTNEED``), so
        a loader never keeps the whole file resident."""
        dtype, shape, begin, end = self._lookup(key)
        if self._map is None or end == begin:
            return np.zeros(shape, dtype)
        lo, hi = self._base + begin, self._base + end
        out = np.array(self._map[lo:hi]).view(dtype).reshape(shape)
        mm = getattr(self._map, "_mmap", None)
        if hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            start = lo - lo % mmap.PAGESIZE
            with contextlib.suppress(OSError, ValueError):  # only a hint: the copy is right either way
                mm.madvise(mmap.MADV_DONTNEED, start, hi - start)
        return out


def write_safetensors(path: PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Writes ``tensors`` to ``path`` atomically; I/O errors raise :class:`~sparkjax.errors.WriteError`."""
    if not isinstance(tensors, dict):
        raise ArgumentError(f"tensors: expected a dict of name -> array, got {type(tensors).__name__}")
    for key in tensors:
        if not isinstance(key, str):
            raise ArgumentError(f"tensors: keys must be str, got {type(key).__name__} {key!r}")
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for key, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _ST_NAMES:
            raise ArgumentError(f"tensors['{key}']: dtype {arr.dtype} cannot be stored in safetensors")
        header[key] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                       "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


class WeightFiles:
    """The safetensors files of a checkpoint folder: a single file, or shards with an index whose
    ``weight_map`` values are relative file names below the folder (links are followed)."""

    def __init__(
        self, folder: PathLike, single: str = "model.safetensors", index: str = "model.safetensors.index.json"
    ):
        self.folder = str(folder)
        index_path = os.path.join(self.folder, index)
        single_path = os.path.join(self.folder, single)
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if os.path.lexists(index_path):
            weight_map = read_json(index_path, CheckpointError, "index file").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: missing or malformed 'weight_map'")
            if not weight_map:
                raise CheckpointError(f"{index_path}: 'weight_map' is empty")
            for key, fname in weight_map.items():
                fname = self._shard_name(index_path, key, fname)
                if fname not in self.files:
                    self.files[fname] = SafetensorsFile(os.path.join(self.folder, fname))
                if key not in self.files[fname].entries:
                    raise CheckpointError(
                        f"{os.path.join(self.folder, fname)}: key '{key}' listed in {index_path} is absent"
                    )
                self.where[key] = fname
            for fname, f in self.files.items():
                for key in f.keys():
                    self.where.setdefault(key, fname)
        elif os.path.lexists(single_path):
            self.files[single] = SafetensorsFile(single_path)
            self.where = dict.fromkeys(self.files[single].keys(), single)
        else:
            raise CheckpointError(f"{self.folder}: no {single} or {index} found")

    def _shard_name(self, index_path: str, key: str, fname: Any) -> str:
        """Validates one ``weight_map`` value: a relative path to a file inside the folder."""

        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"{index_path}: 'weight_map' entry for key '{key}' {why}")

        if not isinstance(fname, str) or not fname:
            raise bad(f"must be a file name, got {fname!r:.80}")
        if "\0" in fname:
            raise bad("contains a NUL byte")
        if os.path.isabs(fname) or os.path.splitdrive(fname)[0]:
            raise bad(f"is an absolute path ({fname!r}); shard names must be relative to the folder")
        parts = re.split(r"[/\\]", fname)
        if ".." in parts:
            raise bad(f"leads outside the checkpoint folder ({fname!r})")
        # links are followed on purpose: the Hugging Face hub cache links every file into ../../blobs
        return os.path.normpath(fname)

    def keys(self) -> list[str]:
        return list(self.where)

    def file_of(self, key: str) -> SafetensorsFile:
        return self.files[self.where[key]]

    def describe(self) -> str:
        return ", ".join(os.path.join(self.folder, f) for f in self.files)

    def dtype(self) -> np.dtype:
        """The floating dtype the parameters are stored in (the default model dtype): their one dtype, else
        float32 (mixed, or float64); a checkpoint without any float tensor is a CheckpointError."""
        found = {f.dtype(key) for f in self.files.values() for key in f.keys()}
        floats = found & set(_FLOAT_DTYPES)
        if not floats:
            if found:
                key = next(iter(self.where))
                src = self.file_of(key)
                raise CheckpointError(f"{src.path}: no floating-point tensor in the checkpoint (tensor '{key}' is "
                                      f"{_ST_NAMES[src.dtype(key)]})")
            return np.dtype(np.float32)
        if len(floats) == 1 and np.dtype(np.float64) not in floats:
            return next(iter(floats))
        return np.dtype(np.float32)


_EXPONENT_MASK = {np.dtype(ml_dtypes.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}
_FINITE_BLOCK = 1 << 22  # elements per block of the finiteness check: its temporaries stay a few MB


def _all_finite(x: np.ndarray) -> bool:
    """True when ``x`` holds no NaN or Inf (checked in blocks along the first axis: small temporaries)."""
    if x.size == 0:
        return True
    x = x.reshape(1) if x.ndim == 0 else x
    rows = max(1, _FINITE_BLOCK // max(1, x.size // x.shape[0]))
    mask = _EXPONENT_MASK.get(x.dtype)
    for i in range(0, x.shape[0], rows):
        if mask is not None:  # np.isfinite is slow on 16-bit floats; compare the exponent bits instead
            ok = int((x[i : i + rows].view(np.uint16) & np.uint16(0x7FFF)).max()) < mask
        else:
            ok = bool(np.isfinite(x[i : i + rows]).all())
        if not ok:
            return False
    return True


def _non_finite_error(path: str, key: str, stored: np.ndarray, dtype: np.dtype) -> CheckpointError:
    """The error for a tensor that is non-finite as stored, or becomes so when converted to ``dtype``."""
    wide = stored.astype(np.float64)
    if np.isfinite(wide).all():
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite(stored.astype(dtype).astype(np.float64))
        first = [int(i) for i in np.argwhere(bad)[0]]
        return CheckpointError(
            f"{path}: tensor '{key}' overflows to Inf when converted to {dtype} ({int(bad.sum())} of {bad.size} "
            f"values, first at index {first}); load the model in a wider dtype"
        )
    bad = ~np.isfinite(wide)
    first = [int(i) for i in np.argwhere(bad)[0]]
    kinds = "/".join(sorted({"NaN" if np.isnan(v) else "Inf" for v in wide[bad][:1000]}))
    return CheckpointError(
        f"{path}: tensor '{key}' holds non-finite values ({kinds}: {int(bad.sum())} of {bad.size}, first at "
        f"index {first}); the weights are corrupt"
    )
