"""Generation on a device mesh: bad meshes, sharded == single-device token for token, the collectives of a
round, and two processes over one global mesh (jax.distributed, gloo on CPU)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from sparkjax.errors import ArgumentError

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = ("ar", "dflash", "dspark", "ddtree", "sparklingtree", "sparklingtree-beam", "auto")


# ----------------------------------------------------------------------------- bad meshes (one device)


def _one_device_mesh(names, axis_types=None):
    import jax
    from jax.sharding import AxisType, Mesh

    types = axis_types or (AxisType.Auto,) * len(names)
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names, axis_types=types)


def test_bad_meshes_are_refused(tiny_pair):
    from jax.sharding import AxisType

    from sparkjax import engine

    target, drafter = tiny_pair
    spec = dict(method="dspark", drafter=drafter)
    explicit = _one_device_mesh(("data", "model"), (AxisType.Explicit, AxisType.Auto))
    tp = _one_device_mesh(("batch", "tp"))
    for call, kw, mesh, words in (
        (engine.generate, spec, tp, r"axis names \('batch', 'tp'\).*unknown \('batch', 'tp'\)"),
        (engine.launch, {}, _one_device_mesh(("data", "x")), r".*unknown \('x',\)"),
        (engine.stream, spec, _one_device_mesh(("replica",)), r".*unknown \('replica',\)"),
        (engine.generate, spec, (2, 4), r"expected a jax.sharding.Mesh .* got .*tuple"),
        (engine.generate, {}, explicit, r"axes \('data',\) are not AxisType.Auto"),
    ):
        kw = {"drafter": None, **kw}
        with pytest.raises(ArgumentError, match="mesh: " + words):
            call(target, kw.pop("drafter"), [[1, 2, 3]], max_new_tokens=4, mesh=mesh, **kw)


@pytest.mark.slow
def test_one_device_mesh_gives_the_single_device_tokens(tiny_pair):
    """A (1, 1) mesh (or a data-only one) runs the placed program: same tokens as no mesh."""
    from sparkjax import engine
    from sparkjax.distributed_demo import tiny_prompts
    from sparkjax.sharding import make_mesh

    target, drafter = tiny_pair
    prompts = tiny_prompts(2)
    want = engine.generate(target, drafter, prompts, method="sparklingtree@8", max_new_tokens=10)
    got = engine.generate(target, drafter, prompts, method="sparklingtree@8", max_new_tokens=10,
                          mesh=make_mesh(1, 1))
    assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths
    streamed = [[] for _ in prompts]
    for step in engine.stream(target, drafter, prompts, method="sparklingtree@8", max_new_tokens=10,
                              mesh=make_mesh(1, 1)):
        for b, toks in enumerate(step):
            streamed[b] += toks
    assert streamed == want.tokens


# ----------------------------------------------------------------------------- 8 CPU devices (subprocesses)


def _env(xla_cache: str, devices: int | None = 8) -> dict[str, str]:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_cache, "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}" if devices else ""
    return env


def _demo(args: list[str], xla_cache: str, out: pathlib.Path, timeout: int = 600) -> dict:
    cmd = [sys.executable, "-m", "sparkjax.distributed_demo", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(xla_cache, None), timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single_device(tmp_path_factory, xla_cache):
    """Every method's tokens on one device (no mesh), batch 8, the demo's tiny pair."""
    out = tmp_path_factory.mktemp("mesh") / "single.json"
    return _demo(["--local-devices", "8", "--mesh", "1x1", "--batch", "8"], xla_cache, out)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1x8", "2x4", "8x1"])
def test_sharded_generation_equals_single_device(single_device, mesh, tmp_path, xla_cache):
    res = _demo(["--local-devices", "8", "--mesh", mesh, "--batch", "8"], xla_cache, tmp_path / "mesh.json")
    assert res["devices"] == 8 and res["mesh"] == [int(x) for x in mesh.split("x")]
    assert sorted(res["tokens"]) == sorted(METHODS) == sorted(single_device["tokens"])
    for method in METHODS:
        assert res["tokens"][method] == single_device["tokens"][method], method
        assert res["tokens"][method] == single_device["tokens"]["ar"], method  # greedy == the target's own
    lengths = {len(t) for t in res["tokens"]["ar"]}
    assert lengths == {12}  # every sequence ran the full budget (no early EOS hides a divergence)


ROUND_SCRIPT = textwrap.dedent("""
    import json
    import jax
    from sparkjax import engine
    from sparkjax.distributed_demo import tiny_pair, tiny_prompts
    from sparkjax.engine.api import round_hlo
    from sparkjax.engine.placement import collective_ops
    from sparkjax.errors import ArgumentError
    from sparkjax.sharding import make_mesh
    from sparkjax.config import Qwen3Config
    assert jax.device_count() == 8
    target, drafter = tiny_pair(0)
    prompts = tiny_prompts(8)
    res = {"layers": [target.config.num_hidden_layers, drafter.config.num_hidden_layers], "rounds": {},
           "errors": {}}
    for method in ("dflash", "dspark", "ddtree", "sparklingtree", "sparklingtree-beam", "pctree"):
        spec = f"{method}@8" if method in engine.TREE_METHODS else method
        for cache in (None, 512):
            text = round_hlo(target, drafter, prompts, mesh=make_mesh(2, 4), method=spec, max_new_tokens=12,
                             cache_size=cache)
            res["rounds"][f"{method}/{cache}"] = collective_ops(text)
    # bad meshes on 8 devices: the model axis does not divide the heads / KV heads, the batch the data axis
    six, six_kv = tiny_pair(0, heads=6, kv_heads=6), tiny_pair(0, heads=8, kv_heads=2)
    cases = {"heads": (six, make_mesh(2, 4), 8), "kv_heads": (six_kv, make_mesh(1, 4), 8),
             "batch": ((target, drafter), make_mesh(4, 2), 6)}
    for name, ((t, d), mesh, batch) in cases.items():
        try:
            engine.generate(t, d, tiny_prompts(batch), method="dspark", max_new_tokens=4, mesh=mesh)
            res["errors"][name] = None
        except ArgumentError as e:
            res["errors"][name] = str(e)
    # stream on a mesh yields generate's tokens
    mesh = make_mesh(2, 4)
    want = engine.generate(target, drafter, prompts, method="ddtree@8", max_new_tokens=12, mesh=mesh).tokens
    got = [[] for _ in prompts]
    for step in engine.stream(target, drafter, prompts, method="ddtree@8", max_new_tokens=12, mesh=mesh):
        for b, toks in enumerate(step):
            got[b] += toks
    res["stream_equal"] = got == want
    # sampling on the mesh draws the same tokens as one device (partitionable threefry keys)
    kw = dict(method="dspark", max_new_tokens=12, temperature=1.0, seed=3)
    one = engine.generate(target, drafter, prompts, **kw).tokens
    res["sampled_equal"] = engine.generate(target, drafter, prompts, mesh=mesh, **kw).tokens == one
    res["sampled_differs_from_greedy"] = one != engine.generate(target, drafter, prompts, method="dspark",
                                                               max_new_tokens=12).tokens
    print(json.dumps(res))
