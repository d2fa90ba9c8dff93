"""sparkjax.io.safetensors and the loaders over it, fuzzed: truncations, byte flips and JSON header mutations of a
valid safetensors file and of the fixture target's, and random config values, end in success or a SparkjaxError:
never a hang (each example runs under an alarm), never another exception. ``SPARKJAX_FUZZ_EXAMPLES=2000`` makes a
longer run. The hand-built broken headers are in test_io_hf.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjax import load_target
from sparkjax.config import DrafterConfig, Qwen3Config
from sparkjax.errors import SparkjaxError
from sparkjax.io.safetensors import SafetensorsFile, write_safetensors

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny_dspark_b16")
EXAMPLES = int(os.environ.get("SPARKJAX_FUZZ_EXAMPLES", "60"))
ALARM_S = 20  # far above the slowest example (a full load of the tiny target)

FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Hang(BaseException):
    """Raised by the alarm: an example ran past ALARM_S (BaseException so no loader can swallow it)."""


def _hang(signum, frame):
    raise Hang(f"no result after {ALARM_S}s")


def outcome(fn) -> str:
    """Runs fn; "ok" or "error" (a SparkjaxError). Any other exception, or a hang, fails the test."""
    old = signal.signal(signal.SIGALRM, _hang)
    signal.setitimer(signal.ITIMER_REAL, ALARM_S)
    try:
        fn()
    except SparkjaxError:
        return "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return "ok"


LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
JSON = st.recursive(
    LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8,
)
INT_LIKE = st.one_of(
    st.integers(-3, 70), st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.booleans(), st.none(),
)
DTYPE = st.one_of(
    st.sampled_from(["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
                     "F8_E4M3", "U64", "f32", ""]),
    JSON,
)
FIELD_VALUE = {
    "dtype": DTYPE,
    "shape": st.one_of(st.lists(INT_LIKE, max_size=4), JSON),
    "data_offsets": st.one_of(st.lists(INT_LIKE, max_size=3), st.tuples(INT_LIKE, INT_LIKE).map(list), JSON),
}

MUTATION = st.one_of(
    st.sampled_from(sorted(FIELD_VALUE)).flatmap(
        lambda field: st.tuples(st.just("set"), st.integers(0, 10**6), st.just(field), FIELD_VALUE[field])),
    st.tuples(st.just("del"), st.integers(0, 10**6), st.sampled_from(sorted(FIELD_VALUE))),
    st.tuples(st.just("extra"), st.integers(0, 10**6), st.text(max_size=6), JSON),
    st.tuples(st.just("entry"), st.integers(0, 10**6), JSON),
    st.tuples(st.just("newkey"), st.text(max_size=10), JSON),
    st.tuples(st.just("copy"), st.integers(0, 10**6), st.text(max_size=10)),  # aliases another entry's bytes
    st.tuples(st.just("metadata"), JSON),
    st.tuples(st.just("whole"), JSON),
)


def mutate_header(header: dict, mutation) -> object:
    keys = [k for k in header if k != "__metadata__"] or ["x"]
    op = mutation[0]
    if op == "whole":
        return mutation[1]
    if op == "metadata":
        header["__metadata__"] = mutation[1]
        return header
    if op == "newkey":
        header[mutation[1]] = mutation[2]
        return header
    key = keys[mutation[1] % len(keys)]
    entry = header.get(key)
    if op == "entry":
        header[key] = mutation[2]
    elif op == "copy":
        header[mutation[2]] = json.loads(json.dumps(entry))
    elif isinstance(entry, dict):
        if op == "set":
            entry[mutation[2]] = mutation[3]
        elif op == "del":
            entry.pop(mutation[2], None)
        elif op == "extra":
            entry[mutation[2]] = mutation[3]
    return header


@st.composite
def corruptions(draw, size: int, header_end: int):
    """A recipe: header mutations, a wrong length field, byte flips, a truncation (one kind or all)."""
    kind = draw(st.sampled_from(["header", "header", "header", "flips", "truncate", "length", "all"]))
    some = {k: kind in (k, "all") for k in ("header", "flips", "truncate", "length")}
    return dict(
        mutations=draw(st.lists(MUTATION, min_size=1, max_size=3)) if some["header"] else [],
        length_delta=draw(st.one_of(st.integers(-16, 16), st.sampled_from([2**63, 2**64 - 1 - header_end])))
        if some["length"] else 0,
        flips=draw(st.lists(st.tuples(st.one_of(st.integers(0, header_end - 1), st.integers(0, size - 1)),
                                      st.integers(1, 255)), min_size=1, max_size=4)) if some["flips"] else [],
        truncate=draw(st.integers(0, size)) if some["truncate"] else None,
    )


def corrupt(data: bytes, recipe: dict) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    if recipe["mutations"]:
        for m in recipe["mutations"]:
            header = mutate_header(header, m) if isinstance(header, dict) else header
        blob = json.dumps(header).encode()  # NaN / Infinity literals included, as a hostile writer would
    else:
        blob = data[8 : 8 + n]
    length = (len(blob) + recipe["length_delta"]) % 2**64
    out = bytearray(struct.pack("<Q", length) + blob + body)
    for pos, xor in recipe["flips"]:
        if pos < len(out):
            out[pos] ^= xor
    if recipe["truncate"] is not None:
        del out[recipe["truncate"] :]
    return bytes(out)


def _header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("fuzz_small") / "valid.safetensors"
    write_safetensors(path, {
        "a": rng.standard_normal((2, 3)).astype(np.float32),
        "b": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
        "c": np.arange(4, dtype=np.int32),
        "empty": np.zeros((0, 3), np.float16),
        "scalar": np.array(7, np.uint8),
        "d": rng.standard_normal((3, 2)).astype(np.float64),
    }, {"format": "pt"})
    assert sorted(SafetensorsFile(path).keys()) == ["a", "b", "c", "d", "empty", "scalar"]  # a valid start
    return path.read_bytes()


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    folder = shutil.copytree(os.path.join(FIXTURE, "target"), tmp_path_factory.mktemp("fuzz_target") / "target")
    return folder, (folder / "model.safetensors").read_bytes()


@FUZZ
@given(recipe=st.data())
def test_fuzz_safetensors_file(small_file, tmp_path_factory, recipe):
    path = tmp_path_factory.getbasetemp() / "fuzz_small_case.safetensors"
    path.write_bytes(corrupt(small_file, recipe.draw(corruptions(len(small_file), _header_end(small_file)))))

    def read_all():
        f = SafetensorsFile(path)
        for key in f.keys():
            x = f.get(key)
            assert x.shape == f.shape(key)
            np.asarray(x).tobytes()  # touch every byte of every tensor

    outcome(read_all)


@FUZZ
@given(recipe=st.data())
def test_fuzz_target_folder(target_folder, recipe):
    folder, data = target_folder
    (folder / "model.safetensors").write_bytes(corrupt(data, recipe.draw(corruptions(len(data), _header_end(data)))))
    outcome(lambda: load_target(folder))


def test_fuzz_untouched_inputs_load(small_file, target_folder, tmp_path):
    # the mutations start from valid inputs: with an empty recipe both load
    empty = dict(mutations=[], length_delta=0, flips=[], truncate=None)
    path = tmp_path / "same.safetensors"
    path.write_bytes(corrupt(small_file, empty))
    assert path.read_bytes() == small_file
    assert outcome(lambda: [SafetensorsFile(path).get(k) for k in SafetensorsFile(path).keys()]) == "ok"
    folder, data = target_folder
    (folder / "model.safetensors").write_bytes(corrupt(data, empty))
    assert outcome(lambda: load_target(folder)) == "ok"


TARGET_CONFIG = json.load(open(os.path.join(FIXTURE, "target", "config.json")))
DRAFTER_CONFIG = json.load(open(os.path.join(FIXTURE, "drafter", "config.json")))
CONFIG_VALUE = st.one_of(JSON, INT_LIKE, st.lists(st.sampled_from(["full_attention", "sliding_attention"]), max_size=8))


@FUZZ
@given(which=st.sampled_from(["target", "drafter"]),
       edits=st.lists(st.tuples(st.one_of(st.sampled_from(sorted(set(TARGET_CONFIG) | set(DRAFTER_CONFIG))),
                                          st.text(max_size=8)), st.one_of(st.just("<del>"), CONFIG_VALUE)),
                      min_size=1, max_size=4))
def test_fuzz_configs(which, edits):
    data = json.loads(json.dumps(TARGET_CONFIG if which == "target" else DRAFTER_CONFIG))
    for key, value in edits:
        if value == "<del>":
            data.pop(key, None)
        else:
            data[key] = value
    cls = Qwen3Config if which == "target" else DrafterConfig
    outcome(lambda: cls.from_hf_config(data, source="fuzz.json"))
