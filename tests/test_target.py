"""The Qwen3 target: parity with transformers and with the upstream fixture, cache, greedy decoding."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import sparkjax
from sparkjax import generate, load_target, save_target
from sparkjax.engine.programs import spec_program as _spec_program
from sparkjax.reference import ancestor_mask
from tests.conftest import jit_call, jit_exact


def _hf_outputs(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


def _run(target, ids_rows):
    """Our forward over right-padded rows; returns per-row logits and all hidden states (ids -1..L-1)."""
    n_layers = target.config.num_hidden_layers
    width = max(len(r) for r in ids_rows)
    tokens = np.zeros((len(ids_rows), width), np.int32)
    for b, r in enumerate(ids_rows):
        tokens[b, : len(r)] = r
    pos = np.broadcast_to(np.arange(width), tokens.shape)
    out = jit_call(target, jnp.asarray(tokens), jnp.asarray(pos), hidden_layers=tuple(range(-1, n_layers)))
    return np.asarray(out.logits), [np.asarray(h) for h in out.hidden]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tied=True, heads=4, kv_heads=2),
        dict(tied=False, heads=4, kv_heads=4, max_shard_size="50KB"),  # sharded, with an index file
        dict(tied=False, heads=8, kv_heads=2, attention_bias=True),
    ],
    ids=["tied-gqa2", "untied-gqa1-sharded", "untied-gqa4-bias"],
)
def test_parity_with_transformers(hf_factory, kwargs):
    folder, hf = hf_factory(**kwargs)
    if "max_shard_size" in kwargs:
        assert os.path.exists(folder / "model.safetensors.index.json")
        assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    target = load_target(folder)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 160, n).tolist() for n in (11, 5, 8)]  # a batch of different lengths
    logits, hidden = _run(target, rows)
    for b, r in enumerate(rows):
        ref_logits, ref_hidden = _hf_outputs(hf, r)
        np.testing.assert_allclose(logits[b, : len(r)], ref_logits, atol=1e-4, rtol=1e-4)
        assert len(ref_hidden) == len(hidden)
        for ours, theirs in zip(hidden, ref_hidden, strict=True):
            np.testing.assert_allclose(ours[b, : len(r)], theirs, atol=1e-4, rtol=1e-4)


def test_fixture_target_matches_upstream(fixture_target, ref):
    ids = ref["a.prompt_ids"][0].tolist()
    logits, hidden = _run(fixture_target, [ids])
    np.testing.assert_allclose(logits[0], ref["a.target_logits"][0], atol=1e-4, rtol=1e-4)
    for i, h in enumerate(hidden):
        np.testing.assert_allclose(h[0], ref["a.target_hidden_states"][i, 0], atol=1e-4, rtol=1e-4)
    prompt = ref["a.prompt_ids"]
    expected = ref["c.ar_output_ids"][0, prompt.shape[1]:].tolist()
    out = generate(fixture_target, None, prompt, method="ar", max_new_tokens=len(expected))
    assert out.tokens == [expected]
    assert out.acceptance_lengths == [[1] * (len(expected) - 1)]  # the prefill's token, then one per step


def test_prefill_then_cached_steps_equal_full_forward(fixture_target):
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 300, 20), rng.integers(0, 300, 20)]
    tokens = np.stack(rows).astype(np.int32)
    pos = np.broadcast_to(np.arange(20, dtype=np.int32), (2, 20))
    full = jit_call(fixture_target, tokens, pos, hidden_layers=(1, 3))
    full_logits, full_h3 = np.asarray(full.logits), np.asarray(full.hidden[1])
    # prefill 12 tokens for row 0 and 9 for row 1, then feed the rest one at a time
    lengths = np.array([12, 9], np.int32)
    # the two prefill paths run the same ops, so the cache they write is bit-identical when both are compiled the
    # same way: one program holds both, compiled with the suite's XLA options whatever XLA_FLAGS says (XLA's
    # default fusion, as in CI's second pass, rounds the two attention shapes differently)
    out, fresh = jit_exact(lambda m, t, p: (m(t, p, cache=m.init_cache(2, 32)),
                                            m(t, p, cache=m.init_cache(2, 32), fresh_cache=True)),
                           fixture_target, tokens[:, :12], pos[:, :12])
    np.testing.assert_allclose(np.asarray(fresh.logits), np.asarray(out.logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(fresh.cache.k), np.asarray(out.cache.k))
    cache = out.cache.with_lengths(lengths)
    got = {b: [] for b in range(2)}
    for _ in range(8):
        now = np.asarray(cache.lengths)
        cur = np.take_along_axis(tokens, now[:, None], axis=1)
        step = jit_call(fixture_target, cur, now[:, None], cache=cache, hidden_layers=(1, 3))
        step_logits, step_h3 = np.asarray(step.logits), np.asarray(step.hidden[1])
        for b in range(2):
            got[b].append((int(now[b]), step_logits[b, 0], step_h3[b, 0]))
        cache = step.cache.with_lengths(now + 1)
    for b in range(2):
        for p, logit, h3 in got[b]:
            np.testing.assert_allclose(logit, full_logits[b, p], atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(h3, full_h3[b, p], atol=1e-4, rtol=1e-4)


def test_tree_mask_block_equals_per_path_causal(fixture_target):
    """An arbitrary node-to-node mask on a cached block: each node sees the prefix and its ancestors."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 300, 10)
    vis = ancestor_mask(np.array([0, 1, 0, 1]))  # a small tree: 0 <- 1 <- 2, 0 <- 3, 1 <- 4
    depth = vis.sum(1) - 1
    node_tok = rng.integers(0, 300, 5)
    cache = fixture_target.init_cache(1, 32)
    pre = jit_call(fixture_target, jnp.asarray(prefix[None], jnp.int32), jnp.arange(10)[None], cache=cache)
    cache = pre.cache.with_lengths(jnp.array([10]))
    out = jit_call(fixture_target, jnp.asarray(node_tok[None], jnp.int32), jnp.asarray(10 + depth)[None], cache=cache,
                   mask=jnp.asarray(vis))
    # the reference: each node's root-to-node path after the prefix as its own causal sequence, right-padded
    # into one batch (causal attention: the padding after a row's last token does not change its logits)
    seqs = [np.concatenate([prefix, node_tok[[j for j in range(5) if vis[i, j]]]]) for i in range(5)]
    rows = np.zeros((5, max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        rows[i, : len(seq)] = seq
    ref = jit_call(fixture_target, jnp.asarray(rows), jnp.broadcast_to(jnp.arange(rows.shape[1]), rows.shape))
    for i, seq in enumerate(seqs):
        np.testing.assert_allclose(np.asarray(out.logits[0, i]), np.asarray(ref.logits[i, len(seq) - 1]),
                                   atol=1e-4, rtol=1e-4)


def test_compact_moves_selected_rows(fixture_target):
    k = np.arange(2 * 6 * 2 * 16, dtype=np.float32).reshape(2, 6, 2, 16)

    @jax.jit  # one program (integer-valued rows, moved exactly as op by op)
    def write_and_compact(k):
        cache = fixture_target.init_cache(2, 16).with_lengths(jnp.array([3, 5]))
        for layer in range(len(cache.k)):
            cache = cache.write_layer(layer, k, -k)
        return cache, cache.compact(jnp.array([3, 5]), jnp.array([[0, 2, 5], [1, 0, 0]]), jnp.array([3, 1]))

    cache, out = jax.tree.map(np.asarray, write_and_compact(k))
    np.testing.assert_array_equal(out.lengths, [6, 6])
    # heads-major [B, K, S, H] cache, token-major [B, T, K, H] rows
    np.testing.assert_array_equal(out.k[0][0, :, 3:6], np.swapaxes(k[0, [0, 2, 5]], 0, 1))
    np.testing.assert_array_equal(out.v[2][1, :, 5], -k[1, 1])
    np.testing.assert_array_equal(out.k[1][0, :, :3], cache.k[1][0, :, :3])  # the committed prefix is untouched
    np.testing.assert_array_equal(out.k[1][1, :, 8:11], cache.k[1][1, :, 8:11])  # rows past the moved window untouched


def test_greedy_equals_transformers_generate_with_eos(hf_factory):
    folder, hf = hf_factory(tied=True, heads=4, kv_heads=2)
    target = load_target(folder)
    prompts = [[5, 17, 42, 8, 99, 23, 7], [11, 2, 150, 64]]
    refs = []
    for p in prompts:
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        refs.append(g[0, len(p):].tolist())
    ours = generate(target, None, prompts, max_new_tokens=24)
    assert ours.tokens == refs
    # EOS: stop each sequence at the first occurrence of a token from its greedy output
    eos = refs[0][9]
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                        pad_token_id=0)
    expected = g[0, len(prompts[0]):].tolist()
    assert expected[-1] == eos and len(expected) <= 10
    out = generate(target, None, prompts, max_new_tokens=24, eos_token_ids=[eos])
    assert out.tokens[0] == expected
    cut = refs[1][: refs[1].index(eos) + 1] if eos in refs[1] else refs[1]
    assert out.tokens[1] == cut


def test_ar_program_buckets_and_greedy_draws_no_random_bits(fixture_target):
    """Prompts of one bucket share one compilation. At temperature 0 ``ar``'s round (the general round with no
    draft and no node) splits no key; at temperature > 0 it does draw."""
    generate(fixture_target, None, [[1, 2, 3, 4, 5]], max_new_tokens=8)
    before = _spec_program._cache_size()
    generate(fixture_target, None, [[9, 8, 7, 6, 5, 4, 3, 2, 1]], max_new_tokens=7)
    assert _spec_program._cache_size() == before
    from sparkjax.engine import api

    texts = {}
    for temperature in (0.0, 0.7):
        run = api.validate(fixture_target, None, [[1, 2, 3]], max_new_tokens=4, temperature=temperature)
        graphdefs, states = run.split(fixture_target)
        texts[temperature] = _spec_program.lower(graphdefs, states, *run.device_args(), None, plan=run.plan,
                                                 cache_size=run.cache_size, buf_len=run.buf_len).as_text()
    assert "threefry" not in texts[0.0] and "threefry" in texts[0.7]
    greedy = generate(fixture_target, None, [[1, 2, 3]], max_new_tokens=8).tokens
    assert generate(fixture_target, None, [[1, 2, 3]], max_new_tokens=8, seed=5).tokens == greedy  # key unused


@pytest.mark.slow  # builds the 36-layer module trees of both libraries (shapes only)
def test_qwen3_4b_parameter_count_matches_transformers(fixture_dir):
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from sparkjax.nn.qwen3 import Qwen3

    path = fixture_dir / "configs" / "qwen3_4b_target_config.json"
    cfg = sparkjax.Qwen3Config.from_hf_config(path)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    with open(path) as f:
        raw = json.load(f)
    from transformers import Qwen3Config as HFConfig

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(HFConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    theirs = sum(p.numel() for p in hf.parameters())
    assert ours == theirs
    assert ours > 4_000_000_000


def test_bf16_safetensors_round_trip(tmp_path, fixture_target):
    save_target(fixture_target, tmp_path / "bf16", dtype="bfloat16")
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    back = load_target(tmp_path / "bf16")
    assert back.dtype == jnp.bfloat16
    want = np.asarray(fixture_target.layers[2].mlp.up_proj.kernel[...]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(back.layers[2].mlp.up_proj.kernel[...]), want)
    # transformers reads what we wrote, and a float32 load of it matches the bf16 weights exactly
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    w = hf.model.layers[2].mlp.up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(w.T, want.astype(np.float32))
    again = load_target(tmp_path / "bf16", dtype="float32")
    assert again.dtype == jnp.float32
    # the written folder and files get the usual permissions (not mkdtemp's / mkstemp's 0700 / 0600)
    old = os.umask(0o022)
    try:
        save_target(fixture_target, tmp_path / "perm")
    finally:
        os.umask(old)
    assert (tmp_path / "perm").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "perm" / "model.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_orbax_checkpoint_round_trip(tmp_path, fixture_target):
    from sparkjax.io.checkpoint import restore_model, save_model

    save_model(fixture_target, tmp_path / "ck")
    back = restore_model(tmp_path / "ck")
    ids = jnp.arange(12)[None]
    np.testing.assert_array_equal(np.asarray(jit_call(back, ids, ids).logits),
                                  np.asarray(jit_call(fixture_target, ids, ids).logits))


def _edit_config(fn):
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        fn(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def _edit_weights(fn):
    def edit(folder):
        tensors = load_file(str(folder / "model.safetensors"))
        fn(tensors)
        save_file(tensors, str(folder / "model.safetensors"))

    return edit


def _truncate(folder):
    path = folder / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 1000)


UP = "model.layers.2.mlp.up_proj.weight"
ROPE = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}


@pytest.mark.parametrize("edit, error, pattern", [
    (_edit_config(lambda c: c.pop("hidden_size")), sparkjax.ConfigError, r"config\.json.*hidden_size"),
    (_edit_config(lambda c: c.update(rope_parameters=ROPE)), sparkjax.ConfigError, "yarn"),
    (_edit_config(lambda c: c.update(rope_scaling=ROPE)), sparkjax.ConfigError, "yarn"),
    (_edit_weights(lambda t: t.__setitem__(UP, t[UP][:-1])), sparkjax.CheckpointError,
     r"model\.safetensors.*up_proj.*\[127, 64\].*\[128, 64\]"),
    (_edit_weights(lambda t: t.pop("model.layers.4.self_attn.k_norm.weight")), sparkjax.CheckpointError,
     r"missing tensor 'model\.layers\.4\.self_attn\.k_norm"),
    (_edit_weights(lambda t: t.__setitem__("model.layers.9.extra.weight", np.zeros(3, np.float32))),
     sparkjax.CheckpointError, r"model\.safetensors.*unexpected tensor 'model\.layers\.9"),
    (_truncate, sparkjax.CheckpointError, r"model\.safetensors.*truncated"),
], ids=["missing-field", "rope-parameters", "rope-scaling", "wrong-shape", "missing", "unexpected", "truncated"])
def test_bad_target_folder(tmp_path, fixture_dir, edit, error, pattern):
    folder = tmp_path / "t"
    shutil.copytree(fixture_dir / "target", folder)
    edit(folder)
    with pytest.raises(error, match=pattern):
        load_target(folder)


def test_sliding_window_and_other_architectures_rejected(fixture_dir):
    base = json.loads((fixture_dir / "target" / "config.json").read_text())
    for pattern, edit in [("sliding", {"use_sliding_window": True}), ("model_type", {"model_type": "llama"}),
                          ("layer_types", {"layer_types": ["sliding_attention"] * 6})]:
        with pytest.raises(sparkjax.ConfigError, match=pattern):
            sparkjax.Qwen3Config.from_hf_config({**base, **edit})
    # older transformers: top-level rope_theta
    old = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 5e5}
    assert sparkjax.Qwen3Config.from_hf_config(old).rope_theta == 5e5


