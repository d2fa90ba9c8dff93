"""Sharded loading: ``load_target`` / ``load_drafter`` with ``mesh=`` place every tensor straight on its
sharding, equal the unsharded load, and keep peak host memory at the model plus about one tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparkjax import load_drafter, load_target
from sparkjax.errors import ArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "tiny_dspark_b16")


def _run(code: str, *args: str, devices: int = 1, timeout: int = 300) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout


def test_mesh_argument_is_checked():
    with pytest.raises(ArgumentError, match="load_target: mesh must be a jax.sharding.Mesh.*got tuple"):
        load_target(os.path.join(FIXTURE, "target"), mesh=(2, 4))
    with pytest.raises(ArgumentError, match="load_drafter: mesh must be a jax.sharding.Mesh.*got str"):
        load_drafter(os.path.join(FIXTURE, "drafter"), mesh="data")


_SHARDED = r"""
import sys
import jax, numpy as np
from flax import nnx
from sparkjax import sharding as S
from sparkjax import load_drafter, load_target
from sparkjax import load_drafter, load_target
from sparkjax.errors import ArgumentError
from tests.conftest import make_hf_qwen3
assert len(jax.devices()) == 8
tmp, fixture = sys.argv[1], sys.argv[2]

def check(ref, got, mesh, what):
    a = dict(nnx.to_flat_state(nnx.state(ref, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(got, nnx.Param)))
    want = {k: (v.get_value() if isinstance(v, nnx.Variable) else v)
            for k, v in nnx.to_flat_state(S.param_shardings(ref, mesh))}
    assert a.keys() == b.keys() == want.keys()
    split = 0
    for k in a:
        x, y = a[k].get_value(), b[k].get_value()
        assert y.sharding.is_equivalent_to(want[k], y.ndim), (what, k, y.sharding, want[k])
        assert len(y.sharding.device_set) == 8, (what, k)
        full = int(np.prod(y.shape))
        shard = max(int(np.prod(s.data.shape)) for s in y.addressable_shards)
        if any(ax == "model" for ax in want[k].spec):
            assert shard * mesh.shape["model"] == full, (what, k, shard, full)  # no device holds it whole
            split += 1
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert x.dtype == y.dtype
    assert split > 0, what
    print(what, "OK", split)

# an HF Qwen3 whose 8 heads / 4 KV heads / FFN split over the model axis of a (2, 4) mesh
make_hf_qwen3(tmp, heads=8, kv_heads=4, hidden=64, ffn=128, head_dim=16, tied=False)
mesh = S.make_mesh(2, 4)
check(load_target(tmp), load_target(tmp, mesh=mesh), mesh, "hf-2x4")
check(load_target(tmp, dtype="bfloat16"), load_target(tmp, dtype="bfloat16", mesh=mesh), mesh, "hf-2x4-bf16")

# the bundled DSpark pair (2 KV heads): a (4, 2) mesh fits
mesh = S.make_mesh(4, 2)
t_ref = load_target(fixture + "/target")
t = load_target(fixture + "/target", mesh=mesh)
check(t_ref, t, mesh, "fixture-target-4x2")
check(load_drafter(fixture + "/drafter", target=t_ref), load_drafter(fixture + "/drafter", target=t, mesh=mesh),
      mesh, "fixture-drafter-4x2")
odd = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "tensor"))
# a (2, 4) mesh over the fixture's 2 KV heads, and a mesh without the rules' axis names: refused before any read
for mesh, parts in ((S.make_mesh(2, 4), ("k_proj", "has 2 along dimension 1", "size 4")),
                    (odd, ("('batch', 'tensor')",))):
    try:
        load_target(fixture + "/target", mesh=mesh)
    except ArgumentError as e:
        assert all(p in str(e) for p in parts), str(e)
    else:
        raise SystemExit(f"{mesh} was accepted")
