"""Checkpoint formats: safetensors streaming, declarative key maps, atomic export.

This is the only module that knows file formats (orbax lives in
:mod:`sparkjax.checkpoint`). A *key map* is a table of rules
``(module path pattern, checkpoint key pattern, layout)``; ``{i}`` stands for a
layer index. Loading walks the abstract module's parameters, finds the rule of
each, reads that one tensor from its safetensors file (memory-mapped), asserts
its shape, converts dtype and layout, and moves on; so peak host memory is one
tensor. Missing, unexpected and mis-shaped tensors and truncated files raise
:class:`~sparkjax.errors.CheckpointError` naming the file and the key.

Layouts (checkpoint = PyTorch ``nn.Linear`` layout, module = JAX layout):

``same``       identical shapes (embeddings, norms, head tables)
``linear``     ``[out, in]`` <-> kernel ``[in, out]``
``heads_in``   ``[n*h, in]`` <-> kernel ``[in, n, h]`` (q/k/v projections)
``heads_out``  ``[d, n*h]`` <-> kernel ``[n, h, d]`` (o projection)
``flat``       ``[n*h]`` <-> ``[n, h]`` (q/k/v biases)
"""

from __future__ import annotations

import json
import os
import re
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from .config import Qwen3Config, open_regular, read_json
from .errors import ArgumentError, CheckpointError

PathLike = str | os.PathLike

# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# The dtypes a model parameter may be stored in (anything else is refused, never reinterpreted).
_FLOAT_DTYPES = tuple(np.dtype(_ST_DTYPES[k]) for k in ("F32", "BF16", "F16", "F64"))
# The safetensors format caps the JSON header at 100 MB; a larger length field is corruption.
_MAX_HEADER = 100 * 1024 * 1024


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsFile:
    """A memory-mapped safetensors file with a validated header.

    The file must be a regular file (a FIFO or device is refused before anything is read). Every
    header entry must have a known ``dtype``, a ``shape`` of non-negative integers and
    ``data_offsets`` ``[begin, end)`` of exactly the tensor's size, inside the data section and not
    overlapping any other entry; anything else raises :class:`CheckpointError` naming the file and key.
    """

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
            self.entries: dict[str, tuple[Any, tuple[int, ...], int, int]] = {}
            for key, e in header.items():
                self.entries[key] = self._entry(key, e, data_size)
            spans = sorted((begin, end, key) for key, (_, _, begin, end) in self.entries.items() if end > begin)
            for (_, prev_end, prev), (begin, _, key) in zip(spans, spans[1:], strict=False):
                if begin < prev_end:
                    raise CheckpointError(
                        f"{self.path}: tensors '{prev}' and '{key}' overlap in the data section "
                        f"(byte {begin} < {prev_end})"
                    )
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
        count = 1
        for d in shape:  # Python ints: a shape of 2**64 is just a large number, no overflow
            count *= d
        if not 0 <= begin <= end or end - begin != count * np.dtype(dtype).itemsize:
            raise CheckpointError(
                f"{self.path}: key '{key}' has inconsistent data offsets [{begin}, {end}) for "
                f"{name} shape {shape} ({count * np.dtype(dtype).itemsize} bytes)"
            )
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


