"""What a target refuses in a model today, which rewrite would fix each refusal, and what it would
still refuse after the rewrite: the answer of ``inspect --target``, and the plan ``rewrite
--target`` applies.

The plan chooses per node, among leaving it as it is, each rule of the catalogue that matches it,
and (for nodes the target refuses as they are) each rule of the forms the profile names
(``[[rewrites.form]]``, within the consent it gives). Every candidate is tried by the engine itself
(a rewrite in memory) and its replacement checked against the profile, so ``inspect --target`` and
``rewrite`` cannot disagree. The choice, per node:

1. a choice after which the target refuses nothing of the node beats any that leaves refusals;
2. among those, exact rewrites first, then the node as it is, then bounded, then approximate
   rules: so a bounded or approximate rule runs only where the target needs it;
3. when every choice leaves refusals, the fewest refused nodes, the node as it is on a tie: a
   rewrite never turns an accepted node into refused ones, nor one refused node into more.

A removal rule (one that removes its node: qdq-to-float-drop-q, float-emulation-q-unread) applies
only once nothing reads the node (the engine decides, ``Plan.remove_if_dead``), so weighed node by
node it never applies: a refused node left as it is is tried with its removal rules together with
its readers' rules of the same builder (:func:`_try_removals`), and kept if the target then refuses
less; where a reader has no such rule, the node stays refused and is named.

Rules that rewrite only ops the profile lists under ``[rewrites] keep`` (ops it runs natively) are
left out. The chosen rewrites are then applied together and checked again; a rewrite whose result
is refused more than the node as it is gives way, and if the whole still has more refusals than
the original, nothing is rewritten.

Stages: a rule's replacement may itself need a rule (a QOperator lowering emits a QuantizeLinear
the target computes wrongly, which the float-emulation form fixes). Each rewrite the plan tries is
followed by a later stage planned the same way on what it wrote, restricted to the nodes the target
still refuses, and judged by where that chain ends; at most ``MAX_STAGES`` stages, each kept only
if it leaves fewer refused nodes, so a chain cannot loop. ``rewrite --target`` applies the stages
in turn (``TargetPlan.later``), and ``inspect --target`` names each rule of a node's chain.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Collection
from pathlib import Path
from typing import Any

import onnx

from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule
from onnx_qrewrite.rewriter.contract import UNREAD
from onnx_qrewrite.rewriter.graph import iter_scopes
from onnx_qrewrite.targets.check import Refused, check_model, node_label
from onnx_qrewrite.targets.lower_opset import check_for_target, lowering_for_target
from onnx_qrewrite.targets.profile import TargetProfile
from onnx_qrewrite.targets.shapes import InputShapes, apply_input_shapes

#: Preference between choices that leave the target nothing to refuse (lower first).
_RANK = {"exact": 0, "bounded": 2, "approximate": 3}
_AS_IS = 1

__all__ = [
    "NodeVerdict",
    "TargetPlan",
    "engine_options",
    "form_rules",
    "plan_for_model",
    "plan_for_target",
    "profile_rule_options",
    "target_catalogue",
]


@dataclasses.dataclass
class NodeVerdict:
    """One node of the original model that the target refuses, or that a rewrite would change
    into something the target refuses."""

    scope: str
    node: str
    op: str
    reasons: tuple[str, ...]  # why the target refuses it today (empty: it accepts it today)
    rule: str | None = None  # the rewrite that replaces it, if any
    exactness: str | None = None  # that rule's declared exactness, when the catalogue declares one
    after: tuple[str, ...] = ()  # why the target would still refuse what replaces it
    form: str | None = None  # the named form the rule comes from, when a profile's form
    #: The other choices the plan weighed for this node, in words ("dql-expand (exact): leaves 4
    #: refused nodes"): why the chosen one won.
    considered: tuple[str, ...] = ()
    #: Later stages' rewrites of what ``rule`` emitted ("float-emulation-q (exact) on n/Quantize"):
    #: the rule's replacement needed them. ``exactness`` is then the least exact of the chain.
    then: tuple[str, ...] = ()
    #: What the declared exactness does not cover on this target (float64 arithmetic it computes
    #: otherwise: profile [arithmetic]).
    caveats: tuple[str, ...] = ()
    #: Why a rule that would rewrite the node does not, when the profile set its options
    #: ([[rewrites.options]]) and still refuses the node: the profile's why (what to do instead).
    hint: str = ""
    #: Per weighed rule of ``considered`` that leaves refused nodes, those nodes in the words of
    #: ``after`` ("name (op): why"): what the count in its entry of ``considered`` stands for.
    weighed_left: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.after:
            return "refused after the rewrite" if self.reasons else "made worse by the rewrite"
        # Refused today, accepted after: by its own rule or by the rewrites of the nodes it reads
        # (a folded constant it adds, form static-shapes).
        return "fixed by the rewrite" if self.rule or self.reasons else "accepted"


@dataclasses.dataclass
class TargetPlan:
    model: str
    target: str
    target_version: str
    proof: str
    before: list[Refused]
    after: list[Refused]
    nodes: list[NodeVerdict]
    skipped_rules: dict[str, str]  # rule id -> why it is not used for this target
    #: Per form of the profile used here: its consent, how many nodes its rules rewrote, the least
    #: exact level among them, and why the profile names it.
    forms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: The rewrite for this target (in memory) and the rules that made it; not in to_dict().
    rewritten: onnx.ModelProto | None = dataclasses.field(default=None, repr=False)
    catalogue: Catalogue | None = dataclasses.field(default=None, repr=False)
    options: Any = dataclasses.field(default=None, repr=False)  # the engine options of that rewrite
    #: The engine options of each later stage, applied in turn to what the one before wrote (each
    #: one's node_rules index that model's nodes); empty for a one-stage plan.
    later: list[Any] = dataclasses.field(default_factory=list, repr=False)
    #: The default-domain opset lowered to the target's highest ({"from", "to", "why"}), exact
    #: node by node (lower_opset.py); ``rewritten`` is the lowered model.
    opset_lowering: dict[str, Any] | None = None
    #: The IR version lowered to the target's highest ({"from", "to", "why"}): the model uses
    #: nothing the versions in between added (lower_ir.py).
    ir_lowering: dict[str, Any] | None = None
    #: Rules of the rewrite that compute in float64, on a target that computes float64 otherwise
    #: ({"loss": in words, "rules": {rule: nodes with float64 outputs}}); None when none do.
    float64: dict[str, Any] | None = None
    #: The input shapes given (--input-shape) and the dimensions they fixed before planning, if any.
    input_shapes: dict[str, Any] | None = None
    #: Per catalogue rule the profile sets options of (``[[rewrites.options]]``): the profile's
    #: options ("profile"), those the plan used ("options"), those the user's own options set
    #: instead ("user": the user's values, which win), the profile's why and its source.
    rule_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: When the target would still refuse something and the profile has approximate forms that
    #: wait for the user's consent: what --allow-approximate would give ({"forms": [...],
    #: "refused_after": n, "first": why the first still refused node is}).
    with_consent: dict[str, Any] | None = None

    def refusal_error(self) -> str:
        """One line for ``rewrite --target`` when the target would still refuse something."""
        first = self.after[0]
        more = f" (and {len(self.after) - 1} more node(s); `inspect --target {self.target}` lists them)"
        at = (first.scope, first.node)
        hint = next((f"; {v.hint}" for v in self.nodes if (v.scope, v.node) == at and v.hint), "")
        return (
            f"{self.model}: target {self.target} would still refuse node {first.node} ({first.op_key}) "
            f"after the rewrite: {first.reasons[0]}{hint}{more if len(self.after) > 1 else ''}{self.consent_note()}"
        )

    def consent_note(self) -> str:
        """What --allow-approximate would change, in words ("" when nothing waits for it)."""
        c = self.with_consent
        if not c:
            return ""
        forms = ", ".join(c["forms"])
        if not c["refused_after"]:
            return f"; with --allow-approximate (form {forms}, approximate) it would refuse nothing"
        return (
            f"; with --allow-approximate (form {forms}, approximate) it would still refuse {c['refused_after']} "
            f"node(s): {c['first']}"
        )

    @property
    def refused_after(self) -> int:
        return len(self.after)

    @property
    def ok(self) -> bool:
        return not self.after

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "target": self.target,
            "target_version": self.target_version,
            "proof": self.proof,
            "refused_before": len(self.before),
            "refused_after": len(self.after),
            "ok": self.ok,
            "skipped_rules": self.skipped_rules,
            "forms": self.forms,
            "rule_options": self.rule_options,
            "with_consent": self.with_consent,
            "opset_lowering": self.opset_lowering,
            "ir_lowering": self.ir_lowering,
            "float64": self.float64,
            "input_shapes": self.input_shapes,
            "nodes": [{**dataclasses.asdict(n), "status": n.status} for n in self.nodes],
            "after": [dataclasses.asdict(r) for r in self.after],
        }


def target_catalogue(catalogue: Catalogue, profile: TargetProfile) -> tuple[Catalogue, dict[str, str]]:
    """The rules to use for ``profile``: without those that rewrite only ops it keeps, nor those
    it avoids."""
    skipped = {}
    for rule in catalogue:
        if rule.id in profile.avoid:
            skipped[rule.id] = (
                f"{profile.id} was seen not to run what it emits as onnxruntime does "
                f"{profile.cite(profile.rewrites_source)}"
            )
        elif rule.match and all(ref.domain in ("", "ai.onnx") and ref.op in profile.keep for ref in rule.match):
            ops = ", ".join(ref.op for ref in rule.match)
            skipped[rule.id] = f"{profile.id} runs {ops} natively {profile.cite(profile.rewrites_source)}"
    kept = [r.id for r in catalogue if r.id not in skipped]
    return catalogue.select(only=kept) if skipped else catalogue, skipped


def profile_rule_options(catalogue: Catalogue, profile: TargetProfile) -> tuple[Catalogue, dict[str, dict[str, Any]]]:
    """``catalogue`` with the options ``profile`` sets for its rules (``[[rewrites.options]]``),
    and per rule what was set. An option the user set for the rule (``--rule-option RULE.KEY=V``, the
    API's ``options=``: ``Rule.overridden``) wins over the profile's: the user asked for it by
    name, and the plan then judges the rule with it like any other. Rules not in ``catalogue``
    (``--skip``, ``--only``) get nothing."""
    from onnx_qrewrite.errors import UsageError

    rules = {r.id: r for r in catalogue}
    overrides: dict[str, dict[str, Any]] = {}
    said: dict[str, dict[str, Any]] = {}
    for entry in profile.rule_options:
        rule = rules.get(entry.rule)
        if rule is None:
            continue
        applied = {k: v for k, v in entry.options.items() if k not in rule.overridden}
        user = {k: rule.options[k] for k in entry.options if k in rule.overridden}
        if applied:
            overrides[entry.rule] = applied
        said[entry.rule] = {
            "profile": dict(entry.options),
            "options": applied,
            "user": user,
            "why": entry.why,
            "source": profile.cite(entry.source),
        }
    if not overrides:
        return catalogue, said
    try:
        return catalogue.with_options(overrides), said
    except UsageError as exc:  # the rule of that id is not the shipped one the profile was checked against
        raise UsageError(f"{profile.path}: target {profile.id!r}, [[rewrites.options]]: {exc}") from None


def form_rules(
    profile: TargetProfile, taken: Collection[str] = (), user_allow: Collection[str] | None = None
) -> tuple[list[Rule], dict[str, str], dict[str, int]]:
    """The rules of the forms ``profile`` names (``[[rewrites.form]]``), within each listing's
    consent and with its options; per rule the form it comes from, and the listing (index into
    ``profile.forms``: a form listed twice with different options is two listings). Rules whose id
    is in ``taken`` (the user added the form's file already) are not repeated. A listing with
    ``consent = "user"`` uses approximate rules only when ``user_allow`` has "approximate"."""
    rules: list[Rule] = []
    form_of: dict[str, str] = {}
    listing: dict[str, int] = {}
    user = set(user_allow) if user_allow is not None else set()
    for index, form in enumerate(profile.forms):
        allow = form.allow
        if form.consent == "user" and "approximate" not in user and _RANK[allow] > _RANK["bounded"]:
            allow = "bounded"
        for rule in form.rules():
            base_id = rule.id.split("[", 1)[0]
            if base_id in profile.avoid or rule.id in taken or rule.id in form_of:
                continue
            if _RANK[rule.exactness] <= _RANK[allow]:
                rules.append(rule)
                form_of[rule.id] = form.name
                listing[rule.id] = index
    return rules, form_of, listing


def withheld_forms(profile: TargetProfile, user_allow: Collection[str] | None) -> list[str]:
    """The listings whose approximate rules wait for the user's consent (--allow-approximate)."""
    user = set(user_allow) if user_allow is not None else set()
    return [
        f.name + (f"[{f.variant}]" if f.variant else "")
        for f in profile.forms
        if f.consent == "user" and f.allow == "approximate" and "approximate" not in user
    ]


def engine_options(
    profile: TargetProfile,
    *,
    target_opset: int | None = None,
    keep_opset: bool = False,
    allow: Collection[str] | None = None,
    node_rules: dict[tuple[str, int], tuple[str, ...]] | None = None,
    later_stage: bool = False,
) -> Any:
    """The engine's options for ``profile``: a rewrite never raises the opset above what the
    target loads (``[opset] max``), so rules that would need more give way to the next rule.
    Exactness levels as for any rewrite (exact first, bounded where no exact rule applies,
    approximate only when ``allow`` names it). ``later_stage``: the model holds an earlier stage's
    replacements, whose provenance (and bound) an exact rule rewriting their nodes continues."""
    from onnx_qrewrite.rewriter import engine
    from onnx_qrewrite.rewriter.opset import MAX_RUNTIME_OPSET

    highest = min(MAX_RUNTIME_OPSET, profile.opset_max or MAX_RUNTIME_OPSET)
    levels = frozenset(allow) if allow is not None else engine.DEFAULT_ALLOW
    return engine.EngineOptions(
        target_opset=target_opset,
        keep_opset=keep_opset,
        allow_unlowered=True,
        max_opset=highest,
        provenance="full",
        allow=levels,
        node_rules=node_rules,
        continue_provenance=later_stage,
    )


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


def plan_for_target(
    path: str | Path,
    catalogue: Catalogue,
    profile: TargetProfile,
    *,
    target_opset: int | None = None,
    keep_opset: bool = False,
    allow: Collection[str] | None = None,
    input_shapes: InputShapes | None = None,
) -> TargetPlan:
    """Check the model at ``path`` against ``profile`` before and after the target's rewrite
    (``input_shapes``: fix those dimensions first, :mod:`.shapes`)."""
    from onnx_qrewrite.io import model_io

    loaded = model_io.open_model(path)
    try:
        return plan_for_model(
            loaded.proto,
            catalogue,
            profile,
            external=loaded.external,
            label=str(path),
            target_opset=target_opset,
            keep_opset=keep_opset,
            allow=allow,
            input_shapes=input_shapes,
        )
    finally:
        if loaded.external is not None:
            loaded.external.close()


@dataclasses.dataclass
class _Node:
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
) -> list[_Node]:
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
            rules.sort(key=lambda r: _RANK[r.exactness])  # stable: catalogue order within a level
            # Listed even without candidates: then no rule may touch it (node_rules ()).
            nodes.append(_Node((scope.path, index), site, label, is_refused, [r.id for r in rules], in_forms))
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


@dataclasses.dataclass
class _State:
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


def _replacements(reports: list[Any]) -> list[dict[tuple[str, str], Any]]:
    """Per stage: (scope, engine label) of each node it rewrote -> that rewrite."""
    return [{(rw.scope, rw.node): rw for rw in report.rewrites} for report in reports]


def _through(scope: str, names: Any, stages: list[dict[tuple[str, str], Any]]) -> tuple[list[str], list[Any]]:
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


def _left_refused(state: _State) -> dict[tuple[str, str], list[Refused]]:
    """Per node the first stage rewrote (scope, engine label): the refusals of the nodes replacing
    it, after the later stages (their number weighs the choice; their names, ops and reasons are
    what ``inspect`` says the choice left)."""
    refused = {(r.scope, r.node): r for r in state.after}
    later = _replacements(state.reports[1:])
    out = {}
    for rw in state.reports[0].rewrites:
        final, _ = _through(rw.scope, rw.created_nodes, later)
        out[(rw.scope, rw.node)] = [refused[(rw.scope, name)] for name in final if (rw.scope, name) in refused]
    return out


def _in_words(refused: Refused) -> str:
    """A refused node as ``inspect`` names it: "name (op): why"."""
    return f"{refused.node} ({refused.op_key}): {'; '.join(refused.reasons)}"


def _naming(refused: Collection[Refused], most: int = 3) -> str:
    """ ": a (op), b (op)" for what a weighed choice leaves refused, the first ``most`` and how many
    more (``weighed_left`` lists every one, with why); "" for nothing."""
    named = [f"{r.node} ({r.op_key})" for r in itertools.islice(refused, most)]
    more = f", and {len(refused) - most} more" if len(refused) > most else ""
    return f": {', '.join(named)}{more}" if named else ""


def _preference(choice: str | None, left: int, rank: int, order: int) -> tuple[int, ...]:
    if left == 0:
        return (0, 0, rank, order)
    return (1, left, 0 if choice is None else 1, rank, order)


@dataclasses.dataclass
class _Context:
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
    follows: dict[tuple[int, bytes], _State] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Stage:
    state: _State
    nodes: list[_Node]
    trials: dict[str, tuple[list[Refused], int]]  # listing -> what the target refuses with it, without it
    applied: set[str]
    why: dict[tuple[str, str], dict[str, tuple[int, str]]] = dataclasses.field(default_factory=dict)


def _may_follow(state: _State, ctx: _Context) -> bool:
    """A later stage is worth planning when a stage rewrote something, the target refuses some of
    what it emitted, and some usable rule matches a node the target still refuses."""
    if not state.reports[-1].rewrites or not any(x.rule for x in state.after):
        return False  # nothing rewritten, or nothing refused that a rewrite emitted
    return any(
        r.id in ctx.usable for x in state.after if x.node != "(model)" for r in ctx.catalogue.candidates(x.domain, x.op)
    )


def _stage(model: onnx.ModelProto, ctx: _Context, depth: int, before: list[Refused]) -> _Stage:
    """Plan one stage on ``model`` (the input, or what the stages before emitted), each rewrite it
    tries followed by the later stages it makes possible (up to MAX_STAGES), so a rule whose
    replacement needs another rule is judged by where the chain ends.

    In steps: weigh each node's candidates (:func:`_weigh`), choose per node (:func:`_best`) and
    settle the choices together; then try the profile's forms on the whole model
    (:func:`_try_forms`) and, in the first stage, leaving some refused nodes to the next stage
    (:func:`_try_deferring`); never keep a choice that leaves more refused than ``before``."""
    refused_now = {(r.scope, r.node) for r in before}
    nodes = _nodes(model, ctx.catalogue, ctx.usable, set(ctx.form_of), refused_now, refused_only=depth > 0)
    runs = _StageRuns(model, ctx, depth, nodes)
    applied = _weigh(runs)
    chosen = {n.key: _best(n, ctx.rules) for n in nodes}
    choice: dict[tuple[str, int], tuple[str, ...]] = {k: (c,) if c else () for k, c in chosen.items()}
    state = runs.settle(choice)
    choice, state = _try_removals(runs, choice, state)
    choice, state, trials = _try_forms(runs, choice, state, applied)
    if depth == 0 and state.after and MAX_STAGES > 1:
        choice, state = _try_deferring(runs, choice, state)
    if len(state.after) > len(before):  # never make things worse, whatever the interactions
        state = runs.run(dict.fromkeys(choice, ()))
    elif depth > 0:  # a later stage's choice, then the stages after it
        state = _follow(state, ctx, depth, runs.inferred_of.get(state.digest))
    return _Stage(state, nodes, trials, applied, ctx.why)


class _StageRuns:
    """The rewrites one stage tries on its model, each node choice run once: the engine with that
    choice, the target's check of what it wrote and, in the first stage, the later stages it
    makes possible. The weighing, the settling and the trials ask for the same choices again."""

    def __init__(self, model: onnx.ModelProto, ctx: _Context, depth: int, nodes: list[_Node]) -> None:
        self.model, self.ctx, self.depth, self.nodes = model, ctx, depth, nodes
        self.by_site = {(n.key[0], n.site): n for n in nodes}
        self._tried: dict[tuple[Any, ...], _State] = {}
        #: A later stage's models with inferred types (stage_input), by digest: the one the stage
        #: chooses is what the stage after it rewrites. Kept only while this stage is planned.
        self.inferred_of: dict[bytes, onnx.ModelProto] = {}

    def run(self, node_rules: dict[tuple[str, int], tuple[str, ...]]) -> _State:
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
        state = _State(rewritten, [report], [used], after, digest)
        if self.depth == 0:  # each choice of the first stage is judged with the stages it makes possible
            state = _follow(state, ctx, self.depth, inferred)
        elif inferred is not None and _may_follow(state, ctx):
            self.inferred_of[digest] = inferred
        self._tried[key] = state
        return state

    def settle(self, choice: dict[tuple[str, int], tuple[str, ...]]) -> _State:
        """Apply the choices together and check again: what a rewrite leaves can depend on its
        neighbours' choices. A rewrite refused more than the node as it is gives way (its entry
        of ``choice`` becomes ())."""
        for _ in range(len(self.nodes) + 1):
            state = self.run(choice)
            worse = [
                self.by_site[key]
                for key, left in _left_refused(state).items()
                if key in self.by_site and len(left) > self.by_site[key].refused
            ]
            if not worse:
                break
            for node in worse:
                choice[node.key] = ()
        return state


def _note_why(why: dict[tuple[str, str], dict[str, tuple[int, str]]], report: Any, depth: int) -> None:
    """Record in ``why`` (``_Context.why``) the reason each rule gave for not rewriting a node,
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


def _weigh(runs: _StageRuns) -> set[str]:
    """Try each node's k-th candidate, all nodes at once, and record per node what the target
    refuses of what each rule left (``outcome``) or why a rule did not apply (``declined``): one
    run per rank of candidate, not one per rule and node. The rules that rewrote something."""
    applied: set[str] = set()
    for k in range(max((len(n.candidates) for n in runs.nodes), default=0)):
        state = runs.run({n.key: tuple(n.candidates[k : k + 1]) for n in runs.nodes})
        leaves = _left_refused(state)
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


def _best(node: _Node, rules: dict[str, Rule]) -> str | None:
    """The node's choice by what each weighed candidate left (module docstring: no refusals
    first, then exact, as it is, bounded, approximate); None leaves it as it is."""
    options: list[tuple[tuple[int, ...], str | None]] = [(_preference(None, node.refused, _AS_IS, 0), None)]
    for order, rule_id in enumerate(node.candidates, 1):
        if rule_id in node.outcome:
            n = node.outcome[rule_id]
            options.append((_preference(rule_id, n, _RANK[rules[rule_id].exactness], order), rule_id))
    return min(options, key=lambda o: o[0])[1]


_SUBGRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _removes(rule: Rule) -> bool:
    """Whether ``rule`` removes the node it matches (its builder declares every output unread,
    contract.UNREAD): the engine removes it only once nothing reads it (``Plan.remove_if_dead``),
    so weighed node by node, its readers as they are, it never applies."""
    types = rule.contract.output_types
    return types is not None and all(types(rule.options, ref.op) == (UNREAD,) for ref in rule.match)


def _try_removals(
    runs: _StageRuns, choice: dict[tuple[str, int], tuple[str, ...]], state: _State
) -> tuple[dict[tuple[str, int], tuple[str, ...]], _State]:
    """Refused nodes left as they are that a removal rule (:func:`_removes`) would remove once
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
        removals = [r for r in node.candidates if _removes(runs.ctx.rules[r])]
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

    def __init__(self, runs: _StageRuns) -> None:
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
        self, node: _Node, removals: list[str], choice: dict[tuple[str, int], tuple[str, ...]]
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


