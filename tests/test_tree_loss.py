"""The tree-aware training term (``sparkjax.training.loss.tree_recall``, the ``tree_*`` settings): a hand-computed
value, the hard metrics and the gradient against finite differences; with ``tree_alpha = 0`` the objective is
upstream's exactly, metrics or not; bad settings name the recipe key or the setting."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparkjax.errors import ArgumentError, SparkjaxError
from sparkjax.training import Objective, TrainConfig, TrainingError, dspark_loss_sums
from sparkjax.training.loss import tree_recall

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "train", "recipes")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# one block of two supervised slots over a 4-token vocabulary, then one unsupervised slot
LOGITS = np.array([[[[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 1.0, 0.5], [5.0, 0.0, 0.0, 0.0]]]], np.float32)
LABELS = np.array([[[2, 1, 3]]], np.int32)
MASK = np.array([[[True, True, False]]])
KEEP = np.array([[True]])


loss_sums = jax.jit(dspark_loss_sums, static_argnums=6)  # the objective is static
recall = jax.jit(tree_recall, static_argnums=(2, 3))
# a LossSums' losses and logged metrics under an objective, one program each (results on the host)
_losses_and_metrics = jax.jit(lambda sums, objective: (sums.losses(objective), sums.metrics(objective)),
                              static_argnums=1)


def losses_and_metrics(sums, objective):
    return jax.tree.map(np.asarray, _losses_and_metrics(sums, objective))


def sums_for(logits, objective):
    b = logits.shape[:-1]
    return loss_sums(logits, np.zeros_like(logits), LABELS, MASK, KEEP, np.zeros(b, np.float32), objective)


def test_tree_recall_by_hand():
    soft, hard = (np.asarray(x) for x in recall(LOGITS, LABELS, 1, 1.0))
    # slot 0: label 2 (logit 1), best other 2.0 -> outside the top-1; slot 1: label 1 (3), best other 1.0
    # slot 2: label 3 (0), best other 5.0
    np.testing.assert_allclose(soft[0, 0], [sigmoid(-1.0), sigmoid(2.0), sigmoid(-5.0)], rtol=1e-6)
    np.testing.assert_array_equal(hard[0, 0], [0.0, 1.0, 0.0])
    # top-2 at temperature 0.5: slot 0's threshold is the second best other (0.0), slot 1's is 0.5
    soft2, hard2 = (np.asarray(x) for x in recall(LOGITS, LABELS, 2, 0.5))
    np.testing.assert_allclose(soft2[0, 0, :2], [sigmoid(2.0), sigmoid(5.0)], rtol=1e-6)
    np.testing.assert_array_equal(hard2[0, 0], [1.0, 1.0, 0.0])


def test_tree_term_value_and_metrics_by_hand():
    obj = Objective(tree_alpha=0.5, tree_top_c=1, tree_temperature=1.0)
    sums = sums_for(LOGITS, obj)
    w0, w1 = 1.0, math.exp(-1 / 4)  # upstream's slot weights exp(-k / 4); slot 2 is unsupervised
    r0, r1 = sigmoid(-1.0), sigmoid(2.0)
    expected_num = (1 - r0) * w0 + (1 - r0 * r1) * w1
    np.testing.assert_allclose(float(sums.tree_num), expected_num, rtol=1e-6)
    losses, metrics = losses_and_metrics(sums, obj)
    np.testing.assert_allclose(float(losses["tree_loss"]), expected_num / (w0 + w1 + 1e-6), rtol=1e-6)
    base, _ = losses_and_metrics(sums, dataclasses.replace(obj, tree_alpha=0.0))
    np.testing.assert_allclose(float(losses["loss"]), float(base["loss"]) + 0.5 * float(losses["tree_loss"]),
                               rtol=1e-6)
    # hard recall per slot over supervised slots only; the beam's path ends at slot 0 here
    np.testing.assert_array_equal(np.asarray(metrics["tree_recall"]), [0.0, 1.0, 0.0])
    assert float(metrics["tau_tree"]) == 1.0
    two = sums_for(LOGITS, dataclasses.replace(obj, tree_top_c=2))
    assert float(losses_and_metrics(two, dataclasses.replace(obj, tree_top_c=2))[1]["tau_tree"]) == 3.0


def test_tree_term_gradient_matches_finite_differences():
    obj = Objective(tree_alpha=1.0, tree_top_c=2, tree_temperature=0.7)

    def term(z):
        sums = dspark_loss_sums(z, jnp.zeros_like(z), jnp.asarray(LABELS), jnp.asarray(MASK), jnp.asarray(KEEP),
                                None, obj)
        return sums.tree_num / (sums.weight_sum + 1e-6)

    with jax.enable_x64(True):
        # the points on the host in float64 (the same IEEE operations), the gradient and the terms compiled
        z = np.asarray(LOGITS, np.float64) + 0.01 * np.arange(12, dtype=np.float64).reshape(LOGITS.shape)
        grad = np.asarray(jax.jit(jax.grad(term))(z))
        eps = 1e-6
        # central differences along every coordinate, all in one vmapped program
        steps = eps * np.eye(z.size, dtype=np.float64).reshape(z.size, *z.shape)
        both = np.asarray(jax.jit(jax.vmap(term))(np.concatenate([z + steps, z - steps])))
        numeric = ((both[: z.size] - both[z.size :]) / (2 * eps)).reshape(z.shape)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)
    # the gradient reaches the label's logit and the competing threshold logits of both supervised slots,
    # and nothing of the unsupervised slot
    assert grad[0, 0, 0, 2] < 0 and grad[0, 0, 1, 1] < 0
    assert np.all(grad[0, 0, 2] == 0)


def test_tree_settings_off_keep_upstreams_objective():
    rng = np.random.default_rng(0)
    logits, target = rng.normal(size=(2, 2, 3, 5, 16)).astype(np.float32)
    labels = rng.integers(0, 16, size=logits.shape[:-1]).astype(np.int32)
    mask = np.arange(5)[None, None, :] < rng.integers(0, 6, size=(2, 3, 1))
    keep = np.ones((2, 3), bool)
    conf = rng.normal(size=labels.shape).astype(np.float32)

    def losses(obj):
        return losses_and_metrics(loss_sums(logits, target, labels, mask, keep, conf, obj), obj)

    plain, plain_m = losses(Objective())
    logged, logged_m = losses(Objective(tree_top_c=4))  # metrics only
    assert "tree_loss" not in plain and "tau_tree" not in plain_m
    assert float(logged["loss"]) == float(plain["loss"])
    assert 0.0 < float(logged["tree_loss"]) < 1.0
    # the hard beam accepted length from the definition, per kept block with a supervised slot
    top4 = np.argsort(-logits, axis=-1)[..., :4]
    hit = (top4 == labels[..., None]).any(-1) & mask
    tau = 1 + np.cumprod(hit, axis=-1).sum(-1)
    blocks = mask.any(-1)
    np.testing.assert_allclose(float(logged_m["tau_tree"]), tau[blocks].mean(), rtol=1e-6)
    weighted, _ = losses(Objective(tree_alpha=2.0, tree_top_c=4))
    np.testing.assert_allclose(float(weighted["loss"]), float(plain["loss"]) + 2.0 * float(logged["tree_loss"]),
                               rtol=1e-6)


def test_demo_recipes_differ_only_in_the_tree_term():
    tree = TrainConfig.from_file(os.path.join(RECIPES, "demo_dspark_tree.json"))
    plain = TrainConfig.from_file(os.path.join(RECIPES, "demo_dspark_plain.json"))
    assert tree.objective.tree_alpha > 0 and plain.objective.tree_alpha == 0
    assert plain.objective.tree_top_c == tree.objective.tree_top_c  # the control logs the same metrics
    diff = {k for k, v in tree.to_dict().items() if plain.to_dict()[k] != v}
    assert diff == {"name", "description", "tree_loss_alpha"}


@pytest.mark.parametrize("override, key", [
    ({"tree_top_c": -1}, "tree_top_c"),
    ({"tree_top_c": 2.5}, "tree_top_c"),
    ({"tree_loss_alpha": 1.0, "tree_top_c": 0}, "tree_top_c"),
    ({"tree_loss_alpha": -0.1}, "tree_loss_alpha"),
    ({"tree_temperature": 0}, "tree_temperature"),
])
def test_bad_tree_settings_name_the_key(override, key):
    base = {"target": "t", "data": "d.jsonl"}
    with pytest.raises(TrainingError, match=f"'{key}'") as err:
        TrainConfig.from_dict({**base, **override}, source="recipe.json")
    assert "recipe.json" in str(err.value) and isinstance(err.value, SparkjaxError)


def test_tree_top_c_must_fit_the_vocabulary():
    with pytest.raises(ArgumentError, match="tree_top_c: 4 candidates"):
        sums_for(LOGITS, Objective(tree_alpha=1.0, tree_top_c=4))
