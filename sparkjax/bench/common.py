"""What the benchmark subcommands share: argument parsing, the model presets, method labels and the output
(:class:`Report`: printed, and written atomically with ``--out`` / ``--json``)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sparkjax import testing
from sparkjax.config import DrafterConfig, Qwen3Config
from sparkjax.demo import DEMO_DIR as DEMO
from sparkjax.engine.methods import Method
from sparkjax.engine.names import TREE_METHODS, parse_method
from sparkjax.engine.options import DEFAULT_OPTIONS, Options
from sparkjax.engine.programs import spec_program, split_pair
from sparkjax.errors import ArgumentError
from sparkjax.io.atomic import atomic_file
from sparkjax.nn.drafter import Drafter
from sparkjax.nn.qwen3 import Qwen3
from sparkjax.tree import TREE_CANDIDATE_MODES

from .timing import load_warning

FIXTURE = pathlib.Path("tests", "fixtures", "tiny_dspark_b16")  # in the checkout the benchmarks run from
RECIPES = pathlib.Path("train", "recipes")
TAU = 7.34  # the SparklingTree write-up's mean accepted length, for projected speedups
WRITEUP_SPEEDUP = 4.29  # the speedup the SparklingTree write-up reports at that tau
PRESETS = ("tiny", "demo", "reduced", "real")
SIZE_KEYS = ("argument", "output", "temp", "alias")


def log(text: str) -> None:
    """Progress on stderr (the report goes to stdout)."""
    print(text, file=sys.stderr, flush=True)


def ints(text: str, arg: str, minimum: int = 1) -> list[int]:
    """Comma-separated integers of at least ``minimum``; ArgumentError naming ``arg`` otherwise."""
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ArgumentError(f"{arg}: expected comma-separated integers, got {text!r}") from None
    if not out or any(x < minimum for x in out):
        raise ArgumentError(f"{arg}: expected integers of at least {minimum}, got {text!r}")
    return out


def at_least(value: int | float, arg: str, minimum: int | float = 1):
    """``value``; ArgumentError naming ``arg`` when it is below ``minimum``."""
    if value < minimum:
        raise ArgumentError(f"{arg}: expected at least {minimum}, got {value}")
    return value


def pct(x: float | None, width: int = 0) -> str:
    """``x`` as a percentage (``-`` for None, e.g. the spread of a non-positive median)."""
    return f"{x:>{width}.0%}" if x is not None else f"{'-':>{width}}"


def names(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def add_output(p, json_records: bool = True) -> None:
    p.add_argument("--out", metavar="PATH", help="also write the printed report here")
    if json_records:
        p.add_argument("--json", metavar="PATH", help="write the records here (JSON)")


def parse_label(label: str):
    """The method of ``name[@budget][:option...]``; options: ``base`` / ``corrected`` / ``union`` / ``seed`` (the
    tree's candidates), ``fanout=K`` (the seed's children per parent) or ``auto`` (the beam's widths), e.g.
    ``sparklingtree@64:union``."""
    name, *opts = label.split(":")
    kw: dict[str, Any] = {}
    for o in opts:
        if o in TREE_CANDIDATE_MODES:
            kw["candidates"] = o
        elif o == "auto":
            kw["widths"] = "auto"
        elif o.startswith("fanout=") and o[7:].isascii() and o[7:].isdigit():
            kw["max_fanout"] = int(o[7:])
        else:
            raise ArgumentError(f"--methods: unknown tree option {o!r} in {label!r} (base, corrected, union, seed, "
                                "fanout=K, auto)")
    return parse_method(name, **kw)


def method_labels(methods: str, budgets: Sequence[int]) -> list[str]:
    """The speculative labels of ``--methods`` (``ar`` dropped: it is always the baseline row): a tree method
    without a budget once per budget, ``name@budget`` as given. Every label is checked."""
    out = []
    for m in names(methods):
        base = m.split(":")[0]
        out += [f"{base}@{b}{m[len(base):]}" for b in budgets] if base in TREE_METHODS else [m]
    return [m for m in out if parse_label(m).speculative]


def label_fields(label: str) -> dict:
    """``method`` (options kept, budget dropped) and ``budget`` (None for a chain) of a label."""
    name, _, opts = label.partition(":")
    base, _, budget = name.partition("@")
    return {"method": base + (f":{opts}" if opts else ""), "budget": int(budget) if budget else None}


def _dflash_like(ds: DrafterConfig) -> DrafterConfig:
    return dataclasses.replace(ds, kind="dflash", markov_rank=0, markov_head_type=None,
                               enable_confidence_head=False, confidence_head_with_markov=False)


def configs(preset: str) -> tuple[Qwen3Config, DrafterConfig, DrafterConfig, str]:
    """(target, DSpark drafter, DFlash drafter configs, where they come from) of a preset: ``real`` (Qwen3-4B and
    DSpark-b16; DFlash: the same without the Markov and confidence heads), ``reduced`` (``real`` narrowed for a
    CPU), ``demo`` (the bundled demo pair) or ``tiny`` (the upstream test fixture)."""
    if preset in ("real", "reduced"):
        d = FIXTURE / "configs"
        t = Qwen3Config.from_hf_config(d / "qwen3_4b_target_config.json")
        ds = DrafterConfig.from_hf_config(d / "dspark_qwen3_4b_b16_config.json")
        src = "Qwen3-4B and DSpark-b16 (tests/fixtures/tiny_dspark_b16/configs)"
        if preset == "reduced":
            width = {"vocab_size": 16384, "hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 4,
                     "num_key_value_heads": 1, "head_dim": 128}
            t = dataclasses.replace(t, num_hidden_layers=6, **width)
            ds = dataclasses.replace(ds, num_hidden_layers=1, num_target_layers=6, target_layer_ids=(0, 1, 2, 3, 4),
                                     mask_token_id=16383, **width)
            src += " narrowed: 6 target layers, 1 drafter layer reading layers 0-4, " + ", ".join(
                f"{k}={v}" for k, v in width.items())
        return t, ds, _dflash_like(ds), src + "; dflash: the drafter without Markov / confidence heads"
    if preset == "demo":
        return (Qwen3Config.from_hf_config(DEMO / "target/config.json"),
                DrafterConfig.from_hf_config(DEMO / "dspark_b16/config.json"),
                DrafterConfig.from_hf_config(DEMO / "dflash_b16/config.json"),
                "sparkjax/assets/demo/{target,dspark_b16,dflash_b16}/config.json")
    if preset == "tiny":
        ds = DrafterConfig.from_hf_config(FIXTURE / "drafter/config.json")
        return (Qwen3Config.from_hf_config(FIXTURE / "target/config.json"), ds, _dflash_like(ds),
                "tests/fixtures/tiny_dspark_b16/{target,drafter}/config.json")
    raise ArgumentError(f"--preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")


def describe(preset: str) -> str:
    t, ds, _, src = configs(preset)
    f = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim")
    return (f"preset {preset}: {src}\n  target: {', '.join(f'{k}={getattr(t, k)}' for k in f)}\n  dspark drafter: "
            f"layers={ds.num_hidden_layers}, block_size={ds.block_size}, target_layer_ids="
            f"{list(ds.target_layer_ids)}, markov_rank={ds.markov_rank} ({ds.markov_head_type}), "
            f"confidence_head={ds.enable_confidence_head}")


def abstract_models(preset: str) -> tuple[Qwen3, Drafter, Drafter]:
    """(target, DSpark drafter, DFlash drafter) of a preset with abstract bf16 weights (nothing allocated)."""
    t, ds, df, _ = configs(preset)
    return tuple(nnx.eval_shape(lambda cls=cls, c=c: cls(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
                 for cls, c in ((Qwen3, t), (Drafter, ds), (Drafter, df)))


def random_pair(preset: str, seed: int = 0) -> tuple[Qwen3, Drafter]:
    """The preset's target and DSpark drafter with random bf16 weights on the default device."""
    t, ds, _, _ = configs(preset)
    return testing.random_pair(seed, configs=(t, ds), sharpen=False, dtype=jnp.bfloat16, drafter_seed=seed + 1)


def lower(method: Method, target, drafter, batch: int, prompt: int, context: int, buf_len: int,
          options: Options = DEFAULT_OPTIONS):
    """``(lowered generation program, plan)`` of a parsed method from abstract arguments."""
    sds = jax.ShapeDtypeStruct
    args = (sds((batch, prompt), jnp.int32), sds((batch,), jnp.int32), sds((), jnp.int32), sds((1,), jnp.int32),
            sds((), jnp.float32), jax.eval_shape(lambda: jax.random.key(0)))
    plan = method.plan(target, drafter, False, options)
    graphdefs, states = split_pair(target, drafter if plan.drafts else None)
    plan, inputs = method.bind(plan, target=target, drafter=drafter, batch=batch, cache_size=context, measure=False)
    return spec_program.lower(graphdefs, states, *args, inputs, plan=plan, cache_size=context, buf_len=buf_len), plan


def lower_visit(method: Method, target, drafter, batch: int, context: int, buf_len: int,
                options: Options = DEFAULT_OPTIONS, eos_slots: int = 4):
    """``(lowered serving visit, plan)``: the greedy :func:`~sparkjax.serve.slots.pool_visit` of a pool of ``batch``
    slots, every slot in the visit (no gather), from abstract arguments (the pool from ``pool_init``'s shapes)."""
    from sparkjax.serve.slots import pool_init, pool_visit

    plan = method.plan(target, drafter, False, options)
    graphdefs, states = split_pair(target, drafter if plan.drafts else None)
    plan, inputs = method.bind(plan, target=target, drafter=drafter, batch=batch, cache_size=context, measure=False)
    pool = jax.eval_shape(lambda st, inp: pool_init(graphdefs, st, jax.random.key(0), inp, slots=batch, plan=plan,
                                                     eos_slots=eos_slots, cache_size=context, buf_len=buf_len),
                          states, inputs)
    sds, n = jax.ShapeDtypeStruct, (batch,)
    window = min(buf_len, 8 * (plan.depth + 1) + 1)  # the engine's, 8 rounds a visit
    return pool_visit.lower(graphdefs, states, pool, sds(n, jnp.bool_), sds((), jnp.int32), sds(n, jnp.int32),
                            sds(n, jnp.int32), window=window, plan=plan), plan


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment and import path, for a child ``python -m sparkjax.bench``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}


