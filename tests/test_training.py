"""Joint retraining of the DSpark drafter (sparkjax.training).

* parity with upstream DeepSpec's training forward and loss on the fixture (group e.*);
* learning works on the tiny pair; kill -9 + resume reproduces an uninterrupted run; damaged
  checkpoints fall back; config changes refuse to resume unless forced;
* data parallel on 8 CPU devices (subprocess) equals one device;
* export round trip, the block-7 -> block-16 reload, recipes, data pipeline and bad input;
* robustness: exports never replace user files, one run per output folder, output and data-cache problems are one
  clear error, a damaged checkpoint's fallback is one line, a resumed run keeps each metric step once, and the CLIs
  answer every mistake with one line and exit 2 (tiny settings: the fixture target, a 2-layer drafter, a few steps;
  a 2-layer 32-wide LM).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparkjax import load_drafter, save_drafter
from sparkjax.config import DrafterConfig, Qwen3Config
from sparkjax.errors import ArgumentError, CheckpointError, IncompatiblePairError, SparkjaxError
from sparkjax.io.checkpoint import TrainCheckpointer
from sparkjax.nn.drafter import Drafter
from sparkjax.nn.qwen3 import Qwen3
from sparkjax.training import (
    DataError,
    Objective,
    OptimConfig,
    TrainConfig,
    Trainer,
    TrainingError,
    export_run,
    load_jsonl,
    train,
)
from sparkjax.training import cli as train_cli
from sparkjax.training.anchors import anchor_candidates, anchors_from_uniforms, build_blocks, sample_anchors
from sparkjax.training.data import BatchStream, TokenData, as_batch, fixed_batches, precompute_features, synthetic_data
from sparkjax.training.drafter import build_models
from sparkjax.training.fit import fit
from sparkjax.training.forward import batch_loss
from sparkjax.training.lm import LMConfig, LMTask, export_lm, train_lm
from sparkjax.training.models import init_drafter, load_drafter_for_training, new_drafter_config
from sparkjax.training.optim import make_schedule
from sparkjax.training.outdir import LOCK_NAME, MARKER, RunLock, check_overwritable, drop_metrics_after
from tests.conftest import TINY_RECIPE as RECIPE
from tests.conftest import TINY_RUN
from tests.conftest import tiny_run_config as cfg
from tests.conftest import tiny_run_config as run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "tiny_dspark_b16")
RECIPES = os.path.join(ROOT, "train", "recipes")
TIGHT = dict(rtol=1e-4, atol=1e-4)
N = 2  # checkpoint interval of the shared tiny run (conftest.tiny_run), which takes 2N steps


def close(actual, expected, tol=TIGHT, what=""):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), err_msg=what, **tol)


@pytest.fixture(scope="module")
def target(fixture_target):
    return fixture_target


@pytest.fixture(scope="module")
def drafter(fixture_drafter):
    return fixture_drafter


@pytest.fixture(scope="module")
def summary():
    with open(os.path.join(FIX, "summary.json")) as f:
        return json.load(f)


@nnx.jit
def run_loss(drafter, target, ids, lm, anchors, keep, feats, last):
    """``batch_loss`` of a drafter and a target (or None), compiled once per shape."""
    return batch_loss(drafter, target, ids, lm, anchors, keep, Objective(), features=feats, last_hidden=last)


# anchors from uniforms, one program per shape and count
_anchors_from_uniforms = jax.jit(anchors_from_uniforms, static_argnums=2)


def reference_batch(ref, precomputed=True):
    """The reference's batch as host arrays (the anchors compiled)."""
    lm = ref["e.loss_mask"]
    anchors, keep = (np.asarray(x) for x in _anchors_from_uniforms(lm, ref["e.anchor_sampler_uniforms"], 8))
    feats = ref["e.target_hidden_states"] if precomputed else None
    last = ref["e.target_last_hidden_states"] if precomputed else None
    return ref["e.input_ids"], lm, anchors, keep, feats, last


def tensors(folder):
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def same_drafters(a_dir, b_dir):
    a, b = tensors(a_dir), tensors(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)


# ----------------------------------------------------------------------------- parity (group e)


def test_anchors_and_blocks_match_reference(ref, summary):
    lm = ref["e.loss_mask"]
    uniforms = ref["e.anchor_sampler_uniforms"]
    anchors, keep = (np.asarray(x) for x in _anchors_from_uniforms(lm, uniforms, ref["e.anchor_positions"].shape[1]))
    np.testing.assert_array_equal(anchors, ref["e.anchor_positions"])
    np.testing.assert_array_equal(keep, ref["e.block_keep_mask"])
    blocks = jax.jit(build_blocks, static_argnames=("block_size", "mask_token_id"))(
        ref["e.input_ids"], lm, anchors, keep, block_size=16, mask_token_id=300)
    for mine, theirs in (("tokens", "noise_input_ids"), ("full_positions", "full_position_ids"),
                         ("mask", "attention_mask_dense"), ("target_ids", "target_ids"), ("eval_mask", "eval_mask")):
        np.testing.assert_array_equal(getattr(blocks, mine), ref[f"e.{theirs}"], err_msg=mine)
    assert int(np.asarray(blocks.eval_mask).sum()) == summary["e"]["eval_mask_count"]
    assert np.asarray(anchors).tolist() == summary["e"]["anchors"]


def test_sampled_anchors_follow_the_rule():
    """Anchors drawn from a key: valid, distinct, sorted, dummies (position 0, keep False) last."""
    rng = np.random.default_rng(0)
    lm = (rng.random((6, 40)) < 0.6).astype(np.float32)
    lm[0] = 0.0
    lm[0, 30:34] = 1.0  # 3 valid candidates for 8 anchors
    anchors, keep = map(np.asarray, jax.jit(lambda lm: sample_anchors(jax.random.key(4), lm, 8))(lm))
    valid = np.asarray(jax.jit(anchor_candidates)(lm))
    for b in range(6):
        n = min(8, int(valid[b].sum()))
        assert keep[b].tolist() == [True] * n + [False] * (8 - n)
        assert np.all(np.diff(anchors[b, :n]) > 0) and np.all(valid[b, anchors[b, :n]])
        assert np.all(anchors[b, n:] == 0)
    assert anchors[0, :3].tolist() == [30, 31, 32]
    # explicit uniforms: the smallest u among valid candidates win
    u = rng.random((6, 39)).astype(np.float32)
    a2 = np.asarray(_anchors_from_uniforms(lm, u, 4)[0])
    for b in range(1, 6):
        want = np.sort(np.argsort(np.where(valid[b], u[b], 2.0), kind="stable")[:4])
        np.testing.assert_array_equal(a2[b], want)


