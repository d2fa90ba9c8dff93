"""The loaders of sparkjax.io.hf (load_target, load_drafter) and the safetensors reader under them on hostile or
broken checkpoints, index files and configs: each one is a SparkjaxError naming the file and the key or argument.
Each broken input is built by hand from the fixture pair; FIFO cases run under a timeout. The fuzzed inputs are in
test_io_safetensors.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct

import ml_dtypes
import numpy as np
import pytest

import sparkjax
from sparkjax import load_drafter, load_target
from sparkjax.config import DrafterConfig, Qwen3Config, read_json
from sparkjax.errors import ArgumentError, CheckpointError, ConfigError, SparkjaxError, WriteError
from sparkjax.io.safetensors import SafetensorsFile, WeightFiles, write_safetensors

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny_dspark_b16")
TARGET_DIR = os.path.join(FIXTURE, "target")
DRAFTER_DIR = os.path.join(FIXTURE, "drafter")


def raw_safetensors(path, header: dict, body: bytes = b"") -> str:
    """Writes a safetensors file byte by byte, with any header (valid or not)."""
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body)
    return str(path)


def copy_folder(src, dst) -> str:
    return str(shutil.copytree(src, dst))


def read_tensors(folder) -> dict[str, np.ndarray]:
    f = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    return {k: np.array(f.get(k)) for k in f.keys()}


def rewrite_tensors(folder, fn):
    tensors = read_tensors(folder)
    tensors = fn(tensors) or tensors  # fn edits in place or returns new tensors
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors, {"format": "pt"})


def edit_config(folder, fn):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)  # writes NaN / Infinity literals as Python's json does


def assert_names(err: BaseException, *parts: str):
    assert isinstance(err, SparkjaxError)
    for p in parts:
        assert str(p) in str(err), f"{p!r} not in {str(err)!r}"


@pytest.fixture()
def target_copy(tmp_path):
    return copy_folder(TARGET_DIR, tmp_path / "target")


VALID_F32 = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}


@pytest.mark.parametrize("header, pattern, key", [
    ({"w": {"dtype": "F32", "shape": [2**64], "data_offsets": [0, 4]}}, "inconsistent data offsets", "'w'"),
    *[({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 24]}}, what, "'w'") for shape, what in [
        ([-1, 6], "non-negative"), ([2.0, 3], "integers"), (["2", 3], "integers"), ([True, 6], "integers"),
        ("6", "shape"), (None, "shape")]],
    *[({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": off}}, what, "'w'") for off, what in [
        ([-24, 0], "inconsistent"), ([24, 48], "truncated"), ([0, 24, 48], "data_offsets"),
        ([0.0, 24], "data_offsets"), ([2**70, 2**70 + 24], "truncated")]],
    # two 24-byte tensors sharing bytes [12, 24), and identical ranges: both overlap
    ({"a": VALID_F32, "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [12, 36]}}, "overlap", "'b'"),
    ({"a": VALID_F32, "b": VALID_F32, "e": {"dtype": "F32", "shape": [0], "data_offsets": [12, 12]}}, "overlap", "'a'"),
    *[(h, "malformed", "") for h in [{"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, {"w": [1, 2]},
                                     {"__metadata__": [1], "w": VALID_F32}, [1, 2]]],
])
def test_bad_headers(tmp_path, header, pattern, key):
    path = raw_safetensors(tmp_path / "m.safetensors", header, b"\0" * 36)
    with pytest.raises(CheckpointError, match=pattern) as info:
        SafetensorsFile(path)
    assert_names(info.value, path, key)


def test_empty_tensors_overlap_nothing_and_deep_headers(tmp_path):
    header = {"a": VALID_F32, "e": {"dtype": "F32", "shape": [0], "data_offsets": [12, 12]}}
    f = SafetensorsFile(raw_safetensors(tmp_path / "m.safetensors", header, b"\0" * 24))
    assert f.get("e").shape == (0,) and f.get("a").shape == (2, 3)
    path = tmp_path / "deep.safetensors"
    blob = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(CheckpointError, match="header") as info:
        SafetensorsFile(path)
    assert_names(info.value, path)


def test_integer_tensors_on_float_parameters(target_copy):
    weights = os.path.join(target_copy, "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    # same bytes, relabelled I32: never reinterpreted as floats
    rewrite_tensors(target_copy, lambda t: t.update({key: t[key].view(np.int32)}))
    with pytest.raises(CheckpointError, match="stored as I32.*floating") as info:
        load_target(target_copy)
    assert_names(info.value, weights, key)
    # an integer first tensor does not make the model dtype integer
    first = "model.embed_tokens.weight"
    rewrite_tensors(target_copy, lambda t: {first: t.pop(first).astype(np.int32),
                                            key: t.pop(key).view(np.float32), **t})
    assert next(iter(SafetensorsFile(weights).keys())) == first
    assert WeightFiles(target_copy).dtype() == np.float32
    with pytest.raises(CheckpointError, match="stored as I32") as info:
        load_target(target_copy)
    assert_names(info.value, "model.safetensors", first)
    # a checkpoint without any float tensor has no model dtype at all
    rewrite_tensors(target_copy, lambda t: {k: v.astype(np.int32) for k, v in t.items()})
    with pytest.raises(CheckpointError, match="no floating-point tensor"):
        load_target(target_copy)


def test_config_dtype_and_header_dtype(target_copy):
    # the header wins for storage: a config declaring bfloat16 over float32 tensors loads as float32
    edit_config(target_copy, lambda c: c.update(dtype="bfloat16", torch_dtype="bfloat16"))
    assert load_target(target_copy).embed_tokens.embedding.get_value().dtype == np.float32
    # a declared non-float dtype is an error naming the key
    edit_config(target_copy, lambda c: c.update(torch_dtype="int8"))
    with pytest.raises(ConfigError, match="torch_dtype.*int8") as info:
        load_target(target_copy)
    assert_names(info.value, "config.json")
    edit_config(target_copy, lambda c: c.update(torch_dtype=None, dtype=32))
    with pytest.raises(ConfigError, match="'dtype'"):
        load_target(target_copy)


def test_mixed_float_dtypes_load_losslessly(target_copy):
    norm = "model.norm.weight"
    original = read_tensors(target_copy)
    rewrite_tensors(target_copy, lambda t: {k: (v if k == norm else v.astype(np.float16)) for k, v in t.items()})
    assert SafetensorsFile(os.path.join(target_copy, "model.safetensors")).dtype(norm) == np.float32
    assert WeightFiles(target_copy).dtype() == np.float32  # float16 + float32: the one holding every value exactly
    got = np.asarray(load_target(target_copy).norm.weight.get_value())
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, original[norm])
    # one float dtype throughout: that dtype
    rewrite_tensors(target_copy, lambda t: {k: v.astype(np.float16) for k, v in t.items()})
    assert WeightFiles(target_copy).dtype() == np.float16


# ----------------------------------------------------------------------------- sharded index files


def _shard(folder, weight_map_edit):
    """Splits the fixture target into two shards with an index, then edits the weight_map."""
    tensors = read_tensors(folder)
    os.remove(os.path.join(folder, "model.safetensors"))
    keys = list(tensors)
    wm = {}
    for name, part in (("model-00001-of-00002.safetensors", keys[: len(keys) // 2]),
                       ("model-00002-of-00002.safetensors", keys[len(keys) // 2 :])):
        write_safetensors(os.path.join(folder, name), {k: tensors[k] for k in part})
        wm.update(dict.fromkeys(part, name))
    weight_map_edit(wm)
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return index


@pytest.mark.parametrize("value, pattern", [
    (7, "must be a file name"), (None, "must be a file name"), ("", "must be a file name"),
    ("ABS", "absolute path"), ("../outside.safetensors", "outside"), ("sub/../../outside.safetensors", "outside"),
])
def test_sharded_index_bad_weight_map_values(target_copy, tmp_path, value, pattern):
    # a valid shard outside the folder, which a path traversal would load without complaint
    outside = os.path.join(tmp_path, "outside.safetensors")
    write_safetensors(outside, {"model.norm.weight": read_tensors(TARGET_DIR)["model.norm.weight"]})
    value = outside if value == "ABS" else value
    key = "model.norm.weight"
    index = _shard(target_copy, lambda wm: wm.update({key: value}))
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_target(target_copy)
    assert_names(info.value, index, key)


def test_sharded_index_weight_map_not_an_object(target_copy):
    index = _shard(target_copy, lambda wm: None)
    for weight_map, pattern in ((["model-00001-of-00002.safetensors"], "weight_map"), ({}, "'weight_map' is empty")):
        with open(index, "w") as f:
            json.dump({"weight_map": weight_map}, f)
        with pytest.raises(CheckpointError, match=pattern) as info:
            load_target(target_copy)
        assert_names(info.value, index)


def test_sharded_index_with_symlinked_shards_loads(target_copy, tmp_path):
    # the Hugging Face hub cache stores each file of a snapshot as a link into ../../blobs
    _shard(target_copy, lambda wm: None)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        os.replace(os.path.join(target_copy, name), blobs / name)
        os.symlink(os.path.relpath(blobs / name, target_copy), os.path.join(target_copy, name))
    model = load_target(target_copy)
    np.testing.assert_array_equal(np.asarray(model.norm.weight.get_value()),
                                  read_tensors(TARGET_DIR)["model.norm.weight"])


# ----------------------------------------------------------------------------- configs


def test_config_nested_too_deeply(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="nested too deeply") as info:
        Qwen3Config.from_hf_config(path)
    assert_names(info.value, path)
    with pytest.raises(CheckpointError):  # the caller's error class is kept
        read_json(path, CheckpointError)


def _set_float(key, value):
    def edit(c):
        if key == "rope_theta":
            c.pop("rope_parameters")
        (c["rope_parameters"] if key.startswith("rope_parameters.") else c)[key.split(".")[-1]] = value

    return edit


BAD_CONFIGS = [
    *[(lambda c, v=v: c.update(layer_types=v), "layer_types")
      for v in ["full_attention", 6, {"0": "full_attention"}, [None] * 6, [["full_attention"]] * 6]],
    *[(_set_float(key, value), key.split(".")[-1] + "' (must be a finite|is too large)")
      for key in ("rope_theta", "rms_norm_eps", "rope_parameters.rope_theta")
      for value in (math.nan, math.inf, -math.inf, 10**400)],
    (_set_float("rope_theta", 0.0), "rope_theta.*positive"),
    (_set_float("rms_norm_eps", -1e-6), "rms_norm_eps.*positive"),
    (lambda c: (c.pop("model_type"), c.update(architectures=["Qwen3MoeForCausalLM"])), "architectures.*Qwen3Moe"),
    (lambda c: c.update(architectures=["Qwen3MoeForCausalLM"]), "architectures"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    (lambda c: c.update(architectures="Qwen3ForCausalLM"), "architectures"),
    (lambda c: c.update(num_experts=8, moe_intermediate_size=64), "num_experts.*mixture-of-experts"),
    *[(lambda c, q=q: c.update(quantization_config=q), "quantization_config")
      for q in ({"quant_method": "gptq", "bits": 4}, {"load_in_8bit": True}, "fp8")],
]


@pytest.mark.parametrize("case", range(len(BAD_CONFIGS)))
def test_bad_target_configs(target_copy, case):
    edit, pattern = BAD_CONFIGS[case]
    edit_config(target_copy, edit)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_target(target_copy)
    assert_names(info.value, "config.json")


def test_drafter_block_size_bounded(tmp_path):
    folder = copy_folder(DRAFTER_DIR, tmp_path / "drafter")
    for block, pattern in ((10**9, "block_size.*1024"), (1025, "block_size"), (2**40, "below 2\\*\\*31")):
        edit_config(folder, lambda c, b=block: c.update(block_size=b))
        with pytest.raises(ConfigError, match=pattern) as info:
            load_drafter(folder)
        assert_names(info.value, os.path.join(folder, "config.json"))
    base = json.load(open(os.path.join(DRAFTER_DIR, "config.json")))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        DrafterConfig.from_hf_config({**base, "max_position_embeddings": 8}, source="d.json")
    assert DrafterConfig.from_hf_config({**base, "block_size": 1024}).block_size == 1024


# ----------------------------------------------------------------------------- non-regular files


class _Hang(BaseException):
    pass


def _hang(signum, frame):
    raise _Hang


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "model.safetensors.index.json", "shard"])
def test_fifo_is_refused_not_hung(target_copy, tmp_path, name):
    if name == "shard":
        _shard(target_copy, lambda wm: None)
        name = "model-00002-of-00002.safetensors"
    elif name == "model.safetensors.index.json":
        os.remove(os.path.join(target_copy, "model.safetensors"))
    path = os.path.join(target_copy, name)
    if os.path.exists(path):
        os.remove(path)
    os.mkfifo(path)
    old = signal.signal(signal.SIGALRM, _hang)  # a read blocked on the FIFO is interrupted: the test fails
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        with pytest.raises((CheckpointError, ConfigError)) as info:
            load_target(target_copy)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert_names(info.value, path, "FIFO")


def test_folder_named_like_a_weights_file(target_copy):
    path = os.path.join(target_copy, "model.safetensors")
    os.remove(path)
    os.mkdir(path)
    with pytest.raises(CheckpointError, match="is a folder; expected a regular file") as info:
        load_target(target_copy)
    assert_names(info.value, path)


# ----------------------------------------------------------------------------- load_drafter(target=)


@pytest.mark.parametrize("target", ["target", {"config": None}, 3])
def test_load_drafter_target_not_a_model(target):
    with pytest.raises(ArgumentError, match="target") as info:
        load_drafter(DRAFTER_DIR, target=target)
    assert_names(info.value, "target", type(target).__name__)


def test_load_drafter_target_is_a_drafter(fixture_drafter):
    with pytest.raises(ArgumentError, match="target.*Drafter"):
        load_drafter(DRAFTER_DIR, target=fixture_drafter)


# ----------------------------------------------------------------------------- non-finite weights


@pytest.mark.parametrize("bad, kind", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
@pytest.mark.parametrize("stored", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_non_finite_weights(target_copy, bad, kind, stored):
    key = "model.layers.3.self_attn.v_proj.weight"

    def poison(t):
        t = {k: v.astype(stored) for k, v in t.items()}
        t[key] = t[key].copy()
        t[key][5, 7] = bad
        return t

    rewrite_tensors(target_copy, poison)
    with pytest.raises(CheckpointError, match=f"non-finite.*{kind}.*1 of .*\\[5, 7\\]") as info:
        load_target(target_copy)
    assert_names(info.value, os.path.join(target_copy, "model.safetensors"), key)


def test_overflow_when_converting_is_non_finite(target_copy):
    key = "model.layers.0.mlp.down_proj.weight"
    rewrite_tensors(target_copy, lambda t: t[key].__setitem__((1, 2), 1e6))  # beyond float16's 65504
    model = load_target(target_copy, dtype="float32")  # fine in float32
    assert float(np.asarray(model.layers[0].mlp.down_proj.kernel.get_value())[2, 1]) == 1e6
    with pytest.raises(CheckpointError, match="overflows.*float16") as info:
        load_target(target_copy, dtype="float16")
    assert_names(info.value, "model.safetensors", key)


def test_non_finite_drafter_weights(tmp_path, fixture_target):
    folder = copy_folder(DRAFTER_DIR, tmp_path / "drafter")
    key = "fc.weight"
    rewrite_tensors(folder, lambda t: t[key].__setitem__((0, 0), np.nan))
    with pytest.raises(CheckpointError, match="non-finite") as info:
        load_drafter(folder, target=fixture_target)
    assert_names(info.value, os.path.join(folder, "model.safetensors"), key)


def test_all_errors_are_value_errors_too():
    # generic handlers written against the built-in classes keep working
    for cls in (CheckpointError, ConfigError, ArgumentError, WriteError):
        assert issubclass(cls, sparkjax.SparkjaxError) and issubclass(cls, ValueError)
    assert issubclass(WriteError, CheckpointError)
