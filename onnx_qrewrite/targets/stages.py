"""The plan's stages: per stage, every node some rule matches with its candidate rules, each choice
run once by the engine and checked against the target, weighed node by node and settled together;
each first-stage choice followed by the later stages it makes possible (up to :data:`MAX_STAGES`),
so a rule whose replacement needs another rule is judged by where the chain ends. The trials on
the whole model (removals, forms, deferring) are :mod:`.trials`."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import onnx

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule
from onnx_qrewrite.rewriter.graph import iter_scopes
from onnx_qrewrite.targets.check import Refused, node_label
from onnx_qrewrite.targets.lower_opset import check_for_target
from onnx_qrewrite.targets.profile import TargetProfile
from onnx_qrewrite.targets.target_rules import RANK, engine_options
from onnx_qrewrite.targets.trials import try_deferring, try_forms, try_removals

_AS_IS = 1  # the rank of leaving a node as it is, between exact and bounded (target_rules.RANK)


def _rewrite(model: onnx.ModelProto, catalogue: Catalogue, external: Any, options: Any) -> tuple[Any, Any, Any]:
    from onnx_qrewrite.errors import LoweringError
    from onnx_qrewrite.io.encoded import to_proto
    from onnx_qrewrite.rewriter import engine

    try:
        out, report = engine.run(copy.deepcopy(model), catalogue, options, external)
    except LoweringError:
        if options.keep_opset:
            raise
        # Raising the opset failed: plan with the opset kept, as `inspect` does.
        options = dataclasses.replace(options, keep_opset=True, target_opset=None)
        out, report = engine.run(copy.deepcopy(model), catalogue, options, external)
    return to_proto(out), report, options


@dataclass
class Node:
    """One node of the input model, as the engine (``key``, ``site``) and the check (``label``)
    name it, with the choices the plan weighs for it."""

    key: tuple[str, int]  # (scope path, index in its scope): EngineOptions.node_rules
    site: str  # how the engine's report names it (builders.Site.label)
    label: str  # how check_model names it
    refused: int  # refusals of the node as it is (0 or 1)
    candidates: list[str]
    form_rules: list[str]  # every rule of the profile's forms that matches it (the form stage)
    outcome: dict[str, int] = dataclasses.field(default_factory=dict)  # rule -> refused nodes it leaves
    #: rule -> those refused nodes, for the account.
    left: dict[str, tuple[Refused, ...]] = dataclasses.field(default_factory=dict)
    #: rule -> why it did not rewrite the node when tried (the engine's reason), for the account.
    declined: dict[str, str] = dataclasses.field(default_factory=dict)


def _nodes(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    usable: set[str],
    forms: set[str],
    refused: set[tuple[str, str]],
    refused_only: bool = False,
) -> list[Node]:
    """Every node some rule matches, with the rules usable on it: form rules only for nodes the
    target refuses as they are (and, in a later stage, any rule only for those, and form rules for
    the nodes that read what they write: a pattern rule anchored at an accepted reader, such as
    the float emulation's Q -> DQ pair anchored at the DequantizeLinear, is what removes a refused
    QuantizeLinear an earlier stage emitted)."""
    nodes = []
    for scope in iter_scopes(model):
        feeds = _refused_outputs(scope, refused) if refused_only else set()
        for index, node in enumerate(scope.container.node):
            matching = catalogue.candidates(node.domain, node.op_type)
            if not matching:
                continue
            rules = [r for r in matching if r.id in usable]
            name = node.name or (
                f"<unnamed {node.op_type} -> {node.output[0]}>" if node.output else f"<unnamed {node.op_type}>"
            )
            site = name if scope.path == "main" else f"{name} (in {scope.path})"
            label = node_label(node)
            is_refused = int((scope.path, label) in refused)
            in_forms = [r.id for r in rules if r.id in forms]
            if not is_refused and refused_only:
                rules = [r for r in rules if r.id in forms] if feeds.intersection(node.input) else []
            elif not is_refused:
                rules = [r for r in rules if r.id not in forms]
            rules.sort(key=lambda r: RANK[r.exactness])  # stable: catalogue order within a level
            # Listed even without candidates: then no rule may touch it (node_rules ()).
            nodes.append(Node((scope.path, index), site, label, is_refused, [r.id for r in rules], in_forms))
    return nodes


def _refused_outputs(scope: Any, refused: set[tuple[str, str]]) -> set[str]:
    """The values the nodes of ``scope`` the target refuses write."""
    out: set[str] = set()
    for node in scope.container.node:
        if (scope.path, node_label(node)) in refused:
            out.update(name for name in node.output if name)
    return out


#: How many stages a plan may have: a later stage applies rules to what earlier ones emitted (a
#: QOperator lowering's QuantizeLinear the target needs emulated, say). A later stage rewrites only
#: nodes the target refuses and is kept only if it leaves fewer of them, so stages never loop.
MAX_STAGES = 3


@dataclass
class State:
    """One rewrite tried: the model after its last stage, each stage's report and engine options
    (the first stage's node choice, then the later stages the plan chose on top of it), and what
    the target refuses of the result."""

    rewritten: onnx.ModelProto
    reports: list[Any]
    options: list[Any]
    after: list[Refused]
    #: ``rewritten``'s digest (:func:`_digest`): the key of its check and of the stages after it.
    digest: bytes


def stage_input(model: onnx.ModelProto) -> onnx.ModelProto:
    """What a later stage rewrites: the stage before's output with the types of the values it
    created recorded (onnx's shape inference, as ``check_model`` runs it: rules such as the float
    emulation need the element type of what they read). ``rewrite --target`` does the same between
    stages, so the plan and the rewrite see the same model."""
    from onnx_qrewrite.targets.check import _inferred

    return _inferred(model)


def replacements(reports: list[Any]) -> list[dict[tuple[str, str], Any]]:
    """Per stage: (scope, engine label) of each node it rewrote -> that rewrite."""
    return [{(rw.scope, rw.node): rw for rw in report.rewrites} for report in reports]


def through(scope: str, names: Any, stages: list[dict[tuple[str, str], Any]]) -> tuple[list[str], list[Any]]:
    """What the nodes ``names`` became through ``stages`` (later rewrites replace them by what
    they create; removals drop them), and the rewrites that did it."""
    current, used = list(names), []
    for replaced in stages:
        following: list[str] = []
        for name in current:
            rw = replaced.get((scope, name if scope == "main" else f"{name} (in {scope})"))
            if rw is None:
                following.append(name)
            else:
                used.append(rw)
                following.extend(rw.created_nodes)
        current = following
    return current, used


def left_refused(state: State) -> dict[tuple[str, str], list[Refused]]:
    """Per node the first stage rewrote (scope, engine label): the refusals of the nodes replacing
    it, after the later stages (their number weighs the choice; their names, ops and reasons are
    what ``inspect`` says the choice left)."""
    refused = {(r.scope, r.node): r for r in state.after}
    later = replacements(state.reports[1:])
    out = {}
    for rw in state.reports[0].rewrites:
        final, _ = through(rw.scope, rw.created_nodes, later)
        out[(rw.scope, rw.node)] = [refused[(rw.scope, name)] for name in final if (rw.scope, name) in refused]
    return out


def _preference(choice: str | None, left: int, rank: int, order: int) -> tuple[int, ...]:
    if left == 0:
        return (0, 0, rank, order)
    return (1, left, 0 if choice is None else 1, rank, order)


@dataclass
class Context:
    """What every stage of one plan shares."""

    profile: TargetProfile
    catalogue: Catalogue
    rules: dict[str, Rule]
    usable: set[str]
    form_of: dict[str, str]
    listing: dict[str, int]
    levels: set[str]
    external: Any
    target_opset: int | None
    keep_opset: bool

    @property
    def may_lower(self) -> bool:
        """Whether the plan may lower the opset to the target's (lower_opset.py): not when the user
        keeps or chooses the opset."""
        return not self.keep_opset and self.target_opset is None

    #: (scope, engine label) -> rule -> (stage, why it did not apply there): the deepest stage
    #: that tried it, whose model is the most rewritten (inspect says why a rule was not used).
    why: dict[tuple[str, str], dict[str, tuple[int, str]]] = dataclasses.field(default_factory=dict)
    #: A model's digest -> what the target refuses of it (:func:`_checked`).
    checked: dict[bytes, list[Refused]] = dataclasses.field(default_factory=dict)
    #: (depth, a stage's output digest) -> the later stages planned on it (:func:`_follow`).
    follows: dict[tuple[int, bytes], State] = dataclasses.field(default_factory=dict)


@dataclass
class Stage:
    state: State
    nodes: list[Node]
    trials: dict[str, tuple[list[Refused], int]]  # listing -> what the target refuses with it, without it
    applied: set[str]
    why: dict[tuple[str, str], dict[str, tuple[int, str]]] = dataclasses.field(default_factory=dict)


def _may_follow(state: State, ctx: Context) -> bool:
    """A later stage is worth planning when a stage rewrote something, the target refuses some of
    what it emitted, and some usable rule matches a node the target still refuses."""
    if not state.reports[-1].rewrites or not any(x.rule for x in state.after):
        return False  # nothing rewritten, or nothing refused that a rewrite emitted
    return any(
        r.id in ctx.usable for x in state.after if x.node != "(model)" for r in ctx.catalogue.candidates(x.domain, x.op)
    )


def plan_stage(model: onnx.ModelProto, ctx: Context, depth: int, before: list[Refused]) -> Stage:
    """Plan one stage on ``model`` (the input, or what the stages before emitted), each rewrite it
    tries followed by the later stages it makes possible (up to MAX_STAGES), so a rule whose
    replacement needs another rule is judged by where the chain ends.

    In steps: weigh each node's candidates (:func:`_weigh`), choose per node (:func:`_best`) and
    settle the choices together; then try the profile's forms on the whole model
    (:func:`try_forms`) and, in the first stage, leaving some refused nodes to the next stage
    (:func:`try_deferring`); never keep a choice that leaves more refused than ``before``."""
    refused_now = {(r.scope, r.node) for r in before}
    nodes = _nodes(model, ctx.catalogue, ctx.usable, set(ctx.form_of), refused_now, refused_only=depth > 0)
    runs = StageRuns(model, ctx, depth, nodes)
    applied = _weigh(runs)
    chosen = {n.key: _best(n, ctx.rules) for n in nodes}
    choice: dict[tuple[str, int], tuple[str, ...]] = {k: (c,) if c else () for k, c in chosen.items()}
    state = runs.settle(choice)
    choice, state = try_removals(runs, choice, state)
    choice, state, trials = try_forms(runs, choice, state, applied)
    if depth == 0 and state.after and MAX_STAGES > 1:
        choice, state = try_deferring(runs, choice, state)
    if len(state.after) > len(before):  # never make things worse, whatever the interactions
        state = runs.run(dict.fromkeys(choice, ()))
    elif depth > 0:  # a later stage's choice, then the stages after it
        state = _follow(state, ctx, depth, runs.inferred_of.get(state.digest))
    return Stage(state, nodes, trials, applied, ctx.why)


class StageRuns:
    """The rewrites one stage tries on its model, each node choice run once: the engine with that
    choice, the target's check of what it wrote and, in the first stage, the later stages it
    makes possible. The weighing, the settling and the trials ask for the same choices again."""

    def __init__(self, model: onnx.ModelProto, ctx: Context, depth: int, nodes: list[Node]) -> None:
        self.model, self.ctx, self.depth, self.nodes = model, ctx, depth, nodes
        self.by_site = {(n.key[0], n.site): n for n in nodes}
        self._tried: dict[tuple[Any, ...], State] = {}
        #: A later stage's models with inferred types (stage_input), by digest: the one the stage
        #: chooses is what the stage after it rewrites. Kept only while this stage is planned.
        self.inferred_of: dict[bytes, onnx.ModelProto] = {}

    def run(self, node_rules: dict[tuple[str, int], tuple[str, ...]]) -> State:
        """The stage's model rewritten with ``node_rules`` (a node not listed, or listed with no
        rule, stays as it is), checked, and in the first stage followed by the later stages."""
        key = tuple(sorted(node_rules.items()))
        if key in self._tried:
            return self._tried[key]
        ctx = self.ctx
        options = engine_options(
            ctx.profile,
            target_opset=ctx.target_opset,
            keep_opset=ctx.keep_opset,
            allow=ctx.levels,
            node_rules=dict(node_rules),
            later_stage=self.depth > 0,
        )
        rewritten, report, used = _rewrite(self.model, ctx.catalogue, ctx.external, options)
        _note_why(ctx.why, report, self.depth)
        digest = _digest(rewritten)
        after, inferred = _checked(rewritten, digest, ctx)
        state = State(rewritten, [report], [used], after, digest)
        if self.depth == 0:  # each choice of the first stage is judged with the stages it makes possible
            state = _follow(state, ctx, self.depth, inferred)
        elif inferred is not None and _may_follow(state, ctx):
            self.inferred_of[digest] = inferred
        self._tried[key] = state
        return state

    def settle(self, choice: dict[tuple[str, int], tuple[str, ...]]) -> State:
        """Apply the choices together and check again: what a rewrite leaves can depend on its
        neighbours' choices. A rewrite refused more than the node as it is gives way (its entry
        of ``choice`` becomes ())."""
        for _ in range(len(self.nodes) + 1):
            state = self.run(choice)
            worse = [
                self.by_site[key]
                for key, left in left_refused(state).items()
                if key in self.by_site and len(left) > self.by_site[key].refused
            ]
            if not worse:
                break
            for node in worse:
                choice[node.key] = ()
        return state


def _note_why(why: dict[tuple[str, str], dict[str, tuple[int, str]]], report: Any, depth: int) -> None:
    """Record in ``why`` (``Context.why``) the reason each rule gave for not rewriting a node,
    and, in a later stage, each rule that did: ``inspect`` then says that a rule the first stage
    could not apply applies only to what a later stage sees. The deepest stage's word wins."""
    for left in report.unlowered:
        known = why.setdefault((left.scope, left.node), {})
        for reason in left.reasons:
            rule_id, _, text = reason.partition(": ")
            if text and known.get(rule_id, (-1, ""))[0] <= depth:
                known[rule_id] = (depth, text)
    for done in report.rewrites if depth else ():  # a rule that applies only at a later stage
        known = why.setdefault((done.scope, done.node), {})
        if known.get(done.rule, (-1, ""))[0] <= depth:
            known[done.rule] = (depth, "")


