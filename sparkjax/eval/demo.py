"""The bundled demo pair, shipped inside the package (``sparkjax/assets/demo``).

``python -m sparkjax.eval`` with no pair flag runs it::

    sparkjax/assets/demo/
      target/       Hugging Face Qwen3 folder with its tokenizer (the default --target and --tokenizer)
      dspark_b16/   DeepSpec DSpark drafter, block 16, with a Markov head (the default --drafter)
      dflash_b16/   the same drafter trained without a Markov head (the default --baseline-drafter:
                    what dflash and ddtree run with)
      prompts/      python_docs.jsonl, stdlib_code.jsonl (raw code), synthetic_math.jsonl
      MODEL_CARD.md

Every path is looked up through :data:`DEMO_DIR` when used, so a test can point it elsewhere.
"""

from __future__ import annotations

import pathlib

from ..demo import COMPUTE_DTYPE, DEMO_DIR
from ..demo import PROMPT_SETS as SETS
from ..errors import EvalError

__all__ = ["COMPUTE_DTYPE", "DEMO_DIR", "NOTE", "SETS", "path", "target_dir"]
NOTE = (
    "The default pair is the bundled demo pair: a small Qwen3 (~4M parameters, 4 layers, d=256, byte-level BPE "
    "4k vocab) trained from scratch on this CPU on Python's stdlib sources + Python docs + synthetic math, with "
    "block-16 drafters trained against it with and without the Markov head; see "
    "sparkjax/assets/demo/MODEL_CARD.md. Its CPU timings say nothing about real models on accelerators."
)


def path(part: str) -> pathlib.Path:
    """``DEMO_DIR / part`` (e.g. ``"target"``, ``"dspark_b16"``, ``"prompts"``)."""
    return DEMO_DIR / part


def target_dir() -> pathlib.Path:
    return path("target")


def drafter_dir() -> pathlib.Path:
    return path("dspark_b16")


def baseline_dir() -> pathlib.Path:
    return path("dflash_b16")


def prompts_file(name: str) -> pathlib.Path:
    return path("prompts") / f"{name}.jsonl"


def is_target(folder) -> bool:
    """Whether ``folder`` is the demo target folder."""
    try:
        return pathlib.Path(folder).resolve() == target_dir().resolve()
    except TypeError:
        return False


def _present(folder: pathlib.Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def require(*parts: str) -> None:
    """Raises one EvalError naming every missing demo folder of ``parts`` (config.json + safetensors)."""
    missing = [str(path(p)) for p in parts if not _present(path(p))]
    if missing:
        raise EvalError(
            f"the bundled demo pair is incomplete: {', '.join(missing)} not found (no config.json + *.safetensors; "
            "a source checkout from before the demo weights were added?); pass --target and --drafter to run "
            "another pair, e.g. (from a source checkout) --target tests/fixtures/tiny_dspark_b16/target --drafter "
            "tests/fixtures/tiny_dspark_b16/drafter --tokenizer eval/default_pair/tokenizer"
        )
