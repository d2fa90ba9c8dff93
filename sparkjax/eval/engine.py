"""The harness's view of the engine: fixed-shape launches, prefill-only launches, instrumented runs.

Every batch of a run is padded to one prompt width (the power of two above the longest prompt of
the whole run), one cache size and one output capacity (``prompt_width``, ``cache_size`` and
``capacity`` of :func:`sparkjax.engine.launch`). So each method compiles once per run, and the
*prefill-only* run (``max_new_tokens = 1``, which stops before the first round) reuses the very
same compiled program as the timed run: ``max_new_tokens`` is a traced value in the engine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .. import engine as core
from ..engine.api import check_temperature
from ..engine.methods import Method, parse_method


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """One column of the benchmark: a method and (for trees) its budget."""

    method: str
    budget: int | None = None
    top_c: int | None = None

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"

    @functools.cached_property
    def spec(self) -> Method:
        """The method object (:func:`sparkjax.engine.parse_method` of the name, budget and top-c)."""
        return parse_method(self.method, budget=self.budget, top_c=self.top_c)

    @property
    def speculative(self) -> bool:
        return self.spec.speculative


@dataclasses.dataclass
class BatchOutput:
    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    accepted_per_depth: list[list[int]]
    stage_seconds: dict[str, float] | None = None
    size_choices: list[list[str]] | None = None  # method auto: each round's verification size (its label)


class Engine:
    """Runs one pair with a fixed cache size, EOS set and temperature."""

    def __init__(self, target, drafter, *, eos: list[int], temperature: float, max_new_tokens: int,
                 cache_size: int, prompt_width: int, mesh=None, carry_auto: bool = True):
        self.target, self.drafter = target, drafter
        self.eos_ids = list(eos)
        self.temperature = check_temperature(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.cache_size = int(cache_size)
        self.prompt_width = int(prompt_width)
        self.mesh = mesh  # a jax.sharding.Mesh (data x model) or None: one device
        if mesh is not None:  # place the weights once, not per launch (a launch reuses placed arrays)
            from ..engine.placement import check_mesh, place_model

            check_mesh(mesh, target, drafter)
            place_model(target, mesh)
            if drafter is not None:
                place_model(drafter, mesh)
        self._plans: dict[MethodConfig, Any] = {}
        self.carry_auto = bool(carry_auto)  # method auto: each chain of launches carries its AutoMemory
        self._memories: dict[tuple, Any] = {}

    path = "fixed-shape"  # recorded in results.json: every batch shares one prompt width, cache and capacity

    # ------------------------------------------------------------------ validation and shapes

    def plan(self, mc: MethodConfig):
        """The engine's static plan for ``mc`` (None for ``ar``); raises ArgumentError when it does not apply."""
        if mc not in self._plans:
            self._plans[mc] = mc.spec.plan(self.target, self.drafter, self.temperature > 0)
        return self._plans[mc]

    def depth(self, mc: MethodConfig) -> int:
        p = self.plan(mc)
        return 0 if p is None else int(p.depth)

    def describe(self, mc: MethodConfig) -> dict[str, Any]:
        p = self.plan(mc)
        d = {"label": mc.label, "method": mc.method, "budget": mc.budget, "top_c_requested": mc.top_c}
        if p is not None:
            d.update(depth=p.depth, nodes=p.nodes, top_c=p.top_c or None,
                     widths=list(p.widths) if p.widths else None, normalization=p.normalization,
                     candidates=p.candidates)
        return d

    def shape_key(self, mc: MethodConfig, batch: list[list[int]]) -> tuple:
        return (mc, len(batch), self.prompt_width)

    def _kwargs(self, mc: MethodConfig, max_new: int, seed: int) -> dict[str, Any]:
        return dict(method=mc.spec, max_new_tokens=max_new, eos_token_ids=self.eos_ids or None,
                    temperature=self.temperature, seed=seed, cache_size=self.cache_size,
                    prompt_width=self.prompt_width, capacity=self.max_new_tokens, mesh=self.mesh)

    def padded(self, batch: list[list[int]]) -> list[list[int]]:
        """``batch`` padded (with copies of its last prompt) to a multiple of the mesh's data axis; the
        extra rows' outputs are dropped by :meth:`outputs` / :meth:`instrumented`."""
        from ..engine.placement import axis_size

        d = 1 if self.mesh is None else axis_size(self.mesh, "data")
        return list(batch) + [batch[-1]] * (-len(batch) % d)

    # ------------------------------------------------------------------ runs

    def launch(self, mc: MethodConfig, batch: list[list[int]], seed: int, *, prefill_only: bool = False,
               auto_memory=None):
        """Dispatches one generation without waiting; ``prefill_only`` stops before the first round.
        ``auto_memory``: method ``auto``'s memory to start from (:meth:`memory`; None: a fresh one)."""
        max_new = 1 if prefill_only else self.max_new_tokens
        drafter = self.drafter if mc.speculative else None
        return core.launch(self.target, drafter, self.padded(batch), report_nonfinite=True,
                           auto_memory=auto_memory, **self._kwargs(mc, max_new, seed))

    def memory(self, mc: MethodConfig, batch: int, chain: int):
        """Method ``auto``: the memory chain ``chain`` (a repetition index) of batches of ``batch`` sequences
        ended with, to start the next launch from (None: a fresh one; always None without ``carry_auto``)."""
        return self._memories.get((mc, batch, chain)) if self.carry_auto else None

    def remember(self, mc: MethodConfig, batch: int, chain: int, res) -> None:
        """Keeps the memory a finished launch of method ``auto`` returned (device arrays, no copy)."""
        mem = [x for x in res if isinstance(x, core.AutoMemory)]
        if mem and self.carry_auto:
            self._memories[(mc, batch, chain)] = mem[0]

    def instrumented(self, mc: MethodConfig, batch: list[list[int]], seed: int) -> BatchOutput:
        """The engine's instrumented mode (each stage its own jitted call, synced and timed)."""
        out = core.generate(self.target, self.drafter, self.padded(batch), instrument=True,
                            **self._kwargs(mc, self.max_new_tokens, seed))
        n = len(batch)
        sizes = None if out.size_choices is None else out.size_choices[:n]
        return BatchOutput([list(t) for t in out.tokens[:n]], [list(a) for a in out.acceptance_lengths[:n]],
                           [list(h) for h in out.accepted_per_depth[:n]], dict(out.stage_seconds or {}), sizes)

    def size_labels(self, mc: MethodConfig) -> tuple[str, ...]:
        """Method ``auto``: the labels of its candidate sizes (what its ``choices`` index); else empty."""
        p = self.plan(mc)
        return p.method.labels() if p is not None and p.is_auto else ()

    @staticmethod
    def outputs(res, size: int | None = None, labels: tuple[str, ...] = ()) -> BatchOutput:
        """Host copies of a finished launch's arrays (the first ``size`` sequences: the rest pad a batch to
        the mesh's data axis); raises NumericalError if the target's logits were not finite. ``labels``:
        method ``auto``'s candidate labels (:meth:`size_labels`), to name its per-round choices."""
        from ..engine.placement import to_host

        arrays = [to_host(x)[:size] for x in res if not isinstance(x, core.AutoMemory)]
        core.raise_if_nonfinite(arrays.pop())  # the target's logits must stay finite (NumericalError)
        out, n = arrays[0], arrays[1]
        tokens = [out[b, : n[b]].tolist() for b in range(out.shape[0])]
        if len(arrays) == 2:  # ar: one token per step
            return BatchOutput(tokens, [[1] * len(t) for t in tokens], [[] for _ in tokens])
        accept_lens, rounds, hits = arrays[2], arrays[3], arrays[4]
        lens = [accept_lens[b, : rounds[b]].tolist() for b in range(out.shape[0])]
        sizes = None
        if len(arrays) > 5:  # auto: each round's chosen candidate index
            sizes = [[labels[i] if 0 <= i < len(labels) else str(i) for i in arrays[5][b, : rounds[b]].tolist()]
                     for b in range(out.shape[0])]
        return BatchOutput(tokens, lens, hits.tolist(), None, sizes)
