"""Shared test fixtures: the bundled reference fixture and tiny random Hugging Face Qwen3 models."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np
import pytest

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "tiny_dspark_b16"

# No test reads or writes the user's cache folder (cost tables, compilation cache) unless it sets its own.
os.environ.setdefault("SPARKJAX_CACHE_DIR", "off")

# One persistent XLA compilation cache for the session and the subprocesses it starts (set before jax is imported;
# a folder the caller chose is kept).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparkjax-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# The suite is mostly XLA:CPU compilation, so it compiles for speed: optimisation level 0, and the legacy elemental
# emitters instead of the MLIR fusion emitters (about a third less compile time; the HLO passes are the same). CI
# runs the exactness files with XLA's defaults too. An XLA_FLAGS the caller set, even an empty one, is kept.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


_STATIC = (bool, int, float, str, tuple, type(None))


def jit_call(model, *args, **kwargs):
    """``model(*args, **kwargs)`` as one compiled program per shape (plain Python values and callables static),
    the same computation as an eager call without compiling op by op."""
    static = tuple(sorted((k, v) for k, v in kwargs.items() if _is_static(v)))
    dynamic = {k: v for k, v in kwargs.items() if not _is_static(v)}
    return _jitted_call(model, args, dynamic, static=static)


def _is_static(v) -> bool:
    return isinstance(v, _STATIC) or callable(v)  # a callable: the models' attention=


def _call(model, args, dynamic, static):
    return model(*args, **dynamic, **dict(static))


_jitted = None  # built on first use: conftest does not import flax at collection time


def _jitted_call(model, args, dynamic, *, static):
    global _jitted
    if _jitted is None:
        from flax import nnx

        _jitted = nnx.jit(_call, static_argnames=("static",))
    return _jitted(model, args, dynamic, static=static)


# The XLA options the suite compiles with (above), per program: what jit_exact passes whatever XLA_FLAGS says.
EXACT_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def jit_exact(fn, *modules_and_args):
    """``fn(*modules_and_args)`` (Flax modules among them) as one compiled program with :data:`EXACT_OPTIONS`,
    for a test that compares two computations inside it bit for bit: both are compiled together and the same
    way under any XLA_FLAGS (CI's second pass runs XLA's defaults, whose fusion may round two shapes of the
    same ops differently). Compiled on every call: for checks that run once."""
    import jax
    from flax import nnx

    is_module = [isinstance(x, nnx.Module) for x in modules_and_args]
    graphdefs = {i: nnx.split(x) for i, x in enumerate(modules_and_args) if is_module[i]}
    dynamic = [graphdefs[i][1] if is_module[i] else x for i, x in enumerate(modules_and_args)]

    def run(dynamic):
        return fn(*(nnx.merge(graphdefs[i][0], x) if is_module[i] else x for i, x in enumerate(dynamic)))

    return jax.jit(run).lower(dynamic).compile(EXACT_OPTIONS)(dynamic)


@pytest.fixture(scope="session")
def xla_cache() -> str:
    """The session's persistent XLA cache folder (set above), for subprocesses to reuse."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture(scope="session")
def fixture_dir() -> pathlib.Path:
    return FIXTURE


@pytest.fixture(scope="session")
def ref() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(FIXTURE / "reference.safetensors"))


@pytest.fixture(scope="session")
def fixture_target():
    from sparkjax import load_target

    return load_target(FIXTURE / "target")


@pytest.fixture(scope="session")
def fixture_drafter(fixture_target):
    from sparkjax import load_drafter

    return load_drafter(FIXTURE / "drafter", target=fixture_target)


@pytest.fixture(scope="session")
def pair(fixture_target, fixture_drafter):
    """The upstream fixture pair as (target, drafter)."""
    return fixture_target, fixture_drafter


# The shapes the engine tests share, so their programs are reused: three prompts in one bucket, and these lengths
# (``max_new_tokens`` is traced but sets the output buffer's bucket).
NEW_SHORT, NEW_LONG = 8, 24
PROMPTS3 = [[1, 2, 3, 4, 5], [7, 3], [9, 9, 9, 1, 0, 4, 2, 8]]


