"""The DSpark objective, exactly as upstream DeepSpec's ``compute_dspark_loss`` (world size 1).

Per slot ``k`` of every block ``[B, A, G]``, with weights ``w = eval_mask * exp(-k / gamma)`` (no decay when
``gamma`` is None or <= 0): ``ce`` (cross-entropy of the Markov-corrected draft logits vs the labels), ``l1``
(``sum_v |softmax(draft) - softmax(target)|``, the target's logits at ``anchor + k``) and ``conf`` (BCE-with-logits
of the confidence logits vs the *detached* accept rate ``clamp(1 - l1 / 2, 0, 1)``), each reduced as
``sum(term * w) / (sum(w) + 1e-6)``; ``total = ce_alpha * ce + l1_alpha * l1 + conf_alpha * conf`` (float32).

The tree-aware term (off by default): with ``z`` the corrected logits, ``y`` the label and ``t_k`` the C-th
largest logit of the other tokens, the soft recall is ``r_k = sigmoid((z_y - t_k) / T)`` and
``tree = 1 - prod_{j<=k} r_j``, reduced like the others and added as ``tree_alpha * tree``. ``tree_top_c > 0``
also logs ``tree_recall@k`` (the label among the top-C) and ``tau_tree = 1 + sum_k prod_{j<=k} recall_j``.

Metrics are kept as sums (batches and devices add up before dividing): ``accept_rate@k`` over supervised slots,
``tau_probabilistic`` (over kept blocks with a supervised slot, the mean of ``1 + sum_k cumprod_k(accept *
eval_mask)``) and ``confidence_abs_error`` / ``confidence_bias`` / ``confidence_cumprod_bias`` as upstream.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ..errors import ArgumentError

Array = jax.Array

EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Objective:
    """Loss weights (upstream: ``loss_decay_gamma``, ``ce_loss_alpha``, ``l1_loss_alpha``, ``confidence_head_alpha``)
    and the tree term's weight, candidates per depth (0: not computed) and sigmoid temperature (logit units)."""

    gamma: float | None = 4.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    tree_alpha: float = 0.0
    tree_top_c: int = 0
    tree_temperature: float = 1.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossSums:
    """Numerators / denominators of every loss term and metric of one batch (float32 scalars or ``[G]``)."""

    ce_num: Array
    l1_num: Array
    conf_num: Array
    weight_sum: Array  # = ce_den = l1_den = conf_den
    accept_sum: Array  # [G]
    accept_count: Array  # [G]
    tau_sum: Array
    block_count: Array
    conf_abs_error_num: Array
    conf_bias_num: Array
    conf_cumprod_bias_num: Array
    tree_num: Array
    tree_recall_sum: Array  # [G]
    tree_tau_sum: Array

    def __add__(self, other: LossSums) -> LossSums:
        return jax.tree.map(jnp.add, self, other)

    def losses(self, objective: Objective, has_confidence: bool = True) -> dict[str, Array]:
        den = self.weight_sum + EPS
        ce = self.ce_num / den
        l1 = self.l1_num / den
        conf = self.conf_num / den if has_confidence else jnp.zeros_like(ce)
        total = objective.ce_alpha * ce + objective.l1_alpha * l1 + objective.conf_alpha * conf
        out = {"loss": total, "ce_loss": ce, "l1_loss": l1, "confidence_loss": conf}
        if objective.tree_top_c > 0:
            tree = self.tree_num / den
            out["tree_loss"] = tree
            if objective.tree_alpha > 0:
                out["loss"] = total + objective.tree_alpha * tree
        return out

    def metrics(self, objective: Objective, has_confidence: bool = True) -> dict[str, Array]:
        """Every logged value as ``num / den`` (a zero denominator gives 0)."""
        ratio = lambda num, den: jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)  # noqa: E731
        out = dict(self.losses(objective, has_confidence))
        out["tau_probabilistic"] = ratio(self.tau_sum, self.block_count)
        out["accept_rate"] = ratio(self.accept_sum, self.accept_count)
        out["supervised_slots"] = jnp.sum(self.accept_count)
        if objective.tree_top_c > 0:
            out["tree_recall"] = ratio(self.tree_recall_sum, self.accept_count)
            out["tau_tree"] = ratio(self.tree_tau_sum, self.block_count)
        if has_confidence:
            out["confidence_abs_error"] = ratio(self.conf_abs_error_num, self.weight_sum)
            out["confidence_bias"] = ratio(self.conf_bias_num, self.weight_sum)
            out["confidence_cumprod_bias"] = ratio(self.conf_cumprod_bias_num, self.weight_sum)
        return out


def loss_weights(eval_mask: Array, gamma: float | None) -> Array:
    """``eval_mask * exp(-k / gamma)`` ``[B, A, G]`` in float32."""
    w = eval_mask.astype(jnp.float32)
    if gamma is not None and gamma > 0:
        k = jnp.arange(w.shape[-1], dtype=jnp.float32)
        w = w * jnp.exp(-k / float(gamma))
    return w


