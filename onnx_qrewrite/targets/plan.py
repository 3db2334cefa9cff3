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

Rules that rewrite only ops the profile lists under ``[rewrites] keep`` (ops it runs natively) are
left out. The chosen rewrites are then applied together and checked again; a rewrite whose result
is refused more than the node as it is gives way, and if the whole still has more refusals than
the original, nothing is rewritten.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

import onnx

from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule
from onnx_qrewrite.rewriter.graph import iter_scopes
from onnx_qrewrite.targets.check import Refused, check_model
from onnx_qrewrite.targets.profile import TargetProfile

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

    @property
    def status(self) -> str:
        if self.after:
            return "refused after the rewrite" if self.reasons else "made worse by the rewrite"
        return "fixed by the rewrite" if self.rule else "accepted"


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

    def refusal_error(self) -> str:
        """One line for ``rewrite --target`` when the target would still refuse something."""
        first = self.after[0]
        more = f" (and {len(self.after) - 1} more node(s); `inspect --target {self.target}` lists them)"
        return (
            f"{self.model}: target {self.target} would still refuse node {first.node} ({first.op_key}) "
            f"after the rewrite: {first.reasons[0]}{more if len(self.after) > 1 else ''}"
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
) -> Any:
    """The engine's options for ``profile``: a rewrite never raises the opset above what the
    target loads (``[opset] max``), so rules that would need more give way to the next rule.
    Exactness levels as for any rewrite (exact first, bounded where no exact rule applies,
    approximate only when ``allow`` names it)."""
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
) -> TargetPlan:
    """Check the model at ``path`` against ``profile`` before and after the target's rewrite."""
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


def _nodes(
    model: onnx.ModelProto, catalogue: Catalogue, usable: set[str], forms: set[str], refused: set[tuple[str, str]]
) -> list[_Node]:
    """Every node some rule matches, with the rules usable on it: form rules only for nodes the
    target refuses as they are."""
    nodes = []
    for scope in iter_scopes(model):
        for index, node in enumerate(scope.container.node):
            matching = catalogue.candidates(node.domain, node.op_type)
            if not matching:
                continue
            rules = [r for r in matching if r.id in usable]
            name = node.name or (
                f"<unnamed {node.op_type} -> {node.output[0]}>" if node.output else f"<unnamed {node.op_type}>"
            )
            site = name if scope.path == "main" else f"{name} (in {scope.path})"
            label = node.name or (node.output[0] if node.output else node.op_type)
            is_refused = int((scope.path, label) in refused)
            in_forms = [r.id for r in rules if r.id in forms]
            if not is_refused:
                rules = [r for r in rules if r.id not in forms]
            rules.sort(key=lambda r: _RANK[r.exactness])  # stable: catalogue order within a level
            # Listed even without candidates: then no rule may touch it (node_rules ()).
            nodes.append(_Node((scope.path, index), site, label, is_refused, [r.id for r in rules], in_forms))
    return nodes


def _left_refused(report: Any, after: list[Refused]) -> dict[tuple[str, str], int]:
    """Per rewritten node (scope, engine label): how many of the nodes replacing it the target refuses."""
    refused = {(r.scope, r.node) for r in after}
    return {
        (rw.scope, rw.node): sum((rw.scope, name) in refused for name in rw.created_nodes) for rw in report.rewrites
    }


