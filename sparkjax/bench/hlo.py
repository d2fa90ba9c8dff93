"""Kernel, byte and FLOP counts of an optimised HLO module: the counter behind ``python -m sparkjax.bench round``.

:func:`count_hlo` walks from the entry (or one iteration of the generation loop): a ``while`` counts its body
trip-count times (``known_trip_count``, else a condition ``i < constant``; else once, in ``unknown_loops``),
a ``call`` in place, a ``conditional`` its costliest branch. A kernel is every executed instruction except
:data:`NOT_KERNELS` and pure converts; ``sequential`` kernels are inside a loop. Bytes: operands read + results
written (sliced operands and in-place updates count only the slice). The byte model is in docs/benchmarks.md.
``elide_converts=False`` counts a module compiled for a GPU (``python -m sparkjax.bench gpu-compile``): every
convert is a kernel there, and cuDNN / cuBLAS custom calls are charged their matrix FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import numpy as np

from sparkjax.engine.round import STAGES  # the round's named scopes

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
# what a kernel that only relayouts or joins values is made of
MOVING_OPS = frozenset({"transpose", "copy", "concatenate", "bitcast", "reshape", "convert", "slice",
                        "dynamic-slice", "pad", "broadcast"})
_CUDNN_ATTENTION = re.compile(r'custom_call_target="__cudnn\$fmha\w*"')
_GEMM = re.compile(r'custom_call_target="__cublas\$\w*gemm\w*"')

# the custom-call target jax.pure_callback lowers to (xla_ffi_python_cpu_callback on XLA:CPU, ..._gpu_... on a GPU)
FUSED_ATTENTION_TARGET = re.compile(r'custom_call_target="[\w]*python_\w*callback"')


def fused_attention_model(q, parts, **kw):
    """Stands in for :func:`sparkjax.nn.layers.attend` under ``--attention fused``: one opaque
    ``jax.pure_callback`` (compiled, never run) of the queries and every part's keys, values and mask, so the
    byte model charges a fused attention kernel's operands read once and its output written once."""
    b, t, n, h = q.shape
    out = jax.ShapeDtypeStruct((b, t, n, h), parts[0][1].dtype)
    flat = [q] + [x for part in parts for x in part]
    return jax.pure_callback(lambda *_: np.zeros(out.shape, out.dtype), out, *flat)


def fused_attention_flops(shapes: Sequence[tuple[int, ...]]) -> float:
    """Matrix FLOPs of one fused attention call from its operands' shapes (``q [B, T, N, H]``, then ``k, v, mask``
    per part, ``k [B, K, S_i, H]``): ``2 B T N H S`` for the scores and as many for the weighted values."""
    b, t, n, h = shapes[0]
    return 4.0 * b * t * n * h * sum(k[2] for k in shapes[1::3])


def library_call_flops(ins: Instr, operand_shapes: Sequence[str]) -> float:
    """Matrix FLOPs of a cuDNN fused attention call (``4 B N T S H``, from its score shape ``[B, N, T, S]`` in the
    backend config and the queries' head size) or a cuBLAS gemm (``2 * out * contracted``); 0 for other calls."""
    def numbers(pattern: str) -> list[int] | None:  # a JSON list of quoted integers in the backend config
        m = re.search(pattern + r'\s*:\s*\[([^\]]*)\]', ins.attrs)
        return [int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip()] if m else None

    if not operand_shapes:
        return 0.0
    if _CUDNN_ATTENTION.search(ins.attrs):
        scores = numbers(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"')
        if scores is None:
            return 0.0
        head = shape_arrays(operand_shapes[0])[0][1][-1]
        return (4.0 if "Backward" not in ins.attrs else 8.0) * math.prod(scores) * head
    dims = numbers(r'"lhs_contracting_dimensions"') if _GEMM.search(ins.attrs) else None
    if dims is None:
        return 0.0
    lhs = shape_arrays(operand_shapes[0])[0][1]
    return 2.0 * math.prod(shape_arrays(ins.shape)[0][1]) * math.prod(lhs[d] for d in dims)


def shape_arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(dtype, dims), ...]`` of every array in an HLO shape string (a tuple gives several)."""
    return [(dt, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip()))
            for dt, dims in _ARRAY.findall(shape)]


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
    depth = 0
    for k in range(start, len(s)):
        depth += (s[k] in "([{") - (s[k] in ")]}")
        if depth == 0:
            return k + 1
    raise ValueError(f"unbalanced brackets in HLO line: {s[:120]!r}")


def _split_top(s: str) -> list[str]:
    """``s`` split at its top-level commas."""
    parts, depth, start = [], 0, 0
    for k, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(s[start:k])
            start = k + 1
    return parts + [s[start:]] if s[start:].strip() else parts


_INSTR_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")


def parse_instr(line: str) -> Instr | None:
    line = _COMMENT.sub("", line)  # XLA prints /*index=5*/ every five tuple elements and operands
    m = _INSTR_HEAD.match(line)
    if not m:
        return None
    k = m.end()
    end = _balanced(line, k) if line[k] == "(" else line.index(" ", k)
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


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def stage_of(attrs: str) -> str:
    """The round stage named in an instruction's metadata (``.../while/body/verify/...``), else "other"."""
    m = _OP_NAME.search(attrs)
    return next((p for p in m.group(1).split("/") if p in STAGES), "other") if m else "other"


