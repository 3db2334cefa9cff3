"""Covering tables for parametrized tests: every pair of values, not every combination.

A table of k dimensions run as a full product grows as the product of their sizes (the
GatherBlockQuantized battery ran 400 cases, each a rewrite and two onnxruntime sessions), while the
faults these tables have found involved one value or the interaction of two (a storage with a
scale type, an axis pair with a form): a table that holds every value of every dimension together
with every value of every other dimension, at least once, finds those at a fraction of the cost.
:func:`pairwise` builds one deterministically (the same rows on every run and machine, so a
failure names a case that can be re-run), greedily from the full product: each step takes the
first row of the product that covers the most pairs not yet covered. Rows a past fix named (the
combination that failed) are passed as ``keep`` and come first, so they stay whatever else
changes. CONTRIBUTING.md ("Tests") says when to use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["pairwise"]


def _pairs(row: Sequence[Any]) -> set[tuple[int, int, int, int]]:
    """The pairs a row covers, as (dimension, value index, dimension, value index)."""
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def pairwise(*dimensions: Sequence[Any], keep: Iterable[Sequence[Any]] = ()) -> list[tuple[Any, ...]]:
    """Rows (one value per dimension, in ``dimensions``' order) in which every value of each
    dimension meets every value of each other dimension at least once; ``keep``'s rows first.

    Deterministic; values are compared by position in their dimension, so they need not be
    hashable (dtypes, shapes). A single dimension gives its values; two give the full product
    (every pair is a row)."""
    sizes = [len(d) for d in dimensions]
    if not dimensions or 0 in sizes:
        raise ValueError(f"pairwise needs non-empty dimensions, got sizes {sizes}")
    product = list(itertools.product(*(range(n) for n in sizes)))
    uncovered = set().union(*(_pairs(r) for r in product)) if len(sizes) > 1 else set()
    chosen: list[tuple[int, ...]] = []
    for row in keep:
        if len(row) != len(dimensions):
            raise ValueError(f"kept row {row!r} has {len(row)} values for {len(dimensions)} dimensions")
        index = tuple(_position(d, v) for d, v in zip(dimensions, row, strict=True))
        chosen.append(index)
        uncovered -= _pairs(index)
    if len(sizes) == 1:
        chosen += [r for r in product if r not in chosen]
    while uncovered:
        best = max(product, key=lambda r: len(_pairs(r) & uncovered))  # max keeps the first of ties
        chosen.append(best)
        uncovered -= _pairs(best)
    return [tuple(d[i] for d, i in zip(dimensions, row, strict=True)) for row in chosen]


def _position(dimension: Sequence[Any], value: Any) -> int:
    """Where ``value`` is in ``dimension`` (by ``is`` or ``==``; dtypes compare with ``==``)."""
    for i, v in enumerate(dimension):
        if v is value or v == value:
            return i
    raise ValueError(f"{value!r} is not one of {list(dimension)!r}")
