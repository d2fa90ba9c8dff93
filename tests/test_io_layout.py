"""The io package layout: orbax in one module, the one pair check, KV cache shardings on a CPU mesh."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import sparkjax
from sparkjax.config import DrafterConfig, Qwen3Config
from sparkjax.errors import ArgumentError, IncompatiblePairError
from sparkjax.pairing import check_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
DRAFTER = DrafterConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, kind="dspark",
                        block_size=4, target_layer_ids=(1, 3), mask_token_id=5, num_target_layers=6)


def test_only_the_checkpoint_module_imports_orbax():
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "sparkjax")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    if any(line.lstrip().startswith(("import orbax", "from orbax")) for line in f):
                        found.append(os.path.relpath(path, ROOT))
    assert found == [os.path.join("sparkjax", "io", "checkpoint.py")]


@pytest.mark.parametrize("change, pattern", [
    ({"hidden_size": 32, "head_dim": 8}, r"hidden_size: drafter vs target hidden_size 32 vs 64"),
    ({"vocab_size": 256}, r"vocab_size: .*vocab_size 256 vs 128"),
    ({"target_layer_ids": (1, 5)}, r"target_layer_ids: entry 5 is the target's final layer"),
    ({"target_layer_ids": (1, 7)}, r"target_layer_ids: entry 7 of target_layer_ids \[1, 7\] is outside \[-1, 4\]"),
    ({"num_target_layers": 8}, r"num_target_layers: drafter expects 8 target layers, target has 6"),
])
def test_check_pair_names_the_field_and_both_sources(change, pattern):
    bad = dataclasses.replace(DRAFTER, **change)
    with pytest.raises(IncompatiblePairError, match=pattern) as info:
        check_pair(TARGET, bad, target_source="t/config.json", drafter_source="d/config.json")
    assert str(info.value).startswith("drafter d/config.json does not fit target t/config.json: ")
    check_pair(TARGET, DRAFTER)  # the unchanged pair fits


def test_check_pair_mask_token_outside_a_smaller_target_vocabulary():
    small = dataclasses.replace(TARGET, vocab_size=4)
    drafter = dataclasses.replace(DRAFTER, vocab_size=4, mask_token_id=5)  # not validated by the config itself
    with pytest.raises(IncompatiblePairError, match=r"mask_token_id: 5 is outside the target vocabulary \[0, 4\)"):
        check_pair(small, drafter)


def test_check_pair_stored_table_shapes_and_models():
    from flax import nnx

    from sparkjax.nn.drafter import Drafter
    from sparkjax.nn.qwen3 import Qwen3

    with pytest.raises(IncompatiblePairError, match=r"tensor 'lm_head.weight' in d/model.safetensors has "
                                                    r"shape \[129, 64\], the target's is \[128, 64\]"):
        check_pair(TARGET, DRAFTER, drafter_tensors={"embed_tokens.weight": ((128, 64), "d/model.safetensors"),
                                                     "lm_head.weight": ((129, 64), "d/model.safetensors")})
    target = nnx.eval_shape(lambda: Qwen3(TARGET, rngs=nnx.Rngs(0)))
    drafter = nnx.eval_shape(lambda: Drafter(DRAFTER, rngs=nnx.Rngs(0)))
    check_pair(target, drafter)
    with pytest.raises(IncompatiblePairError, match="drafter <drafter config> does not fit target <target model>: "
                                                    "num_target_layers"):
        check_pair(target, dataclasses.replace(DRAFTER, num_target_layers=3))
    with pytest.raises(ArgumentError, match="target: expected a Qwen3 target"):
        check_pair(drafter, target)  # swapped
    with pytest.raises(ArgumentError, match="target: expected"):
        check_pair(DRAFTER, DRAFTER)  # a drafter config is not a target config
    with pytest.raises(ArgumentError, match="drafter: expected a drafter"):
        check_pair(TARGET, TARGET)


@pytest.mark.slow  # a subprocess on 8 CPU devices, like the other mesh checks
def test_io_without_orbax_and_kv_cache_shardings_on_8_cpu_devices():
    """Importing sparkjax.io does not import orbax; the cache's own shardings split batch over data and kv heads over
    model."""
    code = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, sparkjax, sparkjax.io, sparkjax.io.hf, sparkjax.io.atomic
from sparkjax import sharding as S
from sparkjax.cache import KVCache
assert "orbax" not in sys.modules, "sparkjax.io imported orbax"
assert len(jax.devices()) == 8
mesh = S.make_mesh(2, 4)
cache = KVCache.zeros(3, 4, 16, 4, 8)
sh = cache.shardings(mesh)
assert len(sh.k) == len(sh.v) == 3
assert tuple(sh.k[0].spec) == ("data", "model", None, None), sh.k[0].spec
assert tuple(sh.lengths.spec) == ("data",), sh.lengths.spec
placed = jax.device_put(cache, sh)
shard = placed.k[1].addressable_shards[0].data.shape
assert shard == (2, 1, 16, 8), shard
assert len(placed.lengths.sharding.device_set) == 8
rules = {**S.DEFAULT_RULES, "kv_heads": None}
assert tuple(cache.shardings(mesh, rules).v[2].spec) == ("data", None, None, None)
print("CACHE-SHARDED-OK")
"""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "CACHE-SHARDED-OK" in res.stdout


def test_public_loaders_still_reachable():
    assert sparkjax.load_target is sparkjax.io.load_target
    assert callable(sparkjax.io.save_model)