def test_loss_matches_reference(ref, target, drafter, summary):
    args = reference_batch(ref)
    total, sums, blocks, outs = run_loss(drafter, target, *args)
    for mine, theirs in (("hidden", "output_hidden"), ("base_logits", "base_draft_logits"),
                         ("draft_logits", "draft_logits"), ("confidence", "confidence_pred"),
                         ("target_logits", "aligned_target_logits")):
        close(getattr(outs, mine), ref[f"e.{theirs}"], what=mine)
    loss_tol = dict(rtol=1e-5, atol=0)
    for mine, theirs in (("ce_num", "ce_loss_num"), ("l1_num", "l1_loss_num"), ("conf_num", "confidence_loss_num"),
                         *(("weight_sum", d) for d in ("ce_loss_den", "l1_loss_den", "confidence_loss_den"))):
        close(getattr(sums, mine), ref[f"e.{theirs}"][0], loss_tol, mine)
    losses, metrics = jax.tree.map(np.asarray, _losses_and_metrics(sums))
    sums = jax.tree.map(np.asarray, sums)  # indexed on the host below
    for mine, theirs in (("loss", "total_loss"), ("ce_loss", "ce_loss"), ("l1_loss", "l1_loss"),
                         ("confidence_loss", "confidence_loss")):
        close(losses[mine], ref[f"e.{theirs}"][0], loss_tol, mine)
    close(total, ref["e.total_loss"][0], loss_tol, "total")
    # DeepSpec's logged metrics: per-position accept rates, probabilistic tau, confidence calibration
    logged = summary["e"]["metrics"]
    for k in range(16):
        rate = logged[f"train/accept_rate@{k}"]
        close(sums.accept_sum[k], rate["num"], dict(rtol=1e-5, atol=1e-5))
        close(sums.accept_count[k], rate["den"], dict(rtol=0, atol=0))
        close(metrics["accept_rate"][k], rate["value"], dict(rtol=1e-5, atol=1e-6))
    tau = logged["train/tau_probabilistic"]
    close(sums.tau_sum, tau["num"], loss_tol)
    close(sums.block_count, tau["den"], dict(rtol=0, atol=0))
    close(metrics["tau_probabilistic"], tau["value"], loss_tol)
    for name in ("confidence_abs_error", "confidence_bias", "confidence_cumprod_bias"):
        close(metrics[name], logged[f"train/{name}"]["value"], dict(rtol=1e-4, atol=1e-6), name)
    # the drafter's own (frozen) LM head gives the same aligned logits as the target's
    _, sums_head, _, outs_head = run_loss(drafter, None, *args)
    close(outs_head.target_logits, ref["e.aligned_target_logits"], what="aligned logits via the drafter's head")
    close(_losses_and_metrics(sums_head)[0]["loss"], ref["e.total_loss"][0], loss_tol)


# the default objective's losses and logged metrics of a LossSums, one program
_losses_and_metrics = jax.jit(lambda sums: (sums.losses(Objective()), sums.metrics(Objective())))


@pytest.mark.slow
def test_on_the_fly_target_features_match_reference(ref, target, drafter):
    total, sums, _, outs = run_loss(drafter, target, *reference_batch(ref, precomputed=False))
    close(outs.draft_logits, ref["e.draft_logits"], what="draft logits, features on the fly")
    close(total, ref["e.total_loss"][0], dict(rtol=1e-4, atol=0), "total, features on the fly")
    # precomputed features (small runs): the same tensors, and a target-free trainer gives the same metrics
    data = precompute_features(target, TokenData(ref["e.input_ids"], ref["e.loss_mask"]), (1, 3), batch=2)
    close(data.features, ref["e.target_hidden_states"], what="features")
    close(data.last_hidden, ref["e.target_last_hidden_states"], what="final-normed last hidden")
    optim = OptimConfig(lr=1e-3, steps=10)
    live = Trainer(drafter, target, optim=optim, num_anchors=8).evaluate(
        [{"input_ids": data.input_ids, "loss_mask": data.loss_mask}])
    cached = Trainer(drafter, None, optim=optim, num_anchors=8).evaluate([as_batch(data)])
    assert live["supervised_slots"] == cached["supervised_slots"] > 0
    for k in ("loss", "ce_loss", "l1_loss", "confidence_loss", "tau_probabilistic"):
        assert cached[k] == pytest.approx(live[k], rel=1e-4), k


@pytest.mark.slow
def test_trainer_step_matches_a_plain_optax_step(target, drafter, tiny_data):
    """The jitted step = value_and_grad of the loss + clip + AdamW, on the trainable params only."""
    cfg = run_config(warmup_steps=2)
    batch = BatchStream(tiny_data, cfg.batch_size, seed=0).batch(0)
    tr = Trainer(drafter, target, optim=cfg.optim, num_anchors=cfg.num_anchors, seed=0)
    params0 = jax.tree.map(np.asarray, jax.device_get(tr.state["params"]))
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(tr.state["params"])}
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.kernel"} <= names
    key = jax.random.split(jax.random.key(0))[1]  # the first step's anchor key (seed 0)
    loss, sums, grads = tr.loss_and_grads(batch, key)
    lr0 = float(make_schedule(cfg.optim)(0))
    assert lr0 == pytest.approx(cfg.lr / cfg.warmup_steps)
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(lr0, weight_decay=0.0))
    want = optax.apply_updates(tr.state["params"], tx.update(grads, tx.init(tr.state["params"]), tr.state["params"])[0])
    step_sums, info = tr.step(batch)
    exact = dict(rtol=1e-6, atol=0)
    close(step_sums.losses(Objective())["loss"], loss, exact)
    close(info["grad_norm"], optax.tree.norm(grads), exact)
    close(info["lr"], lr0, exact)
    # Adam's first step moves each element by about lr0. The step and the reference are two compiled programs whose
    # float32 sums differ in order, which an element with a gradient near Adam's eps amplifies: each element within 1%
    # of lr0, and each tensor within 1e-4 of lr0 on average (a weight decay of 0.01 moves it about 1e-3 * lr0).
    for a, b, p in zip(*map(jax.tree.leaves, (tr.state["params"], want, params0)), strict=True):
        diff = np.abs((np.asarray(a) - p) - (np.asarray(b) - p)) / lr0
        assert diff.max() <= 1e-2 and diff.mean() <= 1e-4, (diff.max(), diff.mean())
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), tr.state["params"], params0)
    assert min(jax.tree.leaves(moved)) > 0  # every trainable tensor (heads included) was updated
    assert tr.step_count == 1
    d1 = tr.drafter()
    np.testing.assert_array_equal(d1.embed_tokens.embedding[...], drafter.embed_tokens.embedding[...])
    np.testing.assert_array_equal(d1.lm_head.weight[...], drafter.lm_head.weight[...])
    close(drafter.fc.kernel[...], params0["fc"]["kernel"], dict(rtol=0, atol=0))  # the input module is intact


