"""Key maps: which checkpoint tensor fills which NNX parameter, and in which layout.

A *key map* (:data:`QWEN3_KEYS`: Hugging Face ``Qwen3ForCausalLM``; :data:`DRAFTER_KEYS`: DeepSpec / z-lab
drafters) is a table of rules ``(module path pattern, checkpoint key pattern, layout)``; ``{i}`` stands for a
layer index. :func:`param_keys` maps every parameter of a module to its checkpoint key and layout.

Layouts (checkpoint = PyTorch ``nn.Linear`` layout, module = JAX layout):

``same``       identical shapes (embeddings, norms, head tables)
``linear``     ``[out, in]`` <-> kernel ``[in, out]``
``heads_in``   ``[n*h, in]`` <-> kernel ``[in, n, h]`` (q/k/v projections)
``heads_out``  ``[d, n*h]`` <-> kernel ``[n, h, d]`` (o projection)
``flat``       ``[n*h]`` <-> ``[n, h]`` (q/k/v biases)
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from flax import nnx

Rule = tuple[str, str, str]  # (module path pattern, checkpoint key pattern, layout)

QWEN3_KEYS: tuple[Rule, ...] = (
    ("embed_tokens.embedding", "model.embed_tokens.weight", "same"),
    ("layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", "same"),
    ("layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight", "same"),
    ("layers.{i}.self_attn.q_proj.kernel", "model.layers.{i}.self_attn.q_proj.weight", "heads_in"),
    ("layers.{i}.self_attn.k_proj.kernel", "model.layers.{i}.self_attn.k_proj.weight", "heads_in"),
    ("layers.{i}.self_attn.v_proj.kernel", "model.layers.{i}.self_attn.v_proj.weight", "heads_in"),
    ("layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias", "flat"),
    ("layers.{i}.self_attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias", "flat"),
    ("layers.{i}.self_attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias", "flat"),
    ("layers.{i}.self_attn.o_proj.kernel", "model.layers.{i}.self_attn.o_proj.weight", "heads_out"),
    ("layers.{i}.self_attn.o_proj.bias", "model.layers.{i}.self_attn.o_proj.bias", "same"),
    ("layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", "same"),
    ("layers.{i}.self_attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", "same"),
    ("layers.{i}.mlp.gate_proj.kernel", "model.layers.{i}.mlp.gate_proj.weight", "linear"),
    ("layers.{i}.mlp.up_proj.kernel", "model.layers.{i}.mlp.up_proj.weight", "linear"),
    ("layers.{i}.mlp.down_proj.kernel", "model.layers.{i}.mlp.down_proj.weight", "linear"),
    ("norm.weight", "model.norm.weight", "same"),
    ("lm_head.weight", "lm_head.weight", "same"),
)


# DeepSpec ``Qwen3DSparkModel`` and z-lab ``DFlashDraftModel`` checkpoints share the backbone keys
# (no ``model.`` prefix). A DFlash drafter simply has no embed / head / Markov / confidence parameters.
DRAFTER_KEYS: tuple[Rule, ...] = (
    ("embed_tokens.embedding", "embed_tokens.weight", "same"),
    *((mod, key.removeprefix("model."), layout) for mod, key, layout in QWEN3_KEYS if mod.startswith("layers.")),
    ("norm.weight", "norm.weight", "same"),
    ("fc.kernel", "fc.weight", "linear"),
    ("hidden_norm.weight", "hidden_norm.weight", "same"),
    ("lm_head.weight", "lm_head.weight", "same"),
    ("markov_head.markov_w1.weight", "markov_head.markov_w1.weight", "same"),
    ("markov_head.markov_w2.weight", "markov_head.markov_w2.weight", "same"),
    ("markov_head.gate_proj.kernel", "markov_head.gate_proj.weight", "linear"),
    ("markov_head.gate_proj.bias", "markov_head.gate_proj.bias", "same"),
    ("confidence_head.proj.kernel", "confidence_head.proj.weight", "linear"),
    ("confidence_head.proj.bias", "confidence_head.proj.bias", "same"),
)


def _checkpoint_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "same":
        return shape
    if layout == "linear":
        return shape[::-1]
    if layout == "heads_in":
        return (shape[1] * shape[2], shape[0])
    if layout == "heads_out":
        return (shape[2], shape[0] * shape[1])
    if layout == "flat":
        return (int(np.prod(shape)),)
    raise ValueError(f"unknown layout {layout!r}")


def _to_module(layout: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout in ("same", "flat"):
        return x.reshape(shape)
    if layout == "linear":
        return x.T
    if layout == "heads_in":
        return x.T.reshape(shape)
    if layout == "heads_out":
        return x.T.reshape(shape)
    raise ValueError(f"unknown layout {layout!r}")


def _to_checkpoint(layout: str, x: np.ndarray) -> np.ndarray:
    if layout == "same":
        return x
    if layout == "flat":
        return x.reshape(-1)
    if layout == "linear":
        return x.T
    if layout == "heads_in":
        return x.reshape(x.shape[0], -1).T
    if layout == "heads_out":
        return x.reshape(-1, x.shape[-1]).T
    raise ValueError(f"unknown layout {layout!r}")


def _compile_rules(rules: Sequence[Rule]) -> list[tuple[re.Pattern, str, str]]:
    return [(re.compile(re.escape(mod).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$"), key, layout)
            for mod, key, layout in rules]


def param_keys(state: nnx.State, rules: Sequence[Rule]) -> list[tuple[tuple, str, str]]:
    """Maps every parameter of ``state`` to ``(path, checkpoint key, layout)``; every path must match a rule."""
    compiled = _compile_rules(rules)
    out = []
    for path, _ in nnx.to_flat_state(state):
        dotted = ".".join(str(p) for p in path)
        for pattern, key, layout in compiled:
            m = pattern.match(dotted)
            if m:
                out.append((path, key.format(**m.groupdict()), layout))
                break
        else:
            raise AssertionError(f"key map has no rule for parameter {dotted}")
    return out