@dataclasses.dataclass
class Kernel:
    name: str
    op: str
    count: float  # executions per program run
    bytes: float  # per execution
    flops: float  # per execution
    sequential: bool
    stage: str = "other"  # the round's stage (named scope) it runs in, from the HLO metadata
    shape: str = ""  # the HLO shape of what it writes
    moves: bool = False  # it only moves or joins values (transpose, copy, concatenate, ...; no arithmetic)


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

    def seconds(self, bandwidth: float, peak: float, launch: float = 0.0, every_kernel: bool = False) -> float:
        """Per-kernel roofline ``max(bytes / BW, flops / peak)`` summed, plus ``launch`` per sequential kernel
        (``every_kernel``: per kernel executed)."""
        t = sum(k.count * max(k.bytes / bandwidth, k.flops / peak) for k in self.kernels)
        return t + launch * (self.total_kernels if every_kernel else self.sequential_kernels)

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


def _updates(ins: Instr) -> list[str]:
    """The update operands of an in-place op: dynamic-update-slice(buffer, update, ...), scatter(operands...,
    indices, updates...)."""
    if ins.op == "dynamic-update-slice":
        return ins.operands[1:2]
    return ins.operands[(len(ins.operands) - 1) // 2 + 1 :]


class HloCounter:
    """Counts kernels, bytes and FLOPs of an optimised HLO module (see the module docstring)."""

    def __init__(self, text: str, elide_converts: bool = True):
        self.comps, self.entry = parse_module(text)
        self.elide_converts = elide_converts
        self._elided: dict[str, set[str]] = {}
        self.param_ratio: dict[tuple[str, int], object] = {}  # (computation, parameter number) -> ratios

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

    def fused_ops(self, ins: Instr) -> set[str]:
        """The ops a kernel runs: its own, or those of its fused computation (nested fusions opened)."""
        if ins.op != "fusion":
            return {ins.op}
        body = self.comps.get(ins.attr_comp("calls") or "")
        if body is None:
            return {ins.op}
        ops: set[str] = set()
        for i in body.instrs:
            if i.op not in ("parameter", "constant", "tuple", "get-tuple-element"):
                ops |= self.fused_ops(i)
        return ops

    def only_moves(self, ins: Instr) -> bool:
        """A kernel that only moves, joins, slices or converts values (:data:`MOVING_OPS`), not just a fill."""
        ops = self.fused_ops(ins)
        return ops <= MOVING_OPS and bool(ops - {"broadcast", "bitcast", "reshape"})

    def trip_count(self, ins: Instr) -> int | None:
        m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', ins.attrs)
        if m:
            return int(m.group(1))
        cond = self.comps.get(ins.attr_comp("condition") or "")
        init = re.search(r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"(-?\d+)"\s*,\s*"step"\s*:\s*"(-?\d+)"', ins.attrs)
        if cond is None or not init or int(init.group(2)) != 1:
            return None
        r = cond.root
        body = self.comps.get(r.attr_comp("calls") or "") if r.op == "fusion" else cond  # a fused compare: inside
        if body is None or body.root.op != "compare" or "direction=LT" not in body.root.attrs:
            return None
        consts = [cond.by_name[o] for o in r.operands if o in cond.by_name and cond.by_name[o].op == "constant"]
        if len(consts) != 1 or not re.fullmatch(r"-?\d+", consts[0].inner):
            return None
        return max(int(consts[0].inner) - int(init.group(1)), 0)

    def elided(self, comp: Computation) -> set[str]:
        if comp.name not in self._elided:
            self._elided[comp.name] = {i.name for i in comp.instrs
                                       if self.elide_converts and self.is_pure_convert(comp, i)}
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
        roots = [ins if body is None else body.root]
        if body is not None:
            if roots[0].op == "tuple":
                roots = [body.by_name[o] for o in roots[0].operands if o in body.by_name]
            for k, r in enumerate(roots):  # an in-place update converted / bitcast on the way out is still in place
                while r.op in _VIEW and r.operands and r.operands[0] in body.by_name:
                    r = body.by_name[r.operands[0]]
                roots[k] = r if r.op in _IN_PLACE else roots[k]
        if not any(r.op in _IN_PLACE for r in roots):
            return None
        total = 0.0
        for r in roots:
            if r.op not in _IN_PLACE:
                total += shape_bytes(r.shape)
            elif body is not None:
                total += sum(shape_bytes(body.by_name[o].shape) for o in _updates(r))
        return total

    def stage(self, ins: Instr) -> str:
        """The stage in the kernel's metadata, else the most common one inside its fused computation."""
        st = stage_of(ins.attrs)
        body = self.comps.get(ins.attr_comp("calls") or "") if ins.op == "fusion" else None
        if st != "other" or body is None:
            return st
        inner = [x for x in (stage_of(i.attrs) for i in body.instrs) if x != "other"]
        return max(set(inner), key=inner.count) if inner else st

    def dot_flops(self, comp: Computation, ins: Instr) -> float:
        if ins.op == "custom-call" and FUSED_ATTENTION_TARGET.search(ins.attrs):
            return fused_attention_flops([shape_arrays(comp.by_name[o].shape)[0][1] for o in ins.operands])
        if ins.op == "custom-call":
            return library_call_flops(ins, [comp.by_name[o].shape for o in ins.operands if o in comp.by_name])
        if ins.op == "dot":
            lhs = comp.by_name.get(ins.operands[0])
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
            if lhs is None or not m:
                return 0.0
            ldims = shape_arrays(lhs.shape)[0][1]
            k = math.prod(ldims[int(d)] for d in m.group(1).split(",") if d)
            return 2.0 * math.prod(shape_arrays(ins.shape)[0][1]) * k
        sub = ins.attr_comp("calls") or ins.attr_comp("to_apply")
        if ins.op in ("fusion", "call") and sub in self.comps:
            body = self.comps[sub]
            return sum(self.dot_flops(body, i) for i in body.instrs)
        return 0.0

    def kernel_cost(self, comp: Computation, ins: Instr, elided: set[str]) -> tuple[float, float]:
        """(bytes, flops) of one execution of kernel ``ins`` of ``comp``."""
        body = self.comps.get(ins.attr_comp("calls") or "") if ins.op == "fusion" else None
        read = 0.0
        params = {int(i.inner): i.name for i in body.instrs if i.op == "parameter" and i.inner.isdigit()} if body \
            else {}  # fused parameter number -> its name
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
            write = sum(self.charged(comp, o, elided) for o in _updates(ins))
        else:
            write = inplace
        return read + write, self.dot_flops(comp, ins)

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
                    c for c in (ins.attr_comp("true_computation"), ins.attr_comp("false_computation")) if c]
                branches = [self.walk(b, mult, in_loop) for b in names]
                if branches:
                    tally.extend(max(branches, key=lambda t: (t.bytes, t.total_kernels)))
            elif ins.op in NOT_KERNELS or ins.name in elided:
                continue
            else:
                b, f = self.kernel_cost(comp, ins, elided)
                tally.kernels.append(Kernel(ins.name, ins.op, mult, b, f, in_loop, self.stage(ins), ins.shape,
                                            self.only_moves(ins)))
        return tally

    def generation_loop(self, any_trip_count: bool = False) -> Instr:
        """The ``while`` (in the entry, or a ``call`` from it) with no known trip count (or any, with
        ``any_trip_count``) and the largest body: the generation loop."""
        found: list[Instr] = []

        def visit(name):
            for ins in self.comps[name].instrs:
                if ins.op == "while" and (any_trip_count or self.trip_count(ins) is None):
                    found.append(ins)
                elif ins.op == "call":
                    visit(ins.attr_comp("to_apply"))

        visit(self.entry)
        if not found:
            raise ValueError("no while loop" + ("" if any_trip_count else " without a known trip count")
                             + " at the top of the program")
        return max(found, key=lambda w: len(self.comps[w.attr_comp("body")].instrs))

    def count_loop_body(self) -> Tally:
        """One iteration of the generation loop: its body and one evaluation of its condition."""
        w = self.generation_loop()
        self.walk(self.entry)  # records what the loop carries (the dtype each value was upcast from)
        t = self.walk(w.attr_comp("body"))
        t.extend(self.walk(w.attr_comp("condition")))
        return t


def count_hlo(text: str, *, loop_body: bool = False, elide_converts: bool = True) -> Tally:
    c = HloCounter(text, elide_converts)
    return c.count_loop_body() if loop_body else c.walk(c.entry)


def f32_score_tensors(tally: Tally, batch: int, heads: int, kv_heads: int, slots: int, rows: int = 256) -> list[str]:
    """The float32 results of ``tally``'s kernels shaped like attention scores ``[B, N, T, S]`` (grouped
    ``[B, K, N / K, T, S]``, or with dimensions merged, e.g. ``[K, S, N / K * T]``): one dimension that spans the
    cache and at most ``rows`` more (``slots <= d <= slots + rows``) and ``B N`` dividing the product of the others
    (a shape test: another tensor of such a shape would be reported too). Their shapes, once each."""
    found: dict[str, None] = {}
    for k in tally.kernels:
        for dt, dims in shape_arrays(k.shape):
            if dt != "f32" or len(dims) < 2:
                continue
            span = [i for i, d in enumerate(dims) if slots <= d <= slots + rows]
            if not span:
                continue
            rest = math.prod(d for i, d in enumerate(dims) if i != span[-1])
            if rest % (batch * heads) == 0:
                found[f"f32{list(dims)}"] = None
    return list(found)


DEVICES = {"H100": (3.35e12, 989.5e12), "H200": (4.8e12, 989.5e12)}  # name: (bytes/s, bf16 dense FLOP/s)
LAUNCH_US = (0.0, 1.0, 2.0, 4.0)
TABLE_LAUNCH_US = (0.0, 1.0, 4.0)