def write_safetensors(path: PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Writes ``tensors`` to ``path`` atomically (temp file in the same folder, then rename).

    I/O errors (read-only folder, full disk) raise :class:`~sparkjax.atomic.WriteError` naming ``path``.
    """
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


# The atomic writers and the overwrite rule live in :mod:`sparkjax.atomic`; these names stay importable
# from here (training code and the train/ scripts use them).
from .atomic import (  # noqa: E402, F401 - re-exported names
    MARKER,
    WriteError,
    _umask,
    atomic_dir,
    atomic_file,
    check_destination,
    is_sparkjax_output,
    recover,
)


def _require_model(model, cls, func: str, what: str, other: str) -> None:
    """Writers take only the model class they can write back (a wrong one would make an unloadable folder)."""
    if isinstance(model, cls):
        return
    hint = ""
    if type(model).__name__ in ("Qwen3", "Drafter"):
        hint = f" (use {other} for a {type(model).__name__})"
    raise ArgumentError(f"{func}: model must be {what} ({cls.__module__}.{cls.__name__}), "
                        f"got {type(model).__name__}{hint}")


class WeightFiles:
    """The safetensors files of a checkpoint folder: a single file, or shards with an index.

    Every ``weight_map`` value of the index must be a relative file name below the folder (no
    absolute path, no ``..`` component); every file must be a regular file (links are followed).
    """

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
        # Symbolic links inside the folder are followed on purpose: the Hugging Face hub cache
        # stores every file of a snapshot as a link into ../../blobs. The index itself can only
        # name files below the folder.
        return os.path.normpath(fname)

    def keys(self) -> list[str]:
        return list(self.where)

    def file_of(self, key: str) -> SafetensorsFile:
        return self.files[self.where[key]]

    def describe(self) -> str:
        return ", ".join(os.path.join(self.folder, f) for f in self.files)

    def dtype(self) -> np.dtype:
        """The floating dtype the checkpoint's parameters are stored in (the default model dtype).

        Only floating tensors count (a non-float parameter is refused by :func:`load_into`). When
        all of them share one dtype that is the answer. A mix of float dtypes gives float32, which
        holds every float16 and bfloat16 value exactly; float64 also gives float32, the widest
        dtype a model may use. A checkpoint without any float tensor is a CheckpointError.
        """
        found = {f.dtype(key) for f in self.files.values() for key in f.keys()}
        floats = found & set(_FLOAT_DTYPES)
        if not floats:
            if found:
                key = next(iter(self.where))
                src = self.file_of(key)
                raise CheckpointError(
                    f"{src.path}: no floating-point tensor in the checkpoint (tensor '{key}' is "
                    f"{_ST_NAMES[src.dtype(key)]})"
                )
            return np.dtype(np.float32)
        if len(floats) == 1 and np.dtype(np.float64) not in floats:
            return next(iter(floats))
        return np.dtype(np.float32)


# ----------------------------------------------------------------------------- key maps

Rule = tuple[str, str, str]  # (module path pattern, checkpoint key pattern, layout)

QWEN3_KEYS: tuple[Rule, ...] = (
    ("embed_tokens.embedding", "model.embed_tokens.weight", "same"),
    ("layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", "same"),
    ("layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight", "same"),
    ("layers.{i}.self_attn.q_proj.kernel", "model.layers.{i}.self_attn.q_proj.weight", "heads_in"),
    ("layers.{i}.self_attn.k_proj.kernel", "model.layers.{i}.self_attn.k_proj.weight", "heads_in"),
    ("layers.{i}.self_attn.v_proj.kernel", "model.layers.{i}.self_attn.v_proj.weight", "heads_in"),
    ("layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias", "flat"),
    ("layers.{i}.self_attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias", "flat"),
    ("layers.{i}.self_attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias", "flat"),
    ("layers.{i}.self_attn.o_proj.kernel", "model.layers.{i}.self_attn.o_proj.weight", "heads_out"),
    ("layers.{i}.self_attn.o_proj.bias", "model.layers.{i}.self_attn.o_proj.bias", "same"),
    ("layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", "same"),
    ("layers.{i}.self_attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", "same"),
    ("layers.{i}.mlp.gate_proj.kernel", "model.layers.{i}.mlp.gate_proj.weight", "linear"),
    ("layers.{i}.mlp.up_proj.kernel", "model.layers.{i}.mlp.up_proj.weight", "linear"),
    ("layers.{i}.mlp.down_proj.kernel", "model.layers.{i}.mlp.down_proj.weight", "linear"),
    ("norm.weight", "model.norm.weight", "same"),
    ("lm_head.weight", "lm_head.weight", "same"),
)


def _checkpoint_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "same":
        return shape
    if layout == "linear":
        return shape[::-1]
    if layout == "heads_in":
        return (shape[1] * shape[2], shape[0])
    if layout == "heads_out":
        return (shape[2], shape[0] * shape[1])
    if layout == "flat":
        return (int(np.prod(shape)),)
    raise ValueError(f"unknown layout {layout!r}")


def _to_module(layout: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout in ("same", "flat"):
        return x.reshape(shape)
    if layout == "linear":
        return x.T
    if layout == "heads_in":
        return x.T.reshape(shape)
    if layout == "heads_out":
        return x.T.reshape(shape)
    raise ValueError(f"unknown layout {layout!r}")


def _to_checkpoint(layout: str, x: np.ndarray) -> np.ndarray:
    if layout == "same":
        return x
    if layout == "flat":
        return x.reshape(-1)
    if layout == "linear":
        return x.T
    if layout == "heads_in":
        return x.reshape(x.shape[0], -1).T
    if layout == "heads_out":
        return x.reshape(-1, x.shape[-1]).T
    raise ValueError(f"unknown layout {layout!r}")


def _compile_rules(rules: Sequence[Rule]) -> list[tuple[re.Pattern, str, str]]:
    out = []
    for mod, key, layout in rules:
        pattern = re.escape(mod).replace(re.escape("{i}"), r"(?P<i>\d+)")
        out.append((re.compile(pattern + "$"), key, layout))
    return out


def param_keys(state: nnx.State, rules: Sequence[Rule]) -> list[tuple[tuple, str, str]]:
    """Maps every parameter of ``state`` to ``(path, checkpoint key, layout)``; every path must match a rule."""
    compiled = _compile_rules(rules)
    out = []
    for path, _ in nnx.to_flat_state(state):
        dotted = ".".join(str(p) for p in path)
        for pattern, key, layout in compiled:
            m = pattern.match(dotted)
            if m:
                out.append((path, key.format(**m.groupdict()), layout))
                break
        else:
            raise AssertionError(f"key map has no rule for parameter {dotted}")
    return out


_MODEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def resolve_dtype(dtype: Any, default: Any, argument: str = "dtype") -> Any:
    """The model dtype: ``dtype`` when given, else ``default``; either must be float32, bfloat16 or float16."""
    if dtype is None:
        dt = jnp.dtype(default)
        if dt not in _MODEL_DTYPES:
            raise ArgumentError(f"{argument}: the checkpoint's dtype {dt} cannot be used for a model; pass {argument}=")
        return dt
    try:
        dt = jnp.dtype(dtype)
    except (TypeError, ValueError):
        raise ArgumentError(f"{argument}: unknown dtype {dtype!r:.80}") from None
    if dt not in _MODEL_DTYPES:
        raise ArgumentError(f"{argument}: expected float32, bfloat16 or float16, got {dt}")
    return dt


# Exponent bits of the 16-bit floats: a value is Inf or NaN exactly when all of them are set.
_EXPONENT_MASK = {np.dtype(ml_dtypes.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}


def _all_finite(x: np.ndarray) -> bool:
    """One reduction over ``x``: True when it holds no NaN or Inf."""
    if x.size == 0:
        return True
    mask = _EXPONENT_MASK.get(x.dtype)
    if mask is not None:  # np.isfinite is slow on 16-bit floats; compare the exponent bits instead
        return int((x.view(np.uint16) & np.uint16(0x7FFF)).max()) < mask
    return bool(np.isfinite(x).all())


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


def load_into(
    build: Callable[[], nnx.Module],
    files: WeightFiles,
    rules: Sequence[Rule],
    *,
    dtype: Any,
    ignore: Sequence[str] = (),
    shared: dict[tuple, Any] | None = None,
    check_finite: bool = True,
) -> nnx.Module:
    """Builds ``build()`` abstractly and fills its parameters from ``files`` through ``rules``.

    ``ignore`` lists checkpoint keys that may be present and are skipped (e.g. a
    tied ``lm_head.weight``); ``shared`` gives values for module paths that do not
    come from the checkpoint (e.g. a drafter reusing the target's embedding).

    Every tensor must have the parameter's shape and a floating dtype (an integer or
    boolean tensor is refused, never reinterpreted); it is converted to ``dtype`` and,
    with ``check_finite``, checked for NaN / Inf after the conversion (one reduction per
    tensor on the host copy), so a corrupt tensor or one that overflows ``dtype`` raises
    :class:`CheckpointError` naming the file and the key.
    """
    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    shared = shared or {}
    flat = dict(nnx.to_flat_state(state))
    mapping = [(p, k, lay) for p, k, lay in param_keys(state, rules) if p not in shared]
    expected = {k for _, k, _ in mapping}
    available = set(files.keys())
    missing = sorted(expected - available)
    if missing:
        raise CheckpointError(f"{files.describe()}: missing tensor '{missing[0]}'" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(available - expected - set(ignore))
    if unexpected:
        raise CheckpointError(
            f"{files.folder}/{files.where[unexpected[0]]}: unexpected tensor '{unexpected[0]}'"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    dt = np.dtype(jnp.dtype(dtype))
    for path, key, layout in mapping:
        var = flat[path]
        shape = tuple(var.get_value().shape)
        want = _checkpoint_shape(layout, shape)
        src = files.file_of(key)
        got = src.shape(key)
        if tuple(got) != want:
            raise CheckpointError(f"{src.path}: tensor '{key}' has shape {list(got)}, expected {list(want)}")
        stored = src.dtype(key)
        if stored not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{src.path}: tensor '{key}' is stored as {_ST_NAMES[stored]}; parameters must be "
                "floating-point (F32, BF16, F16 or F64)"
            )
        raw = src.get(key)
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, naming the tensor
            host = _to_module(layout, raw, shape).astype(dt)
        if check_finite and not _all_finite(host):
            raise _non_finite_error(src.path, key, raw, dt)
        var.set_value(jnp.asarray(host))
    for path, value in shared.items():
        flat[path].set_value(value)
    return nnx.merge(graphdef, state)


def export_tensors(model: nnx.Module, rules: Sequence[Rule], *, skip: Sequence[tuple] = ()) -> dict[str, np.ndarray]:
    """The model's parameters as checkpoint-layout NumPy arrays keyed by checkpoint name."""
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    out = {}
    for path, key, layout in param_keys(state, rules):
        if path in skip:
            continue
        out[key] = np.asarray(jax.device_get(flat[path].get_value()))
        out[key] = np.ascontiguousarray(_to_checkpoint(layout, out[key]))
    return out


# ----------------------------------------------------------------------------- Qwen3 target

def load_target(path: PathLike, dtype: Any = None):
    """Loads a Hugging Face Qwen3 folder (``config.json`` + ``model.safetensors`` or shards).

    ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``) defaults to the checkpoint's own:
    the dtype in the safetensors header, which wins over the config's ``torch_dtype`` / ``dtype``
    (that key is only checked to name a floating dtype). float64 tensors load as float32, a
    checkpoint mixing float dtypes loads as float32.

    Validated at load time (each failure raises a :class:`~sparkjax.errors.SparkjaxError` naming
    the file and the key): the config (see :class:`~sparkjax.config.Qwen3Config`); regular files
    only; the safetensors header (dtypes, shapes, offsets in range and not overlapping); the
    index's shard names (relative, inside the folder); every tensor present, of the expected
    shape and a floating dtype; and every converted tensor finite (no NaN / Inf).
    """
    from .nn.qwen3 import Qwen3

    folder = str(path)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a folder")
    cfg = Qwen3Config.from_hf_config(os.path.join(folder, "config.json"))
    files = WeightFiles(folder)
    dt = resolve_dtype(dtype, files.dtype())
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    model = load_into(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), dtype=dt), files, QWEN3_KEYS, dtype=dt, ignore=ignore)
    _SOURCES[model] = folder  # named in drafter/target compatibility errors
    return model


