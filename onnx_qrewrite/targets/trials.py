"""Trials of a stage on the whole model, for what weighing node by node cannot find: a removal
rule tried with its readers' rules (:func:`try_removals`), each listing of the profile's forms
(:func:`try_forms`), and refused nodes left to the next stage (:func:`try_deferring`). Each is
kept only if the target then refuses less."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import onnx

from onnx_qrewrite.rewriter.catalogue import Rule
from onnx_qrewrite.rewriter.contract import UNREAD
from onnx_qrewrite.rewriter.graph import iter_scopes
from onnx_qrewrite.targets.check import Refused
from onnx_qrewrite.targets.target_rules import RANK, listed_as

if TYPE_CHECKING:
    from onnx_qrewrite.targets.stages import Node, StageRuns, State


_SUBGRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def removes(rule: Rule) -> bool:
    """Whether ``rule`` removes the node it matches (its builder declares every output unread,
    contract.UNREAD): the engine removes it only once nothing reads it (``Plan.remove_if_dead``),
    so weighed node by node, its readers as they are, it never applies."""
    types = rule.contract.output_types
    return types is not None and all(types(rule.options, ref.op) == (UNREAD,) for ref in rule.match)


def try_removals(
    runs: StageRuns, choice: dict[tuple[str, int], tuple[str, ...]], state: State
) -> tuple[dict[tuple[str, int], tuple[str, ...]], State]:
    """Refused nodes left as they are that a removal rule (:func:`removes`) would remove once
    their readers no longer read them: qdq-to-float-drop-q removes a QuantizeLinear whose
    DequantizeLinear readers qdq-to-float-drop-dq rewrites (accepted readers, which the node's own
    choice leaves as they are). Tried together: each such node with its removal rules, each of its
    readers left as it is with its weighed rules of the same builder that leave it no more refused;
    kept if the target then refuses less. A node with a reader no such rule rewrites is not tried
    (it stays refused, and ``inspect`` names it)."""
    trial = dict(choice)
    readers: _Readers | None = None
    for node in runs.nodes:
        if not node.refused or choice[node.key]:
            continue
        removals = [r for r in node.candidates if removes(runs.ctx.rules[r])]
        if not removals:
            continue
        readers = readers or _Readers(runs)
        partners = readers.rules(node, removals, choice)
        if partners is not None:
            trial[node.key] = tuple(removals)
            trial.update(partners)
    if trial == choice:
        return choice, state
    tried = runs.settle(trial)
    return (trial, tried) if len(tried.after) < len(state.after) else (choice, state)


class _Readers:
    """Who reads each value of a stage's model (per scope, from its index :meth:`Scope.reads`; the
    scope's outputs and nodes holding subgraphs as readers no rule rewrites), and which of its rules
    a removal's readers would need. Reads inside a subgraph are not counted: a trial that would
    remove a node read there only costs a settle, as the engine keeps that node
    (``Plan.remove_if_dead``)."""

    def __init__(self, runs: StageRuns) -> None:
        self.runs = runs
        self.by_key = {n.key: n for n in runs.nodes}
        self.nodes: dict[str, Any] = {}
        #: (scope, value) -> indices of the nodes reading it; -1 for a reader no rule may rewrite.
        self.of: dict[tuple[str, str], list[int]] = {}
        for scope in iter_scopes(runs.model):
            container = scope.container
            nodes = self.nodes[scope.path] = container.node
            outputs = [o.name for o in container.output] if isinstance(container, onnx.GraphProto) else container.output
            for name in outputs:
                self.of.setdefault((scope.path, name), []).append(-1)
            opaque: dict[int, bool] = {}
            for name, reads in scope.reads().items():
                at = self.of.setdefault((scope.path, name), [])
                for index, slot in reads:
                    if slot < 0:
                        continue
                    if index not in opaque:
                        opaque[index] = any(a.type in _SUBGRAPHS for a in nodes[index].attribute)
                    at.append(-1 if opaque[index] else index)

    def rules(
        self, node: Node, removals: list[str], choice: dict[tuple[str, int], tuple[str, ...]]
    ) -> dict[tuple[str, int], tuple[str, ...]] | None:
        """Per reader of ``node``'s outputs, its weighed rules of the removal rules' builders that
        leave it no more refused than it is; None when a reader has none, or another rule is chosen
        for it, or it is the scope's output or a subgraph: then nothing removes the node."""
        path, index = node.key
        rules_of = self.runs.ctx.rules
        builders = {rules_of[r].builder for r in removals}
        out: dict[tuple[str, int], tuple[str, ...]] = {}
        for name in self.nodes[path][index].output:
            for at in self.of.get((path, name), []) if name else []:
                reader = self.by_key.get((path, at))
                if reader is None or choice[reader.key]:
                    return None
                weighed = reader.outcome
                fits = [r for r in reader.candidates if rules_of[r].builder in builders and r in weighed]
                rules = tuple(r for r in fits if weighed[r] <= reader.refused)
                if not rules:
                    return None
                out[reader.key] = rules
        return out or None