@pytest.fixture(scope="session")
def demo_pair():
    """The bundled, trained demo pair (``sparkjax.demo.load``) in float32."""
    from sparkjax import demo

    return demo.load(dtype="float32")


@pytest.fixture(scope="session")
def tiny_pair():
    """The distributed demo's tiny pair (``sparkjax.distributed_demo.tiny_pair(0)``), as (target, drafter)."""
    from sparkjax.distributed_demo import tiny_pair

    return tiny_pair(0)


# The auto method the tests share (one program on the random pair with PROMPTS3 and NEW_LONG): these sizes, and a
# cost table under which every size is viable (each pays at half its depth + 1 tokens), probe floor 4.
AUTO_SIZES = (0, "chain", 2, 6, 16)
AUTO_SECONDS = (1.0, 1.3, 1.4, 1.6, 1.9)


def auto_method(drafter, seconds=AUTO_SECONDS, sizes=AUTO_SIZES, **kw):
    """``Auto(sizes=sizes, table=<seconds for the labels sizes resolve to on drafter>, **kw)``."""
    from sparkjax.engine import Auto, CostTable

    return Auto(sizes=sizes, table=CostTable(Auto(sizes=sizes).resolve(drafter).labels(), tuple(seconds)), **kw)


@pytest.fixture(scope="session")
def random_pair():
    """The session's random pair (:func:`sparkjax.testing.random_pair` with its defaults)."""
    from sparkjax import testing

    return testing.random_pair()


@pytest.fixture(scope="session")
def fixture_prompts(ref) -> list[list[int]]:
    """Three prompts for the fixture pair, in one bucket: upstream's prompt, 13 random ids and its first 19."""
    p = ref["a.prompt_ids"][0].tolist()
    return [p, np.random.default_rng(7).integers(0, 300, 13).tolist(), p[:19]]


@pytest.fixture(scope="session")
def fixture_ar(pair, fixture_prompts) -> list[list[int]]:
    """The fixture target's greedy NEW_LONG tokens of ``fixture_prompts`` (``ar``): what every method reproduces."""
    from sparkjax import generate

    return generate(pair[0], None, fixture_prompts, max_new_tokens=NEW_LONG).tokens


@pytest.fixture(scope="session")
def random_ar(random_pair) -> list[list[int]]:
    """The random target's greedy NEW_LONG tokens of PROMPTS3 (``ar``)."""
    from sparkjax import generate

    return generate(random_pair[0], None, PROMPTS3, max_new_tokens=NEW_LONG).tokens


# The short drafter training run the training tests resume, damage and export: train/recipes/tiny.json for
# 4 steps, checkpoints at steps 2 and 4 (one set of shapes and optimizer settings, so one compiled step).
TINY_RUN = dict(steps=4, checkpoint_every=2, log_every=1, eval_size=0, seq_len=48, batch_size=8, warmup_steps=1,
                keep_last=3, synthetic={"num_sequences": 16, "prompt_len": 16, "seed": 1, "vocab_high": 300})
TINY_RECIPE = str(pathlib.Path(__file__).parents[1] / "train" / "recipes" / "tiny.json")


def tiny_run_config(**kw):
    from sparkjax.training import TrainConfig

    return TrainConfig.from_file(TINY_RECIPE, {**TINY_RUN, **kw})


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> str:
    """The folder of one finished TINY_RUN (tests copy it before they change anything). It is trained once for the
    whole run: the first xdist worker that needs it trains it under a lock, the other one reads it."""
    import fcntl

    from sparkjax.training import train

    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # this run's folder, the same for every worker
    out, done = root / "tiny_run", root / "tiny_run.done"
    with open(root / "tiny_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            assert train(tiny_run_config(), str(out), progress=False, log=lambda m: None).step == 4
            done.touch()
    return str(out)


def make_hf_qwen3(folder, *, tied=True, layers=3, heads=4, kv_heads=2, vocab=160, hidden=64, ffn=128,
                  head_dim=16, attention_bias=False, seed=0, max_positions=512, dtype="float32", **save_kwargs):
    """Saves a tiny random transformers Qwen3ForCausalLM with sharp logits to ``folder``; returns the torch model."""
    import torch
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    cfg = HFConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=tied, attention_bias=attention_bias, max_position_embeddings=max_positions,
        rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) * 0.4 + 0.8)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "o_proj" in name else 0.2))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(folder), safe_serialization=True, **save_kwargs)
    return model


