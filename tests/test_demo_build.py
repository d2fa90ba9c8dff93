"""The demo pair's build tools: corpus builder, tokenizer trainer, target pre-training (resume, export)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sysconfig

import numpy as np
import pytest

from sparkjax.errors import SparkjaxError, TrainingError

TRAIN = pathlib.Path(__file__).resolve().parents[1] / "train"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"train_{name}", TRAIN / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


corpus = _load("corpus")

FAQ = """\
===========
Library FAQ
===========

General
=======

How do I find a module for a task?
----------------------------------

Look in the :ref:`Library Reference <library-index>` and use :func:`help`.

Is there a ``math`` library?
----------------------------

Yes, see `the docs <https://docs.python.org/3/library/math.html>`_.

Threads
=======

How do I program using threads?
-------------------------------

Use the :mod:`threading` module.
"""


@pytest.fixture(scope="module")
def docs_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs_sources")
    (root / "faq").mkdir()
    (root / "faq" / "library.rst.txt").write_text(FAQ)
    (root / "library").mkdir()
    (root / "library" / "math.rst.txt").write_text(":mod:`math` --- Mathematical functions\n" * 20)
    return root


def test_faq_pages_become_question_answer_turns():
    turns = corpus.faq_turns(FAQ)
    assert [q for q, _ in turns] == ["How do I find a module for a task?", "Is there a math library?",
                                     "How do I program using threads?"]
    # a section heading ('Threads' / '=====') ends the previous answer; roles and links become plain text
    assert turns[1][1] == "Yes, see the docs."
    assert turns[0][1] == "Look in the Library Reference and use help."
    assert "Threads" not in turns[1][1]


def test_math_problems_are_correct_and_boxed():
    import random
    import re

    rng = random.Random(1)
    for _ in range(200):
        text = corpus.math_problem(rng)
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", text)
        assert steps, text
        for a, op, b, c in ((int(a), op, int(b), int(c)) for a, op, b, c in steps):
            assert (b and a == b * c) if op == "/" else {"+": a + b, "-": a - b, "*": a * b}[op] == c, text
        assert text.rstrip().endswith("}.<|im_end|>") and f"\\boxed{{{steps[-1][3]}}}" in text


def test_corpus_build_is_deterministic_and_respects_the_math_share(tmp_path, docs_root):
    kw = dict(stdlib_root=sysconfig.get_paths()["stdlib"], docs_root=str(docs_root), seed=3, math_share=0.15,
              heldout=0.2, limit_files=12)
    a, b = corpus.build(**kw), corpus.build(**kw)
    assert a[2]["sha256"] == b[2]["sha256"]
    corpus.write(str(tmp_path / "c1"), *a)
    corpus.write(str(tmp_path / "c2"), *b)
    for name in ("train.jsonl", "heldout.jsonl", "manifest.json"):
        assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c2" / name).read_bytes()
    m = a[2]
    assert 0.10 <= m["math_char_share"] <= 0.15
    assert m["chars_per_source"]["stdlib"] > 0 and m["chars_per_source"]["docs"] > 0
    faq = [d for d in a[0] + a[1] if d["id"].startswith("faq/")]
    assert len(faq) == 3 and all(d["text"].startswith("<|im_start|>user\n") for d in faq)
    # another seed changes the synthetic part and therefore the hash
    c = corpus.build(**{**kw, "seed": 4})
    assert c[2]["sha256"]["train"] != m["sha256"]["train"]
    with pytest.raises(corpus.CorpusError, match="math-share"):
        corpus.build(**{**kw, "math_share": 1.5})


def test_missing_docs_folder_is_a_clear_error(tmp_path, capsys):
    assert corpus.main(["--out", str(tmp_path / "c"), "--docs-root", str(tmp_path / "nope")]) == 2
    assert "python3.11-doc" in capsys.readouterr().err


# ----------------------------------------------------------------------------- target pre-training
TINY_MODEL = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_tokens")
    rng = np.random.default_rng(0)
    base = np.tile(np.arange(1, 33, dtype=np.uint16), 200)  # a learnable stream: a repeated pattern with noise
    noise = rng.integers(1, 64, base.size).astype(np.uint16)
    stream = np.where(rng.random(base.size) < 0.1, noise, base)
    np.save(root / "train.tokens.npy", stream)
    np.save(root / "heldout.tokens.npy", stream[:800])
    return root


def _cfg(**kw):
    from sparkjax.training.lm import LMConfig

    d = dict(model=TINY_MODEL, seq_len=16, batch_size=4, steps=12, lr=1e-2, warmup_steps=2, eval_every=6,
             eval_batches=2, checkpoint_every=4, log_every=2)
    d.update(kw)
    return LMConfig(**d)


@pytest.mark.slow
def test_lm_pretraining_learns_resumes_exactly_and_exports(tmp_path, token_files):
    import jax
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from sparkjax import load_target
    from sparkjax.training.lm import export_lm, train_lm

    kw = dict(tokens=str(token_files / "train.tokens.npy"), heldout=str(token_files / "heldout.tokens.npy"),
              log=lambda *_: None)
    straight = train_lm(_cfg(), str(tmp_path / "straight"), **kw)
    assert straight.step == 12 and not straight.stopped_early
    metrics = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl")]
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.5  # it learns the pattern

    # a time limit of 0 minutes stops (and saves) after one step; the resumed run ends with the same weights
    cut = train_lm(_cfg(), str(tmp_path / "cut"), max_minutes=0.0, **kw)
    assert cut.stopped_early and cut.step == 1
    with pytest.raises(TrainingError, match="--resume"):
        train_lm(_cfg(), str(tmp_path / "cut"), **kw)
    with pytest.raises(TrainingError, match="another config"):
        train_lm(_cfg(lr=2e-2), str(tmp_path / "cut"), resume=True, **kw)
    resumed = train_lm(_cfg(), str(tmp_path / "cut"), resume=True, **kw)
    assert resumed.step == 12
    # a stop right after a scheduled checkpoint does not save that step twice
    again = train_lm(_cfg(checkpoint_every=1), str(tmp_path / "every"), max_minutes=0.0, **kw)
    assert again.stopped_early and again.step == 1

    a = export_lm(str(tmp_path / "straight"), str(tmp_path / "hf_a"), dtype="float32",
                  special_ids={"eos_token_id": 2, "pad_token_id": 0})
    b = export_lm(str(tmp_path / "cut"), str(tmp_path / "hf_b"), dtype="float32")
    pa, pb = nnx.state(load_target(a), nnx.Param), nnx.state(load_target(b), nnx.Param)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)

    # transformers reads the export, and its logits agree with sparkjax's
    import torch

    hf = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    assert hf.config.eos_token_id == 2
    ids = np.arange(1, 17)[None]
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    ours = load_target(a)(ids, np.arange(16)[None]).logits
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=2e-4, atol=2e-4)


def test_lm_bad_inputs(tmp_path, token_files):
    from sparkjax.training.lm import LMConfig, load_tokens

    with pytest.raises(TrainingError, match="seq_len"):
        _cfg(seq_len=0)
    with pytest.raises(TrainingError, match="unknown key"):
        LMConfig.from_dict({"model": TINY_MODEL, "sequence_length": 3}, source="r.json")
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full(100, 500, np.uint16))
    with pytest.raises(TrainingError, match="outside the model's vocabulary"):
        load_tokens(str(bad), 64, 16)
    with pytest.raises(TrainingError, match="fewer than one window"):
        load_tokens(str(token_files / "heldout.tokens.npy"), 64, 5000)


# ----------------------------------------------------------------------------- tokenizer and distillation prompts
def test_tokenizer_trains_saves_and_encodes_the_corpus(tmp_path, docs_root):
    from transformers import AutoTokenizer

    tokmod = _load("demo_tokenizer")
    distill = _load("distill_data")
    train, held, manifest = corpus.build(stdlib_root=sysconfig.get_paths()["stdlib"], docs_root=str(docs_root),
                                         seed=0, heldout=0.2, limit_files=6)
    corpus.write(str(tmp_path / "c"), train, held, manifest)
    assert tokmod.main(["--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "tok"), "--vocab", "400"]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    mine = tmp_path / "mine"  # a folder of the user's is refused and kept; the tokenizer's own is replaced
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    trained = tokmod.train_tokenizer(str(tmp_path / "c"), 400)
    with pytest.raises(SparkjaxError, match="mine"):
        tokmod.save_tokenizer(trained, str(mine))
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    tokmod.save_tokenizer(trained, str(tmp_path / "tok"))
    assert [tok.convert_tokens_to_ids(t) for t in tokmod.SPECIALS] == [0, 1, 2, 3]
    assert tok.eos_token == "<|im_end|>" and len(tok) == 400
    text = tok.apply_chat_template([{"role": "user", "content": "2 + 2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode("x = 1234\n", add_special_tokens=False)
    assert tok.decode(ids) == "x = 1234\n"
    assert [tok.decode([i]) for i in ids[-5:-1]] == ["1", "2", "3", "4"]  # digits one per token
    stream = np.load(tmp_path / "c" / "train.tokens.npy")
    assert stream.dtype == np.uint16 and 3 not in set(stream.tolist())  # the mask token never comes from text
    assert (stream == 0).sum() == len(train)  # one <|endoftext|> after each document
    # distillation prompts: chat documents end at the assistant header, others are 32..max windows
    prompts = distill.pick_prompts(str(tmp_path / "c"), tok, 40, seed=1, max_prompt=48)
    assert prompts == distill.pick_prompts(str(tmp_path / "c"), tok, 40, seed=1, max_prompt=48)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for p in prompts:
        assert 1 <= len(p) <= 48
        assert p[-len(header):] == header or 1 not in p
    assert tokmod.main(["--corpus", str(tmp_path / "nowhere"), "--out", str(tmp_path / "t2")]) == 2


def test_bundle_drafters_only_replaces_the_drafters_and_records_the_runs(tmp_path):
    """``bundle_demo.py --drafters-only`` (a fine-tune of the bundled drafters): both drafters re-saved in bf16,
    the fine-tune runs added to training.json, the pre-training record and the target left as they were."""
    import shutil

    from sparkjax import demo, load_drafter, load_target

    bundle = _load("bundle_demo")
    out = tmp_path / "demo"
    shutil.copytree(demo.path("target"), out / "target")
    shutil.copy(demo.path("training.json"), out / "training.json")
    before = json.loads((out / "training.json").read_text())
    runs = {}
    for kind in ("dspark", "dflash"):
        run = tmp_path / f"{kind}_run"
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"name": f"{kind}_ft", "tree_loss_alpha": 1.0}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "split": "eval", "tau_probabilistic": 5.5}) + "\n")
        runs[kind] = run
    args = ["--drafters-only", "--out", str(out), "--dspark", str(demo.path("dspark_b16")),
            "--dflash", str(demo.path("dflash_b16")), "--dspark-run", str(runs["dspark"]),
            "--dflash-run", str(runs["dflash"])]
    assert bundle.main(args) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["corpus"] == before["corpus"] and info["target_run"] == before["target_run"]
    assert info["dspark_finetune"]["config"]["name"] == "dspark_ft"
    assert info["dflash_finetune"]["last_eval"]["tau_probabilistic"] == 5.5
    target = load_target(str(out / "target"))
    for name in ("dspark_b16", "dflash_b16"):
        d = load_drafter(str(out / name), target=target)
        assert str(d.dtype) == "bfloat16" and info["bytes"][name] > 0
    assert not list(out.glob(".*tmp*"))  # nothing half-written left behind
    # a run folder without its config is refused before anything is written
    (runs["dflash"] / "config.json").unlink()
    stamp = (out / "dspark_b16" / "model.safetensors").stat().st_mtime_ns
    assert bundle.main(args) == 2
    assert (out / "dspark_b16" / "model.safetensors").stat().st_mtime_ns == stamp
