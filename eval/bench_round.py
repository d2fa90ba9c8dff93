"""Kernel, byte and FLOP counts of one speculative round and one AR step, from the optimised HLO.

The CPU-side proxy for GPU latency. For each method, budget, batch and preset the pair is built with
ABSTRACT bf16 weights (``nnx.eval_shape``: nothing is allocated), and two programs are lowered and
compiled for XLA:CPU (nothing is run):

* the round: the body of the generation ``while_loop`` of :func:`sparkjax.engine.programs.spec_program`
  (one ``spec_round``; the ``while`` of the entry computation with no known trip count);
* the AR step: the body of the generation ``while_loop`` of :func:`sparkjax.engine.programs.ar_program`
  at temperature 0 (``sampling=False``).

Both programs are compiled whole (with a 16-token prompt) and only one iteration of their generation
loop (its body and one evaluation of its condition) is counted: what XLA hoists out of the loop (the
f32 upcasts of the weights on CPU) is then outside, for the round as for the AR step. ddtree and dflash
use the DFlash-style drafter (no Markov head), the Markov methods the DSpark one.

Both use a cache of ``--context`` slots (S, the power-of-two cache bucket).

**Counting.** Computations are walked from the program's top (the entry, or the AR loop's body) with
a multiplier: a ``while`` multiplies its body by its trip count and its condition by the trip count
+ 1; ``call`` bodies are walked in place; of a ``conditional`` the costliest branch (by bytes) is
counted. The trip count is XLA's ``known_trip_count`` annotation (backend_config), else derived from a
condition ``i < constant`` with ``known_init_step`` 0/1; a loop with neither is counted once and
reported in ``unknown_loops``.

A **kernel** is every instruction executed at that level except the ones that launch nothing:
``parameter``, ``constant``, ``tuple``, ``get-tuple-element``, ``bitcast``, ``after-all``,
``add-dependency``, ``opt-barrier``, ``partition-id``, ``replica-id``, the control ops themselves
(``while``, ``call``, ``conditional``: their bodies are counted instead) and *pure converts* (below).
So fusions (loop, input, output and custom/dot fusions), dots, custom-calls, sorts, scatters,
gathers, reduces, copies, (dynamic-)slices and dynamic-update-slices are kernels. A fusion counts
once, whatever it fuses. ``kernels`` is the total executed per round (loop trips counted);
``sequential_kernels`` are those inside a loop within the program (each trip waits for the previous
one: launch latency is paid per kernel, one after another).

**Pure converts.** XLA:CPU computes bf16 dots in f32: it wraps them in ``convert`` kernels (bf16 ->
f32 before, f32 -> bf16 after; for weights often with a transpose, hoisted out of loops) that XLA:GPU
would not emit (cuBLAS reads and writes bf16, transposed or not), and the reason its own
``cost_analysis`` bytes are inflated. A kernel of one operand that only converts (with or without
``transpose`` / ``copy`` / ``bitcast`` / ``reshape``), or only changes the layout of such a value, is not
counted: its consumers read its source at the source's dtype (also through ``while`` / ``call``
boundaries, where XLA carries hoisted f32 copies of the weights), and a kernel whose every result user
is such a narrowing convert writes at the narrow dtype. Transposes and copies that convert nothing
(e.g. of the KV cache) are kernels.

**Byte model** (per kernel, real dtypes: bf16 2 bytes, f32/s32 4, pred 1): bytes of every operand read
+ bytes of every result written, with these refinements: an operand (of a fusion: a fused parameter,
seen through bitcast / reshape) used only through ``slice`` / ``dynamic-slice`` / ``gather`` reads only
the sliced bytes; the buffer of an in-place ``dynamic-update-slice`` or ``scatter`` (also as a fusion
root) is not read, and only the update is written (plus the update and indices read). A weight is thus
read once per kernel that reads it. **FLOPs** are matrix FLOPs only: ``2 * prod(result dims) *
prod(contracting dims)`` for every ``dot`` (also inside fusions); elementwise work is ignored.

**Projection** (labelled as such; nothing is measured on a GPU): per kernel the roofline
``max(bytes / BW, flops / peak)``, summed over the kernels of the program, plus ``launch`` seconds per
sequential kernel (0, 1, 2, 4 us). H100: 3.35 TB/s, H200: 4.8 TB/s, both 989.5 TFLOP/s bf16 dense.
``round_ar_steps`` is the projected round time over the projected AR step time (same launch cost per
sequential kernel of the AR step, which has none unless the model loops over layers), and the
projected speedup is ``tau / round_ar_steps`` at ``--tau`` (7.34, compared with the SparklingTree
write-up's 4.29x).

``--attention fused`` replaces every attention call (target and drafter, AR step and round) by one opaque call
(:func:`fused_attention_model`, a ``jax.pure_callback`` that is compiled, never run), charged its operands read
once and its output written once, with :func:`fused_attention_flops`: a projection of a fused GPU attention kernel
(cuDNN's, which ``attend(impl="dpa")`` calls for bf16), which the CPU program cannot contain.

Usage::

    python eval/bench_round.py --preset real,demo --batches 1,8 --budgets 16,64 \\
        --out eval/results/round_bench.txt --json eval/results/round_bench.json
    python eval/bench_round.py --quick        # real preset, batch 1: ar, dspark, sparklingtree@64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ============================================================================= the HLO text parser

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
    "token": 0,
}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([^\]]*)\]")

# instructions that launch nothing (control ops are walked into instead)
NOT_KERNELS = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "while", "call", "conditional", "domain",
})
_VIEW = frozenset({"bitcast", "reshape", "convert"})  # seen through when looking how a fused parameter is used
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
_LAYOUT = frozenset({"transpose", "copy", "bitcast", "reshape"})


# ============================================================================= the fused-attention model

# the custom-call target jax.pure_callback lowers to (xla_ffi_python_cpu_callback on XLA:CPU, ..._gpu_... on a GPU)
FUSED_ATTENTION_TARGET = re.compile(r'custom_call_target="[\w]*python_\w*callback"')


def fused_attention_model(q, parts, impl=None):
    """Stands in for :func:`sparkjax.nn.layers.attend` under ``--attention fused``: one opaque call (a
    ``jax.pure_callback``: compiled, never run) of the queries and every part's keys, values and mask that returns
    the attention output. The byte model then charges what a fused attention kernel moves (cuDNN's, which
    ``attend(impl="dpa")`` calls on a GPU for bf16): its operands read once and its output written once, and
    :func:`fused_attention_flops` its FLOPs. A projection of that kernel, not of anything XLA:CPU runs."""
    import jax
    import numpy as np

    b, t, n, h = q.shape
    out = jax.ShapeDtypeStruct((b, t, n, h), parts[0][1].dtype)
    flat = [q] + [x for part in parts for x in part]
    return jax.pure_callback(lambda *_: np.zeros(out.shape, out.dtype), out, *flat)


def fused_attention_flops(shapes: Sequence[tuple[int, ...]]) -> float:
    """Matrix FLOPs of one fused attention call from its operands' shapes (``q [B, T, N, H]``, then ``k, v, mask``
    per part, ``k [B, K, S_i, H]``): ``2 B T N H S`` for the scores and as many for the weighted values."""
    b, t, n, h = shapes[0]
    return 4.0 * b * t * n * h * sum(k[2] for k in shapes[1::3])


def shape_arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(dtype, dims), ...]`` of every array in an HLO shape string (a tuple gives several)."""
    out = []
    for dt, dims in _ARRAY.findall(shape):
        out.append((dt, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())))
    return out


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string at its dtypes (a tuple: the sum of its elements)."""
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shape_arrays(shape))


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    root: bool = False
    inner: str = ""  # the text inside the operand parentheses (a parameter's number, a constant's value)

    def attr_comp(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instrs}
        self.users: dict[str, list[Instr]] = {}
        for i in self.instrs:
            for o in i.operands:
                self.users.setdefault(o, []).append(i)

    @property
    def root(self) -> Instr:
        return next((i for i in self.instrs if i.root), self.instrs[-1])


def _balanced(s: str, start: int) -> int:
    """Index just past the bracket group opening at ``s[start]``."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closers = set(pairs.values())
    for k in range(start, len(s)):
        c = s[k]
        if c in pairs:
            depth += 1
        elif c in closers:
            depth -= 1
            if depth == 0:
                return k + 1
    raise ValueError(f"unbalanced brackets in HLO line: {s[:120]!r}")


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