def test_schedule_recipes_and_a_new_drafter_for_a_qwen3_4b_target():
    sched = make_schedule(OptimConfig(lr=1e-3, steps=110, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1))
    # upstream's warmup (step + 1) / warmup * lr, then the cosine to 10%
    for step, lr, rel in ((0, 1e-4, 1e-6), (9, 1e-3, 1e-6), (10, 1e-3, 1e-6), (60, 1e-4 + 0.5 * 9e-4, 1e-5),
                          (110, 1e-4, 1e-5)):
        assert float(sched(step)) == pytest.approx(lr, rel=rel), step
    assert float(make_schedule(OptimConfig(lr=1e-3, steps=100, schedule="linear"))(50)) == pytest.approx(5e-4, rel=1e-5)
    t4b = Qwen3Config.from_hf_config(os.path.join(FIX, "configs", "qwen3_4b_target_config.json"))
    up = DrafterConfig.from_hf_config(os.path.join(FIX, "configs", "dspark_qwen3_4b_b16_config.json"))
    scratch = TrainConfig.from_file(os.path.join(RECIPES, "from_scratch.json"),
                                    {"target": FIX + "/target", "data": "train.jsonl"})
    mine = new_drafter_config(t4b, {**scratch.drafter, "mask_token_id": 151669, "num_anchors": 512})
    fields = [f.name for f in dataclasses.fields(DrafterConfig) if f.name not in ("hf_json", "max_position_embeddings")]
    assert {f: getattr(mine, f) for f in fields} == {f: getattr(up, f) for f in fields}
    assert list(mine.target_layer_ids) == [1, 9, 17, 25, 33]  # (upstream's parameter counts: test_drafter)
    ext = TrainConfig.from_file(os.path.join(RECIPES, "extend_block.json"),
                                {"target": "/m/Qwen3-4B", "init_drafter": "/m/b7", "data": "/d/train.jsonl"})
    assert (ext.seq_len, ext.num_anchors, ext.steps, ext.drafter["block_size"]) == (768, 32, 600, 16)
    assert ext.freeze == ("embed_tokens", "lm_head") and ext.init_drafter == "/m/b7"
    assert ext.optim.warmup_steps == 24 and ext.optim.grad_clip == 1.0  # 4% of 600
    tiny = TrainConfig.from_file(os.path.join(RECIPES, "tiny.json"))
    assert os.path.isdir(tiny.target) and tiny.synthetic is not None
    with pytest.raises(TrainingError, match="key 'target' is required"):
        TrainConfig.from_file(os.path.join(RECIPES, "extend_block.json"))


# ----------------------------------------------------------------------------- learning


def tiny_settings(**kw):
    return {"block_size": 16, "num_draft_layers": 2, "target_layer_ids": [1, 3], "mask_token_id": 300,
            "markov_rank": 16, **kw}


@pytest.fixture(scope="module")
def tiny_data(target):
    return synthetic_data(target, num_sequences=72, seq_len=48, prompt_len=16, seed=3, vocab_high=300)


@pytest.mark.slow
def test_learning_reduces_loss_and_raises_heldout_tau(target, tiny_data):
    cfg = run_config(steps=40, warmup_steps=5)
    data = tiny_data
    # the continuation is the target's greedy output (loss mask on it only)
    gt, st = nnx.split(target)
    logits = jax.jit(lambda s, x: nnx.merge(gt, s)(x, jnp.broadcast_to(jnp.arange(48), x.shape)).logits)(
        st, jnp.asarray(data.input_ids))
    np.testing.assert_array_equal(np.argmax(logits[:, 15:-1], -1), data.input_ids[:, 16:])
    assert data.loss_mask[:, :16].sum() == 0 and data.loss_mask[:, 16:].min() == 1
    train_rows, held = data.take(np.arange(56)), data.take(np.arange(56, 72))
    _, drafter = build_models(cfg, log=lambda m: None)  # a new drafter: random, the target's embedding / head
    np.testing.assert_array_equal(drafter.embed_tokens.embedding[...], target.embed_tokens.embedding[...])
    np.testing.assert_array_equal(drafter.lm_head.weight[...], target.embed_tokens.embedding[...])
    tr = Trainer(drafter, target, optim=cfg.optim, num_anchors=cfg.num_anchors, seed=0)
    evals = fixed_batches(held, cfg.batch_size)
    before = tr.evaluate(evals)
    stream = BatchStream(train_rows, cfg.batch_size, seed=0)
    losses = [float(tr.step(stream.batch(i))[0].losses(Objective())["loss"]) for i in range(cfg.steps)]
    after = tr.evaluate(evals)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2, losses
    assert after["loss"] < before["loss"] - 0.2
    assert after["tau_probabilistic"] > before["tau_probabilistic"] + 0.05, (before, after)
    assert after["accept_rate"].mean() > before["accept_rate"].mean() + 0.03


# ----------------------------------------------------------------------------- runs, resume, checkpoints


def train_losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}


@pytest.fixture(scope="module")
def straight_run(tiny_run):
    assert sorted(train_losses(tiny_run)) == list(range(1, 2 * N + 1))
    return tiny_run


KILL_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from sparkjax.training import TrainConfig, train
    cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
    n = int(sys.argv[3])
    def hook(step, saved):
        if step == n and saved:
            print(f"CHECKPOINT {step}", flush=True)
            time.sleep(600)  # the parent kills us here (SIGKILL)
    train(cfg, sys.argv[2], progress=False, on_step=hook)
