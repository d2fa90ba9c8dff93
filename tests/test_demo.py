"""The bundled, trained demo pair (sparkjax/assets/demo): it loads everywhere, decodes exactly, and is trained.

The tau thresholds below sit under the values measured on the same prompts and settings (written in
sparkjax/assets/demo/MODEL_CARD.md), with margin: they show the drafters learned, not noise.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

import sparkjax
from sparkjax import demo

MAX_NEW = 48
BUDGET = 16
# (method, drafter attribute): the baseline methods run the drafter trained without the Markov head
RUNS = (("dflash", "dflash"), ("dspark", "dspark"), ("ddtree", "dflash"), ("sparklingtree", "dspark"),
        ("sparklingtree-beam", "dspark"))


@pytest.fixture(scope="module")
def prompt_ids(demo_pair):
    """Two prompts of each bundled set (the first two lines), encoded as the eval encodes them."""
    return [demo_pair.encode_row(row) for name in demo.PROMPT_SETS for row in demo.prompts(name)[:2]]


@pytest.fixture(scope="module")
def outputs(demo_pair, prompt_ids):
    """Each method's generation on the demo prompts, run when a test first asks for it (the default run needs two
    of the six; the slow exactness test all of them)."""

    @functools.cache
    def run(method):
        which = dict(RUNS, ar=None)[method]
        label = f"{method}@{BUDGET}" if method in sparkjax.engine.TREE_METHODS else method
        drafter = getattr(demo_pair, which) if which else None
        return sparkjax.generate(demo_pair.target, drafter, prompt_ids, method=label, max_new_tokens=MAX_NEW,
                                 eos_token_ids=demo_pair.eos_token_ids)

    return run


def tau(res) -> float:
    return float(np.mean([x for seq in res.acceptance_lengths for x in seq]))


def test_bundle_is_complete_and_small():
    total = 0
    for part in ("target", "dspark_b16", "dflash_b16"):
        folder = demo.path(part)
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
        total += sum(f.stat().st_size for f in folder.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (demo.path("target") / name).is_file(), name
    assert total <= 25 * 2**20
    card = demo.path("MODEL_CARD.md").read_text()
    info = json.loads(demo.path("training.json").read_text())
    assert info["corpus"]["sha256"]["train"] in card  # the card names the corpus it was trained on


@pytest.mark.slow
def test_transformers_loads_the_target_and_tokenizer(demo_pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(demo.path("target"))
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "What is Python?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is Python?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode("def read(path):\n    with open(path) as f:\n", add_special_tokens=False)
    assert tok.decode(ids) == "def read(path):\n    with open(path) as f:\n"
    assert tok.convert_tokens_to_ids("<|mask|>") == demo_pair.dspark.config.mask_token_id
    mask = demo_pair.dspark.config.mask_token_id
    assert mask not in tok.encode("<|mask|> is plain text here", split_special_tokens=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor([ids])).logits.numpy()
    ours = np.asarray(demo_pair.target(np.asarray([ids]), np.arange(len(ids))[None]).logits)
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_drafters_differ_only_in_the_markov_head(demo_pair):
    a, b = demo_pair.dspark.config, demo_pair.dflash.config
    assert a.has_markov and not b.has_markov and a.block_size == b.block_size == 16
    assert (a.num_hidden_layers, a.target_layer_ids, a.hidden_size) == (b.num_hidden_layers, b.target_layer_ids,
                                                                       b.hidden_size)


# Floors under the values MODEL_CARD.md lists for these prompts and settings; random drafters stay far below them.
TAU_FLOOR_DSPARK = 2.5
TAU_FLOOR_DFLASH = 2.0


@pytest.mark.slow  # also shows that both drafters learned: the Markov one and the one without the head
def test_every_method_emits_exactly_the_greedy_tokens_and_trees_beat_chains(outputs):
    ar = outputs("ar").tokens
    assert all(len(t) > 0 for t in ar)
    for method, _ in RUNS:
        assert outputs(method).tokens == ar, method
    taus = {m: tau(outputs(m)) for m in ("dflash", "dspark", "ddtree", "sparklingtree")}
    assert taus["sparklingtree"] > taus["dspark"] > TAU_FLOOR_DSPARK, taus
    assert taus["ddtree"] > taus["dflash"] > TAU_FLOOR_DFLASH, taus


def test_demo_api_errors(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "missing")
    with pytest.raises(sparkjax.CheckpointError, match="bundled demo pair is missing"):
        demo.load()
    with pytest.raises(sparkjax.CheckpointError, match="not one of"):
        demo.prompts("gsm8k")
    assert os.fspath(demo.DEMO_DIR).endswith("missing")