def _try_forms(
    runs: _StageRuns, choice: dict[tuple[str, int], tuple[str, ...]], state: _State, applied: set[str]
) -> tuple[dict[tuple[str, int], tuple[str, ...]], _State, dict[str, tuple[list[Refused], int]]]:
    """The form stage (first stage only: later stages rewrite refused nodes only): a form whose
    rules rewrite patterns (anchored at a node the target accepts, removing the refused ones it
    reads) cannot be weighed node by node, so each listing is tried on the whole model, each of
    its rules first where it matches and the choice so far after it; it is kept if the target then
    refuses less. Returns the choice, its state, and per listing the refused nodes with it and
    their number without it (for the account); ``applied`` gains the rules the trials used."""
    trials: dict[str, tuple[list[Refused], int]] = {}
    ctx = runs.ctx
    forms = ctx.profile.forms if runs.depth == 0 else ()
    for index in sorted(range(len(forms)), key=lambda i: _RANK[forms[i].allow]):  # stable
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
        trials[_listed_as(request)] = (tried_state.after, len(state.after))
        if len(tried_state.after) < len(state.after):
            choice, state = trial, tried_state
    return choice, state, trials


def _try_deferring(
    runs: _StageRuns, choice: dict[tuple[str, int], tuple[str, ...]], state: _State
) -> tuple[dict[tuple[str, int], tuple[str, ...]], _State]:
    """The choice with the :func:`_deferrable` nodes left as they are for the next stage, when
    the target then refuses less; else the choice as it was."""
    deferred = _deferrable(runs.model, runs.nodes, choice)
    if not deferred:
        return choice, state
    trial = {**choice, **dict.fromkeys(deferred, ())}
    tried_state = runs.settle(trial)
    if len(tried_state.after) < len(state.after):
        return trial, tried_state
    return choice, state


