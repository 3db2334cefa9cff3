"""The hash-keyed indexes of rewriter/graph.py under real collisions.

``_Producers`` (output name -> producing node) and a frozen ``NameAllocator`` (the model's names)
keep only the names' 64-bit hashes and confirm a hit against the names themselves, because two
names may share a hash. With Python's string hash that practically never happens in a test, so the
confirm paths would go unexercised: here the module's ``hash`` is replaced with a 2-bit one (every
name shares its hash with a quarter of the others) and the answers must still be a plain dict's and
a plain set's.
"""

from __future__ import annotations

import random
import zlib

import pytest
from onnx import helper
from test_name_allocator import _model, assert_families_match_a_plain_set

from onnx_qrewrite.rewriter import graph
from onnx_qrewrite.rewriter.graph import NameAllocator, _Producers


def _two_bit_hash(value: object) -> int:
    """Deterministic, and only four values: collisions on almost every lookup."""
    return zlib.crc32(str(value).encode()) & 3


@pytest.fixture
def colliding(monkeypatch):
    # graph.py calls the builtin by its bare name: a module global of that name is found first.
    monkeypatch.setattr(graph, "hash", _two_bit_hash, raising=False)
    return _two_bit_hash


def _nodes(rng: random.Random, count: int) -> list:
    """Nodes writing one to three outputs drawn from a small pool: names repeat across nodes (not
    SSA: the last writer wins, as a dict built in node order), and some optional outputs are absent."""
    pool = [f"v{i}" for i in range(40)] + ["a/b", "a/c", "b"]
    nodes = []
    for i in range(count):
        outputs = [rng.choice([*pool, ""]) for _ in range(rng.randint(1, 3))]
        nodes.append(helper.make_node("Identity", ["x"], outputs, name=f"n{i}"))
    return nodes


def test_producers_answer_as_a_dict_when_hashes_collide(colliding):
    rng = random.Random(11)
    for trial in range(30):
        nodes = _nodes(rng, rng.randint(0, 60))
        plain = {name: node for node in nodes for name in node.output if name}
        index = _Producers.of_nodes(nodes)
        if len(plain) > 4:  # the collisions are real: many names, at most four hashes
            assert len(set(index.hashes.tolist())) <= 4 < len(index.hashes)
        queries = [*plain, "v99", "a", "a/d", "x", ""]
        rng.shuffle(queries)
        for name in queries * 2:  # twice: the second answer comes from the recent-lookups cache
            assert index.find(name, nodes) is plain.get(name), (trial, name)
            assert index._find(name, nodes) is plain.get(name), (trial, name)


def test_producers_keep_node_order_among_equal_hashes(colliding):
    """Equal hashes stay in node order (stable sort), so scanning them from the last finds the
    last writer of a repeated name, even when other names of that hash come after it."""
    names = ["p", "q", "r", "s", "t", "u", "v", "w"]
    same = [n for n in names if colliding(n) == colliding("p")]
    assert len(same) >= 2, same  # the fixture's hash really puts several of these together
    nodes = [helper.make_node("Identity", ["x"], [n]) for n in [*names, "p", *same[1:]]]
    plain = {name: node for node in nodes for name in node.output}
    index = _Producers.of_nodes(nodes)
    assert all(index._find(n, nodes) is plain[n] for n in names)


def test_unique_index_confirms_a_hit_against_the_names(colliding):
    """An SSA node list whose outputs' hashes all differ takes :meth:`_Producers._find`'s unique
    path (one candidate per hash, found by bisection): a name that is no output but shares an
    output's hash must still be answered None, and each output its own writer."""
    by_hash: dict[int, str] = {}
    for i in range(64):  # one output name per 2-bit hash value
        by_hash.setdefault(colliding(f"o{i}"), f"o{i}")
    outputs = sorted(by_hash.values())
    nodes = [helper.make_node("Identity", ["x"], [name], name=f"n{k}") for k, name in enumerate(outputs)]
    index = _Producers.of_nodes(nodes)
    assert index.unique and len(index.hashes) == 4
    strangers = [f"s{i}" for i in range(20)]  # no output has these names; each shares a hash with one
    assert {colliding(s) for s in strangers} <= set(by_hash)
    for name in outputs:
        assert index._find(name, nodes) is nodes[outputs.index(name)], name
    for name in [*strangers, "", "x"]:
        assert index._find(name, nodes) is None, name
        assert index.find(name, nodes) is None, name
    # The search for many names at once (matching's bulk questions) confirms the same way,
    # whether the writers' outputs are read from the nodes or handed over by the caller.
    asked = [*outputs, *strangers, "", "x", *reversed(outputs)]
    expected = [outputs.index(n) if n in outputs else -1 for n in asked]
    assert index.writers_of(asked, nodes, {}) == expected
    handed = {k: (name,) for k, name in enumerate(outputs)}
    assert index.writers_of(asked, nodes, handed) == expected


def test_unique_index_of_a_multi_output_node_remembers_its_outputs():
    """A node found through the index, in an SSA list, is remembered for all its outputs (the
    unique path does what the general one does)."""
    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("DynamicQuantizeLinear", ["a"], ["q", "", "zp"]),
    ]
    index = _Producers.of_nodes(nodes)
    assert index.unique
    assert index._find("q", nodes) is nodes[1]
    assert index.recent == {"q": nodes[1], "zp": nodes[1]}
    assert index._find("a", nodes) is nodes[0] and index._find("", nodes) is None


def test_frozen_name_allocator_answers_as_a_set_when_hashes_collide(colliding):
    model = _model(["p/x", "q", "r/y_1"])
    names = NameAllocator(model, frozen=True)
    everything = {"p/x", "q", "r/y_1", "x"} | {f"node{i}" for i in range(3)}  # values and node names
    absent = ["nope", "p/y", "q_1", "r/y", "zz", "node3"]
    assert any(colliding(a) in {colliding(n) for n in everything} for a in absent)
    for name in [*everything, *absent]:
        assert names._in_model(name) == (name in everything), name
    assert names._exact == everything  # a hit read the names; the set is the model's, no more


@pytest.mark.parametrize("seed", [3, 7])
def test_frozen_families_take_the_names_a_plain_set_would_under_collisions(colliding, seed):
    """test_name_allocator's randomized comparison, with every draw hitting some hash."""
    assert_families_match_a_plain_set(random.Random(seed), 150, 30, frozen=True)


def test_the_patch_reaches_the_index(colliding):
    """Guard: were graph.py to stop calling ``hash`` by its bare name, the tests above would test
    Python's hash again without saying so."""
    index = _Producers.of_nodes([helper.make_node("Identity", ["x"], [f"v{i}"]) for i in range(50)])
    assert set(index.hashes.tolist()) <= {0, 1, 2, 3}