@pytest.fixture(scope="session")
def hf_factory(tmp_path_factory):
    """Builds (and caches) tiny HF Qwen3 folders by keyword configuration."""
    cache: dict = {}

    def build(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            folder = tmp_path_factory.mktemp("hf_qwen3")
            cache[key] = (folder, make_hf_qwen3(folder, **kwargs))
        return cache[key]

    return build


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("SPARKJAX_COUNT_COMPILES"):
        _count_compiles(os.environ["SPARKJAX_COUNT_COMPILES"])


def _count_compiles(path: str) -> None:
    """Opt-in (``SPARKJAX_COUNT_COMPILES=path``): appends one line per XLA compilation in this pytest process (each
    xdist worker) to ``path``: ``worker<TAB>jitted function<TAB>seconds<TAB>hit|miss<TAB>test id`` (hit: read from the
    persistent compilation cache, which the workers share, so a program both workers need is one miss and one hit;
    programs that compile in under JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS are never stored, so always a miss).
    Subprocesses the tests start are not counted. Summarise with ``cut -f2 path | sort | uniq -c | sort -rn``."""
    import threading

    from jax import monitoring

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    hit = threading.local()

    def on_event(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":  # recorded inside the compile it belongs to
            hit.value = True

    def on_duration(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":  # jax._src.dispatch.BACKEND_COMPILE_EVENT
            kind = "hit" if getattr(hit, "value", False) else "miss"
            hit.value = False
            test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]  # the test (or fixture) compiling
            with open(path, "a") as f:
                f.write(f"{worker}\t{kwargs.get('fun_name', '?')}\t{duration:.3f}\t{kind}\t{test}\n")

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)


# The longest files first (by their time in the default run), so that xdist's per-file scheduling (--dist loadfile
# --no-loadscope-reorder) does not leave one worker running a long file alone at the end. A file not listed keeps
# its place after these.
LONGEST_FIRST = ("test_gpu_check.py", "test_exactness.py", "test_auto.py", "test_training.py", "test_target.py",
                 "test_api.py", "test_serve_http.py", "test_attention.py", "test_tree.py", "test_eval.py",
                 "test_drafter.py", "test_serve_engine.py", "test_tree_kernels.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order inside a file is kept


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if an eval run loads a model, warms up or times anything (bad input is refused first)."""
    from sparkjax.eval import harness

    def refuse(*a, **k):
        raise AssertionError("the run started working before it checked its input")

    monkeypatch.setattr(harness, "load_pair", refuse)
    monkeypatch.setattr(harness, "warm_up", refuse)
    monkeypatch.setattr(harness, "time_batch", refuse)


class VisitGate:
    """Wraps a serving engine's device visit (``with VisitGate(engine) as gate``): while closed, a visit runs 0
    rounds (it streams what the prefills wrote and frees cancelled slots), so no request advances, but for
    ``steps`` visits of one round each; :attr:`open` lets every visit through."""

    def __init__(self, engine):
        self.engine, self.real = engine, engine._visit_call
        self.steps = 0
        self.open = False

    def __call__(self, stop, rounds, *rest):
        if not self.open and self.steps > 0:
            self.steps -= 1  # only this thread writes a positive count
            rounds = min(rounds, 1)
        elif not self.open:
            time.sleep(0.005)
            rounds = 0
        return self.real(stop, rounds, *rest)

    def __enter__(self):
        self.engine._visit_call = self
        return self

    def __exit__(self, *exc):
        self.engine._visit_call = self.real