def _deferrable(
    model: onnx.ModelProto, nodes: list[_Node], choice: dict[tuple[str, int], tuple[str, ...]]
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


def _follow(state: _State, ctx: _Context, depth: int, inferred: onnx.ModelProto | None = None) -> _State:
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
        follow = ctx.follows[key] = _stage(stage_model, ctx, depth + 1, state.after).state
    if len(follow.after) >= len(state.after):
        return state
    reports, options = [*state.reports, *follow.reports], [*state.options, *follow.options]
    return _State(follow.rewritten, reports, options, follow.after, follow.digest)


def _digest(model: onnx.ModelProto) -> bytes:
    """A key for a model's content (plans reach the same model by several choices)."""
    import hashlib

    return hashlib.sha256(model.SerializeToString(deterministic=True)).digest()


def _checked(model: onnx.ModelProto, digest: bytes, ctx: _Context) -> tuple[list[Refused], onnx.ModelProto | None]:
    """What the target refuses of ``model`` (check_for_target), computed once per distinct model
    of the plan (``digest``): about half the rewrites a plan tries give a model another choice
    gave already (195 runs, 97 distinct models, planning the QOperator BERT for webgpu). With it,
    the first time, ``model`` with inferred types (stage_input's), which the caller may plan the
    next stage on. The plan does not keep that copy: it is as big as the model, beside the
    models the plan keeps already (kept per digest for the whole plan, the 6-layer QOperator BERT's
    plan for tensorrt peaked at 1.4 GB instead of 0.5 GB). The first stage plans the next on it at
    once; a later stage keeps it only while that stage is planned (``_StageRuns.inferred_of``)."""
    refused = ctx.checked.get(digest)
    if refused is not None:
        return refused, None
    inferred = stage_input(model)
    refused = ctx.checked[digest] = check_for_target(model, ctx.profile, may_lower=ctx.may_lower, inferred=inferred)
    return refused, inferred


def _listed_as(request: Any) -> str:
    return request.name + (f"[{request.variant}]" if request.variant else "")


def plan_for_model(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    profile: TargetProfile,
    *,
    external: Any = None,
    label: str = "model",
    target_opset: int | None = None,
    keep_opset: bool = False,
    allow: Collection[str] | None = None,
    input_shapes: InputShapes | None = None,
) -> TargetPlan:
    """:func:`plan_for_target` for a model in memory (not modified); ``external`` is its opened
    external data (model_io.ExternalData), if any."""
    from onnx_qrewrite.rewriter import engine

    applied = None
    if input_shapes:
        model = copy.deepcopy(model)
        applied = apply_input_shapes(model, input_shapes, label)
    before = check_model(model, profile)
    base, skipped = target_catalogue(catalogue, profile)
    base, set_options = profile_rule_options(base, profile)
    levels = set(allow) if allow is not None else set(engine.DEFAULT_ALLOW)
    extra, form_of, listing = form_rules(profile, taken=base.ids, user_allow=allow)
    chosen_rules = Catalogue([*base, *extra])
    rules = {r.id: r for r in chosen_rules}
    usable = {r.id for r in base if r.exactness in levels} | set(form_of)
    levels |= {rules[i].exactness for i in form_of}
    ctx = _Context(profile, chosen_rules, rules, usable, form_of, listing, levels, external, target_opset, keep_opset)
    top = _stage(model, ctx, 0, before)
    label_of = {r: _listed_as(profile.forms[i]) for r, i in listing.items()}
    plan = _assemble(label, profile, before, top, rules, form_of, skipped, chosen_rules, label_of, set_options)
    _lower_opset(plan, profile, ctx.may_lower)
    _float64_note(plan, profile)
    plan.input_shapes = applied.to_dict() if applied is not None else None
    waiting = withheld_forms(profile, allow)
    if plan.after and waiting:
        consented = plan_for_model(
            model,
            catalogue,
            profile,
            external=external,
            label=label,
            target_opset=target_opset,
            keep_opset=keep_opset,
            allow=(*levels, "approximate"),
        )
        first = consented.after[0] if consented.after else None
        plan.with_consent = {
            "forms": waiting,
            "refused_after": len(consented.after),
            "first": f"{first.node} ({first.op_key}): {first.reasons[0]}" if first else "",
        }
    return plan


def _lower_opset(plan: TargetPlan, profile: TargetProfile, may_lower: bool) -> None:
    """Lower the planned rewrite's opset (and IR version) to the target's when it declares more
    and that is exact; the model-wide refusal of them is then fixed, by this step."""
    if plan.rewritten is None:
        return
    plan.rewritten, plan.opset_lowering, plan.ir_lowering = lowering_for_target(
        plan.rewritten, profile, may_lower=may_lower
    )
    done = [
        (rule, f"{what} {low['from']} -> {low['to']}: {low['why']}")
        for rule, what, low in (("lower-opset", "opset", plan.opset_lowering), ("lower-ir", "IR", plan.ir_lowering))
        if low is not None
    ]
    if not done:
        return
    for verdict in plan.nodes:
        if verdict.node == "(model)" and not verdict.after:
            verdict.rule, verdict.exactness = done[0][0], "exact"
            verdict.then = tuple(then for _, then in done)


def _makes_float64(model: onnx.ModelProto) -> bool:
    """Whether any value of ``model`` can be float64: float64 arithmetic starts at a float64 input,
    a Cast to it or a float64 constant. A cheap look before the shape inference :func:`_float64_note` needs."""
    double = onnx.TensorProto.DOUBLE
    if any(v.type.tensor_type.elem_type == double for v in model.graph.input):
        return True
    for scope in iter_scopes(model):
        if any(t.data_type == double for t in getattr(scope.container, "initializer", ())):
            return True
        for node in scope.container.node:
            for attr in node.attribute:
                if (attr.name == "to" and attr.i == double) or (attr.HasField("t") and attr.t.data_type == double):
                    return True
    return False


def _float64_note(plan: TargetPlan, profile: TargetProfile) -> None:
    """Name the rules whose nodes compute in float64 when the target computes float64 otherwise
    (OpenVINO as float32, QNN in reduced precision, LiteRT not at all: observed), and give each
    node they rewrote the caveat: their declared exactness rests on float64 arithmetic."""
    loss = profile.float64_loss()
    if loss is None or plan.rewritten is None or not _makes_float64(plan.rewritten):
        return
    from onnx_qrewrite.rewriter.provenance import attribute_nodes
    from onnx_qrewrite.targets.check import _inferred

    inferred = _inferred(plan.rewritten)
    rules: dict[str, int] = {}
    origins: dict[str, set[str]] = {}
    for scope in iter_scopes(inferred):
        nodes = scope.container.node
        for node, made in zip(nodes, attribute_nodes(nodes), strict=True):
            if made is None or not any(scope.elem_type(o) == onnx.TensorProto.DOUBLE for o in node.output if o):
                continue
            rules[made[0]] = rules.get(made[0], 0) + 1
            origins.setdefault(made[0], set()).add(made[1])
    if not rules:
        return
    plan.float64 = {"loss": loss, "rules": dict(sorted(rules.items()))}
    for verdict in plan.nodes:
        # An unnamed node's replacement records no origin (""): it is the verdict's whose rule it is.
        mine = sorted(r for r, nodes in origins.items() if verdict.node in nodes or ("" in nodes and r == verdict.rule))
        if mine:
            caveat = f"{', '.join(mine)} compute{'s' if len(mine) == 1 else ''} in float64, which {loss}"
            verdict.caveats = (*verdict.caveats, caveat)


def _assemble(
    label: str,
    profile: TargetProfile,
    before: list[Refused],
    top: _Stage,
    rules: dict[str, Rule],
    form_of: dict[str, str],
    skipped: dict[str, str],
    chosen_rules: Catalogue,
    label_of: dict[str, str],
    set_options: dict[str, dict[str, Any]],
) -> TargetPlan:
    """The plan's account: per refused node what was chosen and why (and what later stages did to
    what it emitted), rules not used, forms used, rule options the profile set."""
    state = top.state
    verdicts = _Account(profile, top, rules, form_of, label_of, set_options).verdicts(before)
    _note_unused(skipped, top, profile.id)
    plan = TargetPlan(
        label,
        profile.id,
        profile.version,
        profile.proof,
        before,
        state.after,
        verdicts,
        skipped,
        _forms_used(profile, state.reports, form_of),
        state.rewritten,
        chosen_rules,
        state.options[0],
        list(state.options[1:]),
    )
    plan.rule_options = set_options
    return plan


@dataclasses.dataclass
class _Account:
    """What the account of each node the target refuses reads: the plan's first stage (its chosen
    state, the nodes it weighed, its form trials and the reasons rules gave), the rules, and per
    rule the form and the listing it comes from."""

    profile: TargetProfile
    top: _Stage
    rules: dict[str, Rule]
    form_of: dict[str, str]
    label_of: dict[str, str]
    #: profile_rule_options' account: a rule that declined a node under the profile's options says so.
    set_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: Per form listing, what its whole-model trial left (one tuple, :meth:`_trial_left`), and per
    #: such tuple its refusals in words (:meth:`_words`): every node the form could rewrite names
    #: the same trial, so building them per node made the account quadratic in the model's nodes
    #: (chain_1000 for tensorrt: 5 million strings; chain_4000: 80 million, about 14 GB).
    _trial_of: dict[str, tuple[Refused, ...]] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _words_of: dict[int, tuple[tuple[Refused, ...], tuple[str, ...]]] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )

    def verdicts(self, before: list[Refused]) -> list[NodeVerdict]:
        """One verdict per refusal of the model as it was, in that order."""
        state = self.top.state
        after_at = {(r.scope, r.node): r for r in state.after}
        by_label = {(n.key[0], n.label): n for n in self.top.nodes}
        stages = _replacements(state.reports)
        return [self._verdict(r, by_label.get((r.scope, r.node)), after_at, stages) for r in before]

    def _verdict(
        self,
        r: Refused,
        node: _Node | None,
        after_at: dict[tuple[str, str], Refused],
        stages: list[dict[tuple[str, str], Any]],
    ) -> NodeVerdict:
        """What replaced the node through every stage (the chain of rewrites), what the target
        still refuses of what it became, and the other choices weighed for it."""
        site = node.site if node is not None else r.node
        final, chain = _through(r.scope, [site if r.scope == "main" else r.node], stages)
        if chain:
            still = [after_at[(r.scope, name)] for name in final if (r.scope, name) in after_at]
            reasons = tuple(_in_words(s) for s in still)
        else:
            same = after_at.get((r.scope, r.node))
            reasons = same.reasons if same is not None else ()
        rule = chain[0].rule if chain else None
        weighed = self._considered(node, r.scope, site, rule) if node is not None else []
        considered = tuple(text for _, text, _ in weighed)
        left = {rule_id: self._words(refused) for rule_id, _, refused in weighed if refused}
        level = max((rw.exactness for rw in chain), key=lambda e: _RANK[e]) if chain else None
        form = next((self.form_of[rw.rule] for rw in chain if rw.rule in self.form_of), None)
        then = tuple(f"{rw.rule} ({rw.exactness}) on {rw.node}" for rw in chain[1:])
        hint = self._hint(node) if node is not None and reasons and not chain else ""
        return NodeVerdict(
            r.scope,
            r.node,
            r.op_key,
            r.reasons,
            rule,
            level,
            reasons,
            form,
            considered,
            then,
            hint=hint,
            weighed_left=left,
        )

    def _hint(self, node: _Node) -> str:
        """For a node left refused: the first of its rules that declined it under options the
        profile set, with the profile's why ("" when none did)."""
        for rule_id in node.candidates:
            said = self.set_options.get(rule_id, {})
            if said.get("options") and rule_id not in node.outcome:
                words = ", ".join(f"{k} = {v!r}" for k, v in said["options"].items())
                why = f": {said['why']}" if said["why"] else ""
                target = f"{self.profile.id} sets for it {said['source']}"
                return f"{rule_id} does not apply with {words}, which {target}{why}"
        return ""

    def _considered(
        self, node: _Node, scope: str, site: str, chosen: str | None
    ) -> list[tuple[str, str, tuple[Refused, ...]]]:
        """Each candidate other than the chosen rule: its id, in words what it left (naming the
        refused nodes) or why it was not weighed (its form was tried on the whole model, it did not
        apply, or it applies only to what a later stage sees), and the refused nodes it left."""
        out: list[tuple[str, str, tuple[Refused, ...]]] = []
        for rule_id in node.candidates:
            if rule_id == chosen:
                continue
            its_level = self.rules[rule_id].exactness
            listed = self.label_of.get(rule_id)
            if rule_id not in node.outcome and listed in self.top.trials:
                with_it, without = self.top.trials[listed]
                text = (
                    f"{rule_id} ({its_level}, form {listed}): tried with the whole form, which leaves "
                    f"{len(with_it)} refused node(s) against {without} without it{_naming(with_it)}"
                )
                out.append((rule_id, text, self._trial_left(listed)))
            elif rule_id not in node.outcome:
                depth, why = self.top.why.get((scope, site), {}).get(rule_id, (0, ""))
                why = why or node.declined.get(rule_id, "")
                if depth and not why:
                    text = (
                        f"{rule_id} ({its_level}): applies only to what stage {depth + 1} sees (after earlier stages' "
                        f"rewrites), and there leaves {self.profile.id} as much or more to refuse"
                    )
                else:
                    said = f"{its_level}{self._set_here(rule_id)}"
                    text = f"{rule_id} ({said}): does not apply here{': ' + why if why else ''}"
                out.append((rule_id, text, ()))
            else:
                left = node.left.get(rule_id, ())
                n = len(left)
                text = f"{rule_id} ({its_level}): leaves {n} refused node{'s' if n != 1 else ''}{_naming(left)}"
                out.append((rule_id, text, left))
        return out

    def _trial_left(self, listed: str) -> tuple[Refused, ...]:
        """The refused nodes the form listing ``listed``'s trial left, one tuple for every node."""
        if listed not in self._trial_of:
            self._trial_of[listed] = tuple(self.top.trials[listed][0])
        return self._trial_of[listed]

    def _words(self, refused: tuple[Refused, ...]) -> tuple[str, ...]:
        """``refused`` in words (:func:`_in_words`), made once per tuple: the nodes a form's trial
        names share its tuple (:meth:`_trial_left`), and so the words."""
        known = self._words_of.get(id(refused))
        if known is None:  # the tuple is kept beside its words, so its id is not reused meanwhile
            known = self._words_of[id(refused)] = (refused, tuple(_in_words(x) for x in refused))
        return known[1]

    def _set_here(self, rule_id: str) -> str:
        """The options the profile set for the rule, as the weighed line adds them (", with
        reduction_length = 'recorded' for mini"; "" when it set none)."""
        applied = self.set_options.get(rule_id, {}).get("options")
        if not applied:
            return ""
        words = ", ".join(f"{k} = {v!r}" for k, v in applied.items())
        return f", with {words} for {self.profile.id}"