def sizes(ma, keys: Sequence[str] = SIZE_KEYS) -> dict[str, int]:
    """``{key: bytes}`` of a ``memory_analysis()`` and ``peak_bytes = argument + output + temp - alias``."""
    out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in keys}
    return {**out, "peak_bytes": out["argument"] + out["output"] + out["temp"] - out["alias"]}


def error_line(e: Exception) -> str:
    """``Type: first line of the message`` (at most 300 characters): an error recorded in a row."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def write_text(path: str, text: str) -> None:
    with atomic_file(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def dump_hlo(folder: str | None, name: str, text: str) -> None:
    """``--dump-hlo``: ``text`` written to ``folder/name.hlo.txt`` (nothing without a folder)."""
    if folder:
        os.makedirs(folder, exist_ok=True)
        write_text(os.path.join(folder, f"{name}.hlo.txt"), text)


@dataclasses.dataclass
class Report:
    """A subcommand's output: ``header`` lines, ``rows`` (records, added as they are measured), ``table`` (rows ->
    text), ``footer`` lines, and ``payload`` (rows -> what ``--json`` writes; the rows themselves by default)."""

    command: str
    out: str | None = None
    json: str | None = None
    header: list[str] = dataclasses.field(default_factory=list)
    rows: list[dict] = dataclasses.field(default_factory=list)
    table: Callable[[list[dict]], str] = lambda rows: ""
    footer: list[str] = dataclasses.field(default_factory=list)
    payload: Callable[[list[dict]], Any] | None = None
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def emit(self, interrupted: bool = False) -> None:
        """Prints the report and writes ``--out`` / ``--json`` (atomically)."""
        footer = list(self.footer)
        if interrupted:
            footer.append("# interrupted (Ctrl-C): the rows above are what was measured")
        warn = load_warning()
        if warn:
            footer.append(f"# warning: {warn}")
        footer.append(f"# total wall time {time.perf_counter() - self.start:.0f}s")
        text = "\n".join([f"# {self.command}", *self.header, self.table(self.rows), *footer]) + "\n"
        print(text, end="", flush=True)
        if self.out:
            write_text(self.out, text)
        if self.json:
            data = self.payload(self.rows) if self.payload else self.rows
            if isinstance(data, dict):
                data = {**data, "interrupted": interrupted, "load_warning": warn}
            write_text(self.json, json.dumps(data, indent=1) + "\n")
