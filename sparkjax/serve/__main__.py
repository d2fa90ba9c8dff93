"""``python -m sparkjax.serve``: an OpenAI-compatible server over the slot-pool engine (see docs/serving.md).

    python -m sparkjax.serve                                  # the bundled demo pair on 127.0.0.1:8000
    python -m sparkjax.serve --target DIR --drafter DIR [--tokenizer DIR] [--method auto] [--slots 8]
                             [--host 127.0.0.1] [--port 8000] [--api-key KEY | $SPARKJAX_API_KEY]

It loads the pair, compiles and warms the engine up, then accepts requests and logs "ready" with the address.
SIGTERM or Ctrl-C stops admitting, lets in-flight requests finish within --grace-s, cancels the rest and exits 0.
A bad flag or a model that does not load is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time

from sparkjax import _startup
from sparkjax.cli import OneLineParser, run_cli
from sparkjax.errors import ArgumentError

API_KEY_ENV = "SPARKJAX_API_KEY"
DEMO_MODEL = "sparkjax-demo"
log = logging.getLogger("sparkjax.serve")


def visit_sizes(text: str | None, slots: int) -> list[int] | None:
    """``--visit-sizes`` as integers (None: the engine's default); ArgumentError naming the flag otherwise."""
    from .engine import _visit_sizes

    try:
        return None if text is None else list(_visit_sizes([int(x) for x in text.split(",")], slots))
    except (ValueError, ArgumentError):
        raise ArgumentError(f"--visit-sizes: {text!r} must be comma-separated integers, ascending and distinct, "
                            f"from 1 up to --slots {slots}") from None


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m sparkjax.serve", description=__doc__.splitlines()[0])
    m = p.add_argument_group("model (none: the bundled demo pair)")
    m.add_argument("--target", metavar="DIR", help="Hugging Face Qwen3 folder")
    m.add_argument("--drafter", metavar="DIR", help="DeepSpec DSpark or z-lab DFlash folder (needs --target)")
    m.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the --target folder)")
    m.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: float32 for the demo pair, the checkpoint's otherwise)")
    m.add_argument("--model-name", metavar="NAME",
                   help=f"the model id clients send (default: {DEMO_MODEL}, or the --target folder's name)")
    e = p.add_argument_group("engine")
    e.add_argument("--method", default="auto", help="decoding method: auto (default), ar, or any sparkjax method")
    e.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
    e.add_argument("--max-logprobs", type=int, default=5,
                   help="log-probability alternatives every slot computes per token, 0-20, or -1 for none (default "
                        "5: completions' bound; chat's top_logprobs up to this). One setting for the pool, so no "
                        "program is added per request")
    e.add_argument("--max-prompt-tokens", type=int, metavar="N", help="longest prompt admitted (engine default)")
    e.add_argument("--max-new-tokens", type=int, metavar="N", help="largest max_tokens a request may ask for")
    e.add_argument("--cache-size", type=int, metavar="S", help="KV cache slots per sequence (engine default)")
    e.add_argument("--rounds-per-visit", type=int, default=8, metavar="K",
                   help="rounds run on device per host visit (default 8)")
    e.add_argument("--visit-sizes", metavar="N,N,...",
                   help="batch sizes the active slots run at, ascending, ending at --slots (default 1, powers of 4 "
                        "up to slots/4, slots; each is a program compiled at start)")
    e.add_argument("--no-sampling", action="store_true",
                   help="compile only the greedy programs (a faster start); requests with temperature > 0 get 400")
    e.add_argument("--queue-limit", type=int, default=64, metavar="N",
                   help="requests waiting for a slot before new ones get 429 (default 64)")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)")
    h.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="larger request bodies get 413 (default 1 MiB)")
    h.add_argument("--max-n", type=int, default=8, metavar="N",
                   help="the largest n (choices per request) a request may ask for (default 8)")
    h.add_argument("--grace-s", type=float, default=30.0, metavar="S",
                   help="on SIGTERM / Ctrl-C, seconds in-flight requests may take to finish (default 30)")
    h.add_argument("--temperature", type=float, default=None,
                   help="temperature of requests that give none (default: 0 when the target's "
                        "generation_config.json says do_sample false, else its temperature, else 1 as OpenAI)")
    h.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return p