def test_failed_conversion_leaves_no_output(tmp_path, fixture_dir, monkeypatch):
    import orbax.checkpoint as ocp

    from convert.hf_to_orbax import main as convert_main

    def boom(self, *a, **k):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", boom)
    out = tmp_path / "out" / "model"
    with pytest.raises(sparkjax.CheckpointError, match="simulated"):
        convert_main([str(fixture_dir / "target"), str(out)])
    assert not out.exists()
    assert os.listdir(tmp_path / "out") == []
    monkeypatch.undo()
    assert convert_main([str(fixture_dir / "target"), str(out)]) == 0
    assert (out / "sparkjax.json").exists()


def test_generate_bad_arguments(fixture_target):
    for pattern, prompts, kw in [
        ("empty prompt", [[1, 2], []], dict(max_new_tokens=4)),
        ("max_position_embeddings", [[1] * 1000], dict(max_new_tokens=100)),
        ("cache_size", [[1] * 40], dict(max_new_tokens=4, cache_size=32)),
        ("temperature", [[1, 2]], dict(max_new_tokens=4, temperature=-1)),
        ("vocab", [[1, 400]], dict(max_new_tokens=4)),
        ("method", [[1, 2]], dict(method="beam-search")),
    ]:
        with pytest.raises(sparkjax.ArgumentError, match=pattern):
            generate(fixture_target, None, prompts, **kw)


