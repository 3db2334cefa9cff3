"""Put a model's nodes into topological order, stably, when a producer left them out of it.

ONNX requires every graph's nodes to be topologically sorted, and onnx's checker refuses a model
whose nodes are not; onnxruntime sorts them itself and runs such a model (AMD Quark's XINT8
output is one). A rewrite must accept what the runtime accepts, so models are sorted on load:

- On load this runs only when onnx's checker (which runs anyway, in C++) says the order is broken
  (:func:`onnx_qrewrite.io.model_io.check_input_model`): a sorted model pays nothing. Where the checker
  does not run (``onnx_ir`` models, protos too big to check in memory) :func:`sort_model` is called
  directly: one pass over each graph checks the order (every input produced before it is read),
  and a sorted graph is never modified.
- An unsorted graph is sorted with Kahn's algorithm taking the lowest original index among the
  ready nodes, so the original order is kept wherever it is already valid.
- A node depends on its inputs and on the names its subgraphs (If/Loop/Scan bodies, at any depth)
  read from this graph; subgraphs and model-local functions are sorted the same way.
- A name that nothing provides (no node, graph input, initializer or enclosing scope) and a cycle
  stay invalid models: :class:`InvalidModelError`, one line naming the node.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.rewriter.graph import _STANDARD_CONTROL_FLOW, subgraphs

__all__ = ["outer_reads", "sort_model"]

_Graph = onnx.GraphProto | onnx.FunctionProto


def sort_model(model: onnx.ModelProto, label: str) -> int:
    """Sort every graph of ``model`` in place; the number of nodes that moved (0: it was sorted)."""
    moved = _sort_graph(model.graph, [], label, "main graph")
    for function in model.functions:
        moved += _sort_graph(function, [], label, f"function {function.domain}::{function.name}")
    return moved


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    # Standard ops other than control flow hold no graphs: skip reading their attributes (~1 us a node).
    if node.op_type not in _STANDARD_CONTROL_FLOW and node.domain in ("", "ai.onnx"):
        return
    for _, g in subgraphs(node):
        yield g


def _own_names(graph: _Graph) -> set[str]:
    """Names a graph provides before its first node: inputs and initializers (functions: inputs)."""
    if isinstance(graph, onnx.FunctionProto):
        return set(graph.input)
    names = {v.name for v in graph.input}
    names.update(t.name for t in graph.initializer)
    names.update(t.values.name for t in graph.sparse_initializer)
    return names


def _visible(name: str, scopes: Sequence[set[str]]) -> bool:
    return any(name in s for s in scopes)


def _free_names(graph: onnx.GraphProto) -> set[str]:
    """Names ``graph`` (and its own subgraphs) reads but does not define, in whatever order its
    nodes are: what it takes from the enclosing scopes."""
    defined = _own_names(graph)
    for node in graph.node:
        defined.update(node.output)
    free: set[str] = set()
    for node in graph.node:
        free.update(n for n in node.input if n and n not in defined)
        for sub in _subgraphs(node):
            free.update(n for n in _free_names(sub) if n not in defined)
    return free


def outer_reads(node: onnx.NodeProto) -> set[str]:
    """Names the subgraphs of ``node`` (at any depth) read from the scopes around them."""
    found: set[str] = set()
    for sub in _subgraphs(node):
        found |= _free_names(sub)
    return found


def _reads(node: onnx.NodeProto) -> Iterable[str]:
    """Every name ``node`` needs before it runs: its inputs and what its subgraphs read from outside."""
    yield from (n for n in node.input if n)
    for sub in _subgraphs(node):
        yield from _free_names(sub)


def _sort_graph(graph: _Graph, outer: list[set[str]], label: str, where: str) -> int:
    """Check (and if needed sort) ``graph``, whose enclosing scopes provide ``outer``, then its
    subgraphs, each seeing the names produced before its node; the number of nodes moved."""
    in_order, nested = _in_order(graph, outer)
    moved = 0 if in_order else _kahn(graph, outer, label, where)
    if nested:
        available = _own_names(graph)
        scopes = [available, *outer]
        for node in graph.node:
            for sub in _subgraphs(node):
                moved += _sort_graph(sub, scopes, label, f"a subgraph of node {_name(node)}")
            available.update(node.output)
    return moved


def _in_order(graph: _Graph, outer: list[set[str]]) -> tuple[bool, bool]:
    """Whether every node reads only names provided before it, and whether any node holds subgraphs
    (True when the order is broken: the subgraphs are then looked at after sorting)."""
    available = _own_names(graph)
    scopes = [available, *outer]
    nested = False
    for node in graph.node:
        if any(n and not _visible(n, scopes) for n in node.input):
            return False, True
        for sub in _subgraphs(node):
            nested = True
            if any(not _visible(n, scopes) for n in _free_names(sub)):
                return False, True
        available.update(node.output)
    return True, nested


def _name(node: onnx.NodeProto) -> str:
    return repr(node.name) if node.name else f"<unnamed {node.op_type}>"


def _kahn(graph: _Graph, outer: list[set[str]], label: str, where: str) -> int:
    """Stable topological sort of ``graph.node``: the lowest original index among the ready nodes."""
    nodes = list(graph.node)
    own = _own_names(graph)
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            if out:
                producer.setdefault(out, i)
    waiting = [0] * len(nodes)
    readers: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for name in set(_reads(node)):
            if name in own:
                continue
            j = producer.get(name)
            if j is None:
                if _visible(name, outer):
                    continue
                raise InvalidModelError(
                    f"{label}: node {_name(node)} ({node.op_type}, {where}) reads {name!r}, which no node, "
                    "graph input or initializer provides"
                )
            if j == i:
                raise InvalidModelError(
                    f"{label}: node {_name(node)} ({node.op_type}, {where}) reads its own output {name!r}"
                )
            waiting[i] += 1
            readers[j].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for k in readers[i]:
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, k)
    if len(order) < len(nodes):
        stuck = next(i for i, w in enumerate(waiting) if w)
        raise InvalidModelError(
            f"{label}: node {_name(nodes[stuck])} ({nodes[stuck].op_type}, {where}) is on a cycle: its inputs "
            "depend on its own output"
        )
    moved = sum(1 for position, i in enumerate(order) if position != i)
    sorted_nodes = [nodes[i] for i in order]
    del graph.node[:]
    graph.node.extend(sorted_nodes)
    return moved
