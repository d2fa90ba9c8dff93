"""The eval's orchestrator: what to run (the pair, the prompts, the methods, the batches), then the report.

:func:`run` validates every setting, loads the pair and the prompt sets, builds one :class:`PairRunner` per
drafter, refuses what cannot fit in memory, times every batch with every method through
:mod:`sparkjax.eval.runner`, and summarizes and saves the :class:`EvalResults`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import platform
import time
from importlib import metadata
from typing import Any

import jax
from tqdm.auto import tqdm

from .. import engine as core
from ..engine.checks import MAX_SEED
from ..errors import EvalError, TokenizerError
from ..text import encode_prompt, eos_ids
from . import datasets as ds
from . import metrics
from .config import EvalConfig, eval_mesh, validate
from .engine import PairRunner
from .pair import DEMO_NOTE, Pair, load_pair, load_tok, param_dtype, resolve_pair
from .records import Record, fill_batches, is_reference, make_record, prompt_pool, summarize, sweep_block, sweep_notes
from .results import EvalResults, check_out
from .runner import CompileLog, Interrupt, LoadMonitor, Stopped, protocol_text, sigint_flag, time_batch, warm_up

_VERSIONED = ("sparkjax", "jax", "jaxlib", "flax", "numpy", "transformers", "tokenizers", "safetensors", "matplotlib",
              "tqdm", "ml_dtypes")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The ``environment`` object of results.json: package versions, platform, CPUs, backend and devices."""
    devices = jax.devices()
    return {"versions": {"python": platform.python_version(), **{p: _version(p) for p in _VERSIONED}},
            "platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "backend": jax.default_backend(), "devices": [str(d) for d in devices],
            "device_kind": devices[0].device_kind if devices else None, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run(config: EvalConfig | None = None, *, target=None, drafter=None, baseline_drafter=None, tokenizer=None,
        progress: bool = True, **overrides) -> EvalResults:
    """Runs the benchmark and returns :class:`EvalResults` (also saved to ``config.out`` when set).

    Models given as folders or objects override the config's; ``overrides`` set :class:`EvalConfig` fields.
    Ctrl-C returns (and saves) the finished batches with ``interrupted=True``; before the first timed batch it
    raises KeyboardInterrupt. The previous SIGINT handler is restored on return.
    """
    with sigint_flag() as stop:
        cfg, methods, notes = validate(dataclasses.replace(config or EvalConfig(), **overrides),
                                       target_given=target is not None)
        return _Run(cfg, methods, notes, stop, progress).go(target, drafter, baseline_drafter, tokenizer)


def _select(cfg: EvalConfig, sets, tok, tok_src: str, vocab: int, max_pos: int, notes: list[str]):
    """The first ``max_samples`` prompts of each set that fit the target's positions, encoded; and the skipped."""
    selected: dict[str, list[tuple[int, int, list[int]]]] = {}
    skipped: list[dict[str, Any]] = []
    for s in sets:
        chosen = []
        for i, (text, line, kind) in enumerate(zip(s.prompts, s.lines, s.kinds, strict=True)):
            if cfg.max_samples is not None and len(chosen) >= cfg.max_samples:
                break
            ids = encode_prompt(tok, text, kind)
            if not ids:
                raise TokenizerError(f"{s.path}:{line}: the prompt encodes to no token")
            if max(ids) >= vocab:
                raise TokenizerError(f"{s.path}:{line}: tokenizer {tok_src} produced id {max(ids)}, outside the "
                                     f"target's vocabulary [0, {vocab}) (is it the target's tokenizer?)")
            if len(ids) + cfg.max_new_tokens > max_pos:
                skipped.append({"dataset": s.name, "index": i, "line": line, "prompt_tokens": len(ids),
                                "reason": f"prompt + max_new_tokens > max_position_embeddings ({max_pos})"})
            else:
                chosen.append((i, line, ids))
        if chosen:
            selected[s.name] = chosen
        else:
            notes.append(f"{s.name}: no prompt fits prompt + {cfg.max_new_tokens} new tokens <= {max_pos} positions; "
                         "set skipped")
    if skipped:
        notes.append(f"{len(skipped)} prompt(s) longer than the target's {max_pos} positions allow were skipped "
                     "(listed in results.json setup.skipped)")
    if not selected:
        raise EvalError("--datasets: no prompt fits the target's max_position_embeddings; lower --max-new-tokens")
    return selected, skipped


def _listed(items: list[str], most: int) -> str:
    return ", ".join(items[:most]) + (", ..." if len(items) > most else "")


WARMUP_THREADS = max(1, min(4, os.cpu_count() or 1))  # methods compiled at once during the warm-up


class _Run:
    """One run's state, from the loaded pair to the saved results."""

    def __init__(self, cfg: EvalConfig, methods, notes: list[str], stop: Interrupt, progress: bool):
        self.cfg, self.methods, self.notes, self.stop, self.progress = cfg, methods, notes, stop, progress
        self.t_start = time.perf_counter()
        self.loads = LoadMonitor()
        self.warmed: set = set()
        self.warmup: dict[str, dict[str, Any]] = {}  # per method label: CompileLog.record of its warm-up
        self.warmup_wall: dict[str, Any] | None = None  # the whole warm-up's wall seconds, methods compiled at once

    def early_stop(self) -> None:  # a Ctrl-C before the first timed batch: nothing to keep
        if self.stop.requested:
            raise KeyboardInterrupt

    def go(self, target, drafter, baseline_drafter, tokenizer) -> EvalResults:
        cfg, methods, notes = self.cfg, self.methods, self.notes
        if cfg.out:
            check_out(cfg.out)  # a bad --out is said before any work
        resolve_pair(cfg, target, drafter, baseline_drafter, methods)  # a missing demo folder: said before reading
        sets = ds.load_all(cfg.datasets)
        self.early_stop()
        pair = load_pair(cfg, target, drafter, baseline_drafter, methods)
        self.early_stop()
        notes += pair.notes
        if pair.default:
            notes.insert(0, DEMO_NOTE)
        tok, tok_src = load_tok(cfg, tokenizer, pair.target_dir)
        eos = [] if cfg.ignore_eos else eos_ids(tok, pair.target_dir)
        tc = pair.target.config
        selected, skipped = _select(cfg, sets, tok, tok_src, tc.vocab_size, tc.max_position_embeddings, notes)
        if cfg.batch_sizes:  # the sweep: batch j of every size runs with seed + j
            n_batches = math.ceil(sum(len(rows) for rows in selected.values()) / min(cfg.batch_sizes))
        else:
            n_batches = sum(math.ceil(len(rows) / cfg.batch_size) for rows in selected.values())
        if cfg.seed + n_batches - 1 >= MAX_SEED:
            raise EvalError(f"--seed: batch i runs with seed + i, and {cfg.seed} + {n_batches - 1} is not below 2**63")
        runners = self.runners(pair, eos, selected)
        self.early_stop()
        setup = self.setup(pair, tok_src, eos, runners, sets, selected, skipped)
        done: list[Record] = []
        pool = prompt_pool(selected) if cfg.batch_sizes else None
        interrupted = False
        try:
            self.loads.sample()
            if pool is not None:
                self.sweep(pool, done)
            else:
                self.per_set(selected, done)
        except (Stopped, KeyboardInterrupt):
            interrupted = True
            if pool is not None:
                batches = sorted({(r.batch_size, r.batch) for r in done})
                notes.append(f"interrupted (Ctrl-C): the sweep covers the {len(batches)} batch(es) every method had "
                             f"finished ({_listed([f'size {b} #{j}' for b, j in batches], 8)})")
            else:
                n = len({(r.dataset, s.index) for r in done for s in r.samples})
                notes.append(f"interrupted (Ctrl-C): the results cover the {n} sample(s) every method had finished")
        setup["timing"] = self.loads.block(cfg.repeats)
        setup["warmup"] = self.warmup
        setup["warmup_wall"] = self.warmup_wall
        labels = [m.label for m in methods]
        records = [] if pool is not None else done
        summary = summarize(records, labels, setup["depths"], list(selected), cfg.temperature)
        notes += _notes(records, summary)
        block = None
        if pool is not None:
            block = sweep_block(done, labels, cfg.batch_sizes, pool, cfg.temperature)
            notes += sweep_notes(block.rows)
            setup["timing"]["order"] = ("interleaved: per (batch size, batch), repetition r runs every method in "
                                        "turn (full run, then prefill-only); no stage pass in a batch-size sweep")
        results = EvalResults(config=dataclasses.asdict(cfg), setup=setup, environment=environment(), summary=summary,
                              records=records, interrupted=interrupted, notes=notes,
                              wall_seconds=time.perf_counter() - self.t_start, sweep=block)
        if cfg.out:
            results.setup["files"] = results.save(cfg.out, plots=cfg.plots)
        return results

    def runners(self, pair: Pair, eos: list[int], selected) -> dict:
        """One runner per drafter (sharing the target, the cache size and the prompt width); checks memory."""
        cfg = self.cfg
        longest = max(len(ids) for rows in selected.values() for _, _, ids in rows)
        width = core.bucket(longest)
        mesh = eval_mesh(cfg.mesh)
        by_drafter: dict[int, PairRunner] = {}
        runners, self.roles = {}, {}
        for m in self.methods:
            model, d_dir, role = pair.drafter_of(m)
            if model is None:  # ar: any runner serves; it runs the target alone
                model = pair.drafter if pair.drafter is not None else pair.baseline
            if id(model) not in by_drafter:
                by_drafter[id(model)] = PairRunner(pair.target, model, eos=eos, temperature=cfg.temperature,
                                                   max_new_tokens=cfg.max_new_tokens, cache_size=1,
                                                   prompt_width=width, mesh=mesh, carry_auto=not cfg.fresh_auto,
                                                   top_p=cfg.top_p, top_k=cfg.top_k)
            runners[m], self.roles[m] = by_drafter[id(model)], (d_dir, role)
        plans = [runners[m].plan(m) for m in self.methods]  # validates budget / top_c against the pair
        cache = core.required_cache_size(longest, cfg.max_new_tokens, plans, prompt_width=width)
        for runner in by_drafter.values():
            runner.cache_size = cache
        flag = "--batch-sizes" if cfg.batch_sizes else "--budgets"
        for size in cfg.batch_sizes or (cfg.batch_size,):  # a verify that cannot fit: refused before compiling
            for m in self.methods:
                runners[m].check_memory(m, size, flag=flag)
        self.units = [(runners[m], m) for m in self.methods]
        return runners

    def setup(self, pair: Pair, tok_src: str, eos, runners, sets, selected, skipped) -> dict[str, Any]:
        cfg, methods = self.cfg, self.methods
        runner = runners[methods[0]]
        return {
            "target": pair.target_dir, "drafter": pair.drafter_dir, "baseline_drafter": pair.baseline_dir,
            "baseline_methods": [m.label for m in methods if self.roles[m][1] == "baseline"],
            "tokenizer": tok_src, "default_pair": pair.default, "dtype": param_dtype(pair.target),
            "methods": [{**runners[m].describe(m), "drafter": self.roles[m][0], "drafter_role": self.roles[m][1]}
                        for m in methods],
            "labels": [m.label for m in methods], "depths": {m.label: runners[m].depth(m) for m in methods},
            "eos_token_ids": eos, "cache_size": runner.cache_size, "prompt_width": runner.prompt_width,
            "timing_path": runner.path, "mesh": None if runner.mesh is None else dict(runner.mesh.shape),
            "auto_memory": "fresh" if cfg.fresh_auto else "carried",
            "datasets": [{"name": s.name, "path": s.path, "kind": s.kind, "prompts_in_file": len(s),
                          "used": [i for i, _, _ in selected.get(s.name, [])]} for s in sets],
            "skipped": skipped, "protocol": protocol_text(),
        }

    def time_chunk(self, dataset: str, batch: int, seed: int, chunk, *, stages: bool, **extra) -> list[Record]:
        """Times ``chunk`` (``(index, line, ids)`` per sequence) with every method: one record per method."""
        timed = time_batch(self.units, [ids for *_, ids in chunk], seed=seed, repeats=self.cfg.repeats, stages=stages,
                           warmed=self.warmed, stop=self.stop)
        done = [make_record(dataset, batch, seed, m, chunk, timed[m], drafter=self.roles[m][0],
                            drafter_role=self.roles[m][1], **extra) for m in self.methods]
        self.loads.sample()
        return done

    def per_set(self, selected, records: list[Record]) -> None:
        """Warms every method up on the first batch, then times every set's batches in order."""
        cfg, methods = self.cfg, self.methods
        first = [ids for _, _, ids in next(iter(selected.values()))[: cfg.batch_size]]
        stages = cfg.stage_samples != 0

        def warm(runner, m):  # (shape key, whether the stage functions got warm, the warm-up's record)
            t0 = time.perf_counter()
            with CompileLog() as log:
                staged = warm_up(runner, m, first, seed=cfg.seed, stages=stages)
            return runner.shape_key(m, first), staged, log.record(time.perf_counter() - t0)

        # Compiling is most of the warm-up and XLA compiles one program per thread: the methods warm up
        # WARMUP_THREADS at a time. auto profiles its candidates' costs while it warms up, so it runs alone.
        alone = [u for u in self.units if isinstance(u[1], core.Auto)]
        together = [u for u in self.units if u not in alone]
        done: dict[str, tuple] = {}
        bar = tqdm(total=len(self.units), desc="warm-up (compiling)", unit="method", disable=not self.progress,
                   leave=False)
        self.stop.check()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=WARMUP_THREADS) as pool:
            futures = {pool.submit(warm, runner, m): m for runner, m in together}
            try:
                for fut in concurrent.futures.as_completed(futures):
                    done[futures[fut].label] = fut.result()
                    bar.set_postfix_str(futures[fut].label)
                    bar.update(1)
                    self.stop.check()
            except BaseException:
                for fut in futures:
                    fut.cancel()  # the ones not started; those running finish
                raise
        for runner, m in alone:
            self.stop.check()
            bar.set_postfix_str(m.label)
            done[m.label] = warm(runner, m)
            bar.update(1)
        bar.close()
        self.warmup_wall = {"seconds": time.perf_counter() - t0, "threads": WARMUP_THREADS}
        for _, m in self.units:  # in the methods' order
            key, staged, record = done[m.label]
            if staged:
                self.warmed.add((key, "stages"))
            self.warmed.add(key)
            self.warmup[m.label] = record
        self.loads.sample()
        batch_no = 0
        for name, rows in selected.items():
            with tqdm(total=len(rows), desc=name, unit="sample", disable=not self.progress) as bar:
                staged = 0  # batches of this set that got the stage pass
                for b0 in range(0, len(rows), cfg.batch_size):
                    self.stop.check()
                    chunk = rows[b0 : b0 + cfg.batch_size]
                    stages = cfg.stage_samples is None or staged < cfg.stage_samples
                    done = self.time_chunk(name, b0 // cfg.batch_size, cfg.seed + batch_no, chunk, stages=stages)
                    records.extend(done)  # a batch counts once every method has run it
                    staged += any(r.stage for r in done)
                    batch_no += 1
                    bar.update(len(chunk))
                    taus = [f"{m.label}={_tau(records, name, m.label):.2f}" for m in methods if m.speculative]
                    if taus:
                        bar.set_postfix_str("tau " + " ".join(taus))

    def sweep(self, pool, records: list[Record]) -> None:
        """The batch-size sweep: every method at every batch size on the cycled pool (see
        :func:`~sparkjax.eval.records.fill_batches`), one record per (batch size, batch, method) once every method
        has run that batch."""
        plan = [(b, j, batch) for b in self.cfg.batch_sizes for j, batch in enumerate(fill_batches(pool, b))]
        with tqdm(plan, desc="batch-size sweep", unit="batch", disable=not self.progress) as bar:
            for size, j, entries in bar:
                self.stop.check()
                bar.set_postfix_str(f"batch size {size}")
                done = self.time_chunk("all", j, self.cfg.seed + j, [e[1:] for e in entries], stages=False,
                                       batch_size=size)
                for rec in done:
                    for slot, (s, entry) in enumerate(zip(rec.samples, entries, strict=True)):
                        s.dataset, s.slot = entry[0], slot
                records.extend(done)


def _tau(records: list[Record], dataset: str, label: str) -> float:
    return metrics.tau_pooled(s.acceptance_lengths for r in records if r.dataset == dataset and r.label == label
                              for s in r.samples)


def _notes(records: list[Record], summary) -> list[str]:
    notes = []
    unmeasured = [f"{r.dataset}/{r.label}#{r.batch}" for r in records if r.timed and r.decode_seconds is None]
    if unmeasured:
        notes.append(f"decode time not measured for {len(unmeasured)} batch(es) ({_listed(unmeasured, 6)}): the "
                     "prefill-only runs took at least as long as the full runs (a busy machine?); they are left out "
                     "of TPOT, tok/s and speedup")
    ended = [f"{r.dataset}#{s.index}" for r in records if is_reference(r.label) for s in r.samples
             if s.output_tokens <= 1]
    if ended:
        notes.append(f"{len(ended)} response(s) ended at their first token ({', '.join(ended)}): no round, so they "
                     "add nothing to tau, and a batch made only of such responses is left out of TPOT")
    for row in summary:
        if row.same_as_ar is not None and row.same_as_ar < 1:
            notes.append(f"{row.dataset}/{row.label}: only {100 * row.same_as_ar:.0f}% of greedy outputs equal ar's "
                         "(greedy speculative decoding should reproduce them exactly)")
    return notes
