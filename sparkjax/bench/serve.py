"""Serving under load: live ``python -m sparkjax.serve`` servers on 127.0.0.1 (one per method), side by side.

    python -m sparkjax.bench serve [--methods ar,auto] [--concurrency 1,4,16,64] [--poisson-rate 4]
                                   [--requests 64] [--time-limit-s 120] [--max-tokens 64] [--slots 8]
                                   [--json PATH] [--csv PATH] [--png PATH]

One server per method (the bundled demo pair, greedy), its ready time recorded; then, per load level, each server
in turn (the order alternating between levels) gets the demo's held-out prompts, streamed (chat turns through
/v1/chat/completions, raw rows through /v1/completions). A level is a fixed concurrency C (closed loop) or
open-loop Poisson arrivals at ``--poisson-rate``/s, bounded by ``--requests`` (at least C) and ``--time-limit-s``
(requests still running at twice the limit are lost). Per level and method: throughput, time to first token and
per output token (p50 / p99), tau (from /metrics), the share of rounds per verification size. After each
concurrency-1 level, batch-1 ``generate`` of each method runs here on the same prompts (the serving overhead);
every greedy response is checked against ``sparkjax.generate`` for its prompt alone. ``--json`` writes
everything, ``--csv`` one row per level and method, ``--png`` throughput and latency against concurrency.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from sparkjax.engine.names import parse_method
from sparkjax.errors import ArgumentError

from .common import add_output, at_least, child_env, device_name, ints, log, names, write_text
from .timing import Stats, load_warning

MODEL = "sparkjax-demo"
READY = re.compile(r" ready on (http://\S+)")


def add_arguments(p) -> None:
    p.add_argument("--methods", default="ar,auto", help="comma-separated methods, one server each (default ar,auto)")
    p.add_argument("--concurrency", default="1,4,16,64", help="fixed-concurrency levels (default 1,4,16,64)")
    p.add_argument("--poisson-rate", type=float, default=4.0,
                   help="open-loop Poisson arrivals per second (0: no Poisson level; default 4)")
    p.add_argument("--requests", type=int, default=64, help="requests per level and method (at least the "
                                                             "concurrency; default 64)")
    p.add_argument("--time-limit-s", type=float, default=120.0, help="seconds a level may start requests")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--slots", type=int, default=8, help="the servers' --slots (default 8)")
    p.add_argument("--rounds-per-visit", type=int, default=8, help="the servers' --rounds-per-visit")
    p.add_argument("--visit-sizes", metavar="N,N,...", help="the servers' --visit-sizes (default: theirs)")
    p.add_argument("--ready-timeout-s", type=float, default=1200.0, help="seconds a server may take to be ready")
    p.add_argument("--repeats", type=int, default=1,
                   help="times the whole set of levels runs, the methods' order alternating (default 1); the "
                        "ratios are of the medians, with the spread")
    p.add_argument("--restart", action="store_true",
                   help="stop each server once it is ready and start it again: the second start's ready time, "
                        "from the compiled programs and cost tables the first one cached")
    p.add_argument("--no-solo", action="store_true", help="skip the exactness check and the batch-1 generate baseline")
    p.add_argument("--seed", type=int, default=0, help="the prompt order and the Poisson arrivals")
    add_output(p)
    p.add_argument("--csv", metavar="PATH", help="write one row per level and method here")
    p.add_argument("--png", metavar="PATH", help="write the throughput and latency plot here")


def prompts() -> list[dict]:
    """The demo's held-out prompt rows as requests: ``{"kind": "chat"|"text", "text", "set", "id"}``."""
    from sparkjax import demo

    out = []
    for name in demo.PROMPT_SETS:
        for row in demo.prompts(name):
            kind, text = ("text", row["text"]) if "text" in row else ("chat", row["turns"][0])
            out.append({"index": len(out), "kind": kind, "text": text, "set": name, "id": row.get("id")})
    return out


def body(p: dict, max_tokens: int) -> tuple[str, dict]:
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if p["kind"] == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": p["text"]}]}
    return "/v1/completions", {**common, "prompt": p["text"]}


