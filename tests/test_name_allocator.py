"""NameAllocator keeps stamped names as families (prefix + shared hints): it must take exactly the
names a plain set of every drawn name would, in every order of draws."""

from __future__ import annotations

import random

import pytest
from onnx import TensorProto, helper

from onnx_qrewrite.rewriter.graph import NameAllocator


class _PlainAllocator:
    """The reference: every name drawn kept as one string (what NameAllocator did before families)."""

    def __init__(self, used: set[str]):
        self.used = set(used)

    def fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self.used:
            n += 1
            name = f"{base}_{n}"
        self.used.add(name)
        return name

    def fresh_all(self, prefix: str, hints: list[str]) -> tuple[list[str], bool]:
        out = [self.fresh(prefix + h) for h in hints]
        return out, out != [prefix + h for h in hints]


def _model(names: list[str]):
    nodes = [helper.make_node("Relu", ["x"], [n], name=f"node{i}") for i, n in enumerate(names)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in names]
    return helper.make_model(helper.make_graph(nodes, "g", [x], outs))


def assert_families_match_a_plain_set(rng: random.Random, trials: int, steps: int, *, frozen: bool) -> None:
    """Random models and random draws (families of hints claimed or drawn, single names): the
    allocator takes exactly the names a plain set of every name would, and never claims a family
    with a taken name."""
    parts = ["a", "b", "a/b", "x", "x_1", "", "b/"]
    hint_sets = [["/x", "/y"], ["/x", "/x"], ["/x", "/y_1"], ["x", "/y"], ["/a/b"], ["/x_1", "/x"], ["/"]]
    for trial in range(trials):
        existing = sorted({rng.choice(parts) + rng.choice(["", "/x", "/y", "/x_1"]) for _ in range(3)} - {""})
        ours = NameAllocator(_model(existing), frozen=frozen)
        plain = _PlainAllocator({*existing, "x", "g"} | {f"node{i}" for i in range(len(existing))})
        for step in range(steps):
            prefix = rng.choice(parts)
            draw = rng.random()
            if draw < 0.15:  # the stamps' claim: all of a family's names at once, or none
                hints = rng.choice(hint_sets)
                names = [prefix + h for h in hints]
                free = len(set(names)) == len(names) and not plain.used.intersection(names)
                claimed = ours.claim_family(prefix, hints)
                assert free or not claimed, (trial, step, names)
                if claimed:
                    plain.used.update(names)
            elif draw < 0.7:
                hints = rng.choice(hint_sets)
                assert ours.fresh_all(prefix, hints) == plain.fresh_all(prefix, hints), (trial, step)
            else:
                base = prefix + rng.choice(["/x", "/y", "/x_1", "", "/q"])
                if base:
                    assert ours.fresh(base) == plain.fresh(base), (trial, step, base)


@pytest.mark.parametrize("frozen", [False, True])
def test_families_take_the_names_a_plain_set_would(frozen):
    """``frozen``: the model's names kept as hashes, read again on a hit (what the engine uses)."""
    assert_families_match_a_plain_set(random.Random(7), 300, 40, frozen=frozen)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_stamped_family_and_a_clashing_prefix(frozen):
    names = NameAllocator(_model(["p/x"]), frozen=frozen)
    assert names.fresh_all("n", ["/x", "/y"]) == (["n/x", "n/y"], False)
    assert names.fresh_all("n", ["/x", "/y"]) == (["n/x_1", "n/y_1"], True)
    assert names.fresh("n/x") == "n/x_2"
    assert names.fresh("n/z") == "n/z"
    assert names.fresh_all("p", ["/x", "/y"]) == (["p/x_1", "p/y"], True)


def test_frozen_names_are_read_only_on_a_hash_hit():
    """Kept as hashes, the model's names are read into a set only when a drawn name hits one."""
    names = NameAllocator(_model(["p/x", "q"]), frozen=True)
    assert names.fresh_all("n", ["/x", "/y"]) == (["n/x", "n/y"], False)
    assert names.fresh("r") == "r"
    assert names._exact is None
    assert names.fresh("q") == "q_1"
    assert names._exact is not None and "p/x" in names._exact


def test_frozen_names_past_a_chunk_of_unnamed_nodes_are_taken():
    """The model's names are hashed in chunks: a chunk of nothing but unnamed nodes ends none early."""
    nodes = [helper.make_node("Relu", ["x"], [f"v{i}"]) for i in range(5000)]
    nodes.append(helper.make_node("Relu", ["x"], ["last/y"], name="last"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("last/y", TensorProto.FLOAT, [1])
    names = NameAllocator(helper.make_model(helper.make_graph(nodes, "g", [x], [y])), frozen=True)
    assert names.fresh("last") == "last_1"
    assert names.fresh_all("last", ["/y", "/z"]) == (["last/y_1", "last/z"], True)
    assert names.fresh("v4999") == "v4999_1"