def check_args(args) -> str | None:
    """Refuses bad flags before any model is loaded; returns the API key (None: no key)."""
    for flag in ("slots", "rounds_per_visit", "queue_limit", "max_body_bytes", "max_prompt_tokens", "max_new_tokens",
                 "cache_size", "max_n"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ArgumentError(f"--{flag.replace('_', '-')}: expected at least 1, got {v}")
    args.visit_sizes = visit_sizes(args.visit_sizes, args.slots)
    if not 0 <= args.port <= 65535:
        raise ArgumentError(f"--port: expected 0..65535, got {args.port}")
    if not args.grace_s >= 0:
        raise ArgumentError(f"--grace-s: expected at least 0, got {args.grace_s}")
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        raise ArgumentError(f"--temperature: expected a number in [0, 2], got {args.temperature}")
    if args.target is None and (args.drafter or args.tokenizer):
        raise ArgumentError(f"--{'drafter' if args.drafter else 'tokenizer'}: given without --target (the demo "
                            f"pair brings its own)")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise ArgumentError("--api-key: empty")
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
        except OSError as e:
            raise ArgumentError(f"--host/--port: cannot bind {args.host}:{args.port} ({e.strerror or e})") from None
    return key


def default_temperature(target_dir) -> float:
    """The temperature of a request that gives none: the target folder's generation_config.json (0 for
    ``do_sample: false``, else its ``temperature``), else 1 (OpenAI's default)."""
    try:
        with open(os.path.join(target_dir, "generation_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return 1.0
    if not isinstance(cfg, dict):
        return 1.0
    if cfg.get("do_sample") is False:
        return 0.0
    t = cfg.get("temperature")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) and 0 <= t <= 2 else 1.0


def weight_bytes(folder) -> int:
    """The bytes of a checkpoint folder's safetensors files (0 when it cannot be listed)."""
    try:
        return sum(e.stat().st_size for e in os.scandir(folder) if e.name.endswith(".safetensors") and e.is_file())
    except OSError:
        return 0


def load(args):
    """(target, drafter or None, tokenizer, target folder, pair description) of the flags; each part is logged as
    it loads (its size, and the time the rest should take at the target's pace)."""
    from sparkjax import demo
    from sparkjax.io.hf import load_drafter, load_target
    from sparkjax.progress import Progress
    from sparkjax.text import load_tokenizer, quiet_transformers

    if args.target is None:
        target_dir, drafter_dir, tok_dir = demo.path("target"), None, demo.path("target")
        dtype = args.dtype or demo.COMPUTE_DTYPE
        if args.method != "ar":
            drafter_dir = demo.path("dspark_b16")
        what = f"the bundled demo pair ({demo.DEMO_DIR}: target + dspark_b16)"
    else:
        target_dir, drafter_dir, tok_dir, dtype = args.target, args.drafter, args.tokenizer or args.target, args.dtype
        what = f"target {args.target}" + (f", drafter {args.drafter}" if args.drafter else ", no drafter")
    sizes = {"target": weight_bytes(target_dir), "drafter": weight_bytes(drafter_dir) if drafter_dir else 0}
    parts = ["target", *(["drafter"] if drafter_dir else []), "tokenizer"]
    progress = Progress(log, "loading", len(parts), "part")
    t0 = time.perf_counter()
    progress.begin(f"the target, {sizes['target'] / 2**20:.1f} MiB from {target_dir}")
    target = load_target(target_dir, dtype=dtype)
    progress.end()
    drafter = None
    if drafter_dir:
        pace = sizes["target"] / max(time.perf_counter() - t0, 1e-6)  # bytes per second
        progress.begin(f"the drafter, {sizes['drafter'] / 2**20:.1f} MiB from {drafter_dir}; about "
                       f"{sizes['drafter'] / max(pace, 1.0):.0f} s at the target's pace")
        drafter = load_drafter(drafter_dir, target=target, dtype=dtype)
        progress.end()
    progress.begin(f"the tokenizer from {tok_dir}")
    with quiet_transformers():
        tok = load_tokenizer(tok_dir, what="demo target") if args.target is None else load_tokenizer(tok_dir)
    progress.end()
    return target, drafter, tok, target_dir, what


def main(argv: list[str] | None = None) -> int:
    _startup.check()
    args = parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.INFO, stream=sys.stderr)
    logging.getLogger("sparkjax.serve").setLevel(logging.INFO)

    def run() -> int:
        t_start = time.perf_counter()
        key = check_args(args)
        import jax

        from sparkjax import cachedir
        from sparkjax.text import eos_ids

        from .engine import Engine
        from .server import create_app, is_loopback, serve

        xla = cachedir.enable_compilation_cache()
        target, drafter, tok, target_dir, what = load(args)
        if drafter is None and args.method != "ar":
            raise ArgumentError(f"--method {args.method}: needs --drafter (or use --method ar)")
        eos = eos_ids(tok, target_dir)
        temperature = default_temperature(target_dir) if args.temperature is None else args.temperature
        if args.no_sampling and temperature > 0:
            raise ArgumentError(f"--no-sampling: the default temperature is {temperature:g}; pass --temperature 0")
        devices = jax.devices()
        log.info("device: %d x %s (%s); compilation cache: %s", len(devices), devices[0].device_kind,
                 devices[0].platform, xla or "off")
        log.info("pair: %s; method %s; %d slots; default temperature %g", what, args.method, args.slots,
                 temperature)
        if args.method == "auto":
            log.info("auto: its round costs are read from the cache folder, or profiled now on this device (once; "
                     "each batch size's compile and timing is logged)")
        engine = Engine(target, drafter, method=args.method, slots=args.slots, cache_size=args.cache_size,
                        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                        rounds_per_visit=args.rounds_per_visit, queue_limit=args.queue_limit, tokenizer=tok,
                        eos_token_ids=eos, sampling=not args.no_sampling, visit_sizes=args.visit_sizes,
                        max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs)
        compile_s = engine.start()
        log.info("compiled and warmed up in %.1f s (max prompt %d tokens, max new tokens %d, queue limit %d)",
                 compile_s, engine.max_prompt_tokens, engine.max_new_tokens, args.queue_limit)
        model = args.model_name or (DEMO_MODEL if args.target is None else os.path.basename(
            os.path.normpath(args.target)))
        app = create_app(engine, tokenizer=tok, model=model, eos_token_ids=eos, api_key=key,
                         max_body_bytes=args.max_body_bytes, default_temperature=temperature, max_n=args.max_n)
        if not is_loopback(args.host) and key is None:
            log.warning("binding %s without an API key: anyone who can reach this address can use the server "
                        "(pass --api-key or set $%s)", args.host, API_KEY_ENV)

        def ready(address: str) -> None:
            log.info("ready on %s (model %r, %.1f s after start)", address, model, time.perf_counter() - t_start)

        rc = serve(app, host=args.host, port=args.port, grace_s=args.grace_s, access_log=args.access_log,
                   ready=ready)
        log.info("shut down")
        return rc

    return run_cli(run)


if __name__ == "__main__":
    code = main()
    # The server has shut down (or never started) and everything it writes is written (compiled programs and cost
    # tables when they were made, the log here): exit now, without the interpreter's teardown of JAX's backends,
    # which takes seconds on a CPU once a start has compiled its programs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