def _preference(choice: str | None, left: int, rank: int, order: int) -> tuple[int, ...]:
    if left == 0:
        return (0, 0, rank, order)
    return (1, left, 0 if choice is None else 1, rank, order)


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
) -> TargetPlan:
    """:func:`plan_for_target` for a model in memory (not modified); ``external`` is its opened
    external data (model_io.ExternalData), if any."""
    from onnx_qrewrite.rewriter import engine

    before = check_model(model, profile)
    base, skipped = target_catalogue(catalogue, profile)
    levels = set(allow) if allow is not None else set(engine.DEFAULT_ALLOW)
    extra, form_of, listing = form_rules(profile, taken=base.ids, user_allow=allow)
    chosen_rules = Catalogue([*base, *extra])
    rules = {r.id: r for r in chosen_rules}
    usable = {r.id for r in base if r.exactness in levels} | set(form_of)
    refused_now = {(r.scope, r.node) for r in before}
    nodes = _nodes(model, chosen_rules, usable, set(form_of), refused_now)
    levels |= {rules[i].exactness for n in nodes for i in (*n.candidates, *n.form_rules)}
    by_site = {(n.key[0], n.site): n for n in nodes}

    def run(node_rules: dict[tuple[str, int], tuple[str, ...]]) -> tuple[Any, Any, Any, list[Refused]]:
        options = engine_options(
            profile, target_opset=target_opset, keep_opset=keep_opset, allow=levels, node_rules=node_rules
        )
        rewritten, report, used = _rewrite(model, chosen_rules, external, options)
        return rewritten, report, used, check_model(rewritten, profile)

    # Try each node's k-th candidate, all nodes at once, and see what the target refuses of each.
    applied: set[str] = set()
    for k in range(max((len(n.candidates) for n in nodes), default=0)):
        _, report, _, after = run({n.key: tuple(n.candidates[k : k + 1]) for n in nodes})
        counts = _left_refused(report, after)
        for rw in report.rewrites:
            node = by_site.get((rw.scope, rw.node))
            if node is not None and rw.rule in node.candidates:
                node.outcome[rw.rule] = counts[(rw.scope, rw.node)]
                applied.add(rw.rule)

    def best(node: _Node) -> str | None:
        options: list[tuple[tuple[int, ...], str | None]] = [(_preference(None, node.refused, _AS_IS, 0), None)]
        for order, rule_id in enumerate(node.candidates, 1):
            if rule_id in node.outcome:
                n = node.outcome[rule_id]
                options.append((_preference(rule_id, n, _RANK[rules[rule_id].exactness], order), rule_id))
        return min(options, key=lambda o: o[0])[1]

    def settle(choice: dict[tuple[str, int], tuple[str, ...]]) -> tuple[Any, Any, Any, list[Refused]]:
        """Apply the choices together and check again: what a rewrite leaves can depend on its
        neighbours' choices. A rewrite refused more than the node as it is gives way."""
        for _ in range(len(nodes) + 1):
            state = run(choice)
            worse = [
                by_site[key]
                for key, n in _left_refused(state[1], state[3]).items()
                if key in by_site and n > by_site[key].refused
            ]
            if not worse:
                break
            for node in worse:
                choice[node.key] = ()
        return state

    chosen = {n.key: best(n) for n in nodes}
    choice: dict[tuple[str, int], tuple[str, ...]] = {k: (c,) if c else () for k, c in chosen.items()}
    rewritten, report, used, after = settle(choice)
    # The form stage: a form whose rules rewrite patterns (anchored at a node the target accepts,
    # removing the refused ones it reads) is tried on the whole model, each of its rules first
    # where it matches and the choice so far after it; it is kept if the target then refuses less.
    trials: dict[str, tuple[int, int]] = {}  # form -> refused with it on the whole model, without
    label_of = {
        r: profile.forms[i].name + (f"[{profile.forms[i].variant}]" if profile.forms[i].variant else "")
        for r, i in listing.items()
    }
    order = sorted(range(len(profile.forms)), key=lambda i: _RANK[profile.forms[i].allow])  # stable
    for index in order:
        request = profile.forms[index]
        listed_as = request.name + (f"[{request.variant}]" if request.variant else "")
        trial = dict(choice)
        for n in nodes:
            if any(form_of.get(r) == request.name for r in choice[n.key]):
                continue  # an earlier listing of the same form already rewrites it
            mine = [r for r in n.form_rules if listing.get(r) == index and r not in choice[n.key]]
            if mine:
                trial[n.key] = (*mine, *choice[n.key])
        if trial == choice:
            continue
        state = settle(trial)
        applied.update(rw.rule for rw in state[1].rewrites)
        trials[listed_as] = (len(state[3]), len(after))
        if len(state[3]) < len(after):
            choice, (rewritten, report, used, after) = trial, state
    if len(after) > len(before):  # never make things worse, whatever the interactions
        rewritten, report, used, after = run(dict.fromkeys(choice, ()))

    return _assemble(
        label, profile, before, after, report, nodes, rules, form_of, skipped, applied, rewritten, chosen_rules, used,
        trials, label_of,
    )  # fmt: skip


