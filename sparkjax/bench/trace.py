"""A reader for the traces ``jax.profiler`` writes, and the per-round summary the device check makes of them.

``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes, under ``dir/plugins/profile/<run>/``, the XSpace
(``<host>.xplane.pb``) and its Chrome trace-event JSON (``<host>.trace.json.gz`` and ``perfetto_trace.json.gz``):
``{"traceEvents": [...]}`` with metadata events (``ph: "M"``) naming each process (``/host:CPU``,
``/device:GPU:0 ...``) and thread (on a GPU: ``Stream #N(...)`` for each CUDA stream, beside derived lines such as
``XLA Ops`` / ``XLA Modules`` that repeat the stream's events), and complete events (``ph: "X"``, ``ts`` / ``dur``
in microseconds, ``args`` with the event's stats). Nothing here needs tensorflow or xprof: the JSON is read as is.

What is read:

- **windows**: host events named by a :class:`jax.profiler.TraceAnnotation` (the device check marks each run);
- **kernels**: complete events on a device process's stream threads (``Stream #...``) that are not memory copies;
- **copies**: events whose name or args say ``memcpy`` / ``MemcpyDtoH`` / ``D2H`` etc.; device->host ones are
  those naming ``DtoH`` / ``D2H`` / ``device to host``;
- **idle**: the gaps in the union of a window's kernel and copy intervals, from the first to the last;
- **kinds** (:func:`kind_of`): ``tree`` (tree building) when the event's scope (any string arg, e.g. the op's name
  stack) holds the round's ``propose`` component, else ``attention`` / ``gemm`` by name (flash / fmha / sdpa /
  softmax kernels; cuBLAS, CUTLASS, nvjet and XLA's gemm fusions), else ``other``.

:func:`summarise` takes a short and a long run of the same program (``units`` rounds apart) and gives per round
(the long window less the short one, over the rounds between them): kernels and kernel time by kind, device->host
copies, device time, idle time, split into the gap at the round boundary and the rest (the round's kernels repeat
with a period; the position in that period with the largest mean gap before it is taken as the boundary).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re

KINDS = ("gemm", "attention", "tree", "other")
_ATTENTION = re.compile(r"fmha|flash|attention|sdpa|softmax", re.I)
_GEMM = re.compile(r"gemm|cublas|cutlass|xmma|nvjet|matmul|gemv|(^|_)dot(_|$)", re.I)
_D2H = re.compile(r"dtoh|d2h|device.?to.?host", re.I)
_COPY = re.compile(r"memcpy|dtoh|htod|d2h|h2d|dtod|d2d", re.I)


@dataclasses.dataclass(frozen=True)
class Event:
    name: str
    start: float  # microseconds
    dur: float
    args: dict

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclasses.dataclass
class Trace:
    """A trace's device kernels and copies (each sorted by start) and its host annotations."""

    kernels: list[Event]
    copies: list[Event]
    host: list[Event]
    devices: list[str]  # the device processes' names (empty: the trace saw no accelerator)

    def window(self, name: str) -> tuple[float, float] | None:
        """``(start, end)`` of the first host event named ``name``."""
        ev = next((e for e in self.host if e.name == name), None)
        return None if ev is None else (ev.start, ev.end)


def find_trace(folder: str) -> str | None:
    """The newest trace-event JSON under ``folder`` (``*.trace.json.gz``, else ``perfetto_trace.json.gz``)."""
    found = sorted(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    found = found or sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json*"), recursive=True),
                            key=os.path.getmtime)
    return found[-1] if found else None