def check_tree_objective(objective: Objective, vocab_size: int) -> None:
    """The tree settings fit the vocabulary (``ArgumentError`` naming the setting)."""
    c = objective.tree_top_c
    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
        raise ArgumentError(f"tree_top_c: must be an integer >= 0, got {c!r}")
    if c >= vocab_size:
        raise ArgumentError(f"tree_top_c: {c} candidates per depth need a vocabulary larger than {vocab_size}")
    if objective.tree_alpha > 0 and c == 0:
        raise ArgumentError(f"tree_top_c: tree_alpha is {objective.tree_alpha}, so the term needs tree_top_c >= 1")
    if not objective.tree_temperature > 0:
        raise ArgumentError(f"tree_temperature: must be > 0, got {objective.tree_temperature!r}")


def tree_recall(logits: Array, labels: Array, top_c: int, temperature: float) -> tuple[Array, Array]:
    """Soft and hard top-C recall of ``labels`` under ``logits`` ``[..., V]`` (float32 ``[...]`` each).

    ``t`` is the ``top_c``-th largest logit of the tokens other than the label; the label is among the top
    ``top_c`` iff its logit is above ``t`` (hard) and the soft recall is ``sigmoid((z_label - t) / T)``."""
    z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # float64 stays (gradient checks)
    labels = labels.astype(jnp.int32)
    label = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    others = jnp.where(jnp.arange(z.shape[-1]) == labels[..., None], -jnp.inf, z)
    thresh = jax.lax.top_k(others, top_c)[0][..., -1]
    return jax.nn.sigmoid((label - thresh) / temperature), (label > thresh).astype(z.dtype)


def dspark_loss_sums(draft_logits: Array, target_logits: Array, target_ids: Array, eval_mask: Array, keep: Array,
                     confidence_logits: Array | None, objective: Objective) -> LossSums:
    """The sums behind every term: ``draft_logits``/``target_logits`` ``[B, A, G, V]``, ``target_ids``,
    ``eval_mask`` ``[B, A, G]``, ``keep`` ``[B, A]``, ``confidence_logits`` ``[B, A, G]`` or None."""
    w = loss_weights(eval_mask, objective.gamma)
    valid = eval_mask.astype(jnp.float32)
    draft = draft_logits.astype(jnp.promote_types(draft_logits.dtype, jnp.float32))
    # optax's losses: upstream's torch formulas up to float32 rounding
    ce = optax.softmax_cross_entropy_with_integer_labels(draft, target_ids.astype(jnp.int32))
    p_draft = jax.nn.softmax(draft, axis=-1)
    p_target = jax.nn.softmax(jax.lax.stop_gradient(target_logits).astype(jnp.float32), axis=-1)
    l1 = jnp.sum(jnp.abs(p_draft - p_target), axis=-1)
    accept = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))

    zero = jnp.zeros((), jnp.float32)
    valid_accept = accept * valid
    tau_block = jnp.sum(jnp.cumprod(valid_accept, axis=-1), axis=-1) + 1.0
    blocks = (keep & jnp.any(eval_mask, axis=-1)).astype(jnp.float32)

    conf_num = conf_abs = conf_bias = conf_cum = zero
    if confidence_logits is not None:
        x = confidence_logits.astype(jnp.float32)
        conf_num = jnp.sum(optax.sigmoid_binary_cross_entropy(x, accept) * w)  # BCE with logits
        prob = jax.lax.stop_gradient(jax.nn.sigmoid(x))
        err = prob - accept
        conf_abs = jnp.sum(jnp.abs(err) * w)
        conf_bias = jnp.sum(err * w)
        conf_cum = jnp.sum((jnp.cumprod(prob * valid, axis=-1) - jnp.cumprod(valid_accept, axis=-1)) * w)

    tree_num = tree_tau = zero
    tree_hits = jnp.zeros(valid.shape[-1], jnp.float32)
    if objective.tree_top_c > 0:
        check_tree_objective(objective, draft.shape[-1])
        soft, hard = tree_recall(draft, target_ids, objective.tree_top_c, objective.tree_temperature)
        # supervised slots are a prefix of each block, so the prefix products of valid slots are the path's
        tree_num = jnp.sum((1.0 - jnp.cumprod(soft, axis=-1)) * w)
        valid_hard = hard * valid
        tree_hits = jnp.sum(valid_hard, axis=(0, 1))
        tree_tau = jnp.sum((jnp.sum(jnp.cumprod(valid_hard, axis=-1), axis=-1) + 1.0) * blocks)

    return LossSums(ce_num=jnp.sum(ce * w), l1_num=jnp.sum(l1 * w), conf_num=conf_num, weight_sum=jnp.sum(w),
                    accept_sum=jnp.sum(valid_accept, axis=(0, 1)), accept_count=jnp.sum(valid, axis=(0, 1)),
                    tau_sum=jnp.sum(tau_block * blocks), block_count=jnp.sum(blocks), conf_abs_error_num=conf_abs,
                    conf_bias_num=conf_bias, conf_cumprod_bias_num=conf_cum, tree_num=tree_num,
                    tree_recall_sum=tree_hits, tree_tau_sum=tree_tau)