print("SHARDED-LOAD-OK")
"""


@pytest.mark.slow
def test_sharded_load_equals_unsharded_on_8_cpu_devices(tmp_path):
    """(2, 4) and (4, 2) meshes of 8 CPU devices: every parameter has the rules' sharding, heads / FFN are split over
    ``model``, values equal the unsharded load; a mesh that does not fit is a named ArgumentError."""
    out = _run(_SHARDED, str(tmp_path / "hf"), FIXTURE, devices=8)
    assert "SHARDED-LOAD-OK" in out, out
    for what in ("hf-2x4", "hf-2x4-bf16", "fixture-target-4x2", "fixture-drafter-4x2"):
        assert f"{what} OK" in out


_WRITE = r"""
import json, os, sys
import numpy as np
import jax.numpy as jnp
from flax import nnx
from sparkjax.config import Qwen3Config
from sparkjax.io.keymaps import QWEN3_KEYS, _checkpoint_shape, param_keys
from sparkjax.io.safetensors import write_safetensors
from sparkjax.nn.qwen3 import Qwen3
folder = sys.argv[1]
# 24 layers of ~6.7 MB: the model is ~80 times its largest tensor (2 MB)
cfg = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=2048, num_hidden_layers=24,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
state = nnx.state(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)))
flat = dict(nnx.to_flat_state(state))
rng = np.random.default_rng(0)
tensors = {key: rng.standard_normal(_checkpoint_shape(lay, tuple(flat[p].get_value().shape)), np.float32) * 0.02
           for p, key, lay in param_keys(state, QWEN3_KEYS)}
os.makedirs(folder)
with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg.to_hf_dict(), f)
write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
sizes = [v.nbytes for v in tensors.values()]
print(json.dumps({"model": sum(sizes), "largest": max(sizes)}))
"""

_LOAD = r"""
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from sparkjax import load_target

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

mesh = None
if sys.argv[2] != "none":
    from sparkjax.sharding import make_mesh
    mesh = make_mesh(*map(int, sys.argv[2].split("x")))
jnp.ones(3).block_until_ready()  # the runtime is up before the baseline
base = status("VmRSS")
model = load_target(sys.argv[1], mesh=mesh)
leaves = jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
print(json.dumps({"growth": status("VmHWM") - base, "device": device}))
"""


def _peak(folder, mesh: str, devices: int) -> dict:
    return json.loads(_run(_LOAD, str(folder), mesh, devices=devices).strip().splitlines()[-1])


def _rss_model(tmp_path) -> tuple[str, dict]:
    folder = tmp_path / "big"
    sizes = json.loads(_run(_WRITE, str(folder)).strip().splitlines()[-1])
    assert sizes["model"] > 50 * sizes["largest"], sizes
    return str(folder), sizes


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS is read from /proc/self/status")
def test_load_peak_host_memory_is_model_plus_about_one_tensor(tmp_path):
    """Loading a 170 MB float32 model (largest tensor 2 MB) grows peak RSS by the model plus a small margin, far
    below a second full copy (mapped pages kept resident, or the whole model converted on the host)."""
    folder, sizes = _rss_model(tmp_path)
    got = _peak(folder, "none", 1)
    assert got["device"] == sizes["model"], (got, sizes)
    limit = sizes["model"] + 0.3 * sizes["model"]
    assert got["growth"] < limit, (
        f"peak RSS grew by {got['growth'] / 2**20:.0f} MiB loading a {sizes['model'] / 2**20:.0f} MiB model "
        f"(largest tensor {sizes['largest'] / 2**20:.0f} MiB); limit {limit / 2**20:.0f} MiB")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS is read from /proc/self/status")
def test_sharded_load_peak_host_memory_on_8_cpu_devices(tmp_path):
    """The same model onto a (4, 2) mesh of 8 CPU devices (the host's memory): peak RSS grows by the devices'
    copies and a small margin, not a second model."""
    folder, sizes = _rss_model(tmp_path)
    got = _peak(folder, "4x2", 8)
    assert got["device"] >= sizes["model"], (got, sizes)
    limit = got["device"] + 0.3 * sizes["model"]
    assert got["growth"] < limit, (
        f"peak RSS grew by {got['growth'] / 2**20:.0f} MiB for {got['device'] / 2**20:.0f} MiB of device copies "
        f"of a {sizes['model'] / 2**20:.0f} MiB model; limit {limit / 2**20:.0f} MiB")