""")


@pytest.mark.slow
def test_round_collectives_bad_meshes_and_stream_on_8_devices(xla_cache):
    """One compiled round on a (2, 4) mesh holds only the tensor-parallel all-reduces: two per layer of the
    target and the drafter (attention output, MLP down projection, float), no all-gather of weights, cache or
    tree arrays, no collective-permute. A cache over 128 slots takes CPU's blocked attention, whose trip count
    (the last slot any sequence of the batch sees) adds one all-reduce of booleans over the data axis."""
    proc = subprocess.run([sys.executable, "-c", ROUND_SCRIPT], capture_output=True, text=True,
                          env=_env(xla_cache), timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    per_round = 2 * sum(res["layers"])
    for name, ops in res["rounds"].items():
        tensor_parallel = [t for kind, t in ops if kind == "all-reduce" and t.startswith("f32[")]
        live_bound = [t for kind, t in ops if kind == "all-reduce" and "pred[" in t]
        assert len(tensor_parallel) == per_round, (name, ops)
        if name.endswith("/512"):  # XLA combines the layers' bounds into one op; never more than one per layer
            assert 1 <= len(live_bound) <= res["layers"][0], (name, ops)
        else:
            assert not live_bound, (name, ops)
        assert len(ops) == len(tensor_parallel) + len(live_bound), (name, ops)  # nothing else
    errors = res["errors"]
    assert errors["heads"] and "model axis of size 4 does not divide the target's num_attention_heads (6)" \
        in errors["heads"]
    assert errors["kv_heads"] and "model axis of size 4 does not divide the target's num_key_value_heads (2)" \
        in errors["kv_heads"]
    assert errors["batch"] and "batch of 6 sequence(s) does not divide over the mesh's data axis of size 4" \
        in errors["batch"]
    assert res["stream_equal"]
    assert res["sampled_equal"] and res["sampled_differs_from_greedy"]


# ----------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path, xla_cache):
    """Two CPU processes of four devices each (jax.distributed.initialize, gloo) over one global (2, 4) mesh:
    the same tokens, and the same data-parallel training losses, as one process with eight devices."""
    common = ["--mesh", "2x4", "--batch", "8", "--methods", "ar,dspark,sparklingtree", "--train-steps", "2"]
    one = _demo(["--local-devices", "8", *common], xla_cache, tmp_path / "one.json")
    port = _free_port()
    out = tmp_path / "two.json"
    procs = []
    try:
        for pid in range(2):
            cmd = [sys.executable, "-m", "sparkjax.distributed_demo", "--local-devices", "4", *common,
                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid),
                   "--out", str(out)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=_env(xla_cache, None), cwd=ROOT))
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    two = json.loads(out.read_text())
    assert two["processes"] == 2 and two["devices"] == 8 and two["local_devices"] == 4
    assert two["collectives"] == "gloo"
    assert one["processes"] == 1 and one["devices"] == 8
    assert two["tokens"] == one["tokens"]
    assert len(two["train_losses"]) == 2 and np.all(np.isfinite(two["train_losses"]))
    np.testing.assert_allclose(two["train_losses"], one["train_losses"], rtol=1e-5)


def test_eval_mesh_flag():
    from sparkjax.errors import EvalError
    from sparkjax.eval.harness import eval_mesh

    assert eval_mesh(None) is None
    assert dict(eval_mesh("1x1").shape) == {"data": 1, "model": 1}
    for bad in ("2by2", "0x1", "2x", "x4"):
        with pytest.raises(EvalError, match="--mesh: expected DATAxMODEL"):
            eval_mesh(bad)
    with pytest.raises(EvalError, match=r"--mesh: make_mesh: data=64 x model=64 does not fit \d+ devices"):
        eval_mesh("64x64")
