"""Key maps: which checkpoint tensor fills which NNX parameter, and in which layout.

A key map (:data:`QWEN3_KEYS`: Hugging Face ``Qwen3ForCausalLM``; :data:`DRAFTER_KEYS`: DeepSpec / z-lab
drafters) is a table of rules ``(module path pattern, checkpoint key pattern, layout)``; ``{i}`` stands for a
layer index. Layouts (checkpoint = PyTorch ``nn.Linear`` layout, module = JAX layout):

``same``       identical shapes (embeddings, norms, head tables)
``linear``     ``[out, in]`` <-> kernel ``[in, out]``
``heads_in``   ``[n*h, in]`` <-> kernel ``[in, n, h]`` (q/k/v projections)
``heads_out``  ``[d, n*h]`` <-> kernel ``[n, h, d]`` (o projection)
``flat``       ``[n*h]`` <-> ``[n, h]`` (q/k/v biases)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from flax import nnx

Rule = tuple[str, str, str]  # (module path pattern, checkpoint key pattern, layout)

# layout: (checkpoint shape of a module shape, module -> checkpoint array, checkpoint array -> module shape)
_LAYOUTS = {
    "same": (lambda s: s, lambda x: x, lambda x, s: x.reshape(s)),
    "linear": (lambda s: s[::-1], lambda x: x.T, lambda x, s: x.T),
    "heads_in": (lambda s: (s[1] * s[2], s[0]), lambda x: x.reshape(x.shape[0], -1).T, lambda x, s: x.T.reshape(s)),
    "heads_out": (lambda s: (s[2], s[0] * s[1]), lambda x: x.reshape(-1, x.shape[-1]).T, lambda x, s: x.T.reshape(s)),
    "flat": (lambda s: (math.prod(s),), lambda x: x.reshape(-1), lambda x, s: x.reshape(s)),
}

_LAYER = tuple(("layers.{i}." + mod, layout) for mod, layout in (
    ("input_layernorm.weight", "same"), ("post_attention_layernorm.weight", "same"),
    *((f"self_attn.{p}_proj.kernel", "heads_in") for p in "qkv"),
    *((f"self_attn.{p}_proj.bias", "flat") for p in "qkv"),
    ("self_attn.o_proj.kernel", "heads_out"), ("self_attn.o_proj.bias", "same"),
    ("self_attn.q_norm.weight", "same"), ("self_attn.k_norm.weight", "same"),
    *((f"mlp.{p}_proj.kernel", "linear") for p in ("gate", "up", "down")),
))


def _rules(prefix: str, params) -> tuple[Rule, ...]:
    """Rules whose checkpoint key is ``prefix`` + the module path, a ``kernel`` named ``weight``."""
    return tuple((mod, prefix + mod.replace(".kernel", ".weight"), layout) for mod, layout in params)


QWEN3_KEYS: tuple[Rule, ...] = (
    ("embed_tokens.embedding", "model.embed_tokens.weight", "same"),
    *_rules("model.", (*_LAYER, ("norm.weight", "same"))),
    ("lm_head.weight", "lm_head.weight", "same"),
)

# DeepSpec ``Qwen3DSparkModel`` and z-lab ``DFlashDraftModel`` share the backbone keys (no ``model.`` prefix);
# a DFlash drafter has no embed / head / Markov / confidence parameters.
DRAFTER_KEYS: tuple[Rule, ...] = (
    ("embed_tokens.embedding", "embed_tokens.weight", "same"),
    *_rules("", (*_LAYER, ("norm.weight", "same"), ("fc.kernel", "linear"), ("hidden_norm.weight", "same"),
                 ("lm_head.weight", "same"), ("markov_head.markov_w1.weight", "same"),
                 ("markov_head.markov_w2.weight", "same"), ("markov_head.gate_proj.kernel", "linear"),
                 ("markov_head.gate_proj.bias", "same"), ("confidence_head.proj.kernel", "linear"),
                 ("confidence_head.proj.bias", "same"))),
)


def _checkpoint_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_LAYOUTS[layout][0](shape))


def _to_checkpoint(layout: str, x):
    return _LAYOUTS[layout][1](x)


def _to_module(layout: str, x, shape: tuple[int, ...]):
    return _LAYOUTS[layout][2](x, shape)


def param_keys(state: nnx.State, rules: Sequence[Rule]) -> list[tuple[tuple, str, str]]:
    """Maps every parameter of ``state`` to ``(path, checkpoint key, layout)``; every path must match a rule."""
    compiled = [(re.compile(re.escape(mod).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$"), key, layout)
                for mod, key, layout in rules]
    out = []
    for path, _ in nnx.to_flat_state(state):
        dotted = ".".join(str(p) for p in path)
        for pattern, key, layout in compiled:
            if m := pattern.match(dotted):
                out.append((path, key.format(**m.groupdict()), layout))
                break
        else:
            raise AssertionError(f"key map has no rule for parameter {dotted}")
    return out