def _weigh(runs: StageRuns) -> set[str]:
    """Try each node's k-th candidate, all nodes at once, and record per node what the target
    refuses of what each rule left (``outcome``) or why a rule did not apply (``declined``): one
    run per rank of candidate, not one per rule and node. The rules that rewrote something."""
    applied: set[str] = set()
    for k in range(max((len(n.candidates) for n in runs.nodes), default=0)):
        state = runs.run({n.key: tuple(n.candidates[k : k + 1]) for n in runs.nodes})
        leaves = left_refused(state)
        for rw in state.reports[0].rewrites:
            node = runs.by_site.get((rw.scope, rw.node))
            if node is not None and rw.rule in node.candidates:
                node.outcome[rw.rule] = len(leaves[(rw.scope, rw.node)])
                node.left[rw.rule] = tuple(leaves[(rw.scope, rw.node)])
                applied.add(rw.rule)
        for left in state.reports[0].unlowered:
            node = runs.by_site.get((left.scope, left.node))
            for reason in left.reasons if node is not None else ():
                rule_id, _, why = reason.partition(": ")
                if rule_id in node.candidates and why:  # type: ignore[union-attr]
                    node.declined.setdefault(rule_id, why)  # type: ignore[union-attr]
    return applied


def _best(node: Node, rules: dict[str, Rule]) -> str | None:
    """The node's choice by what each weighed candidate left (module docstring: no refusals
    first, then exact, as it is, bounded, approximate); None leaves it as it is."""
    options: list[tuple[tuple[int, ...], str | None]] = [(_preference(None, node.refused, _AS_IS, 0), None)]
    for order, rule_id in enumerate(node.candidates, 1):
        if rule_id in node.outcome:
            n = node.outcome[rule_id]
            options.append((_preference(rule_id, n, RANK[rules[rule_id].exactness], order), rule_id))
    return min(options, key=lambda o: o[0])[1]