class Server:
    """One ``python -m sparkjax.serve`` child process; :attr:`ready_s` is spawn to its "ready" log line."""

    def __init__(self, method: str, args):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.method, self.url, self.ready_s, self.log = method, None, None, []
        queue = max(256, 4 * max(ints(args.concurrency, "--concurrency")))
        cmd = [sys.executable, "-m", "sparkjax.serve", "--method", method, "--port", str(self.port), "--slots",
               str(args.slots), "--max-new-tokens", str(args.max_tokens), "--queue-limit", str(queue),
               "--rounds-per-visit", str(args.rounds_per_visit), "--grace-s", "10"]
        if args.visit_sizes:
            cmd += ["--visit-sizes", args.visit_sizes]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=child_env(PYTHONUNBUFFERED="1"))
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            m = READY.search(line)
            if m and self.url is None:
                self.ready_s = time.perf_counter() - self.t0
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def wait(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            tail = "; ".join(self.log[-3:])
            raise ArgumentError(f"--methods {self.method}: the server was not ready within {timeout:.0f} s "
                                f"(exit {self.proc.poll()}; {tail})")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as ``{series: value}``."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


async def _one(client, url: str, p: dict, max_tokens: int) -> dict:
    path, payload = body(p, max_tokens)
    rec: dict[str, Any] = {"prompt": p["index"], "kind": p["kind"], "status": None, "text": "", "tokens": 0,
                           "finish": None}
    t0 = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", url + path, json=payload) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec["error"] = r.text[:300]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec["error"] = data["error"]["message"]
                    continue
                if data.get("usage"):
                    rec["tokens"] = data["usage"]["completion_tokens"]
                for c in data.get("choices", []):
                    piece = c.get("text") if p["kind"] == "text" else (c.get("delta") or {}).get("content")
                    if piece and first is None:
                        first = time.perf_counter()
                    rec["text"] += piece or ""
                    rec["finish"] = c.get("finish_reason") or rec["finish"]
    except Exception as e:  # noqa: BLE001 - a transport failure is a lost request, recorded
        rec["error"] = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    rec["latency_s"] = end - t0
    rec["ttft_s"] = None if first is None else first - t0
    rec["tpot_s"] = (end - first) / (rec["tokens"] - 1) if first is not None and rec["tokens"] > 1 else None
    return rec


async def _level(url: str, rows: list[dict], *, concurrency: int | None, rate: float | None, requests: int,
                 limit_s: float, max_tokens: int, seed: int) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=30, read=max(60.0, 2 * limit_s), write=30, pool=None)
    order = [rows[i % len(rows)] for i in range(requests)]
    random.Random(seed).shuffle(order)
    records: list[dict] = []
    started = [0]  # closed loop: requests sent
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        deadline = t0 + limit_s
        if concurrency is not None:
            todo = iter(order)

            async def worker():
                for p in todo:
                    if time.perf_counter() > deadline:
                        return
                    started[0] += 1
                    records.append(await _one(client, url, p, max_tokens))

            tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        else:
            rng = random.Random(seed + 1)
            tasks = []
            at = 0.0
            for p in order:
                at += rng.expovariate(rate)
                if t0 + at > deadline:
                    break
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.ensure_future(_one(client, url, p, max_tokens)))
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, 2 * limit_s - (time.perf_counter() - t0)))
        for t in pending:
            t.cancel()
        if concurrency is None:
            records += [t.result() for t in done]
            lost = len(pending)
        else:
            lost = started[0] - len(records)
        wall = time.perf_counter() - t0
    records += [{"status": None, "error": "abandoned at the level's hard limit"} for _ in range(lost)]
    return records, wall


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(method: str, level: str, concurrency: int | None, records: list[dict], wall: float,
              before: dict, after: dict) -> dict:
    ok = [r for r in records if r.get("status") == 200 and r.get("finish") in ("stop", "length")]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    rounds, accepted = delta("sparkjax_rounds_total"), delta("sparkjax_accepted_tokens_total")
    sizes = {k.split('size="')[1][:-2]: delta(k) for k in after if k.startswith("sparkjax_verify_rounds_total{")}
    total = sum(sizes.values())
    five = sum(delta(k) for k in after if k.startswith("sparkjax_http_responses_total") and 'code="5' in k)
    return {"method": method, "level": level, "concurrency": concurrency, "requests": len(records),
            "completed": len(ok), "lost": len(records) - len(ok), "http_5xx": int(five),
            "completion_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall if wall > 0 else None,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99), "tpot_p50_s": _pct(tpot, 0.5),
            "tpot_p99_s": _pct(tpot, 0.99), "tau": accepted / rounds if rounds else None,
            "verify_share": {k: v / total for k, v in sizes.items() if v} if total else {},
            "responses": [{k: r.get(k) for k in ("prompt", "kind", "text", "tokens", "finish", "status", "error")}
                          for r in records]}