def save_target(model, path: PathLike, *, overwrite: bool = False, dtype: Any = None) -> str:
    """Writes a Qwen3 model as a Hugging Face folder (``config.json`` + ``model.safetensors``), atomically.

    ``overwrite=True`` replaces only a folder sparkjax wrote or an empty one (see :mod:`sparkjax.atomic`).
    """
    from .nn.qwen3 import Qwen3

    _require_model(model, Qwen3, "save_target", "a Qwen3 target", "save_drafter")
    check_destination(path, overwrite=overwrite)  # before the export, so a refusal costs nothing
    cfg: Qwen3Config = model.config
    tensors = export_tensors(model, QWEN3_KEYS)
    if dtype is not None:
        dt = resolve_dtype(dtype, None)
        tensors = {k: v.astype(dt) for k, v in tensors.items()}
    config = cfg.to_hf_dict()
    config["dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
    with atomic_dir(path, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
    return str(path)


# ----------------------------------------------------------------------------- drafters (DSpark / DFlash)

# DeepSpec ``Qwen3DSparkModel`` and z-lab ``DFlashDraftModel`` checkpoints share the backbone keys
# (no ``model.`` prefix). A DFlash drafter simply has no embed / head / Markov / confidence parameters.
DRAFTER_KEYS: tuple[Rule, ...] = (
    ("embed_tokens.embedding", "embed_tokens.weight", "same"),
    *((mod, key.removeprefix("model."), layout) for mod, key, layout in QWEN3_KEYS if mod.startswith("layers.")),
    ("norm.weight", "norm.weight", "same"),
    ("fc.kernel", "fc.weight", "linear"),
    ("hidden_norm.weight", "hidden_norm.weight", "same"),
    ("lm_head.weight", "lm_head.weight", "same"),
    ("markov_head.markov_w1.weight", "markov_head.markov_w1.weight", "same"),
    ("markov_head.markov_w2.weight", "markov_head.markov_w2.weight", "same"),
    ("markov_head.gate_proj.kernel", "markov_head.gate_proj.weight", "linear"),
    ("markov_head.gate_proj.bias", "markov_head.gate_proj.bias", "same"),
    ("confidence_head.proj.kernel", "confidence_head.proj.weight", "linear"),
    ("confidence_head.proj.bias", "confidence_head.proj.bias", "same"),
)


# Where each loaded model came from. Kept outside the module: a plain attribute would become part of
# the NNX graphdef, so the same architecture loaded from two folders would compile twice.
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def source_of(model) -> str | None:
    """The folder a model was loaded from (None for a model built in memory)."""
    return _SOURCES.get(model)


def _target_source(target) -> str:
    src = source_of(target)
    return f"{src}/config.json" if src else "<target model>"


def _check_io_shapes(files: WeightFiles, target, drafter_src: str, target_src: str) -> None:
    """DSpark: the drafter's own embed_tokens / lm_head must have the target's table shapes."""
    from .errors import IncompatiblePairError

    want = tuple(target.embed_tokens.embedding.get_value().shape)
    head = want if target.lm_head is None else tuple(target.lm_head.weight.get_value().shape)
    for key, shape in (("embed_tokens.weight", want), ("lm_head.weight", head)):
        if key in files.where:
            got = tuple(files.file_of(key).shape(key))
            if got != shape:
                raise IncompatiblePairError(
                    f"drafter {drafter_src} does not fit target {target_src}: tensor '{key}' in "
                    f"{files.file_of(key).path} has shape {list(got)}, the target's is {list(shape)}"
                )


def load_drafter(path: PathLike, target=None, dtype: Any = None):
    """Loads a DeepSpec DSpark or z-lab DFlash drafter folder (``config.json`` + safetensors).

    The format is detected from ``config.json`` (see :class:`~sparkjax.config.DrafterConfig`).
    With ``target`` (a loaded :class:`~sparkjax.nn.qwen3.Qwen3`) the pair is validated first:
    hidden size, vocabulary, ``num_target_layers``, ``target_layer_ids`` (in range, not the
    final layer), ``mask_token_id``, and for DSpark the shapes of ``embed_tokens`` / ``lm_head``;
    any mismatch raises :class:`~sparkjax.errors.IncompatiblePairError` naming both files;
    a ``target`` that is not such a model raises :class:`~sparkjax.errors.ArgumentError`.
    ``dtype`` defaults to the checkpoint's. :func:`source_of` gives the folder it came from.
    The files are validated as in :func:`load_target` (header, dtypes, finiteness).
    """
    from .config import DrafterConfig, validate_pair
    from .nn.drafter import Drafter

    folder = str(path)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a folder")
    config_path = os.path.join(folder, "config.json")
    if target is not None:
        from .nn.qwen3 import Qwen3

        if not isinstance(target, Qwen3):
            raise ArgumentError(
                f"target: expected a target model from sparkjax.load_target (a Qwen3), got {type(target).__name__}"
            )
    cfg = DrafterConfig.from_hf_config(config_path)
    files = WeightFiles(folder)
    if target is not None:
        target_src = _target_source(target)
        validate_pair(cfg, target.config, drafter_source=config_path, target_source=target_src)
        if cfg.kind == "dspark":
            _check_io_shapes(files, target, config_path, target_src)
    dt = resolve_dtype(dtype, files.dtype())
    model = load_into(lambda: Drafter(cfg, rngs=nnx.Rngs(0), dtype=dt), files, DRAFTER_KEYS, dtype=dt)
    _SOURCES[model] = folder
    return model


def save_drafter(drafter, path: PathLike, *, overwrite: bool = False, dtype: Any = None) -> str:
    """Writes a drafter in its own format, atomically: DeepSpec DSpark (original key names, keys
    sorted like ``save_pretrained``) or z-lab DFlash (backbone only), with the original
    ``config.json`` (updated with the config's values, and ``dtype`` when converting).

    ``overwrite=True`` replaces only a folder sparkjax wrote or an empty one (see :mod:`sparkjax.atomic`)."""
    from .nn.drafter import Drafter

    _require_model(drafter, Drafter, "save_drafter", "a drafter", "save_target")
    check_destination(path, overwrite=overwrite)
    tensors = export_tensors(drafter, DRAFTER_KEYS)
    if dtype is not None:
        dt = resolve_dtype(dtype, None)
        tensors = {k: v.astype(dt) for k, v in tensors.items()}
    tensors = dict(sorted(tensors.items()))
    config = drafter.config.to_hf_dict()
    config["dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
    with atomic_dir(path, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
    return str(path)
