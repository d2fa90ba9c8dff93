"""Where XLA:GPU runs a compiled program's loops: on the device (inside a command buffer), from the host with a
known trip count, or from the host reading the loop's predicate back every iteration.

XLA:GPU runs a ``while`` as a thunk (``xla/backends/gpu/runtime/while_thunk.cc``). With a trip count known at
compile time (``known_trip_count`` in the while's backend config) the host enqueues the body that many times and
never waits. Otherwise, every iteration, it runs the condition, copies the predicate to the host, blocks until the
stream is done and enqueues the next iteration: a device->host round trip per iteration. A ``conditional`` thunk
likewise copies its branch index to the host and waits, every time it runs. Neither happens to a loop or
conditional recorded into a command buffer (a CUDA graph: ``xla_gpu_enable_command_buffer`` with ``WHILE`` /
``CONDITIONAL``), where it becomes a conditional node evaluated on the device.

The command buffers are formed after the optimised HLO, by XLA's thunk pass (``CommandBufferConversionPass``,
``xla/backends/gpu/runtime/command_buffer_conversion_pass.cc``), so ``compiled.as_text()`` cannot show them: the
HLO of a program is the same with and without WHILE command buffers. The pass runs in a deviceless compile too, and
with ``xla_dump_to`` XLA writes the thunk tree it leaves (``*.thunk_sequence_after_thunk_passes.txt``, or
``*.thunk_sequence.txt`` when the passes changed nothing) and each thunk's HLO name (``*.thunk_metadata.txt``).
:func:`compile_with_thunks` compiles with a temporary dump folder and reads those back; :func:`loop_placement`
reads, from them and the optimised HLO, where the program's top loop (the generation loop, the serving visit's
loop) runs and how many device->host round trips one of its iterations costs.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile

from . import hlo

LOOP_MODES = ("command_buffer", "known_trip_count", "host")
_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
_META = re.compile(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)\s*\}\s*thunk_kind:\s*"(\w+)"')


@dataclasses.dataclass
class Thunk:
    """One line of XLA's thunk-tree dump: its id, kind (``kWhile``, ``kCommandBuffer``, ...), indentation and
    the thunk it is nested in (a command buffer, a loop's condition or body, a conditional's branch)."""

    id: int
    kind: str
    indent: int
    parent: Thunk | None = None

    def ancestors(self):
        p = self.parent
        while p is not None:
            yield p
            p = p.parent

    @property
    def in_command_buffer(self) -> bool:
        return any(a.kind == "kCommandBuffer" for a in self.ancestors())


def parse_thunks(text: str) -> list[Thunk]:
    """The thunks of a thunk-tree dump in order, each with the thunk it is nested in (by indentation: nested
    sequences are indented further; the ``condition:`` / ``body:`` headers are not thunks)."""
    out: list[Thunk] = []
    stack: list[Thunk] = []
    for line in text.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue
        t = Thunk(int(m.group(2)), m.group(3), len(m.group(1)))
        while stack and stack[-1].indent >= t.indent:
            stack.pop()
        t.parent = stack[-1] if stack else None
        stack.append(t)
        out.append(t)
    return out


def thunk_names(metadata: str) -> dict[int, str]:
    """``{thunk id: HLO instruction name}`` from a ``*.thunk_metadata.txt`` dump (a command buffer has none)."""
    return {int(i): name for name, i, _ in _META.findall(metadata)}


@dataclasses.dataclass(frozen=True)
class CompiledThunks:
    """The thunk tree XLA left after its thunk passes (``after_passes``: False when the passes changed nothing and
    this is the tree as emitted) and its ``{id: HLO name}``."""

    text: str
    names: dict[int, str]
    after_passes: bool


def compile_with_thunks(lowered, compiler_options: dict | None = None):
    """``(compiled, CompiledThunks)``: ``lowered.compile`` (its jit's compiler options plus ``compiler_options``)
    with XLA dumping into a temporary folder, from which the thunk tree and names are read (the folder is removed).
    A ``RuntimeError`` when XLA wrote no thunk dump (not an XLA:GPU compile)."""
    with tempfile.TemporaryDirectory(prefix="sparkjax-thunks-") as d:
        compiled = lowered.compile({**(compiler_options or {}), "xla_dump_to": d})
        after = glob.glob(os.path.join(d, "*.thunk_sequence_after_thunk_passes.txt"))
        seq = after or glob.glob(os.path.join(d, "*.thunk_sequence.txt"))
        meta = glob.glob(os.path.join(d, "*.thunk_metadata.txt"))
        if len(seq) != 1 or len(meta) != 1:
            raise RuntimeError(f"expected one thunk sequence and one thunk metadata dump from XLA:GPU, found "
                               f"{[os.path.basename(p) for p in sorted(os.listdir(d)) if 'thunk' in p]}")
        with open(seq[0]) as f:
            text = f.read()
        with open(meta[0]) as f:
            names = thunk_names(f.read())
    return compiled, CompiledThunks(text, names, bool(after))


def top_loop(counter: hlo.HloCounter) -> hlo.Instr:
    """The ``while`` in the entry computation (or a ``call`` from it) with the largest body: the generation loop
    (the serving visit's loop), whatever its trip count."""
    return counter.generation_loop(any_trip_count=True)


def loop_thunk(tree: list[Thunk], thunks: CompiledThunks, name: str) -> Thunk:
    """The one ``kWhile`` thunk of HLO while ``name`` in the thunk tree (a ``ValueError`` when it is not one)."""
    ids = [i for i, n in thunks.names.items() if n == name]
    found = [t for t in tree if t.kind == "kWhile" and t.id in ids]
    if len(found) != 1:
        raise ValueError(f"the thunk of {name} (ids {ids}) is not one while thunk in XLA's thunk dump "
                         f"({len(found)} found)")
    return found[0]


# thunks that launch nothing themselves (control flow, command buffers, sequences)
CONTROL_THUNKS = frozenset({"kWhile", "kConditional", "kCommandBuffer", "kSequential"})


def round_launches(hlo_text: str, thunks: CompiledThunks, kernels: list[hlo.Kernel], mode: str) -> dict:
    """How one iteration of the program's top loop launches its ``kernels`` (the loop body's, as
    :func:`~sparkjax.bench.hlo.count_hlo` counts them, each with its executions per iteration), read from XLA's
    thunk tree:

    - ``graph_kernels``: executions of kernels whose thunk sits inside a command buffer (replayed by the device
      from a CUDA graph);
    - ``eager_kernels``: executions of kernels launched one by one by the host (their thunk is in no command
      buffer), and of kernels whose HLO name has no thunk in the loop (counted eager: the dearer assumption;
      ``unmatched_kernels`` says how many);
    - ``graph_launches``: command buffers started per iteration: 1 for a loop inside a command buffer (the
      device starts the body's graph again), else the command buffers at the top of the loop's body and condition
      (the host launches each once per iteration; those inside nested loops count once, a lower bound).

    ``mode`` is :func:`loop_placement`'s ``loop``."""
    tree = parse_thunks(thunks.text)
    loop = loop_thunk(tree, thunks, top_loop(hlo.HloCounter(hlo_text, elide_converts=False)).name)
    inside = [t for t in tree if loop in t.ancestors()]
    in_graph = {thunks.names[t.id] for t in inside if t.kind not in CONTROL_THUNKS and t.in_command_buffer
                and t.id in thunks.names}
    eager_names = {thunks.names[t.id] for t in inside if t.kind not in CONTROL_THUNKS and not t.in_command_buffer
                   and t.id in thunks.names}
    graph = eager = unmatched = 0.0
    for k in kernels:
        if k.name in in_graph:
            graph += k.count
        else:
            eager += k.count
            unmatched += 0 if k.name in eager_names else k.count
    if mode == "command_buffer":
        launches = 1
    else:
        launches = sum(t.kind == "kCommandBuffer" and not t.in_command_buffer
                       and not any(a.kind == "kWhile" for a in t.ancestors() if a is not loop and loop in a.ancestors())
                       for t in inside)
    return {"graph_kernels": int(round(graph)), "eager_kernels": int(round(eager)),
            "unmatched_kernels": int(round(unmatched)), "graph_launches": int(launches)}


def loop_placement(hlo_text: str, thunks: CompiledThunks) -> dict:
    """Where the program's top loop runs, read from its optimised HLO and XLA's thunk tree:

    - ``loop``: ``command_buffer`` (its ``while`` thunk is inside a command buffer: the device evaluates the
      condition), else ``known_trip_count`` (the HLO while has a known trip count: the host enqueues the
      iterations without waiting), else ``host`` (the host reads the predicate back every iteration);
    - ``host_round_trips_per_round``: device->host round trips one iteration costs, at least: 1 for a ``host``
      loop's own predicate, plus 1 for every loop without a known trip count (its predicate, read at least once)
      and every conditional (its branch index) nested in the loop and run from the host, times the known trip
      counts of the host loops around them;
    - ``loop_name`` (the HLO while), ``known_trip_count`` (None when unknown), ``host_control_flow`` (the HLO
      names of the control-flow thunks run from the host inside the loop) and ``command_buffers`` (command-buffer
      thunks in the whole program)."""
    counter = hlo.HloCounter(hlo_text, elide_converts=False)
    loop = top_loop(counter)
    trip = counter.trip_count(loop)
    tree = parse_thunks(thunks.text)
    thunk = loop_thunk(tree, thunks, loop.name)
    if thunk.in_command_buffer:
        mode = "command_buffer"
    elif trip is not None:
        mode = "known_trip_count"
    else:
        mode = "host"
    whiles = {i.name: i for c in counter.comps.values() for i in c.instrs if i.op == "while"}
    trips: list[int] = []
    host: list[str] = []
    inner = [t for t in tree if thunk in t.ancestors() and t.kind in ("kWhile", "kConditional")
             and not t.in_command_buffer]
    for t in inner:
        name = thunks.names.get(t.id, f"thunk {t.id}")
        w = whiles.get(name) if t.kind == "kWhile" else None
        known = counter.trip_count(w) if w is not None else None
        if t.kind == "kWhile" and known is not None:
            continue  # enqueued without a wait; its nested control flow is multiplied below
        times = 1
        for a in t.ancestors():
            if a is thunk:
                break
            if a.kind == "kWhile":
                aw = whiles.get(thunks.names.get(a.id, ""))
                times *= (counter.trip_count(aw) or 1) if aw is not None else 1
        trips.append(times)
        host.append(name)
    return {
        "loop": mode,
        "host_round_trips_per_round": (1 if mode == "host" else 0) + sum(trips),
        "loop_name": loop.name,
        "known_trip_count": trip,
        "host_control_flow": host,
        "command_buffers": sum(t.kind == "kCommandBuffer" for t in tree),
    }
