"""What a target plan says: per node the target refuses, what replaces it and what is still
refused (:class:`NodeVerdict`), and the plan as a whole (:class:`TargetPlan`), which ``inspect
--target`` prints and ``rewrite --target`` applies."""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.catalogue import Catalogue
from onnx_qrewrite.targets.check import Refused

__all__ = ["PLAN_FORMAT", "NodeVerdict", "TargetPlan"]

#: The shape of :meth:`TargetPlan.to_dict` (``inspect --target --json``, ``rewrite --report``'s
#: ``target``), raised when it changes: 2, each node's ``weighed_left`` an index into the plan's
#: ``weighed_left_lists`` (before, without this field: the lists themselves, per node).
PLAN_FORMAT = 2


@dataclass
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


@dataclass
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
    #: Nodes of the rewrite the target runs but computes otherwise than onnxruntime (profile
    #: ``[[differs]]``, observed): no rewrite changes them; named so the user knows before deploying.
    differs: list[Refused] = dataclasses.field(default_factory=list)
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
        """The plan as JSON data (``inspect --target --json``, ``rewrite --report``'s ``target``),
        format :data:`PLAN_FORMAT`: each node's ``weighed_left`` maps a weighed rule to an index
        into ``weighed_left_lists``, where the refused nodes it left are listed once. A form's
        whole-model trial leaves every refused node and every node the form could rewrite names
        that trial, so listing it per node made the answer quadratic in the model's nodes (43 MB
        for a 250-block chain on tensorrt)."""
        lists = _SharedLists()
        return {
            "format": PLAN_FORMAT,
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
            "computed_differently": [dataclasses.asdict(r) for r in self.differs],
            "input_shapes": self.input_shapes,
            "nodes": [_verdict_dict(n, lists) for n in self.nodes],
            "after": [dataclasses.asdict(r) for r in self.after],
            "weighed_left_lists": lists.lists,
        }


class _SharedLists:
    """The distinct lists of ``weighed_left`` in a plan's JSON, each listed once, in the order first
    met; a list is found again by the identity of its tuple (the nodes a form's trial names share
    one, ``_Account._words``), else by its contents."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self._by_id: dict[int, int] = {}
        self._by_words: dict[tuple[str, ...], int] = {}

    def index(self, words: tuple[str, ...]) -> int:
        at = self._by_id.get(id(words))  # the verdicts keep the tuples alive, so ids are not reused
        if at is None:
            at = self._by_words.setdefault(words, len(self.lists))
            if at == len(self.lists):
                self.lists.append(list(words))
            self._by_id[id(words)] = at
        return at


def _verdict_dict(verdict: NodeVerdict, lists: _SharedLists) -> dict[str, Any]:
    """One node's verdict as JSON data: its fields (tuples as lists), ``weighed_left`` as indexes
    into ``lists``, and its status."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(verdict):
        value = getattr(verdict, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    out["weighed_left"] = {rule_id: lists.index(words) for rule_id, words in verdict.weighed_left.items()}
    out["status"] = verdict.status
    return out
