"""Method names: the one table of every method's name, its class and its kind, and :func:`parse_method`, its only
reader (a label ``name[@budget][:candidates][:fanout=K]`` or a method object → the method object). The classes
declare their own names (``KINDS``) in :mod:`~sparkjax.engine.methods` and :mod:`~sparkjax.engine.adaptive`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import ArgumentError
from .adaptive import CHAIN, DEFAULT_SIZES, Auto
from .checks import check_int, describe
from .methods import AR, Chain, Kind, Method, PCTree, Tree

# every method name, its class and its kind: the classes' own KINDS, read here alone (and by kind_of)
_TABLE: dict[str, tuple[type[Method], Kind]] = {name: (cls, kind) for cls in (AR, Chain, Tree, PCTree, Auto)
                                                 for name, kind in cls.KINDS.items()}

METHODS: tuple[str, ...] = tuple(_TABLE)
CHAIN_METHODS: tuple[str, ...] = tuple(n for n, (c, _) in _TABLE.items() if issubclass(c, Chain))
TREE_METHODS: tuple[str, ...] = tuple(n for n, (c, _) in _TABLE.items() if issubclass(c, Tree))
MARKOV_METHODS: tuple[str, ...] = tuple(n for n, (_, k) in _TABLE.items() if k.markov)
AR_LABEL: str = AR().label  # the reference row of every result table


def available_methods() -> tuple[str, ...]:
    """The method names :func:`parse_method` (and so :func:`~sparkjax.engine.generate`) reads."""
    return METHODS


def _entry(name: Any) -> type[Method]:
    """The class of a method name; ArgumentError naming ``method`` for an unknown one."""
    entry = _TABLE.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ArgumentError(f"method: unknown method {describe(name)}; expected one of {', '.join(METHODS)}")
    return entry[0]


def _from_options(name: str, cls: type[Method], *, budget: Any, top_c: Any, widths: Any, normalization: Any) -> Method:
    """The method ``name`` (of class ``cls``) with :func:`parse_method`'s options; ArgumentError for one it does not
    take. A budget for ``auto`` is its largest tree size (its default sizes up to it, and it)."""
    if cls is AR or cls is Chain:
        for arg, value in (("budget", budget), ("top_c", top_c), ("widths", widths)):
            if value is not None:
                why = f"chain method {name!r} drafts one node per depth; {arg} does not apply" if cls is Chain else \
                    f"does not apply to method {name!r}"
                raise ArgumentError(f"{arg}: {why}")
        return cls(name) if cls is Chain else cls()
    if cls is Auto:
        if widths is not None:
            raise ArgumentError("widths: does not apply to method 'auto' (it slices best-first trees)")
        if budget is None:
            return cls(top_c=top_c, normalization=normalization)
        b = check_int("budget", budget, unit="number of tree nodes")
        sizes = tuple(v for v in DEFAULT_SIZES if v == CHAIN or v <= b)
        return cls(sizes=sizes if b in sizes else sizes + (b,), budget=b, top_c=top_c, normalization=normalization)
    return cls(name, cls.budget if budget is None else budget, top_c, widths, normalization)  # Tree, PCTree


def parse_method(method: str | Method, *, budget: Any = None, top_c: Any = None,
                 widths: Sequence[int] | str | None = None, normalization: Any = "fast",
                 candidates: Any = None, max_fanout: Any = None) -> Method:
    """The method object of ``method``: a :class:`Method` (returned as is; then the keyword options must
    be left unset), a name out of :data:`METHODS` (with the keyword options, which only the methods that
    take them accept), or a tree's label ``"name[@budget][:candidates][:fanout=K]"`` (as the eval labels them)."""
    if isinstance(method, Method):
        for arg, value in (("budget", budget), ("top_c", top_c), ("widths", widths), ("candidates", candidates),
                           ("max_fanout", max_fanout)):
            if value is not None:
                raise ArgumentError(f"{arg}: given beside the method object {method!r}; set it on the object")
        return method
    head, *opts = method.split(":") if isinstance(method, str) else (method,)
    name, at, text = head.partition("@") if isinstance(head, str) else (head, "", "")
    entry = _entry(name)
    if at:
        if not (text.isascii() and text.isdigit()):
            raise ArgumentError(f"method: {method!r}: expected 'name@budget' with an integer budget")
        if budget is not None:
            raise ArgumentError(f"budget: given twice, in method={method!r} and as budget={budget!r}")
        budget = int(text)
    for opt in opts:
        key, eq, value = opt.partition("=")
        arg, given = ("max_fanout", max_fanout) if eq else ("candidates", candidates)
        if (eq and (key != "fanout" or not (value.isascii() and value.isdigit()))) or not opt:
            raise ArgumentError(f"method: {method!r}: expected 'name[@budget][:candidates][:fanout=K]', "
                                f"got the option {opt!r}")
        if given is not None:
            raise ArgumentError(f"{arg}: given twice, in method={method!r} and as {arg}={given!r}")
        if eq:
            max_fanout = int(value)
        else:
            candidates = opt
    out = _from_options(name, entry, budget=budget, top_c=top_c, widths=widths, normalization=normalization)
    for arg, value in (("candidates", candidates), ("max_fanout", max_fanout)):
        if value is not None:
            if not isinstance(out, Tree):
                raise ArgumentError(f"{arg}: only the tree methods take a {arg} option, not {name!r}")
            out = dataclasses.replace(out, **{arg: value})
    return out