_INSTR_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


_COMMENT = re.compile(r"/\*.*?\*/")


def parse_instr(line: str) -> Instr | None:
    line = _COMMENT.sub("", line)  # XLA prints /*index=5*/ every five tuple elements and operands
    m = _INSTR_HEAD.match(line)
    if not m:
        return None
    k = m.end()
    if line[k] == "(":
        end = _balanced(line, k)
    else:
        end = line.index(" ", k)
    shape = line[k:end]
    rest = line[end:].lstrip()
    p = rest.index("(")
    op = rest[:p].strip()
    close = _balanced(rest, p)
    inner = rest[p + 1 : close - 1]
    operands = []
    if op not in ("parameter", "constant"):
        for part in _split_top(inner):
            tok = part.strip().split()
            if tok and tok[-1].startswith("%"):
                operands.append(tok[-1][1:])
            elif tok and re.fullmatch(r"[A-Za-z_][\w.\-]*", tok[-1]):
                operands.append(tok[-1])
    return Instr(m.group(2), shape, op, operands, rest[close:], bool(m.group(1)), inner.strip())


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """``({name: Computation}, entry name)`` of an HLO module's text (``compiled.as_text()``)."""
    comps: dict[str, Computation] = {}
    entry = None
    cur_name, cur = None, None
    for line in text.splitlines():
        if cur is None:
            m = _COMP_HEAD.match(line)
            if m:
                cur_name, cur = m.group(2), []
                if m.group(1):
                    entry = cur_name
            continue
        if line.strip() == "}":
            comps[cur_name] = Computation(cur_name, cur)
            cur_name, cur = None, None
            continue
        ins = parse_instr(line)
        if ins is not None:
            cur.append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


# ============================================================================= the counter

STAGES = ("draft", "tree", "verify", "commit")  # sparkjax.engine.round.STAGES: the round's named scopes
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def stage_of(attrs: str) -> str:
    """The round stage named in an instruction's metadata (``.../while/body/verify/...``), else "other"."""
    m = _OP_NAME.search(attrs)
    if not m:
        return "other"
    parts = m.group(1).split("/")
    return next((p for p in parts if p in STAGES), "other")



@dataclasses.dataclass
class Kernel:
    name: str
    op: str
    count: float  # executions per program run
    bytes: float  # per execution
    flops: float  # per execution
    sequential: bool
    stage: str = "other"  # the round's stage (named scope) it runs in, from the HLO metadata