def _follow(state: State, ctx: Context, depth: int, inferred: onnx.ModelProto | None = None) -> State:
    """``state`` followed by the next stage planned on what it wrote, when that leaves fewer
    refused nodes (and stages remain). Only the first stage weighs each of its choices this way;
    a later stage adds the next one to the choice it made, which bounds the plan's cost.
    ``inferred``: ``stage_input(state.rewritten)``, when the check just made it."""
    if depth + 1 >= MAX_STAGES or not state.after or not _may_follow(state, ctx):
        return state
    key = (depth, state.digest)
    follow = ctx.follows.get(key)
    if follow is None:  # the same model, reached by another choice, is planned the same way
        stage_model = inferred if inferred is not None else stage_input(state.rewritten)
        follow = ctx.follows[key] = plan_stage(stage_model, ctx, depth + 1, state.after).state
    if len(follow.after) >= len(state.after):
        return state
    reports, options = [*state.reports, *follow.reports], [*state.options, *follow.options]
    return State(follow.rewritten, reports, options, follow.after, follow.digest)


def _digest(model: onnx.ModelProto) -> bytes:
    """A key for a model's content (plans reach the same model by several choices)."""
    import hashlib

    return hashlib.sha256(model.SerializeToString(deterministic=True)).digest()


def _checked(model: onnx.ModelProto, digest: bytes, ctx: Context) -> tuple[list[Refused], onnx.ModelProto | None]:
    """What the target refuses of ``model`` (check_for_target), computed once per distinct model
    of the plan (``digest``): about half the rewrites a plan tries give a model another choice
    gave already (195 runs, 97 distinct models, planning the QOperator BERT for webgpu). With it,
    the first time, ``model`` with inferred types (stage_input's), which the caller may plan the
    next stage on. The plan does not keep that copy: it is as big as the model, beside the
    models the plan keeps already (kept per digest for the whole plan, the 6-layer QOperator BERT's
    plan for tensorrt peaked at 1.4 GB instead of 0.5 GB). The first stage plans the next on it at
    once; a later stage keeps it only while that stage is planned (``StageRuns.inferred_of``)."""
    refused = ctx.checked.get(digest)
    if refused is not None:
        return refused, None
    inferred = stage_input(model)
    refused = ctx.checked[digest] = check_for_target(model, ctx.profile, may_lower=ctx.may_lower, inferred=inferred)
    return refused, inferred