def _spread(xs: list[float]) -> tuple[float, float, float, int]:
    s = Stats.of(xs)
    return s.median, s.min, s.max, s.n


def _rates(rows: list[dict], concurrency: int) -> dict[str, tuple[float, float, float, int]]:
    """Per method at this concurrency: (median, min, max, runs) of the throughputs of its repetitions."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["concurrency"] == concurrency and r["throughput_tok_s"]:
            out.setdefault(r["method"], []).append(r["throughput_tok_s"])
    return {m: _spread(v) for m, v in out.items()}


class Solo:
    """Batch-1 ``sparkjax.generate`` in this process, on the demo pair: :attr:`expect` holds, per prompt row,
    greedy ``ar``'s (text, completion tokens), the exactness reference; :meth:`rate` times one method over a
    list of rows (the same prompts a concurrency-1 level sent, in its order), the baseline of serving overhead.
    Every method is compiled (and auto profiled) on every row first, untimed."""

    def __init__(self, rows: list[dict], methods: list[str], max_tokens: int):
        import sparkjax
        from sparkjax import demo

        self._generate, pair = sparkjax.generate, demo.load()
        self.ids = [pair.encode_chat(r["text"]) if r["kind"] == "chat" else pair.encode_text(r["text"])
                    for r in rows]
        width = 1 << max(len(i) for i in self.ids).bit_length()
        self.pair, self.expect = pair, []
        self.runs = {m: dict(method=m, max_new_tokens=max_tokens, prompt_width=width,
                             eos_token_ids=pair.eos_token_ids) for m in ["ar", *[m for m in methods if m != "ar"]]}
        for m in self.runs:
            for i in self.ids:
                out = self._call(m, i)
                if m == "ar":
                    self.expect.append((pair.tokenizer.decode(out, skip_special_tokens=True), len(out)))

    def _call(self, method: str, ids: list[int]) -> list[int]:
        drafter = None if method == "ar" else self.pair.dspark
        return self._generate(self.pair.target, drafter, [ids], **self.runs[method]).tokens[0]

    def rate(self, method: str, prompts: list[int]) -> float:
        """Completion tokens per second of batch-1 ``generate`` over ``prompts`` (row indices), one at a time."""
        t0, n = time.perf_counter(), 0
        for i in prompts:
            n += len(self._call(method, self.ids[i]))
        return n / (time.perf_counter() - t0)


def _f(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}ms"


def table(rows: list[dict]) -> str:
    lines = [f"{'level':<10} {'rep':>3} {'method':<8} {'done':>5} {'lost':>4} {'5xx':>3} {'tok/s':>8} {'ttft p50':>9} "
             f"{'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9} {'tau':>5} {'exact':>7}  verify sizes"]
    for r in rows:
        share = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["verify_share"].items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"{r['level']:<10} {r.get('repeat', 0) + 1:>3} {r['method']:<8} {r['completed']:>5} "
                     f"{r['lost']:>4} {r['http_5xx']:>3} "
                     f"{_f(r['throughput_tok_s']):>8} {_ms(r['ttft_p50_s']):>9} {_ms(r['ttft_p99_s']):>9} "
                     f"{_ms(r['tpot_p50_s']):>9} {_ms(r['tpot_p99_s']):>9} {_f(r['tau'], '.2f'):>5} "
                     f"{r.get('exact', '-'):>7}  {share}")
    return "\n".join(lines)


CSV_FIELDS = ("level", "repeat", "method", "concurrency", "requests", "completed", "lost", "http_5xx",
              "completion_tokens", "wall_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
              "tpot_p99_s", "tau", "exact", "generate_tok_s")


def write_csv(path: str, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k)) for k in CSV_FIELDS})
    write_text(path, buf.getvalue())


COLORS = ("#4d4d4d", "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd")


def write_png(path: str, rows: list[dict], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from sparkjax.io.atomic import atomic_file

    fig = Figure(figsize=(11, 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    methods = list(dict.fromkeys(r["method"] for r in rows))

    def value(r: dict, field: str, scale: float = 1.0) -> float:
        return float("nan") if r[field] is None else scale * r[field]

    for j, m in enumerate(methods):  # a line through each level's median, a dot per repetition
        color = COLORS[j % len(COLORS)]
        mine = [r for r in rows if r["method"] == m]
        xs = sorted({r["concurrency"] for r in mine if r["concurrency"]})
        for ax, field, scale, label, line in (
                (axes[0], "throughput_tok_s", 1.0, m, "-"),
                (axes[1], "ttft_p50_s", 1e3, f"{m} p50", "-"), (axes[1], "ttft_p99_s", 1e3, f"{m} p99", ":"),
                (axes[2], "tpot_p50_s", 1e3, f"{m} p50", "-"), (axes[2], "tpot_p99_s", 1e3, f"{m} p99", ":")):
            marker = "o" if line == "-" else "^"
            at = [[value(r, field, scale) for r in mine if r["concurrency"] == x] for x in xs]
            ax.plot(xs, [float(np.nanmedian(v)) if np.isfinite(v).any() else float("nan") for v in at],
                    color=color, linestyle=line, marker=marker, label=label)
            ax.scatter([x for x, v in zip(xs, at, strict=True) for _ in v], [y for v in at for y in v],
                       color=color, marker=marker, s=10, alpha=0.4)
        for level in dict.fromkeys(r["level"] for r in mine if r["concurrency"] is None):
            tok_s = [r["throughput_tok_s"] for r in mine if r["level"] == level and r["throughput_tok_s"]]
            if tok_s:
                axes[0].axhline(float(np.median(tok_s)), color=color, linestyle="--", linewidth=0.8,
                                label=f"{m} {level} (median)")
    levels = sorted({r["concurrency"] for r in rows if r["concurrency"]})
    for ax, label in zip(axes, ("throughput (tok/s)", "time to first token (ms)", "time per output token (ms)"),
                         strict=True):
        if levels:  # fixed limits: an axis with no finite point (no TPOT when every reply is 1 token) still draws
            ax.set_xscale("log", base=2)
            ax.set_xlim(levels[0] / 1.5, levels[-1] * 1.5)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if any(r["ttft_p50_s"] for r in rows):
        axes[1].set_yscale("log")
    fig.suptitle(title, fontsize=9)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png")


def run(args, report) -> None:
    methods = names(args.methods)
    levels = ints(args.concurrency, "--concurrency")
    for arg in ("requests", "max_tokens", "slots", "rounds_per_visit", "repeats"):
        at_least(getattr(args, arg), f"--{arg.replace('_', '-')}")
    at_least(args.time_limit_s, "--time-limit-s", 1)
    at_least(args.poisson_rate, "--poisson-rate", 0)
    if not methods:
        raise ArgumentError("--methods: empty")
    for m in methods:
        parse_method(m)
    rows_p = prompts()
    report.table = table
    report.header.append(f"# {len(methods)} servers ({', '.join(methods)}) on 127.0.0.1, demo pair, {args.slots} "
                         f"slots, greedy, max_tokens {args.max_tokens}; {len(rows_p)} held-out prompts; levels: "
                         f"concurrency {levels}" + (f" and Poisson {args.poisson_rate:g}/s" if args.poisson_rate
                                                    else "") + f"; <= {args.requests} requests and "
                         f"{args.time_limit_s:g} s per level; device {device_name()}")
    servers: dict[str, Server] = {}
    extra: dict[str, Any] = {"ready_s": {}, "exit_codes": {}}
    report.payload = lambda rows: {"command": report.command, "rows": rows, **extra}
    try:
        for m in methods:  # one at a time: their compilations would compete
            for key in ("ready_s", "second_ready_s")[: 1 + args.restart]:  # --restart: stopped and started again
                if m in servers:
                    extra["exit_codes"][m] = servers[m].stop()
                log(f"starting the {m} server ...")
                servers[m] = Server(m, args)
                servers[m].wait(args.ready_timeout_s)
                extra.setdefault(key, {})[m] = servers[m].ready_s
                log(f"  {m} ready in {servers[m].ready_s:.1f} s at {servers[m].url}")
        solo = None
        if not args.no_solo:
            log("batch-1 generate in this process: compiling every method on every prompt ...")
            solo = Solo(rows_p, methods, args.max_tokens)
        plan = [(f"c={c}", c, None) for c in levels]
        if args.poisson_rate:
            plan.append((f"poisson@{args.poisson_rate:g}", None, args.poisson_rate))
        for k, (rep, (level, c, rate)) in enumerate((r, lv) for r in range(args.repeats) for lv in plan):
            order = methods if k % 2 == 0 else methods[::-1]
            for m in order:
                url = servers[m].url
                before = scrape(url)
                records, wall = asyncio.run(_level(url, rows_p, concurrency=c, rate=rate,
                                                   requests=max(args.requests, c or 1), limit_s=args.time_limit_s,
                                                   max_tokens=args.max_tokens, seed=args.seed + k))
                row = {**summarize(m, level, c, records, wall, before, scrape(url)), "repeat": rep}
                report.rows.append(row)
                log(f"  {level} {m}: {row['completed']}/{row['requests']} done, "
                    f"{_f(row['throughput_tok_s'])} tok/s, tau {_f(row['tau'], '.2f')}")
            if c == 1 and solo is not None:  # the baseline, right after and on the same prompts in the same order
                for row in report.rows[-len(order):][::-1]:
                    row["generate_tok_s"] = solo.rate(row["method"], [r["prompt"] for r in row["responses"]
                                                                      if r.get("prompt") is not None])
                    log(f"  {level} {row['method']}: batch-1 generate on its prompts {row['generate_tok_s']:.1f} tok/s")
    finally:
        for m, s in servers.items():
            extra["exit_codes"][m] = s.stop()
    if solo is not None and report.rows:
        same = total = 0
        for row in report.rows:
            hits = [(r["text"], r["tokens"]) == solo.expect[r["prompt"]] for r in row["responses"]
                    if r["status"] == 200 and r["finish"] in ("stop", "length")]
            row["exact"] = f"{sum(hits)}/{len(hits)}"
            same, total = same + sum(hits), total + len(hits)
        extra["exact"] = {"identical": same, "responses": total}
        report.footer.append(f"# exactness: {same}/{total} greedy responses identical to solo generate "
                             f"(text and token count)")
        for m in methods:
            ones = [r for r in report.rows if r["method"] == m and r["concurrency"] == 1 and r.get("generate_tok_s")
                    and r["throughput_tok_s"]]
            if not ones:
                continue
            (sm, s0, s1, n), (gm, g0, g1, _) = (_spread([r[k] for r in ones]) for k in ("throughput_tok_s",
                                                                                        "generate_tok_s"))
            ratios = [r["throughput_tok_s"] / r["generate_tok_s"] for r in ones]
            extra.setdefault("c1_over_generate", {})[m] = sm / gm
            extra.setdefault("solo_generate_tok_s", {})[m] = gm
            report.footer.append(
                f"# c=1 served / batch-1 generate on the same prompts, {m}: {sm / gm:.2f}x (median {sm:.1f} vs "
                f"{gm:.1f} tok/s; min-max {s0:.1f}-{s1:.1f} vs {g0:.1f}-{g1:.1f}; per-run ratios "
                f"{min(ratios):.2f}-{max(ratios):.2f}, {n} runs)")
    ready = ", ".join(f"{m} {v:.1f} s" for m, v in extra["ready_s"].items())
    second = ", ".join(f"{m} {v:.1f} s" for m, v in extra.get("second_ready_s", {}).items())
    codes = ", ".join(f"{m} {v}" for m, v in extra["exit_codes"].items())
    report.footer.append(f"# ready (spawn to 'ready'): {ready}" + (f"; second start: {second}" if second else "")
                         + f"; exit codes after SIGTERM: {codes}")
    for c in levels:
        by = _rates(report.rows, c)
        if "ar" in by and by["ar"][0] and any(m != "ar" for m in by):
            report.footer.append(f"# c={c}: " + ", ".join(
                f"{m}/ar {v[0] / by['ar'][0]:.2f}x (median {v[0]:.1f} vs {by['ar'][0]:.1f} tok/s; "
                f"min-max {v[1]:.1f}-{v[2]:.1f} vs {by['ar'][1]:.1f}-{by['ar'][2]:.1f}, {v[3]} runs)"
                for m, v in by.items() if m != "ar" and v[0]))
    if args.csv:
        write_csv(args.csv, report.rows)
    if args.png and report.rows:
        warn = load_warning()
        write_png(args.png, report.rows, f"sparkjax serve, demo pair, {args.slots} slots, max_tokens "
                  f"{args.max_tokens}, {device_name()}" + (f" ({warn})" if warn else ""))