def _assemble(
    label: str,
    profile: TargetProfile,
    before: list[Refused],
    after: list[Refused],
    report: Any,
    nodes: list[_Node],
    rules: dict[str, Rule],
    form_of: dict[str, str],
    skipped: dict[str, str],
    applied: set[str],
    rewritten: onnx.ModelProto,
    chosen_rules: Catalogue,
    used: Any,
    trials: dict[str, tuple[int, int]],
    label_of: dict[str, str],
) -> TargetPlan:
    """The plan's account: per refused node what was chosen and why, rules not used, forms used."""
    created = {(rw.scope, rw.node): rw for rw in report.rewrites}
    after_at = {(r.scope, r.node): r for r in after}
    by_label = {(n.key[0], n.label): n for n in nodes}
    verdicts = []
    for r in before:
        node = by_label.get((r.scope, r.node))
        rw = created.get((r.scope, node.site)) if node is not None else None
        if rw is not None:
            still = [after_at[(rw.scope, name)] for name in rw.created_nodes if (rw.scope, name) in after_at]
            reasons = tuple(f"{s.node} ({s.op_key}): {'; '.join(s.reasons)}" for s in still)
        else:
            same = after_at.get((r.scope, r.node))
            reasons = same.reasons if same is not None else ()
        considered: list[str] = []
        for rule_id in node.candidates if node is not None else ():
            if rw is not None and rule_id == rw.rule:
                continue
            level = rules[rule_id].exactness
            form = label_of.get(rule_id)
            if rule_id not in node.outcome and form in trials:  # type: ignore[union-attr]
                with_it, without = trials[form]
                considered.append(
                    f"{rule_id} ({level}, form {form}): tried with the whole form, which leaves {with_it} refused "
                    f"node(s) against {without} without it"
                )
            elif rule_id not in node.outcome:  # type: ignore[union-attr]
                considered.append(f"{rule_id} ({level}): does not apply here")
            else:
                n = node.outcome[rule_id]  # type: ignore[union-attr]
                considered.append(f"{rule_id} ({level}): leaves {n} refused node{'s' if n != 1 else ''}")
        rule = rw.rule if rw is not None else None
        verdicts.append(
            NodeVerdict(
                r.scope,
                r.node,
                r.op_key,
                r.reasons,
                rule,
                rules[rule].exactness if rule else None,
                reasons,
                form_of.get(rule) if rule else None,
                tuple(considered),
            )
        )
    used_rules = {rw.rule for rw in report.rewrites}
    for rule_id in sorted(applied - used_rules - set(skipped)):
        worse = any(n.refused == 0 and n.outcome.get(rule_id, 0) > 0 for n in nodes)
        if worse:
            skipped[rule_id] = f"it would turn nodes {profile.id} runs into nodes it refuses"
        else:
            skipped[rule_id] = (
                f"chosen for no node: another choice leaves {profile.id} fewer refused nodes, is more exact, "
                "or comes first in the catalogue (inspect --target lists what each node weighed)"
            )
    forms: dict[str, dict[str, Any]] = {}
    for request in profile.forms:
        if request.name in forms:  # a later listing of the same form: counted with the first
            continue
        mine = [rw for rw in report.rewrites if form_of.get(rw.rule) == request.name]
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
    return TargetPlan(
        label,
        profile.id,
        profile.version,
        profile.proof,
        before,
        after,
        verdicts,
        skipped,
        forms,
        rewritten,
        chosen_rules,
        used,
    )
