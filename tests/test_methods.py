"""Method objects and the one parser of method names (sparkjax.engine.methods)."""

import pytest

import sparkjax
from sparkjax.engine import AR, METHODS, TREE_METHODS, Auto, Chain, CostTable, Options, PCTree, Tree, parse_method
from sparkjax.engine.options import check_options


def test_the_parser_round_trips_every_method_and_methods_know_what_they_need():
    for name in METHODS:
        m = parse_method(name)
        assert m.name == name
        assert parse_method(m.label) == m and parse_method(str(m)) == m
        assert parse_method(m) is m
    for name in TREE_METHODS:
        m = parse_method(f"{name}@16")
        assert isinstance(m, Tree) and m == type(m)(name, budget=16) and m.label == f"{name}@16"
    assert parse_method("ar") == AR() and parse_method("dspark") == Chain("dspark")
    assert parse_method("sparklingtree", budget=8, top_c=4, normalization="exact") == Tree(
        "sparklingtree", 8, 4, None, "exact")
    # what each method needs, and its identity
    assert not AR().speculative and Chain().speculative and Tree().speculative
    assert Chain("dspark").needs_markov and not Chain("dflash").needs_markov
    assert not Tree("ddtree").needs_markov and Tree("sparklingtree-beam").needs_markov
    assert Tree("sparklingtree-beam", budget=8, widths=[4, 4]).widths == (4, 4)
    assert hash(Tree()) == hash(Tree("sparklingtree", 64))
    pc = parse_method("pctree")  # its budget depends on the drafter's depth (test_pctree)
    assert pc == PCTree() == PCTree("pctree", None, k=4) and pc.label == "pctree" and pc.needs_markov
    assert parse_method("pctree@32") == PCTree("pctree", 32) and PCTree(budget=32).label == "pctree@32"
    # the seed's tree: a candidate mode and a fanout, in the label as well
    seed = parse_method("sparklingtree@64:seed:fanout=16")
    assert seed == Tree("sparklingtree", 64, candidates="seed", max_fanout=16)
    assert seed.label == "sparklingtree@64:seed:fanout=16"
    assert parse_method(seed.label) == seed and parse_method("sparklingtree", budget=16, candidates="seed").label == (
        "sparklingtree@16:seed")
    assert parse_method("sparklingtree@8:corrected") == Tree("sparklingtree", 8, candidates="corrected")
    assert parse_method("sparklingtree:seed") == Tree("sparklingtree", candidates="seed")  # the default budget
    assert parse_method("sparklingtree:seed", budget=16).label == "sparklingtree@16:seed"
    assert Tree("sparklingtree", 8).label == "sparklingtree@8" == parse_method("sparklingtree@8:union").label
    assert hash(Options()) == hash(Options("auto", "auto", 1, None, 128)) and Options() != Options(block_slots=16)
    assert parse_method("auto") == Auto() and "auto" in sparkjax.METHODS
    assert parse_method("auto@32") == Auto(sizes=(0, "chain", 8, 16, 32), budget=32)
    assert parse_method("auto", budget=12).sizes == (0, "chain", 8, 12)
    assert Auto(sizes=[16, "chain", 0]).sizes == (0, "chain", 16)  # canonical order


@pytest.mark.parametrize("bad,name", [
    (lambda: Tree("sparklingtree", budget=0), "budget"),
    (lambda: Tree("sparklingtree", budget=True), "budget"),
    (lambda: Tree("ddtree", top_c=2.5), "top_c"),
    (lambda: Tree("sparklingtree", widths=(4, 4)), "widths"),
    (lambda: Tree("sparklingtree-beam", widths=[4, -1]), "widths[1]"),
    (lambda: Tree("sparklingtree", normalization="slow"), "normalization"),
    (lambda: Tree("dspark"), "kind"),
    (lambda: Chain("ddtree"), "kind"),
    (lambda: parse_method("nope"), "method"),
    (lambda: parse_method(3), "method"),
    (lambda: parse_method("ddtree@x"), "method"),
    (lambda: parse_method("ddtree@8", budget=8), "budget"),
    (lambda: parse_method("ar", budget=8), "budget"),
    (lambda: parse_method("dspark", budget=8), "budget"),  # a chain drafts one node per depth
    (lambda: parse_method("dflash", top_c=8), "top_c"),
    (lambda: parse_method(Tree(), budget=8), "budget"),
    (lambda: PCTree(k=0), "k"),
    (lambda: PCTree(k=2.5), "k"),
    (lambda: PCTree(budget=1), "budget"),
    (lambda: parse_method("pctree@1"), "budget"),
    (lambda: PCTree(widths=(4, 4)), "widths"),
    (lambda: Tree("pctree"), "kind"),
    (lambda: Tree("sparklingtree", max_fanout=4), "max_fanout"),
    (lambda: Tree("sparklingtree", candidates="seed", max_fanout=-1), "max_fanout"),
    (lambda: Tree("sparklingtree-beam", candidates="seed"), "candidates"),
    (lambda: Tree("ddtree", candidates="seed"), "candidates"),
    (lambda: PCTree(candidates="seed"), "candidates"),
    (lambda: parse_method("sparklingtree@8:bogus=1"), "method"),
    (lambda: parse_method("sparklingtree@8:seed", candidates="seed"), "candidates"),
    (lambda: parse_method("dspark", max_fanout=4), "max_fanout"),
    (lambda: Options(attention="flash"), "attention"),
    (lambda: Options(attention=[]), "attention"),
    (lambda: Options(chain_mode="jacobi"), "chain_mode"),
    (lambda: Options(candidate_chain_passes=0), "candidate_chain_passes"),
    (lambda: Options(union_top_k=True), "union_top_k"),
    (lambda: Options(block_slots=2.0), "block_slots"),
    (lambda: check_options("einsum"), "options"),
    (lambda: parse_method("auto", widths=(4, 4)), "widths"),
    (lambda: parse_method("auto@0"), "budget"),
    (lambda: CostTable(("ar", "dspark"), (1.0,)), "seconds"),
    (lambda: CostTable(("ar",), (0.0,)), "seconds"),
])
def test_method_objects_validate_themselves(bad, name):
    with pytest.raises(sparkjax.ArgumentError) as info:
        bad()
    assert str(info.value).startswith(f"{name}:")
