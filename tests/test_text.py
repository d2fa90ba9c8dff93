"""sparkjax.text: the demo and the eval encode a question identically through a Qwen3-style chat template (with its
enable_thinking switch); EOS ids; tokenizer errors; where the public prompt sets are looked up."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from fixtures.default_tokenizer import write_default_tokenizer

from sparkjax import demo, text
from sparkjax.errors import ArgumentError, DatasetError, SparkjaxError, TokenizerError
from sparkjax.eval import datasets as ds

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Qwen3's chat template, without the tool-calling branches: a system turn, the conversation (earlier assistant
# turns lose their reasoning), and the generation prompt, which closes an empty think block when thinking is off.
QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
QUESTION = "How do I read a file line by line?"
HEADER = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> pathlib.Path:
    """A tokenizer folder laid out like a Qwen3 checkpoint's: the template in ``chat_template.jinja`` and a
    ``generation_config.json`` with two EOS ids (as Qwen3's: ``<|im_end|>`` and ``<|endoftext|>``)."""
    folder = write_default_tokenizer(tmp_path_factory.mktemp("qwen3_tok"))
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["chat_template"]
    cfg_file.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [303, 301], "do_sample": False}))
    return folder


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return text.load_tokenizer(qwen3_dir)


def test_demo_and_eval_give_the_same_ids(tok, qwen3_dir):
    pair = demo.DemoPair(target=None, dspark=None, dflash=None, tokenizer=tok, target_dir=qwen3_dir)
    by_demo = pair.encode_chat(QUESTION)
    assert by_demo == text.encode_prompt(tok, QUESTION, "chat") == text.encode_chat(tok, QUESTION)
    assert tok.decode(by_demo) == HEADER + "<think>\n\n</think>\n\n"
    # prompt-set rows: chat rows and raw rows, through either path
    for row, prompt, kind in (({"turns": [QUESTION, "a second turn"]}, QUESTION, "chat"),
                              ({"text": "def read(path):\n    "}, "def read(path):\n    ", "text")):
        assert pair.encode_row(row) == text.encode_prompt(tok, prompt, kind) == text.encode_row(tok, row)
    raw = pair.encode_text("def read(path):\n    ")
    assert raw == tok.encode("def read(path):\n    ", add_special_tokens=False) and 302 not in raw
    assert pair.eos_token_ids == text.eos_ids(tok, qwen3_dir) == [301, 303]


def test_the_thinking_switch_is_honoured(tok):
    off = text.encode_chat(tok, QUESTION)
    on = text.encode_chat(tok, QUESTION, enable_thinking=True)
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert (think, end_think) == (304, 305)
    assert tok.decode(on) == HEADER and think not in on and end_think not in on
    assert off[: len(on)] == on and off[len(on):] == tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert off.count(think) == 1 and off.count(end_think) == 1
    assert demo.DemoPair(None, None, None, tok).encode_chat(QUESTION, enable_thinking=True) == on
    # what a call without the switch renders (the old demo path): Qwen3's template then leaves thinking on
    plain = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                    add_generation_prompt=True)
    assert tok.encode(plain, add_special_tokens=False) == on != off


def test_eos_ids_from_generation_config_and_tokenizer(tok, tmp_path):
    assert text.eos_ids(tok, None) == [303]  # the tokenizer's <|im_end|>
    assert text.eos_ids(tok, tmp_path) == [303]  # no generation_config.json
    for value, expected in ((7, [7, 303]), ([303, 5, True, "x"], [5, 303]), (None, [303]), ("2", [303])):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert text.eos_ids(tok, tmp_path) == expected, value
    (tmp_path / "generation_config.json").write_text("not json")
    assert text.eos_ids(tok, tmp_path) == [303]


def test_tokenizer_errors_name_the_folder(tok, tmp_path, qwen3_dir):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match=re.escape(f"--tokenizer: {missing} is not a folder")):
        text.load_tokenizer(missing)
    with pytest.raises(SparkjaxError, match=re.escape(f"demo target: {tmp_path} holds no tokenizer")):
        text.load_tokenizer(tmp_path, what="demo target")
    with pytest.raises(ArgumentError, match="kind must be one of chat, text"):
        text.encode_prompt(tok, QUESTION, "completion")
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((qwen3_dir / name).read_bytes())
    (broken / "chat_template.jinja").write_text("{{ raise_exception('no system turn') if true }}")
    with pytest.raises(TokenizerError, match="chat template does not render"):
        text.encode_chat(text.load_tokenizer(broken), QUESTION)


def test_public_prompt_sets_are_found_from_the_working_folder_or_the_env_var(tmp_path, monkeypatch):
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)  # not a source checkout
    with pytest.raises(DatasetError) as e:
        ds.load("gsm8k")
    msg = str(e.value)
    assert str(tmp_path / "eval" / "datasets" / "gsm8k.jsonl") in msg and ds.ENV_VAR in msg and "source checkout" in msg
    # the demo sets ship in the package and do not depend on the working folder
    assert pathlib.Path(ds.load("python_docs").path).parent == demo.DEMO_DIR / "prompts"
    monkeypatch.setenv(ds.ENV_VAR, str(ROOT / "eval" / "datasets"))
    assert ds.load("gsm8k").path == str(ROOT / "eval" / "datasets" / "gsm8k.jsonl")
    monkeypatch.setenv(ds.ENV_VAR, str(tmp_path / "elsewhere"))
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'elsewhere' / 'mbpp.jsonl'} (${ds.ENV_VAR})")):
        ds.load("mbpp")
    monkeypatch.delenv(ds.ENV_VAR)
    monkeypatch.chdir(ROOT)  # the checkout's root
    assert ds.load("mt-bench").path == str(ROOT / "eval" / "datasets" / "mt-bench.jsonl")


def test_package_resolves_no_path_through_its_source_tree():
    # bundled data is read through importlib.resources; sparkjax/training is checked by its own tests
    offenders = []
    for f in sorted((ROOT / "sparkjax").rglob("*.py")):
        if "training" in f.relative_to(ROOT / "sparkjax").parts:
            continue
        src = f.read_text(encoding="utf-8")
        # sparkjax.cachedir is the one module that names the user's cache folder (cost tables, XLA's cache)
        patterns = ("__file__",) if f.name == "cachedir.py" else ("__file__", "XDG_CACHE_HOME", "~/.cache")
        offenders += [f"{f.relative_to(ROOT)}: {pat}" for pat in patterns if pat in src]
        # a path's ancestors (``Path.parents[1]``), not an array named parents (``prop.parents[:, :b]``)
        offenders += [f"{f.relative_to(ROOT)}: .parents[N]" for _ in re.finditer(r"\.parents\[\s*-?\d", src)]
    assert offenders == []
    assert demo.DEMO_DIR == pathlib.Path(demo.__file__).parent / "assets" / "demo"