""")


@pytest.mark.slow
def test_resume_after_sigkill_reproduces_the_straight_run(tmp_path, straight_run, xla_cache):
    out = str(tmp_path / "killed")
    shutil.copytree(os.path.join(straight_run, "data"), os.path.join(out, "data"))  # same seed, same data
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, json.dumps(run_config().to_dict()), out, str(N)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env={**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_cache})
    try:
        deadline, line = time.time() + 240, ""
        while time.time() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 5)[0]:
                line = proc.stdout.readline()
                if line.startswith("CHECKPOINT") or not line:
                    break
        assert line.strip() == f"CHECKPOINT {N}", f"subprocess did not reach its checkpoint (rc={proc.poll()})"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert sorted(train_losses(out)) == list(range(1, N + 1))
    assert not os.path.exists(os.path.join(out, "drafter"))
    messages = []
    result = train(run_config(), out, resume=True, progress=False, log=messages.append)
    assert result.resumed_from == N and result.step == 2 * N
    assert any(f"resume: step {N}" in m for m in messages)
    want, got = train_losses(straight_run), train_losses(out)
    assert sorted(got) == list(range(1, 2 * N + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-6, atol=0)
    same_drafters(os.path.join(straight_run, "drafter"), os.path.join(out, "drafter"))


# orbax's reader of the damaged chunks leaves an asyncio callback behind when it fails
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupted_checkpoint_falls_back_and_resume_still_matches(tmp_path, straight_run):
    out = str(tmp_path / "copy")
    shutil.copytree(straight_run, out)
    ckdir = os.path.join(out, "checkpoints")
    assert sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) == [N, 2 * N]
    damaged = 0  # the newest checkpoint's array data chunks (its metadata stays readable)
    for root, _, files in os.walk(os.path.join(ckdir, str(2 * N), "state")):
        for name in files if os.path.basename(root) == "d" else ():
            with open(os.path.join(root, name), "r+b") as f:
                f.write(b"\xff" * 64)
            damaged += 1
    assert damaged > 0
    messages = []
    result = train(run_config(), out, resume=True, progress=False, log=messages.append)
    warn = [m for m in messages if "corrupted or incomplete" in m]
    assert len(warn) == 1 and f"falling back to step {N}" in warn[0] and f"checkpoints/{2 * N}" in warn[0]
    assert os.path.isdir(os.path.join(ckdir, f"corrupt-{2 * N}-0"))
    assert result.resumed_from == N
    same_drafters(os.path.join(straight_run, "drafter"), os.path.join(out, "drafter"))


def test_checkpointer_partial_steps_and_shape_mismatch(tmp_path):
    """A step without its state, a step with garbage data: both skipped with a message; wrong shapes raise."""
    messages = []
    ck = TrainCheckpointer(str(tmp_path / "ck"), keep_last=5, log=messages.append)
    state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.int32(0)}
    for s in (1, 2, 3):
        ck.save(s, {"w": state["w"] * s, "step": jnp.int32(s)}, {"data_cursor": s})
    ck.wait()
    shutil.rmtree(os.path.join(ck.step_dir(3), "state"))  # partial: the state never landed
    meta_file = os.path.join(ck.step_dir(2), "meta", "metadata")
    with open(meta_file) as f:
        meta = json.load(f)
    meta["checksums"]["w"] = [1e9, 1e9]  # content that no longer matches what was written
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    step, restored, meta = ck.restore(abstract)
    assert step == 1 and meta["data_cursor"] == 1
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert len(messages) == 2 and "step 3" not in messages[0] and "falling back to step 2" in messages[0]
    assert "checksum" in messages[1] and "falling back to step 1" in messages[1]
    assert ck.steps() == [1]
    bad = {"w": jax.ShapeDtypeStruct((3, 5), jnp.float32), "step": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(CheckpointError, match=r"tensor 'w' has shape \[3, 4\].*expects \[3, 5\]"):
        ck.restore(bad)
    ck.close()
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        TrainCheckpointer(str(tmp_path / "empty")).restore(abstract)


def test_resume_with_a_different_config_refuses_unless_forced(tmp_path, straight_run):
    out = str(tmp_path / "cfg")
    shutil.copytree(straight_run, out)
    quiet = dict(progress=False, log=lambda m: None)
    with pytest.raises(TrainingError, match=r"lr: 0\.01 -> 0\.02.*--force-resume") as info:
        train(run_config(lr=2e-2), out, resume=True, **quiet)
    assert os.path.join(out, "checkpoints") in str(info.value)
    with pytest.raises(TrainingError, match="--resume"):
        train(run_config(), out, **quiet)  # not asked to resume
    # forced, but the drafter's parameter shapes changed: the checkpoint's tensors do not fit
    shapes = r"tensor 'params\.(markov_head|confidence_head)\.[\w.]+' has shape \[\d+, \d+\], this config expects"
    with pytest.raises(CheckpointError, match=shapes):
        train(run_config(drafter=tiny_settings(markov_rank=8)), out, resume=True, force_resume=True, **quiet)
    messages = []
    result = train(run_config(lr=2e-2), out, resume=True, force_resume=True, progress=False, log=messages.append)
    assert result.resumed_from == 2 * N and any("--force-resume" in m for m in messages)


# ----------------------------------------------------------------------------- data parallel

DP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from safetensors.numpy import load_file
    from sparkjax import load_drafter, load_target
    from sparkjax.sharding import make_mesh
    import optax
    from sparkjax.training import OptimConfig, Trainer, make_optimizer
    fix = sys.argv[1]
    target = load_target(fix + "/target")
    drafter = load_drafter(fix + "/drafter", target=target)
    ref = load_file(fix + "/reference.safetensors")
    ids = np.concatenate([np.roll(ref["e.input_ids"], 7 * i, axis=1) for i in range(4)])
    lm = np.concatenate([np.roll(ref["e.loss_mask"], 7 * i, axis=1) for i in range(4)])
    batch = {"input_ids": ids, "loss_mask": lm}
    optim = OptimConfig(lr=1e-3, steps=10, warmup_steps=0, schedule="constant")
    one = Trainer(drafter, target, optim=optim, num_anchors=8, seed=0)
    eight = Trainer(drafter, target, optim=optim, num_anchors=8, seed=0, mesh=make_mesh(data=8))
    key = jax.random.split(jax.random.key(0))[1]  # the anchor key of the first step (seed 0)
    l1, s1, g1 = one.loss_and_grads(batch, key)
    l8, s8, g8 = eight.loss_and_grads(batch, key)
    placed = eight.put_batch(batch)["input_ids"]
    diff = lambda a, b: max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in
                            zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g1))
    # one sharded train step = the one-device gradients through clip + AdamW
    params0 = one.state["params"]
    tx = make_optimizer(optim)
    apply = jax.jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))
    want, want8 = apply(g1, params0), apply(g8, params0)
    sums8, _ = eight.step(batch)
    # where |g| is near AdamW's eps its first step lr * g / (|g| + eps) turns float noise in g into up to lr
    far = lambda a, b, g: max(
        float(np.abs(np.where(np.abs(np.asarray(z)) > 1e-6, np.asarray(x) - np.asarray(y), 0)).max())
        for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(g)))
    print(json.dumps(dict(
        devices=len(jax.devices()), batch_devices=len(placed.sharding.device_set),
        shard_rows=[s.data.shape[0] for s in placed.addressable_shards],
        grad_devices=len(jax.tree.leaves(g8)[0].sharding.device_set),
        param_devices=len(jax.tree.leaves(eight.state["params"])[0].sharding.device_set),
        loss1=float(l1), loss8=float(l8), step_loss8=float(sums8.losses(eight.spec.objective)["loss"]),
        tau1=float(s1.tau_sum), tau8=float(s8.tau_sum),
        grad_diff=diff(g1, g8), grad_scale=scale, param_diff=far(want, eight.state["params"], g1),
        step_diff=diff(want8, eight.state["params"]),
        param_moved=diff(params0, eight.state["params"]))))
""")