@dataclasses.dataclass
class Tally:
    kernels: list[Kernel] = dataclasses.field(default_factory=list)
    unknown_loops: int = 0
    loops: list[tuple[str, int | None]] = dataclasses.field(default_factory=list)

    @property
    def total_kernels(self) -> int:
        return int(round(sum(k.count for k in self.kernels)))

    @property
    def sequential_kernels(self) -> int:
        return int(round(sum(k.count for k in self.kernels if k.sequential)))

    @property
    def bytes(self) -> float:
        return sum(k.count * k.bytes for k in self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.count * k.flops for k in self.kernels)

    def seconds(self, bandwidth: float, peak: float, launch: float = 0.0) -> float:
        """Per-kernel roofline ``max(bytes / BW, flops / peak)`` summed, plus ``launch`` per sequential kernel."""
        t = sum(k.count * max(k.bytes / bandwidth, k.flops / peak) for k in self.kernels)
        return t + launch * self.sequential_kernels

    def by_stage(self) -> dict[str, dict[str, float]]:
        """Per stage: kernels, sequential kernels and bytes executed."""
        out: dict[str, dict[str, float]] = {}
        for k in self.kernels:
            d = out.setdefault(k.stage, {"kernels": 0, "sequential_kernels": 0, "bytes": 0.0})
            d["kernels"] += int(k.count)
            d["sequential_kernels"] += int(k.count) if k.sequential else 0
            d["bytes"] += k.count * k.bytes
        return out

    def extend(self, other: Tally) -> None:
        self.kernels += other.kernels
        self.unknown_loops += other.unknown_loops
        self.loops += other.loops