def _note_unused(skipped: dict[str, str], top: _Stage, target: str) -> None:
    """Add to ``skipped`` each rule that rewrote something when tried but is in no chosen rewrite,
    with why: it makes accepted nodes refused, or another choice won (the account of the nodes
    says which)."""
    used_rules = {rw.rule for report in top.state.reports for rw in report.rewrites}
    for rule_id in sorted(top.applied - used_rules - set(skipped)):
        worse = any(n.refused == 0 and n.outcome.get(rule_id, 0) > 0 for n in top.nodes)
        if worse:
            skipped[rule_id] = f"it would turn nodes {target} runs into nodes it refuses"
        else:
            skipped[rule_id] = (
                f"chosen for no node: another choice leaves {target} fewer refused nodes, is more exact, "
                "or comes first in the catalogue (inspect --target lists what each node weighed)"
            )


def _forms_used(profile: TargetProfile, reports: list[Any], form_of: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per form of the profile the chosen rewrites used (a form listed twice counted once): its
    consent, the least exact level and the nodes and rules it rewrote, and why the profile names it."""
    forms: dict[str, dict[str, Any]] = {}
    every = [rw for report in reports for rw in report.rewrites]
    for request in profile.forms:
        if request.name in forms:  # a later listing of the same form: counted with the first
            continue
        mine = [rw for rw in every if form_of.get(rw.rule) == request.name]
        if mine:
            level = max((rw.exactness for rw in mine), key=lambda e: _RANK[e])
            forms[request.name] = {
                "allow": request.allow,
                "exactness": level,
                "nodes": len(mine),
                "rules": sorted({rw.rule for rw in mine}),
                "why": request.why,
                "source": profile.cite(request.source),
            }
    return forms
