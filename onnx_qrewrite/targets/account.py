"""The plan's account, assembled from its first stage: per node the target refused, what was
chosen through every stage and why, the other choices weighed and what each left, the rules not
used and the forms used (what ``inspect --target`` prints)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection
from typing import Any

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule
from onnx_qrewrite.targets.check import Refused
from onnx_qrewrite.targets.profile import TargetProfile
from onnx_qrewrite.targets.stages import Node, Stage, replacements, through
from onnx_qrewrite.targets.target_rules import RANK
from onnx_qrewrite.targets.verdicts import NodeVerdict, TargetPlan


def _in_words(refused: Refused) -> str:
    """A refused node as ``inspect`` names it: "name (op): why"."""
    return f"{refused.node} ({refused.op_key}): {'; '.join(refused.reasons)}"


def _naming(refused: Collection[Refused], most: int = 3) -> str:
    """ ": a (op), b (op)" for what a weighed choice leaves refused, the first ``most`` and how many
    more (``weighed_left`` lists every one, with why); "" for nothing."""
    named = [f"{r.node} ({r.op_key})" for r in itertools.islice(refused, most)]
    more = f", and {len(refused) - most} more" if len(refused) > most else ""
    return f": {', '.join(named)}{more}" if named else ""


def assemble(
    label: str,
    profile: TargetProfile,
    before: list[Refused],
    top: Stage,
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


@dataclass
class _Account:
    """What the account of each node the target refuses reads: the plan's first stage (its chosen
    state, the nodes it weighed, its form trials and the reasons rules gave), the rules, and per
    rule the form and the listing it comes from."""

    profile: TargetProfile
    top: Stage
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
        stages = replacements(state.reports)
        return [self._verdict(r, by_label.get((r.scope, r.node)), after_at, stages) for r in before]

    def _verdict(
        self,
        r: Refused,
        node: Node | None,
        after_at: dict[tuple[str, str], Refused],
        stages: list[dict[tuple[str, str], Any]],
    ) -> NodeVerdict:
        """What replaced the node through every stage (the chain of rewrites), what the target
        still refuses of what it became, and the other choices weighed for it."""
        site = node.site if node is not None else r.node
        final, chain = through(r.scope, [site if r.scope == "main" else r.node], stages)
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
        level = max((rw.exactness for rw in chain), key=lambda e: RANK[e]) if chain else None
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

    def _hint(self, node: Node) -> str:
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
        self, node: Node, scope: str, site: str, chosen: str | None
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


def _note_unused(skipped: dict[str, str], top: Stage, target: str) -> None:
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
            level = max((rw.exactness for rw in mine), key=lambda e: RANK[e])
            forms[request.name] = {
                "allow": request.allow,
                "exactness": level,
                "nodes": len(mine),
                "rules": sorted({rw.rule for rw in mine}),
                "why": request.why,
                "source": profile.cite(request.source),
            }
    return forms