@pytest.mark.slow
def test_sharded_forward_on_8_cpu_devices():
    """Tensor + data parallel over a (2, 4) mesh of virtual CPU devices equals the single-device forward."""
    import subprocess
    import sys

    code = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from sparkjax.config import Qwen3Config
from sparkjax.nn.qwen3 import Qwen3
from sparkjax import sharding as S
assert len(jax.devices()) == 8
cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=16)
m = Qwen3(cfg, rngs=nnx.Rngs(0))
ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 128)
pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
def fwd(g, s, ids, pos):
    model = nnx.merge(g, s)
    out = model(ids, pos, cache=model.init_cache(2, 16), hidden_layers=(0,))
    return out.logits, out.hidden[0], out.cache.k
g, s = nnx.split(m)
ref = jax.jit(fwd, static_argnums=0)(g, s, ids, pos)
mesh = S.make_mesh(2, 4)
S.shard_model(m, mesh)
g, s = nnx.split(m)
specs = {str(x.sharding.spec) for x in jax.tree.leaves(s)}
assert "PartitionSpec(None, 'model')" in specs or "P(None, 'model')" in specs, specs
bs = S.batch_sharding(mesh, 2)
out = jax.jit(fwd, static_argnums=0)(g, s, jax.device_put(ids, bs), jax.device_put(pos, bs))
assert len(out[0].sharding.device_set) == 8
for a, b in zip(ref, out):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
print("SHARDED-OK")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SHARDED-OK" in res.stdout