class HloCounter:
    """Counts kernels, bytes and FLOPs of an optimised HLO module (see the module docstring)."""

    def __init__(self, text: str):
        self.comps, self.entry = parse_module(text)
        self._elided: dict[str, set[str]] = {}
        self.param_ratio: dict[tuple[str, int], object] = {}  # (computation, parameter number) -> ratios

    # --------------------------------------------------------------- helpers
    def _fused_ops(self, ins: Instr) -> set[str] | None:
        """The ops of a one-operand fusion's body (None for anything else)."""
        if ins.op != "fusion" or len(ins.operands) != 1:
            return None
        body = self.comps.get(ins.attr_comp("calls") or "")
        return None if body is None else {i.op for i in body.instrs if i.op != "parameter"}

    def is_pure_convert(self, comp: Computation, ins: Instr) -> bool:
        """A convert (any direction) of one value, possibly with bitcasts / reshapes: an XLA:CPU artifact
        (see the module docstring); not a kernel."""
        if ins.op == "convert":
            return True
        ops = self._fused_ops(ins)
        return ops is not None and "convert" in ops and ops <= {"convert", "bitcast", "reshape"}

    def is_relayout(self, ins: Instr) -> bool:
        """A kernel that only moves one value (transpose / copy / bitcast / reshape), maybe converting it."""
        if ins.op in ("transpose", "copy"):
            return True
        ops = self._fused_ops(ins)
        return ops is not None and bool(ops) and ops <= {"convert", "transpose", "copy", "bitcast", "reshape"}

    def trip_count(self, ins: Instr) -> int | None:
        m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', ins.attrs)
        if m:
            return int(m.group(1))
        cond = self.comps.get(ins.attr_comp("condition") or "")
        init = re.search(r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"(-?\d+)"\s*,\s*"step"\s*:\s*"(-?\d+)"', ins.attrs)
        if cond is None or not init or int(init.group(2)) != 1:
            return None
        r = cond.root
        if r.op == "fusion":  # a wrapped compare: look inside, then map its operands back
            body = self.comps.get(r.attr_comp("calls") or "")
            if body is None or body.root.op != "compare" or "direction=LT" not in body.root.attrs:
                return None
        elif r.op != "compare" or "direction=LT" not in r.attrs:
            return None
        consts = [cond.by_name[o] for o in r.operands if o in cond.by_name and cond.by_name[o].op == "constant"]
        if len(consts) != 1:
            return None
        if not re.fullmatch(r"-?\d+", consts[0].inner):
            return None
        return max(int(consts[0].inner) - int(init.group(1)), 0)

    def elided(self, comp: Computation) -> set[str]:
        if comp.name not in self._elided:
            self._elided[comp.name] = {i.name for i in comp.instrs if self.is_pure_convert(comp, i)}
        return self._elided[comp.name]

    def ratios(self, comp: Computation, name: str):
        """Charged over nominal bytes of value ``name`` (a list for a tuple): below 1 where the value is an
        elided upcast of a narrower source, also across ``while`` / ``call`` boundaries (XLA:CPU hoists
        the bf16 -> f32 upcast of weights out of loops and carries the f32 copies)."""
        ins = comp.by_name.get(name)
        if ins is None:
            return 1.0
        if ins.op == "tuple":
            return [self.ratios(comp, o) for o in ins.operands]
        if ins.op == "parameter":
            return self.param_ratio.get((comp.name, int(ins.inner) if ins.inner.isdigit() else 0), 1.0)
        if ins.op == "get-tuple-element":
            r = self.ratios(comp, ins.operands[0]) if ins.operands else 1.0
            m = re.search(r"index=(\d+)", ins.attrs)
            return r[int(m.group(1))] if isinstance(r, list) and m and int(m.group(1)) < len(r) else 1.0
        size = shape_bytes(ins.shape)
        return self.charged(comp, name, self.elided(comp)) / size if size else 1.0

    def charged(self, comp: Computation, name: str, elided: set[str]) -> float:
        """Bytes of reading value ``name`` of ``comp`` whole (through elided converts)."""
        ins = comp.by_name.get(name)
        if ins is None:
            return 0.0
        if ins.name in elided:
            return self.charged(comp, ins.operands[0], elided) if ins.operands else 0.0
        if ins.op in ("parameter", "get-tuple-element"):
            r = self.ratios(comp, name)
            return shape_bytes(ins.shape) * (r if isinstance(r, float | int) else 1.0)
        return self.written(comp, ins, elided)

    def written(self, comp: Computation, ins: Instr, elided: set[str]) -> float:
        """Bytes kernel ``ins`` writes (narrowed when every user is an elided narrowing convert; a relayout
        writes at the width its source is charged at, when narrower)."""
        own = shape_bytes(ins.shape)
        if self.is_relayout(ins) and ins.operands and own:
            src = comp.by_name.get(ins.operands[0])
            if src is not None and shape_bytes(src.shape):
                src_arrays, own_arrays = shape_arrays(src.shape), shape_arrays(ins.shape)
                if len(src_arrays) == len(own_arrays) == 1:
                    width = self.charged(comp, src.name, elided) / math.prod(src_arrays[0][1] or (1,))
                    own = min(own, width * math.prod(own_arrays[0][1] or (1,)))
        users = comp.users.get(ins.name, [])
        if users and all(u.name in elided for u in users):
            return min(own, max(shape_bytes(u.shape) for u in users))
        return own

    def _param_use(self, body: Computation, pname: str) -> float | None:
        """Bytes read of fused parameter ``pname`` when it is only sliced or is an in-place buffer
        (None: read whole)."""
        total, frontier = 0.0, [pname]
        while frontier:
            v = frontier.pop()
            for u in body.users.get(v, []):
                if u.op in _VIEW:
                    frontier.append(u.name)
                elif u.op in _SLICING and u.operands and u.operands[0] == v:
                    total += shape_bytes(u.shape)
                elif u.op in _IN_PLACE and u.operands and u.operands[0] == v:
                    pass  # the in-place buffer: not read
                else:
                    return None
        return total

    def _in_place_write(self, body: Computation | None, ins: Instr) -> float | None:
        """Bytes written when the kernel (or its fused root, or each tuple element) is an in-place
        update (None: the result is written whole)."""
        if body is None:
            root, where = ins, None
        else:
            root, where = body.root, body
        roots = [root]
        if root.op == "tuple" and where is not None:
            roots = [where.by_name[o] for o in root.operands if o in where.by_name]
        if where is not None:  # an in-place update converted / bitcast on the way out is still in place
            for k, r in enumerate(roots):
                while r.op in _VIEW and r.operands and r.operands[0] in where.by_name:
                    r = where.by_name[r.operands[0]]
                roots[k] = r if r.op in _IN_PLACE else roots[k]
        if not any(r.op in _IN_PLACE for r in roots):
            return None
        total = 0.0
        for r in roots:
            if r.op == "dynamic-update-slice":
                upd = (where.by_name if where else None)
                total += shape_bytes(upd[r.operands[1]].shape) if upd else 0.0
            elif r.op == "scatter":
                n = (len(r.operands) - 1) // 2  # operands..., indices, updates...
                src = where.by_name if where else None
                total += sum(shape_bytes(src[o].shape) for o in r.operands[n + 1 :]) if src else 0.0
            else:
                total += shape_bytes(r.shape)
        return total

    def stage(self, ins: Instr) -> str:
        """The stage in the kernel's metadata, else the most common one inside its fused computation."""
        st = stage_of(ins.attrs)
        body = self.comps.get(ins.attr_comp("calls") or "") if ins.op == "fusion" else None
        if st != "other" or body is None:
            return st
        inner = [stage_of(i.attrs) for i in body.instrs]
        inner = [x for x in inner if x != "other"]
        return max(set(inner), key=inner.count) if inner else st

    def dot_flops(self, comp: Computation, ins: Instr) -> float:
        if ins.op == "custom-call" and FUSED_ATTENTION_TARGET.search(ins.attrs):
            return fused_attention_flops([shape_arrays(comp.by_name[o].shape)[0][1] for o in ins.operands])
        if ins.op == "dot":
            lhs = comp.by_name.get(ins.operands[0])
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
            if lhs is None or not m:
                return 0.0
            ldims = shape_arrays(lhs.shape)[0][1]
            k = math.prod(ldims[int(d)] for d in m.group(1).split(",") if d)
            out = shape_arrays(ins.shape)[0][1]
            return 2.0 * math.prod(out) * k
        sub = ins.attr_comp("calls") or ins.attr_comp("to_apply")
        if ins.op in ("fusion", "call") and sub in self.comps:
            body = self.comps[sub]
            return sum(self.dot_flops(body, i) for i in body.instrs)
        return 0.0

    def kernel_cost(self, comp: Computation, ins: Instr, elided: set[str]) -> tuple[float, float]:
        """(bytes, flops) of one execution of kernel ``ins`` of ``comp``."""
        body = self.comps.get(ins.attr_comp("calls") or "") if ins.op == "fusion" else None
        read = 0.0
        params = {}  # fused parameter number -> its name
        if body is not None:
            params = {int(i.inner): i.name for i in body.instrs if i.op == "parameter" and i.inner.isdigit()}
        for k, o in enumerate(ins.operands):
            whole = self.charged(comp, o, elided)
            src = comp.by_name.get(o)
            size = shape_bytes(src.shape) if src is not None else 0.0
            ratio = whole / size if size else 1.0
            if body is not None and k in params:
                part = self._param_use(body, params[k])
                read += whole if part is None else part * ratio
            elif body is None and ins.op in _SLICING and k == 0:
                read += shape_bytes(ins.shape) * ratio
            elif body is None and ins.op in _IN_PLACE and k == 0:
                pass
            else:
                read += whole
        inplace = self._in_place_write(body, ins) if body is not None or ins.op in _IN_PLACE else None
        if inplace is None:
            write = self.written(comp, ins, elided)
        elif body is None:
            write = sum(self.charged(comp, o, elided) for o in ins.operands[1:2]) if ins.op == "dynamic-update-slice" \
                else sum(self.charged(comp, o, elided) for o in ins.operands[(len(ins.operands) - 1) // 2 + 1 :])
        else:
            write = inplace
        return read + write, self.dot_flops(comp, ins)

    # --------------------------------------------------------------- the walk
    def walk(self, name: str, mult: float = 1.0, in_loop: bool = False) -> Tally:
        comp = self.comps[name]
        tally = Tally()
        elided = self.elided(comp)
        for ins in comp.instrs:
            if ins.op in ("while", "call"):
                r = [self.ratios(comp, o) for o in ins.operands]
                for sub in (ins.attr_comp("body"), ins.attr_comp("condition"), ins.attr_comp("to_apply")):
                    if sub:
                        self.param_ratio.update({(sub, k): v for k, v in enumerate(r)})
            if ins.op == "while":
                trip = self.trip_count(ins)
                tally.loops.append((ins.name, trip))
                if trip is None:
                    tally.unknown_loops += 1
                n = 1 if trip is None else trip
                tally.extend(self.walk(ins.attr_comp("body"), mult * n, True))
                tally.extend(self.walk(ins.attr_comp("condition"), mult * (n + 1), True))
            elif ins.op == "call":
                tally.extend(self.walk(ins.attr_comp("to_apply"), mult, in_loop))
            elif ins.op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                names = [s.strip().lstrip("%") for s in m.group(1).split(",")] if m else [
                    c for c in (ins.attr_comp("true_computation"), ins.attr_comp("false_computation")) if c
                ]
                branches = [self.walk(b, mult, in_loop) for b in names]
                if branches:
                    tally.extend(max(branches, key=lambda t: (t.bytes, t.total_kernels)))
            elif ins.op in NOT_KERNELS or ins.name in elided:
                continue
            else:
                b, f = self.kernel_cost(comp, ins, elided)
                tally.kernels.append(Kernel(ins.name, ins.op, mult, b, f, in_loop, self.stage(ins)))
        return tally

    def generation_loop(self) -> Instr:
        """The ``while`` (in the entry, or a ``call`` from it) with no known trip count and the
        largest body: the generation loop."""
        found: list[Instr] = []

        def visit(name):
            for ins in self.comps[name].instrs:
                if ins.op == "while" and self.trip_count(ins) is None:
                    found.append(ins)
                elif ins.op == "call":
                    visit(ins.attr_comp("to_apply"))

        visit(self.entry)
        if not found:
            raise ValueError("no while loop without a known trip count at the top of the program")
        return max(found, key=lambda w: len(self.comps[w.attr_comp("body")].instrs))

    def count_program(self) -> Tally:
        return self.walk(self.entry)

    def count_loop_body(self) -> Tally:
        """One iteration of the generation loop: its body and one evaluation of its condition."""
        w = self.generation_loop()
        self.walk(self.entry)  # records what the loop carries (the dtype each value was upcast from)
        t = self.walk(w.attr_comp("body"))
        t.extend(self.walk(w.attr_comp("condition")))
        return t


def count_hlo(text: str, *, loop_body: bool = False) -> Tally:
    c = HloCounter(text)
    return c.count_loop_body() if loop_body else c.count_program()


# ============================================================================= devices (projection only)


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # bytes/s
    peak: float  # FLOP/s bf16 dense


DEVICES = (Device("H100", 3.35e12, 989.5e12), Device("H200", 4.8e12, 989.5e12))
LAUNCH_US = (0.0, 1.0, 2.0, 4.0)
TABLE_LAUNCH_US = (0.0, 1.0, 4.0)
WRITEUP_SPEEDUP = 4.29

# ============================================================================= building the programs


def _configs(preset: str):
    from sparkjax.config import DrafterConfig, Qwen3Config

    if preset == "real":
        d = ROOT / "tests/fixtures/tiny_dspark_b16/configs"
        t = Qwen3Config.from_hf_config(d / "qwen3_4b_target_config.json")
        ds = DrafterConfig.from_hf_config(d / "dspark_qwen3_4b_b16_config.json")
        df = _dflash_like(ds)
        src = (f"{d.relative_to(ROOT)}/qwen3_4b_target_config.json (Qwen3-4B), "
               f"{d.relative_to(ROOT)}/dspark_qwen3_4b_b16_config.json (DSpark-b16 for Qwen3-4B); "
               "dflash: the same drafter without Markov / confidence heads")
    elif preset == "demo":
        d = ROOT / "sparkjax/assets/demo"
        t = Qwen3Config.from_hf_config(d / "target/config.json")
        ds = DrafterConfig.from_hf_config(d / "dspark_b16/config.json")
        df = DrafterConfig.from_hf_config(d / "dflash_b16/config.json")
        src = "sparkjax/assets/demo/{target,dspark_b16,dflash_b16}/config.json"
    elif preset == "tiny":
        d = ROOT / "tests/fixtures/tiny_dspark_b16"
        t = Qwen3Config.from_hf_config(d / "target/config.json")
        ds = DrafterConfig.from_hf_config(d / "drafter/config.json")
        df = _dflash_like(ds)
        src = "tests/fixtures/tiny_dspark_b16/{target,drafter}/config.json"
    else:
        from sparkjax.errors import ArgumentError

        raise ArgumentError(f"--preset: unknown preset {preset!r}; expected real, demo or tiny")
    return t, ds, df, src


def _dflash_like(ds):
    return dataclasses.replace(ds, kind="dflash", markov_rank=0, markov_head_type=None,
                               enable_confidence_head=False, confidence_head_with_markov=False)


def describe_configs(preset: str) -> str:
    t, ds, df, src = _configs(preset)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings")
    tt = ", ".join(f"{f}={getattr(t, f)}" for f in fields)
    dd = ", ".join(f"{f}={getattr(ds, f)}" for f in fields[1:7]) + (
        f", block_size={ds.block_size}, target_layer_ids={list(ds.target_layer_ids)}, markov_rank={ds.markov_rank}"
        f" ({ds.markov_head_type}), confidence_head={ds.enable_confidence_head}")
    return f"preset {preset}: {src}\n  target: {tt}\n  dspark drafter: {dd}"


_MODELS: dict = {}


def abstract_models(preset: str):
    """(target, dspark drafter, dflash drafter) with abstract bf16 weights (nothing allocated)."""
    if preset not in _MODELS:
        import jax.numpy as jnp
        from flax import nnx

        from sparkjax.nn.drafter import Drafter
        from sparkjax.nn.qwen3 import Qwen3

        t, ds, df, _ = _configs(preset)
        mk = lambda cls, c: nnx.eval_shape(lambda: cls(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))  # noqa: E731
        _MODELS[preset] = (mk(Qwen3, t), mk(Drafter, ds), mk(Drafter, df))
    return _MODELS[preset]


def _args(batch: int, prompt: int):
    import jax
    import jax.numpy as jnp

    s = jax.ShapeDtypeStruct
    return (s((batch, prompt), jnp.int32), s((batch,), jnp.int32), s((), jnp.int32), s((1,), jnp.int32),
            s((), jnp.float32), jax.eval_shape(lambda: jax.random.key(0)))


def compile_ar(preset: str, batch: int, context: int) -> tuple[str, float]:
    """The optimised HLO text of the AR program (its loop body is the AR step) and the compile seconds."""
    from flax import nnx

    from sparkjax.engine.programs import ar_program

    target = abstract_models(preset)[0]
    g, st = nnx.split(target)
    t0 = time.perf_counter()
    import inspect

    greedy = {"sampling": False} if "sampling" in inspect.signature(ar_program).parameters else {}
    lowered = ar_program.lower(g, st, *_args(batch, 16), buf_len=64, cache_size=context, **greedy)
    text = lowered.compile().as_text()
    return text, time.perf_counter() - t0


def parse_method_label(label: str):
    """``name[@budget][:option...]``: a method with tree options, ``base`` / ``corrected`` / ``union`` (candidates)
    or ``auto`` (the beam's widths), e.g. ``sparklingtree@64:union``."""
    from sparkjax.engine.methods import parse_method
    from sparkjax.errors import ArgumentError
    from sparkjax.tree import CANDIDATE_MODES

    name, *opts = label.split(":")
    kw = {}
    for o in opts:
        if o in CANDIDATE_MODES:
            kw["candidates"] = o
        elif o == "auto":
            kw["widths"] = "auto"
        else:
            raise ArgumentError(f"--methods: unknown tree option {o!r} in {label!r} (base, corrected, union, auto)")
    return parse_method(name, **kw)


def compile_round(preset: str, method: str, batch: int, context: int) -> tuple[str, float, object]:
    """The optimised HLO text of the speculative program (its loop body is one round), the compile seconds
    and the plan."""
    from flax import nnx  # noqa: F401 - the models are nnx modules

    from sparkjax.engine.programs import spec_program, split_pair

    target, dspark, dflash = abstract_models(preset)
    m = parse_method_label(method)
    drafter = dspark if m.needs_markov else dflash
    plan = m.plan(target, drafter, False)
    graphdefs, states = split_pair(target, drafter)
    t0 = time.perf_counter()
    lowered = spec_program.lower(graphdefs, states, *_args(batch, 16), plan=plan, cache_size=context, buf_len=64)
    text = lowered.compile().as_text()
    return text, time.perf_counter() - t0, plan


# ============================================================================= rows


def method_labels(methods: Sequence[str], budgets: Sequence[int]) -> list[str]:
    out = []
    for m in methods:
        if m in ("ddtree", "sparklingtree", "sparklingtree-beam"):
            out += [f"{m}@{b}" for b in budgets]
        else:
            out.append(m)
    return out


def make_row(method: str, batch: int, preset: str, context: int, tally: Tally, ar: Tally, compile_s: float,
             tau: float) -> dict:
    name, _, opts = method.partition(":")
    budget = int(name.split("@")[1]) if "@" in name else None
    row = {
        "method": name.split("@")[0] + (f":{opts}" if opts else ""), "budget": budget, "batch": batch,
        "preset": preset, "context": context,
        "kernels": tally.total_kernels, "sequential_kernels": tally.sequential_kernels,
        "unknown_loops": tally.unknown_loops, "bytes": tally.bytes, "flops": tally.flops,
        "ar_kernels": ar.total_kernels, "ar_bytes": ar.bytes, "ar_flops": ar.flops,
        "bytes_over_ar": tally.bytes / ar.bytes if ar.bytes else None,
        "compile_s": round(compile_s, 1), "projection": True, "stages": tally.by_stage(),
    }
    for dev in DEVICES:
        ar_t = {us: ar.seconds(dev.bandwidth, dev.peak, us * 1e-6) for us in LAUNCH_US}
        for us in LAUNCH_US:
            steps = tally.seconds(dev.bandwidth, dev.peak, us * 1e-6) / ar_t[us]
            row[f"{dev.name.lower()}_ar_steps_at_{us:g}us"] = steps
    row["round_ar_steps_at_2us"] = row["h100_ar_steps_at_2us"]
    row["round_ar_steps_at_2us_h200"] = row["h200_ar_steps_at_2us"]
    row["tau"] = tau
    row["projected_speedup_at_2us"] = tau / row["round_ar_steps_at_2us"]
    row["writeup_speedup"] = WRITEUP_SPEEDUP
    return row


def ar_row(batch: int, preset: str, context: int, ar: Tally, compile_s: float) -> dict:
    row = {"method": "ar", "budget": None, "batch": batch, "preset": preset, "context": context,
           "kernels": ar.total_kernels, "sequential_kernels": ar.sequential_kernels,
           "unknown_loops": ar.unknown_loops, "bytes": ar.bytes, "flops": ar.flops,
           "ar_kernels": ar.total_kernels, "ar_bytes": ar.bytes, "ar_flops": ar.flops, "bytes_over_ar": 1.0,
           "compile_s": round(compile_s, 1), "projection": True, "stages": ar.by_stage()}
    for dev in DEVICES:
        for us in LAUNCH_US:
            row[f"{dev.name.lower()}_ar_steps_at_{us:g}us"] = 1.0
        row[f"{dev.name.lower()}_ar_step_us"] = ar.seconds(dev.bandwidth, dev.peak) * 1e6
    row["round_ar_steps_at_2us"] = 1.0
    row["round_ar_steps_at_2us_h200"] = 1.0
    return row


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'preset':6} {'B':>2} {'method':24} {'kernels':>7} {'seq':>5} {'MB':>9} {'GFLOP':>8} "
            f"{'xAR MB':>6} | " + " ".join(f"{d.name}@{us:g}us" for d in DEVICES for us in TABLE_LAUNCH_US)
            + f" | {'H100@2us':>8} {'spd@2us':>7} {'compile':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        label = r["method"] + (f"@{r['budget']}" if r["budget"] else "")
        proj = " ".join(f"{r[f'{d.name.lower()}_ar_steps_at_{us:g}us']:>{len(d.name) + len(f'{us:g}') + 3}.2f}"
                        for d in DEVICES for us in TABLE_LAUNCH_US)
        spd = f"{r['projected_speedup_at_2us']:.2f}x" if "projected_speedup_at_2us" in r else "-"
        unk = f" ({r['unknown_loops']} unknown loops counted once)" if r["unknown_loops"] else ""
        lines.append(
            f"{r['preset']:6} {r['batch']:>2} {label:24} {r['kernels']:>7} {r['sequential_kernels']:>5} "
            f"{r['bytes'] / 1e6:>9.1f} {r['flops'] / 1e9:>8.2f} {r['bytes_over_ar']:>6.2f} | {proj} | "
            f"{r['round_ar_steps_at_2us']:>8.2f} {spd:>7} {r['compile_s']:>6.0f}s{unk}")
    lines += ["", "Per stage (named scopes of the round): kernels / sequential kernels / MB"]
    names = (*STAGES, "other")
    head2 = f"{'preset':6} {'B':>2} {'method':24} " + " ".join(f"{n:>20}" for n in names)
    lines += [head2, "-" * len(head2)]
    for r in rows:
        label = r["method"] + (f"@{r['budget']}" if r["budget"] else "")
        st = r.get("stages", {})
        cells = []
        for n in names:
            d = st.get(n)
            cells.append(f"{'-':>20}" if not d else
                         f"{d['kernels']:>6}/{d['sequential_kernels']:>4}/{d['bytes'] / 1e6:>8.1f}")
        lines.append(f"{r['preset']:6} {r['batch']:>2} {label:24} " + " ".join(cells))
    return "\n".join(lines)


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through the project's crash-safe writer (no half-written file)."""
    from sparkjax.io.atomic import atomic_file

    with atomic_file(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def run(presets: Iterable[str], batches: Iterable[int], methods: Sequence[str], context: int, tau: float,
        log=print, dump: str | None = None) -> list[dict]:
    rows = []

    def save(name, text):
        if dump:
            os.makedirs(dump, exist_ok=True)
            write_atomic(os.path.join(dump, f"{name}.hlo.txt"), text)

    for preset in presets:
        log(describe_configs(preset))
        for b in batches:
            text, secs = compile_ar(preset, b, context)
            save(f"{preset}_b{b}_ar", text)
            ar = count_hlo(text, loop_body=True)
            log(f"  [{preset} B={b}] ar step compiled in {secs:.0f}s: {ar.total_kernels} kernels, "
                f"{ar.bytes / 1e6:.1f} MB")
            rows.append(ar_row(b, preset, context, ar, secs))
            for m in methods:
                if m == "ar":
                    continue
                text, secs, _ = compile_round(preset, m, b, context)
                save(f"{preset}_b{b}_{m}", text)
                t = count_hlo(text, loop_body=True)
                rows.append(make_row(m, b, preset, context, t, ar, secs, tau))
                log(f"  [{preset} B={b}] {m} round compiled in {secs:.0f}s: {t.total_kernels} kernels "
                    f"({t.sequential_kernels} sequential), {t.bytes / 1e6:.1f} MB")
    return rows


def _ints(text: str, arg: str) -> list[int]:
    from sparkjax.errors import ArgumentError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ArgumentError(f"{arg}: expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise ArgumentError(f"{arg}: expected positive integers, got {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="real,demo", help="comma-separated: real, demo, tiny")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--methods", default="ar,dflash,dspark,ddtree,sparklingtree,sparklingtree-beam",
                    help="names, or name@budget for one tree budget")
    ap.add_argument("--context", type=int, default=1024, help="cache slots S (the cache bucket)")
    ap.add_argument("--tau", type=float, default=7.34, help="accepted tokens per round for the projected speedup")
    ap.add_argument("--quick", action="store_true", help="real preset, batch 1: ar, dspark, sparklingtree@64")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--json", help="write one JSON record per row here")
    ap.add_argument("--dump-hlo", metavar="DIR", help="also write each compiled program's HLO text into DIR")
    ap.add_argument("--chain", default="fixed_point", choices=("fixed_point", "scan"),
                    help="the DSpark chain formulation compiled (default: the GPU's, fixed_point; XLA:CPU's own "
                         "default is the scan)")
    ap.add_argument("--attention", default="einsum", choices=("einsum", "dpa", "blocked", "prefix", "fused"),
                    help="the attention path compiled (default: what accelerators run, einsum; XLA:CPU's own "
                         "default is blocked); fused: every attention call as one opaque kernel charged what a "
                         "fused GPU kernel (cuDNN, attend(impl='dpa')) reads and writes (a projection)")
    a = ap.parse_args(argv)
    import jax

    from sparkjax.errors import ArgumentError, SparkjaxError

    saved = None
    try:
        from sparkjax.engine import drafting
        from sparkjax.nn import drafter as drafter_mod
        from sparkjax.nn import layers, qwen3

        # what mode="auto" / the default attention mean while these programs are traced (restored below)
        saved = drafting.AUTO_CHAIN_MODE, layers.ATTENTION_IMPL, qwen3.attend, drafter_mod.attend
        drafting.AUTO_CHAIN_MODE = a.chain
        layers.ATTENTION_IMPL = "einsum" if a.attention == "fused" else a.attention
        if a.attention == "fused":
            qwen3.attend = drafter_mod.attend = fused_attention_model
        jax.clear_caches()  # these settings are read at trace time: no program traced under others is reused
        if a.quick:
            presets, batches, labels = ["real"], [1], ["ar", "dspark", "sparklingtree@64"]
        else:
            presets = [p.strip() for p in a.preset.split(",") if p.strip()]
            batches = _ints(a.batches, "--batches")
            names = [m.strip() for m in a.methods.split(",") if m.strip()]
            labels = [m for m in names if "@" in m] + method_labels([m for m in names if "@" not in m],
                                                                    _ints(a.budgets, "--budgets"))
        for p in presets:
            _configs(p)  # unknown presets fail before any compile
        if a.context < 64:
            raise ArgumentError(f"--context: {a.context} cache slots are too few (at least 64)")
        for m in labels:
            parse_method_label(m)
        t0 = time.perf_counter()
        rows = run(presets, batches, ["ar"] + [m for m in labels if m != "ar"], a.context, a.tau,
                   log=lambda s: print(s, file=sys.stderr, flush=True), dump=a.dump_hlo)
        table = format_table(rows)
        info = "\n".join(describe_configs(p) for p in presets)
        text = (
            f"# python eval/bench_round.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
            f"# PROJECTIONS from the optimised XLA:CPU HLO (abstract bf16 weights; nothing measured on a GPU).\n"
            f"# DSpark chain compiled as: {a.chain}; attention as: {a.attention}"
            + (" (each call one opaque kernel charged its operands + output: a fused GPU kernel, modelled)"
               if a.attention == "fused" else "") + ".\n"
            f"# S = {a.context} cache slots. kernels / seq: executed per round (loop trips counted) / inside "
            "loops. MB, GFLOP: own byte model, matmul FLOPs.\n"
            f"# xAR MB: round bytes over AR-step bytes. DEV@Nus: projected round cost in AR steps (per-kernel "
            "roofline + N us per sequential kernel).\n"
            f"# spd@2us: tau {a.tau} / H100 AR steps at 2 us (the SparklingTree write-up reports "
            f"{WRITEUP_SPEEDUP}x).\n"
            + "\n".join("# " + line for line in info.splitlines())
            + f"\n{table}\n# total wall time {time.perf_counter() - t0:.0f}s\n"
        )
        print(text, end="")
        if a.out:
            write_atomic(a.out, text)
        if a.json:
            write_atomic(a.json, json.dumps(rows, indent=1) + "\n")
    except SparkjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if saved is not None:
            drafting.AUTO_CHAIN_MODE, layers.ATTENTION_IMPL, qwen3.attend, drafter_mod.attend = saved
            jax.clear_caches()  # nor is one traced here later in the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