def load(path: str) -> Trace:
    """Parse a Chrome trace-event file (gzip or plain JSON; an object with ``traceEvents`` or a bare list)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return parse(data["traceEvents"] if isinstance(data, dict) else data)


def is_copy(e: Event) -> bool:
    return bool(_COPY.search(e.name)) or any("memcpy" in str(k).lower() for k in e.args)


def is_d2h(e: Event) -> bool:
    return bool(_D2H.search(e.name)) or any(_D2H.search(str(v)) for k, v in e.args.items() if "memcpy" in k.lower())


def parse(events: list[dict]) -> Trace:
    procs: dict = {}
    threads: dict = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    devices = {pid for pid, name in procs.items() if "/device:" in name}
    kernels, copies, host = [], [], []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        ev = Event(str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)), dict(e.get("args") or {}))
        pid = e.get("pid")
        if pid in devices:
            if not threads.get((pid, e.get("tid")), "").lower().startswith("stream"):
                continue  # derived lines (XLA Ops, XLA Modules, Steps) repeat the streams' events
            (copies if is_copy(ev) else kernels).append(ev)
        else:
            host.append(ev)
    kernels.sort(key=lambda x: x.start)
    copies.sort(key=lambda x: x.start)
    host.sort(key=lambda x: x.start)
    return Trace(kernels, copies, host, sorted(procs[p] for p in devices))


def kind_of(e: Event) -> str:
    """``tree``, ``gemm``, ``attention`` or ``other`` (see the module docstring)."""
    for v in e.args.values():
        if isinstance(v, str) and "/" in v and "propose" in v.split("/"):  # the round's propose stage
            return "tree"
    if _ATTENTION.search(e.name):
        return "attention"
    if _GEMM.search(e.name):
        return "gemm"
    return "other"


def _inside(events: list[Event], window: tuple[float, float]) -> list[Event]:
    lo, hi = window
    return [e for e in events if lo <= e.start <= hi]


def _gaps(events: list[Event]) -> list[float]:
    """The idle time before each event after the first (0 where it overlaps what ran before)."""
    out, end = [], None
    for e in events:
        if end is not None:
            out.append(max(0.0, e.start - end))
        end = e.end if end is None else max(end, e.end)
    return out


def window_stats(trace: Trace, window: tuple[float, float]) -> dict:
    """Totals over one window: kernels and their time by kind, device->host copies, the device span (first
    start to last end of kernels and copies), busy and idle time, and the kernels in order (for the period)."""
    ks, cs = _inside(trace.kernels, window), _inside(trace.copies, window)
    both = sorted(ks + cs, key=lambda x: x.start)
    span = (max(e.end for e in both) - both[0].start) if both else 0.0
    idle = sum(_gaps(both))
    return {"kernels": {k: sum(kind_of(e) == k for e in ks) for k in KINDS},
            "kernel_us": {k: sum(e.dur for e in ks if kind_of(e) == k) for k in KINDS},
            "d2h_copies": sum(is_d2h(c) for c in cs), "copies": len(cs),
            "span_us": span, "idle_us": idle, "busy_us": span - idle, "_ordered": both}


def boundary_gap(events: list[Event], period: int) -> float | None:
    """The mean gap before the position of the round's kernel cycle with the largest mean gap: the cycle is where
    the names repeat every ``period`` events; None when fewer than two periods repeat."""
    if period < 1 or len(events) < 2 * period + 1:
        return None
    names, gaps = [e.name for e in events], [0.0, *_gaps(events)]
    periodic = [i for i in range(1, len(events) - period) if names[i] == names[i + period]]
    if len(periodic) < period:
        return None
    by_pos: dict[int, list[float]] = {}
    for i in periodic:
        by_pos.setdefault(i % period, []).append(gaps[i])
    return max(sum(v) / len(v) for v in by_pos.values())


def summarise(trace: Trace, short: str, long: str, units: float) -> dict:
    """Per round (or AR step): the ``long`` window less the ``short`` one, over the ``units`` rounds between them
    (see the module docstring). ``gpu_kernels``: False when the trace holds no device kernel (the CPU: XLA:CPU's
    work shows as host threads, not as kernels), and then every per-round figure but the wall time is None."""
    ws, wl = trace.window(short), trace.window(long)
    if ws is None or wl is None:
        raise ValueError(f"the trace has no host annotation {short!r} and {long!r}")
    out = {"units": units, "devices": trace.devices,
           "wall_ms_per_round": ((wl[1] - wl[0]) - (ws[1] - ws[0])) / units / 1e3}
    s, lg = window_stats(trace, ws), window_stats(trace, wl)
    if not lg["_ordered"]:
        return {**out, "gpu_kernels": False, "kernels_per_round": None, "kernel_us_per_round": None,
                "d2h_copies_per_round": None, "device_ms_per_round": None, "idle_us_per_round": None,
                "idle_between_rounds_us": None, "idle_between_kernels_us": None,
                "note": "no device kernel in the trace (no accelerator: XLA:CPU runs on host threads)"
                if not trace.devices else "device process(es) in the trace but no event on a thread named "
                "'Stream ...' inside the runs: the reader found nothing it knows as a kernel"}

    def per(key):
        return (lg[key] - s[key]) / units

    kernels = {k: (lg["kernels"][k] - s["kernels"][k]) / units for k in KINDS}
    idle = per("idle_us")
    period = round(sum(kernels.values()) + (lg["copies"] - s["copies"]) / units)
    boundary = boundary_gap(lg["_ordered"], period)
    return {**out, "gpu_kernels": True, "kernels_per_round": kernels,
            "kernel_us_per_round": {k: (lg["kernel_us"][k] - s["kernel_us"][k]) / units for k in KINDS},
            "d2h_copies_per_round": per("d2h_copies"), "device_ms_per_round": per("span_us") / 1e3,
            "idle_us_per_round": idle, "idle_between_rounds_us": boundary,
            "idle_between_kernels_us": None if boundary is None else idle - boundary}
