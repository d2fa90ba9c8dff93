"""The eval's view of the engine: fixed-shape launches, prefill-only launches, instrumented runs.

Every batch of a run shares one prompt width, cache size and output capacity, so each method compiles once per
batch size and the prefill-only run (``max_new_tokens = 1``) reuses the timed run's compiled program.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from .. import engine as core
from ..engine.api import check_temperature
from ..engine.checks import check_top_k, check_top_p
from ..engine.methods import Method
from ..engine.placement import axis_size, check_mesh, place_model, to_host
from ..errors import EvalError


@dataclasses.dataclass
class BatchOutput:
    """Host copies of one batch's outputs per sequence (tokens, acceptance lengths, depth hits, auto's sizes);
    ``stage_seconds`` from the instrumented mode only."""

    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    accepted_per_depth: list[list[int]]
    stage_seconds: dict[str, float] | None = None
    size_choices: list[list[str]] | None = None


def memory_limit() -> int | None:
    """The device's memory in bytes (the host's RAM on a CPU; None when unknown)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


class PairRunner:
    """Runs the methods of one pair with a fixed cache size, EOS set, temperature and output capacity
    (``max_new_tokens``)."""

    path = "fixed-shape"  # recorded in results.json: every batch shares one prompt width, cache and capacity

    def __init__(self, target, drafter, *, eos: list[int], temperature: float, max_new_tokens: int,
                 cache_size: int, prompt_width: int, mesh=None, carry_auto: bool = True, top_p: float = 1.0,
                 top_k: int = 0):
        self.target, self.drafter, self.eos_ids = target, drafter, list(eos)
        self.mesh = mesh  # a jax.sharding.Mesh (data x model) or None: one device
        self.temperature = check_temperature(temperature)
        self.top_p, self.top_k = check_top_p(top_p), check_top_k(top_k)
        self.max_new_tokens, self.cache_size = int(max_new_tokens), int(cache_size)
        self.prompt_width = int(prompt_width)
        if mesh is not None:  # place the weights once, not per launch
            check_mesh(mesh, target, drafter)
            place_model(target, mesh)
            if drafter is not None:
                place_model(drafter, mesh)
        self.carry_auto = bool(carry_auto)
        self._plans: dict[Method, Any] = {}
        self._memories: dict[tuple, Any] = {}

    def plan(self, m: Method):
        """The engine's static plan for ``m``; ArgumentError when it does not fit the pair."""
        if m not in self._plans:
            self._plans[m] = m.plan(self.target, self.drafter, self.temperature > 0)
        return self._plans[m]

    def depth(self, m: Method) -> int:
        return int(self.plan(m).depth)

    def describe(self, m: Method) -> dict[str, Any]:
        """The ``setup.methods`` entry of ``m``: label, name, budget, the plan's shape and the method's fields."""
        p = self.plan(m)
        d = {"label": m.label, "method": m.name, "budget": getattr(m, "budget", None), "top_c_requested": m.top_c}
        if p.drafts:
            d.update(depth=p.depth, nodes=p.nodes, candidates=p.candidates)
            d.update({f.name: getattr(p.method, f.name) for f in dataclasses.fields(p.method) if f.name not in d})
        return d

    def check_memory(self, m: Method, batch_size: int, *, flag: str = "--budgets") -> None:
        """EvalError naming ``flag``, before anything compiles, when a lower bound of one verify step's memory
        (KV cache, one layer's scores, logits, tree mask) exceeds :func:`memory_limit`."""
        c, p = self.target.config, self.plan(m)
        rows = int(p.nodes) + 1
        heads = int(c.num_attention_heads)
        kv, hd = int(c.num_key_value_heads), int(c.head_dim or c.hidden_size // heads)
        need = 4 * batch_size * (2 * int(c.num_hidden_layers) * self.cache_size * kv * hd
                                 + heads * rows * self.cache_size + rows * int(c.vocab_size) + rows * rows)
        limit = memory_limit()
        if limit and need > limit:
            hint = "use a smaller budget" if flag == "--budgets" else "use smaller batch sizes (or a smaller budget)"
            raise EvalError(
                f"{flag}: {m.label} needs about {need / 2**30:.1f} GiB for one verify step (budget {rows - 1}: "
                f"{rows} rows against a {self.cache_size}-slot cache, batch {batch_size}), more than the "
                f"{limit / 2**30:.1f} GiB this device has; {hint}")

    def shape_key(self, m: Method, batch: list[list[int]]) -> tuple:
        return (m, len(batch), self.prompt_width)

    def _kwargs(self, m: Method, max_new: int, seed: int) -> dict[str, Any]:
        return dict(method=m, max_new_tokens=max_new, eos_token_ids=self.eos_ids or None,
                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed,
                    cache_size=self.cache_size,
                    prompt_width=self.prompt_width, capacity=self.max_new_tokens, mesh=self.mesh)

    def _padded(self, batch: list[list[int]]) -> list[list[int]]:
        """``batch`` padded (with copies of its last prompt) to a multiple of the mesh's data axis; the extra
        rows' outputs are dropped by :meth:`outputs` / :meth:`instrumented`."""
        d = 1 if self.mesh is None else axis_size(self.mesh, "data")
        return list(batch) + [batch[-1]] * (-len(batch) % d)

    def launch(self, m: Method, batch: list[list[int]], seed: int, *, prefill_only: bool = False,
               auto_memory=None) -> core.Launch:
        """Dispatches one generation without waiting; ``prefill_only`` stops before the first round.
        ``auto_memory``: method ``auto``'s memory to start from (:meth:`memory`; None: a fresh one)."""
        max_new = 1 if prefill_only else self.max_new_tokens
        drafter = self.drafter if m.speculative else None
        return core.launch(self.target, drafter, self._padded(batch), auto_memory=auto_memory,
                           **self._kwargs(m, max_new, seed))

    def memory(self, m: Method, batch: int, chain: int):
        """Method ``auto``: the memory chain ``chain`` (a repetition index) of batches of ``batch`` sequences
        ended with (None: start fresh; always None without ``carry_auto``)."""
        return self._memories.get((m, batch, chain)) if self.carry_auto else None

    def remember(self, m: Method, batch: int, chain: int, res: core.Launch) -> None:
        """Keeps the memory a finished launch returned in ``extra`` (method ``auto``; device arrays, no copy)."""
        memory = getattr(res.extra, "memory", None)
        if memory is not None and self.carry_auto:
            self._memories[(m, batch, chain)] = memory

    def instrumented(self, m: Method, batch: list[list[int]], seed: int) -> BatchOutput:
        """The engine's instrumented mode (each stage its own jitted call, synced and timed)."""
        out = core.generate(self.target, self.drafter, self._padded(batch), instrument=True,
                            **self._kwargs(m, self.max_new_tokens, seed))
        n = len(batch)
        sizes = None if out.size_choices is None else out.size_choices[:n]
        return BatchOutput([list(t) for t in out.tokens[:n]], [list(a) for a in out.acceptance_lengths[:n]],
                           [list(h) for h in out.accepted_per_depth[:n]], dict(out.stage_seconds or {}), sizes)

    @staticmethod
    def outputs(res: core.Launch, size: int | None = None) -> BatchOutput:
        """Host copies of a finished launch (its first ``size`` sequences: the rest pad a batch to the mesh's
        data axis); NumericalError if the target's logits were not finite."""
        core.raise_if_nonfinite(to_host(res.nonfinite)[:size])
        out, n = to_host(res.out)[:size], to_host(res.n)[:size]
        tokens = [out[b, : n[b]].tolist() for b in range(out.shape[0])]
        if res.accept_lens.shape[1] == 0:  # ar: the prefill's token, then one token per round
            return BatchOutput(tokens, [[1] * (len(t) - 1) for t in tokens], [[] for _ in tokens])
        lens_all, rounds = to_host(res.accept_lens)[:size], to_host(res.rounds)[:size]
        lens = [lens_all[b, : rounds[b]].tolist() for b in range(out.shape[0])]
        hits = to_host(res.depth_hits)[:size].tolist()
        choices = getattr(res.extra, "choices", None)
        sizes = None
        if choices is not None:  # each round's candidate index into res.labels
            ch = to_host(choices)[:size]
            sizes = [[res.labels[i] if 0 <= i < len(res.labels) else str(i) for i in ch[b, : rounds[b]].tolist()]
                     for b in range(out.shape[0])]
        return BatchOutput(tokens, lens, hits, None, sizes)