@pytest.mark.slow
def test_data_parallel_on_8_cpu_devices_matches_one_device(xla_cache):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_COMPILATION_CACHE_DIR": xla_cache}
    proc = subprocess.run([sys.executable, "-c", DP_SCRIPT, FIX], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 8 and res["batch_devices"] == 8 and res["shard_rows"] == [1] * 8
    assert res["grad_devices"] == 8 and res["param_devices"] == 8  # replicated
    assert res["loss1"] == pytest.approx(res["loss8"], rel=1e-5)
    assert res["step_loss8"] == pytest.approx(res["loss1"], rel=1e-5)
    assert res["tau1"] == pytest.approx(res["tau8"], rel=1e-5)
    assert res["grad_scale"] > 0 and res["grad_diff"] <= 1e-5 * res["grad_scale"] + 1e-7, res
    # the sharded step is clip + AdamW on its own gradients, which equal the one-device ones (above); against
    # the one-device step, parameters whose gradient is not near AdamW's eps agree to 2% of lr
    assert res["param_moved"] > 1e-4 and res["step_diff"] <= 1e-6 and res["param_diff"] <= 2e-5, res


# ----------------------------------------------------------------------------- export and reload


def test_export_round_trip_and_block7_to_block16(tmp_path, ref, target, drafter, straight_run):
    cfg = run_config()
    tr = Trainer(drafter, target, optim=cfg.optim, num_anchors=cfg.num_anchors, seed=0)
    tr.step(BatchStream(TokenData.load(os.path.join(straight_run, "data", "train.npz")), cfg.batch_size).batch(0))
    trained = tr.drafter()
    again = load_drafter(save_drafter(trained, str(tmp_path / "exported")), target=target)
    assert again.config == trained.config
    args = reference_batch(ref)
    l_a, _, _, out_a = run_loss(trained, None, *args)
    l_b, _, _, out_b = run_loss(again, None, *args)
    np.testing.assert_array_equal(out_a.draft_logits, out_b.draft_logits)
    np.testing.assert_array_equal(out_a.confidence, out_b.confidence)
    assert float(l_a) == float(l_b) and abs(float(l_a) - float(ref["e.total_loss"][0])) > 1e-6  # it trained
    # a block-7 DeepSpec drafter continues at block 16: same tensors, new block size
    b7_cfg = DrafterConfig.from_hf_config({**json.loads(drafter.config.hf_json), "block_size": 7})
    b7 = nnx.merge(nnx.split(Drafter(b7_cfg, rngs=nnx.Rngs(0)))[0], nnx.state(drafter))
    b7_dir = save_drafter(b7, str(tmp_path / "block7"))
    assert json.load(open(os.path.join(b7_dir, "config.json")))["block_size"] == 7
    b16 = load_drafter_for_training(b7_dir, target, {"block_size": 16, "num_anchors": 32})
    assert b16.config.block_size == 16 and b16.config.num_anchors == 32
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(b16, nnx.Param)),
                              nnx.to_flat_state(nnx.state(drafter, nnx.Param)), strict=True):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(p))
    bad_shape = r"block7/model\.safetensors: tensor '(confidence|markov)_head\.[\w.]+' has shape"
    with pytest.raises(CheckpointError, match=bad_shape):
        load_drafter_for_training(b7_dir, target, {"block_size": 16, "markov_rank": 32})


# ----------------------------------------------------------------------------- data


CHAT = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4, of course."}]},
    {"turns": ["What is JAX?", "A library for array programs."]},
    {"turns": ["a user turn only"]},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from fixtures.default_tokenizer import write_default_tokenizer  # byte-level BPE, built locally

    return str(write_default_tokenizer(tmp_path_factory.mktemp("tok")))


