"""The harness's view of the engine: fixed-shape launches, prefill-only launches, instrumented runs.

Two paths, chosen once:

* **fixed-shape** (the normal one): every batch of a run is padded to one prompt width
  (the power of two above the longest prompt of the whole run) and one cache size, and is
  dispatched to the engine's jitted programs (``decode._spec_program`` / ``decode._ar_program``)
  with the exact static arguments :func:`sparkjax.decode.launch` would use. So each method
  compiles once per run, and the *prefill-only* run (``max_new_tokens = 1``, which stops before
  the first round) reuses the very same compiled program as the timed run: ``max_new_tokens``
  is a traced value there, and the output buffer keeps the timed run's length.
* **public API** (a fallback, used only if those engine internals are renamed): the public
  :func:`sparkjax.decode.launch` / :func:`sparkjax.decode.generate`, with the cache size fixed.
  The engine then pads each batch to its own power of two, and the prefill-only run is a
  separately compiled program of the same prompt and cache shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import decode


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """One column of the benchmark: a method and (for trees) its budget."""

    method: str
    budget: int | None = None
    top_c: int | None = None

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"

    @property
    def speculative(self) -> bool:
        return self.method != "ar"


@dataclasses.dataclass
class BatchOutput:
    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    accepted_per_depth: list[list[int]]
    stage_seconds: dict[str, float] | None = None


def _has_internals() -> bool:
    return all(hasattr(decode, n) for n in ("_spec_program", "_ar_program", "_instrumented", "make_plan", "Prompts"))


class Engine:
    """Runs one pair with a fixed cache size, EOS set and temperature."""

    def __init__(self, target, drafter, *, eos: list[int], temperature: float, max_new_tokens: int,
                 cache_size: int, prompt_width: int, force_public: bool = False):
        self.target, self.drafter = target, drafter
        self.eos_ids = list(eos)
        self.temperature = decode.check_temperature(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.cache_size = int(cache_size)
        self.prompt_width = int(prompt_width)
        self.fixed_shape = _has_internals() and not force_public
        self._plans: dict[MethodConfig, Any] = {}
        self._split = None

    @property
    def path(self) -> str:
        return "fixed-shape" if self.fixed_shape else "public-api"

    # ------------------------------------------------------------------ validation and shapes

    def plan(self, mc: MethodConfig):
        """The engine's static plan for ``mc`` (None for ``ar``); raises ArgumentError when it does not apply."""
        if mc not in self._plans:
            if mc.method == "ar":
                self._plans[mc] = None
            else:
                self._plans[mc] = decode.make_plan(self.target, self.drafter, mc.method, mc.budget, mc.top_c,
                                                   None, "fast", self.temperature > 0)
        return self._plans[mc]

    def depth(self, mc: MethodConfig) -> int:
        p = self.plan(mc)
        return 0 if p is None else int(p.depth)

    def describe(self, mc: MethodConfig) -> dict[str, Any]:
        p = self.plan(mc)
        d = {"label": mc.label, "method": mc.method, "budget": mc.budget, "top_c_requested": mc.top_c}
        if p is not None:
            d.update(depth=p.depth, nodes=p.nodes, top_c=p.top_c or None,
                     widths=list(p.widths) if p.widths else None, normalization=p.normalization)
        return d

    def buf_len(self, mc: MethodConfig) -> int:
        p = self.plan(mc)
        if p is None:
            return decode.bucket(self.max_new_tokens, 1)
        return decode.bucket(self.max_new_tokens + p.depth + 1, 1)

    def shape_key(self, mc: MethodConfig, batch: list[list[int]]) -> tuple:
        width = self.prompt_width if self.fixed_shape else decode.bucket(max(len(p) for p in batch))
        return (mc, len(batch), width)

    def _pair(self):
        if self._split is None:
            from flax import nnx

            gt, st = nnx.split(self.target)
            if self.drafter is None:
                self._split = ((gt, None), (st, None))
            else:
                gd, sd = nnx.split(self.drafter)
                self._split = ((gt, gd), (st, sd))
        return self._split

    def _args(self, batch: list[list[int]], max_new: int, seed: int):
        tokens = np.zeros((len(batch), self.prompt_width), np.int32)
        for b, p in enumerate(batch):
            tokens[b, : len(p)] = p
        lengths = np.array([len(p) for p in batch], np.int32)
        eos = decode.eos_array(self.eos_ids, self.target.config.vocab_size)
        return (jnp.asarray(tokens), jnp.asarray(lengths), jnp.int32(max_new), jnp.asarray(eos),
                jnp.float32(self.temperature), jax.random.key(seed))

    # ------------------------------------------------------------------ runs

    def launch(self, mc: MethodConfig, batch: list[list[int]], seed: int, *, prefill_only: bool = False):
        """Dispatches one generation without waiting; ``prefill_only`` stops before the first round."""
        max_new = 1 if prefill_only else self.max_new_tokens
        if not self.fixed_shape:
            kw = {"budget": mc.budget, "top_c": mc.top_c} if mc.method in decode.TREE_METHODS else {}
            return decode.launch(self.target, self.drafter, batch, method=mc.method, max_new_tokens=max_new,
                                 eos_token_ids=self.eos_ids or None, temperature=self.temperature, seed=seed,
                                 cache_size=self.cache_size, **kw)
        plan = self.plan(mc)
        args = self._args(batch, max_new, seed)
        (gt, gd), (st, sd) = self._pair()
        if plan is None:
            return decode._ar_program(gt, st, *args, buf_len=self.buf_len(mc), cache_size=self.cache_size)
        return decode._spec_program((gt, gd), (st, sd), *args, plan=plan, cache_size=self.cache_size,
                                    buf_len=self.buf_len(mc))

    def instrumented(self, mc: MethodConfig, batch: list[list[int]], seed: int) -> BatchOutput:
        """The engine's instrumented mode (each stage its own jitted call, synced and timed)."""
        if not self.fixed_shape:
            kw = {"budget": mc.budget, "top_c": mc.top_c} if mc.method in decode.TREE_METHODS else {}
            out = decode.generate(self.target, self.drafter, batch, method=mc.method,
                                  max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos_ids or None,
                                  temperature=self.temperature, seed=seed, cache_size=self.cache_size,
                                  instrument=True, **kw)
        else:
            out = decode._instrumented(self.target, self.drafter, self._args(batch, self.max_new_tokens, seed),
                                       self.plan(mc), self.cache_size, self.buf_len(mc))
        return BatchOutput([list(t) for t in out.tokens], [list(a) for a in out.acceptance_lengths],
                           [list(h) for h in out.accepted_per_depth], dict(out.stage_seconds or {}))

    @staticmethod
    def outputs(res) -> BatchOutput:
        """Host copies of a finished launch's arrays."""
        arrays = [np.asarray(x) for x in res]
        out, n = arrays[0], arrays[1]
        tokens = [out[b, : n[b]].tolist() for b in range(out.shape[0])]
        if len(arrays) == 2:  # ar: one token per step
            return BatchOutput(tokens, [[1] * len(t) for t in tokens], [[] for _ in tokens])
        accept_lens, rounds, hits = arrays[2], arrays[3], arrays[4]
        lens = [accept_lens[b, : rounds[b]].tolist() for b in range(out.shape[0])]
        return BatchOutput(tokens, lens, hits.tolist())