def try_forms(
    runs: StageRuns, choice: dict[tuple[str, int], tuple[str, ...]], state: State, applied: set[str]
) -> tuple[dict[tuple[str, int], tuple[str, ...]], State, dict[str, tuple[list[Refused], int]]]:
    """The form stage (first stage only: later stages rewrite refused nodes only): a form whose
    rules rewrite patterns (anchored at a node the target accepts, removing the refused ones it
    reads) cannot be weighed node by node, so each listing is tried on the whole model, each of
    its rules first where it matches and the choice so far after it; it is kept if the target then
    refuses less. Returns the choice, its state, and per listing the refused nodes with it and
    their number without it (for the account); ``applied`` gains the rules the trials used."""
    trials: dict[str, tuple[list[Refused], int]] = {}
    ctx = runs.ctx
    forms = ctx.profile.forms if runs.depth == 0 else ()
    for index in sorted(range(len(forms)), key=lambda i: RANK[forms[i].allow]):  # stable
        request = forms[index]
        trial = dict(choice)
        for n in runs.nodes:
            if any(ctx.form_of.get(r) == request.name for r in choice[n.key]):
                continue  # an earlier listing of the same form already rewrites it
            mine = [r for r in n.form_rules if ctx.listing.get(r) == index and r not in choice[n.key]]
            if mine:
                trial[n.key] = (*mine, *choice[n.key])
        if trial == choice:
            continue
        tried_state = runs.settle(trial)
        for report in tried_state.reports[:1]:
            applied.update(rw.rule for rw in report.rewrites)
        trials[listed_as(request)] = (tried_state.after, len(state.after))
        if len(tried_state.after) < len(state.after):
            choice, state = trial, tried_state
    return choice, state, trials


def try_deferring(
    runs: StageRuns, choice: dict[tuple[str, int], tuple[str, ...]], state: State
) -> tuple[dict[tuple[str, int], tuple[str, ...]], State]:
    """The choice with the :func:`deferrable` nodes left as they are for the next stage, when
    the target then refuses less; else the choice as it was."""
    deferred = deferrable(runs.model, runs.nodes, choice)
    if not deferred:
        return choice, state
    trial = {**choice, **dict.fromkeys(deferred, ())}
    tried_state = runs.settle(trial)
    if len(tried_state.after) < len(state.after):
        return trial, tried_state
    return choice, state


def deferrable(
    model: onnx.ModelProto, nodes: list[Node], choice: dict[tuple[str, int], tuple[str, ...]]
) -> list[tuple[str, int]]:
    """Refused nodes worth leaving to the next stage: the first stage rewrites one of their
    producers, and one of their rules did not apply to the node as it is, so it may apply to what
    that producer becomes (a DequantizeLinear reading a QLinear op's output: once the op is lowered
    it reads a QuantizeLinear, and the float emulation's pair rule takes the two; rewriting the
    DequantizeLinear alone in the first stage leaves that QuantizeLinear's uint8 output refused)."""
    rewritten: set[tuple[str, str]] = set()
    by_key = {n.key: n for n in nodes}
    scopes = {scope.path: scope for scope in iter_scopes(model)}
    for key, rules in choice.items():
        if rules:
            rewritten.update((key[0], out) for out in scopes[key[0]].container.node[key[1]].output if out)
    out = []
    for key, rules in choice.items():
        node = by_key[key]
        if not rules or not node.refused or all(r in node.outcome for r in node.candidates):
            continue
        proto = scopes[key[0]].container.node[key[1]]
        if any((key[0], name) in rewritten for name in proto.input if name):
            out.append(key)
    return out
