"""tests/_pairwise.py: the covering tables the parametrized batteries use hold every value and every
pair of values, keep the rows asked for, and are the same on every run."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _pairwise import pairwise


def _missing_pairs(dimensions, rows) -> list:
    missing = []
    for (i, di), (j, dj) in itertools.combinations(enumerate(dimensions), 2):
        for a, b in itertools.product(range(len(di)), range(len(dj))):
            if not any(r[i] is di[a] and r[j] is dj[b] for r in rows):
                missing.append((i, di[a], j, dj[b]))
    return missing


def test_every_pair_of_values_is_in_a_row_at_a_fraction_of_the_product():
    dimensions = [("uint8-2", "uint8-4", "uint8-8", "int4", "uint4"), (False, True), (16, 64, 256)]
    dimensions += [(np.float32, np.float16), (13, 21), ("packed", "table")]
    rows = pairwise(*dimensions)
    assert not _missing_pairs(dimensions, rows)
    assert 15 <= len(rows) <= 20 < 240  # at least 5 x 3 rows are needed for the two largest dimensions
    assert len(set(rows)) == len(rows)
    assert rows == pairwise(*dimensions)  # deterministic


def test_kept_rows_come_first_and_count_towards_the_cover():
    dimensions = [(1, 2, 3), ("a", "b"), (True, False)]
    keep = [(3, "b", False), (1, "a", False)]
    rows = pairwise(*dimensions, keep=keep)
    assert rows[:2] == keep
    assert not _missing_pairs(dimensions, rows)
    assert len(set(rows)) == len(rows)


def test_one_dimension_gives_its_values_and_two_their_product():
    assert pairwise((1, 2, 3)) == [(1,), (2,), (3,)]
    assert sorted(pairwise((1, 2), (3, 4, 5))) == sorted(itertools.product((1, 2), (3, 4, 5)))


def test_a_kept_row_outside_the_dimensions_is_refused():
    with pytest.raises(ValueError, match="7 is not one of"):
        pairwise((1, 2), (3, 4), keep=[(7, 3)])
    with pytest.raises(ValueError, match="has 1 values for 2 dimensions"):
        pairwise((1, 2), (3, 4), keep=[(1,)])
    with pytest.raises(ValueError, match="non-empty"):
        pairwise((1, 2), ())