def test_jsonl_chat_tokenisation_masks_assistant_turns(tmp_path, tokenizer_dir):
    from sparkjax.text import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    path = str(tmp_path / "chat.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in CHAT) + "\n\n")
    data = load_jsonl(path, 96, block_size=16, vocab_size=320, tokenizer=tok)
    assert len(data) == 2 and data.info["skipped"] == 1 and data.input_ids.shape == (2, 96)
    supervised = [tok.decode(data.input_ids[i][data.loss_mask[i] > 0]) for i in range(2)]
    assert supervised[1] == "A library for array programs.<|im_end|>"
    full = tok.decode(data.input_ids[1][: int(np.nonzero(data.input_ids[1] != tok.pad_token_id)[0][-1]) + 1])
    assert full.startswith("<|im_start|>user\nWhat is JAX?<|im_end|>")
    long = load_jsonl(path, 256, block_size=16, vocab_size=320, tokenizer=tok)
    assert tok.decode(long.input_ids[0][long.loss_mask[0] > 0]) == (
        "Hello! How can I help?<|im_end|>4, of course.<|im_end|>")
    assert long.loss_mask[0, long.input_ids[0] == tok.pad_token_id].sum() == 0
    packed = load_jsonl(path, 32, block_size=16, vocab_size=320, tokenizer=tok, packing="pack")
    convs = [CHAT[0]["messages"], [{"role": "user", "content": "What is JAX?"},
                                   {"role": "assistant", "content": "A library for array programs."}],
             [{"role": "user", "content": "a user turn only"}]]
    lengths = [len(tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"])
               for c in convs]
    assert packed.input_ids.shape == (-(-sum(lengths) // 32), 32)
    assert packed.supervised_tokens() == long.supervised_tokens()  # the user-only line adds no supervision


def test_jsonl_chat_run_end_to_end(tmp_path, tokenizer_dir):
    path = str(tmp_path / "chat.jsonl")
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(16):
            answer = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"], 6))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    cfg = run_config(synthetic=None, data=path, tokenizer=tokenizer_dir, eval_size=8, eval_every=2 * N)
    result = train(cfg, str(tmp_path / "run"), progress=False, log=lambda m: None)
    assert result.step == 2 * N and result.last_eval is not None
    assert result.last_eval["supervised_slots"] > 0 and np.isfinite(result.last_eval["loss"])
    assert load_drafter(result.drafter_dir).config.block_size == 16 and os.path.isdir(result.best_dir)


def test_synthetic_data_batches_resume_exactly():
    data = TokenData(np.arange(40 * 20, dtype=np.int32).reshape(40, 20), np.ones((40, 20), np.float32))
    a = BatchStream(data, 8, seed=3)
    seen = [a.batch(c)["input_ids"][:, 0] // 20 for c in range(10)]
    assert sorted(np.concatenate(seen[:5]).tolist()) == list(range(40))  # one epoch covers every row once
    assert not np.array_equal(np.concatenate(seen[:5]), np.concatenate(seen[5:]))  # a new order per epoch
    np.testing.assert_array_equal(BatchStream(data, 8, seed=3).batch(7)["input_ids"], a.batch(7)["input_ids"])


# ----------------------------------------------------------------------------- bad input


IDS40 = {"input_ids": list(range(40))}


@pytest.mark.parametrize("rows, pattern", [
    ([IDS40, {"text": "hello"}], r"bad\.jsonl:2: no 'messages', 'turns' or 'input_ids'"),
    (["{not json}"], r"bad\.jsonl:1: not valid JSON"),
    ([{"messages": [{"role": "user"}]}], r"bad\.jsonl:1: message 0"),
    ([IDS40, {"input_ids": [1, 2, 3, 4]}], r"bad\.jsonl:2: sequence of 4 tokens is shorter than a block"),
    ([{"messages": [{"role": "user", "content": "x"}]}], "needs a tokenizer"),
    (None, "file not found"),
])
def test_bad_jsonl(tmp_path, rows, pattern):
    path = tmp_path / "bad.jsonl"
    if rows is not None:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    with pytest.raises(DataError, match=pattern) as info:
        load_jsonl(str(path), 48, block_size=16, vocab_size=320)
    assert isinstance(info.value, SparkjaxError) and str(path) in str(info.value)


def test_short_sequences(tmp_path):
    with pytest.raises(ArgumentError, match=r"S=12 is shorter than a block"):
        build_blocks(jnp.zeros((1, 12), jnp.int32), jnp.ones((1, 12)), jnp.zeros((1, 2), jnp.int32),
                     jnp.ones((1, 2), bool), block_size=16, mask_token_id=300)
    with pytest.raises(TrainingError, match=r"seq_len: 12 is shorter than a block"):
        train(run_config(seq_len=12, num_anchors=4), str(tmp_path / "short"), progress=False, log=lambda m: None)


@pytest.mark.parametrize("key, value, pattern", [
    ("lr", -1e-3, "key 'lr'"),
    ("lr", float("nan"), "key 'lr'"),
    ("lr", 5.0, "key 'lr'"),
    ("steps", 0, "key 'steps'"),
    ("steps", 2.5, "key 'steps'"),
    ("warmup_steps", 300, "key 'warmup_steps' must be smaller than steps"),
    ("batch_size", 0, "key 'batch_size'"),
    ("grad_clip", -1.0, "grad_clip"),
    ("schedule", "exponential", "schedule"),
    ("num_anchors", 100, "key 'num_anchors'"),
    ("bogus_key", 1, "unknown key 'bogus_key'"),
])
def test_bad_settings_raise(key, value, pattern):
    with pytest.raises(TrainingError, match=pattern) as info:
        TrainConfig.from_file(os.path.join(RECIPES, "tiny.json"), {key: value})
    assert "tiny.json" in str(info.value)


def test_mismatched_pair_and_bad_optim(target, drafter):
    other = nnx.eval_shape(lambda: Qwen3(dataclasses.replace(target.config, hidden_size=32, head_dim=8),
                                         rngs=nnx.Rngs(0)))
    with pytest.raises(IncompatiblePairError, match="hidden_size 64 vs 32"):
        Trainer(drafter, other, optim=OptimConfig(), num_anchors=8)
    few = dataclasses.replace(target.config, num_hidden_layers=3)
    with pytest.raises(IncompatiblePairError, match=r"target_layer_ids \[1, 3\].*outside"):
        Trainer(drafter, nnx.eval_shape(lambda: Qwen3(few, rngs=nnx.Rngs(0))), optim=OptimConfig(), num_anchors=8)
    with pytest.raises(IncompatiblePairError, match="does not fit target"):
        init_drafter(target, new_drafter_config(few, tiny_settings(target_layer_ids=[1, 3])))
    for bad, match in ((dict(lr=0.0), "lr"), (dict(steps=-3), "steps")):
        with pytest.raises(TrainingError, match=match):
            OptimConfig(**bad)
    with pytest.raises(ArgumentError, match="num_anchors"):
        Trainer(drafter, target, optim=OptimConfig(), num_anchors=0)
    with pytest.raises(ArgumentError, match="leaves no trainable parameter"):
        Trainer(drafter, target, optim=OptimConfig(), num_anchors=8,
                freeze=("layers", "norm", "fc", "hidden_norm", "markov_head", "confidence_head", "embed_tokens",
                        "lm_head"))
    with pytest.raises(SparkjaxError, match="mask_token_id"):
        new_drafter_config(target.config, {"block_size": 16})


@pytest.mark.slow  # a regression test of one compile-heavy case (256-token sequences); CI runs the slow cases
def test_train_step_differentiates_sequences_longer_than_an_attention_chunk(target, drafter):
    """Sequences longer than the blocked attention's chunk: the CPU's default inference attention has a loop
    with a run-time trip count, which reverse mode cannot go through; the training forward traces the
    reference path."""
    from sparkjax.nn import layers

    s = 2 * layers.BLOCK_SLOTS  # a whole number of chunks: the blocked path applies
    ids = np.random.default_rng(0).integers(4, target.config.vocab_size, size=(2, s)).astype(np.int32)
    for objective in (Objective(), Objective(tree_alpha=1.0, tree_top_c=4)):
        tr = Trainer(drafter, target, optim=OptimConfig(lr=1e-3, steps=2, warmup_steps=0), num_anchors=4,
                     objective=objective)
        loss = float(tr.step({"input_ids": ids, "loss_mask": np.ones_like(ids)})[0].losses(objective)["loss"])
        assert np.isfinite(loss) and loss > 0


# ----------------------------------------------------------------------------- robustness: outputs, resumes, the CLIs


LM_MODEL = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 128,
}
QUIET = dict(progress=False, log=lambda m: None)
_spec = importlib.util.spec_from_file_location("train_target_cli", os.path.join(ROOT, "train", "train_target.py"))
train_target = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_target)


def cli_sets(**kw) -> list[str]:
    return [a for k, v in {**TINY_RUN, **kw}.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def lm_cfg(**kw) -> LMConfig:
    return LMConfig(**{**dict(model=LM_MODEL, seq_len=16, batch_size=4, steps=4, lr=1e-2, warmup_steps=1,
                              eval_every=2, eval_batches=1, checkpoint_every=2, log_every=1), **kw})


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def user_folder(path) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "thesis.tex"), "w") as f:
        f.write("years of work")
    return str(path)


def survives(folder: str) -> bool:
    with open(os.path.join(folder, "thesis.tex")) as f:
        return f.read() == "years of work"


def steps_of(path: str) -> list[int]:
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def run(tiny_run):  # the shared short drafter run: checkpoints at steps 2 and 4
    assert os.path.isfile(os.path.join(tiny_run, "drafter", MARKER))
    return tiny_run


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_tokens")
    stream = np.tile(np.arange(1, 33, dtype=np.uint16), 40)
    np.save(root / "train.tokens.npy", stream)
    np.save(root / "heldout.tokens.npy", stream[:400])
    return dict(tokens=str(root / "train.tokens.npy"), heldout=str(root / "heldout.tokens.npy"))


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, tokens):
    out = str(tmp_path_factory.mktemp("lm"))
    assert train_lm(lm_cfg(), out, log=lambda *_: None, **tokens).step == 4
    return out


# ----------------------------------------------------------------------------- 1. exports


def test_drafter_export_refuses_a_folder_of_user_files(tmp_path, run, capsys):
    dest = user_folder(tmp_path / "mine")
    rc = train_cli.main(["--recipe", RECIPE, "--output", run, *cli_sets(), "--export", "latest",
                         "--export-to", dest, "--no-progress"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and dest in line and MARKER in line
    assert survives(dest) and sorted(os.listdir(dest)) == ["thesis.tex"]
    with pytest.raises(ArgumentError, match="not a folder"):  # a regular file is not replaced by a folder
        export_run(cfg(), run, "latest", os.path.join(dest, "thesis.tex"), log=lambda m: None)
    assert survives(dest)
    for place in (".", "", os.getcwd(), os.path.dirname(os.getcwd()), "/"):
        with pytest.raises(ArgumentError):
            check_overwritable(place)
    # an empty folder, then the folder sparkjax wrote (it holds the marker), may be replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    export_run(cfg(), run, "2", str(empty), log=lambda m: None)
    assert os.path.isfile(empty / MARKER) and os.path.isfile(empty / "model.safetensors")
    export_run(cfg(), run, "latest", str(empty), log=lambda m: None)
    assert os.path.isfile(empty / MARKER)
    # a run refuses user files where it will export before it trains (a missing target would fail later)
    dest = user_folder(tmp_path / "out" / "drafter")
    with pytest.raises(ArgumentError, match="drafter.*not empty and was not written by sparkjax"):
        train(cfg(target=str(tmp_path / "no_target")), str(tmp_path / "out"), **QUIET)
    assert survives(dest)


def test_lm_export_refuses_a_folder_of_user_files(tmp_path, lm_run, capsys):
    dest = user_folder(tmp_path / "mine")
    rc = train_target.main(["--output", lm_run, "--export", dest, "--dtype", "float32"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and dest in line
    assert survives(dest) and sorted(os.listdir(dest)) == ["thesis.tex"]
    with pytest.raises(ArgumentError, match="not empty and was not written by sparkjax"):
        export_lm(lm_run, dest, dtype="float32", overwrite=True)
    assert survives(dest)
    # its own export may be replaced by the next one
    ours = str(tmp_path / "ours")
    assert train_target.main(["--output", lm_run, "--export", ours, "--dtype", "float32"]) == 0
    assert os.path.isfile(os.path.join(ours, MARKER))
    assert train_target.main(["--output", lm_run, "--export", ours, "--dtype", "float32"]) == 0
    assert os.path.isfile(os.path.join(ours, "model.safetensors"))


# ----------------------------------------------------------------------------- 2. one run per output folder

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from sparkjax.training.outdir import RunLock
    lock = RunLock(sys.argv[1])
    print("LOCKED", flush=True)
    time.sleep(600)
""")


def test_a_second_run_into_the_same_output_is_refused(tmp_path, tokens, run, lm_run, capsys):
    out = str(tmp_path / "busy")
    os.makedirs(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, out], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        with pytest.raises(TrainingError, match=f"{out} is in use by another training run \\(process {holder.pid}\\)"):
            train(cfg(), out, **QUIET)
        with pytest.raises(TrainingError, match="in use by another training run"):
            train_lm(lm_cfg(), out, log=lambda *_: None, **tokens)
        rc = train_cli.main(["--recipe", RECIPE, "--output", out, *cli_sets(), "--no-progress"])
        line = one_error_line(capsys.readouterr().err)
        assert rc == 2 and out in line and "another training run" in line
        assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # nothing of the refused runs
        assert not os.path.exists(os.path.join(out, "checkpoints"))
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a crashed run: the OS releases its lock
        holder.wait()
    # a run that ended (or was killed) has released its lock; in one process a held lock refuses too (flock is
    # per open file description) and a released one does not
    for folder in (out, run, lm_run):
        RunLock(folder).release()
    with RunLock(out):
        with pytest.raises(TrainingError, match="in use"):
            RunLock(out)
    RunLock(out).release()


# ----------------------------------------------------------------------------- 3. output folder and data cache


def test_bad_output_folders_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    bogus = cfg(target=str(tmp_path / "no_such_target"))  # any work would fail on the target instead

    def refused(out, msg, cli=True):
        with pytest.raises(TrainingError, match=msg):
            train(bogus, out, **QUIET)
        with pytest.raises(TrainingError, match=msg):
            train_lm(lm_cfg(), out, log=lambda *_: None, tokens="missing.npy", heldout="missing.npy")
        if cli:
            rc = train_cli.main(["--recipe", RECIPE, "--output", out, *cli_sets(), "--no-progress"])
            line = one_error_line(capsys.readouterr().err)
            assert rc == 2 and out in line and msg in line

    refused(str(a_file), "is not a folder")
    refused(str(a_file / "sub"), "cannot be created")
    assert a_file.read_text() == "keep me"
    # a folder of other files with a config.json / metrics.jsonl of its own: a run would overwrite them
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"mine": true}')
    refused(str(project), f"{project} is not a training run folder but holds config.json", cli=False)
    assert os.listdir(project) == ["config.json"] and (project / "config.json").read_text() == '{"mine": true}'
    # read-only: tests run as root, so the permission check is simulated
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(ro) else real(p, mode, **kw))
    refused(str(ro), f"{ro} is not writable", cli=False)
    assert os.listdir(ro) == []


def test_truncated_data_cache_raises_a_data_error_naming_it(tmp_path, run):
    src = os.path.join(run, "data", "train.npz")
    bad = tmp_path / "train.npz"
    with open(src, "rb") as f:
        bad.write_bytes(f.read()[: os.path.getsize(src) // 2])
    with pytest.raises(zipfile.BadZipFile):  # what numpy raises for it
        np.load(bad)["input_ids"]
    with pytest.raises(DataError, match=f"{bad}: cannot read token data"):
        TokenData.load(str(bad))
    assert issubclass(DataError, TrainingError) and issubclass(TrainingError, SparkjaxError)
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(DataError, match="junk.npz"):
        TokenData.load(str(tmp_path / "junk.npz"))
    # the cache write is atomic: no temp file is left beside it, and it reads back
    data = TokenData.load(src)
    data.save(str(tmp_path / "again.npz"))
    assert sorted(os.listdir(tmp_path)) == ["again.npz", "junk.npz", "train.npz"]
    np.testing.assert_array_equal(TokenData.load(str(tmp_path / "again.npz")).input_ids, data.input_ids)


def test_resume_with_a_truncated_data_cache_rebuilds_it(tmp_path, run):
    out = str(tmp_path / "copy")
    shutil.copytree(run, out)
    cache = os.path.join(out, "data", "train.npz")
    os.truncate(cache, os.path.getsize(cache) // 3)
    messages = []
    result = train(cfg(), out, resume=True, progress=False, log=messages.append)
    notes = [m for m in messages if "rebuilding the data cache" in m]
    assert len(notes) == 1 and cache in notes[0], messages
    assert result.resumed_from == 4  # the rebuilt data match the checkpoint's fingerprint
    np.testing.assert_array_equal(TokenData.load(cache).input_ids,
                                  TokenData.load(os.path.join(run, "data", "train.npz")).input_ids)


# ----------------------------------------------------------------------------- 4. one line for a damaged checkpoint

RESUME = textwrap.dedent("""
    import sys
    from sparkjax.training.cli import main
    rc = main(sys.argv[1:])
    print("DROPPED", getattr(sys.unraisablehook, "dropped", None), flush=True)
    sys.exit(rc)
""")


@pytest.mark.slow
def test_damaged_checkpoint_fallback_prints_one_line(tmp_path, run, xla_cache):
    out = str(tmp_path / "damaged")
    shutil.copytree(run, out)
    zeroed = 0
    for root, _, files in os.walk(os.path.join(out, "checkpoints", "4", "state")):
        for name in files if os.path.basename(root) == "d" else ():  # the array data and b-tree nodes
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                f.write(b"\0" * os.path.getsize(path))
            zeroed += 1
    assert zeroed > 0
    proc = subprocess.run(
        [sys.executable, "-c", RESUME, "--recipe", RECIPE, "--output", out, *cli_sets(), "--resume", "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, timeout=400,
        env={**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_cache,
             "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[0])["resumed_from"] == 2
    warn = [line for line in proc.stderr.splitlines() if "corrupted or incomplete" in line]
    assert len(warn) == 1 and "falling back to step 2" in warn[0]
    noise = [line for line in proc.stderr.splitlines()
             if "Exception ignored" in line or "Event loop is closed" in line or "Traceback" in line]
    assert len(noise) < 5, proc.stderr[-3000:]
    print(proc.stdout.splitlines()[-1])  # DROPPED n: how many reports the filter took out
    assert len(proc.stderr.splitlines()) < 12, proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(out, "checkpoints", "corrupt-4-0"))


def _late_tensorstore_read() -> None:
    """What a failed orbax restore leaves: a tensorstore read awaited on an event loop that is closed
    (the restore failed on another read) before this read completes."""
    import tensorstore as ts

    promise, future = ts.Promise.new()

    async def read():
        return await future

    async def restore():
        pending = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        assert not pending.done()
        raise ValueError("another read failed")

    loop = asyncio.new_event_loop()
    with pytest.raises(ValueError):
        loop.run_until_complete(restore())
    loop.close()
    promise.set_result(1)  # the read completes: tensorstore calls loop.call_soon_threadsafe on the closed loop


def test_closed_loop_filter_drops_only_that_report(tmp_path, monkeypatch):
    from sparkjax.io.checkpoint import TrainCheckpointer, _ClosedLoopFilter

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    _late_tensorstore_read()
    assert len(seen) == 1 and str(seen[0].exc_value) == "Event loop is closed"  # the noise, without the filter
    TrainCheckpointer(str(tmp_path / "ck"), keep_last=1, keep_best=0).close()  # installs the filter
    hook = sys.unraisablehook
    assert isinstance(hook, _ClosedLoopFilter) and hook.previous == seen.append
    _late_tensorstore_read()
    assert len(seen) == 1 and hook.dropped == 1
    TrainCheckpointer(str(tmp_path / "ck2"), keep_last=1, keep_best=0).close()
    assert sys.unraisablehook is hook  # installed once
    noise = seen[0]
    report = dict(exc_type=RuntimeError, exc_value=noise.exc_value, exc_traceback=noise.exc_traceback, err_msg=None,
                  object=None)
    others = [types.SimpleNamespace(**{**report, **change}) for change in (
        {"exc_value": RuntimeError("something else")}, {"object": object()}, {"exc_traceback": None})]
    for other in others:  # another error, one tied to an object, one raised elsewhere
        hook(other)
    assert seen[1:] == others and hook.dropped == 1


# ----------------------------------------------------------------------------- 5. metrics after a resume


@pytest.mark.parametrize("how", ["killed", "damaged"])
def test_lm_resume_drops_the_metric_lines_past_its_checkpoint(tmp_path, lm_run, tokens, how):
    out = str(tmp_path / "lm")
    shutil.copytree(lm_run, out)
    metrics = os.path.join(out, "metrics.jsonl")
    assert steps_of(metrics) == [1, 2, 3, 4]
    step4 = os.path.join(out, "checkpoints", "4")
    if how == "killed":  # as a kill between the checkpoints of steps 2 and 4 leaves it: lines 3-4, no step 4
        shutil.rmtree(step4)
        with open(metrics, "a") as f:
            f.write('{"step": 5, "split": "tr')  # a line cut by the kill
    else:  # step 4's metadata unreadable: the resume falls back to step 2
        with open(os.path.join(step4, "meta", "metadata"), "w") as f:
            f.write("{garbage")
    messages = []
    r = train_lm(lm_cfg(), out, resume=True, log=messages.append, **tokens)
    assert r.step == 4 and "resumed at step 2" in messages
    assert steps_of(metrics) == [1, 2, 3, 4]
    if how == "damaged":
        assert os.path.isdir(os.path.join(out, "checkpoints", "corrupt-4-0"))
        assert sum("falling back to step 2" in m for m in messages) == 1


def test_lm_run_without_a_checkpoint_starts_its_metrics_afresh(tmp_path, lm_run, tokens):
    # a run folder killed before its first checkpoint: some metric lines and its lock file, no checkpoints
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with open(os.path.join(lm_run, "metrics.jsonl")) as f:
        (fresh / "metrics.jsonl").write_text("".join(f.readlines()[:3]))
    shutil.copy(os.path.join(lm_run, LOCK_NAME), fresh / LOCK_NAME)
    train_lm(lm_cfg(), str(fresh), log=lambda *_: None, **tokens)  # lm_run's settings: its compiled programs
    assert steps_of(str(fresh / "metrics.jsonl")) == [1, 2, 3, 4]


def test_drop_metrics_after(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    assert drop_metrics_after(path, 3) == 0 and not os.path.exists(path)
    lines = [{"step": 1, "split": "train"}, {"step": 2, "split": "eval"}, {"step": 3}, {"step": 2, "split": "train"}]
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines) + "[1, 2]\n" + '{"step": 4, "lo')
    assert drop_metrics_after(path, 2) == 3
    assert steps_of(path) == [1, 2, 2]


# ----------------------------------------------------------------------------- 6. one line, exit 2


@pytest.mark.parametrize("argv", [
    ["--output", "x"],  # --recipe missing (argparse)
    ["--recipe", RECIPE, "--output", "x", "--steps", "many"],
    ["--recipe", RECIPE, "--output", "x", "--set", "steps"],
    ["--recipe", RECIPE, "--output", "x", "--set", "=3"],
    ["--recipe", "no_such_recipe", "--output", "x"],
    ["--recipe", RECIPE, "--output", "x", "--export-to", "y"],
])
def test_train_cli_mistakes_are_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        sys.exit(train_cli.main(argv))
    assert info.value.code == 2
    one_error_line(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("argv", [
    [],  # --output missing (argparse)
    ["--output", "x"],  # --recipe / --corpus missing
    ["--output", "x", "--recipe", "nope.json", "--corpus", "c"],
    ["--output", "x", "--export", "y", "--tokenizer", "no_tokenizer"],
    ["--output", "x", "--export", "y"],  # not a run
    ["--output", "x", "--recipe", "r.json", "--corpus", "c", "--set", "seq_len"],
    ["--output", "x", "--max-minutes", "soon"],
    ["--output", "x", "--recipe", "r.json", "--corpus", "c", "--set", "model=3"],
    ["--output", "x", "--recipe", "r.json", "--corpus", "c", "--set", 'seed="a"'],
])
def test_train_target_cli_mistakes_are_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open("r.json", "w") as f:
        json.dump({"model": LM_MODEL}, f)
    with pytest.raises(SystemExit) as info:
        sys.exit(train_target.main(argv))
    assert info.value.code == 2
    one_error_line(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "y")


# ----------------------------------------------------------------------------- 7. one loop: SIGTERM / Ctrl-C stop


def test_sigterm_saves_a_checkpoint_and_stops_and_resume_continues(tmp_path, lm_run, tokens):
    out = str(tmp_path / "term")
    before = signal.getsignal(signal.SIGTERM)
    messages = []

    def hook(step, saved):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once: the loop stops after this step

    r = fit(LMTask(**tokens), lm_cfg(), out, log=messages.append, on_step=hook)
    assert r.stopped_early and r.step == 1, messages
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back
    assert sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit()) == [1]
    assert any("SIGTERM" in m for m in messages)
    with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
        fit(LMTask(**tokens), lm_cfg(), out, resume=True, log=lambda m: None,
            on_step=lambda step, saved: [os.kill(os.getpid(), signal.SIGINT) for _ in range(2)])
    assert signal.getsignal(signal.SIGTERM) is before
    r = train_lm(lm_cfg(), out, resume=True, log=lambda *_: None, **tokens)
    assert r.step == 4 and not r.stopped_early
    assert steps_of(os.path.join(out, "metrics.jsonl")) == [1, 2, 3, 4]
