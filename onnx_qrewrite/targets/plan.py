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
its readers' rules of the same builder (:func:`.trials.try_removals`), and kept if the target then refuses
less; where a reader has no such rule, the node stays refused and is named.

Rules that rewrite only ops the profile lists under ``[rewrites] keep`` (ops it runs natively) are
left out. The chosen rewrites are then applied together and checked again; a rewrite whose result
is refused more than the node as it is gives way, and if the whole still has more refusals than
the original, nothing is rewritten.

Stages: a rule's replacement may itself need a rule (a QOperator lowering emits a QuantizeLinear
the target computes wrongly, which the float-emulation form fixes). Each rewrite the plan tries is
followed by a later stage planned the same way on what it wrote, restricted to the nodes the target
still refuses, and judged by where that chain ends; at most ``stages.MAX_STAGES`` stages, each kept only
if it leaves fewer refused nodes, so a chain cannot loop. ``rewrite --target`` applies the stages
in turn (``TargetPlan.later``), and ``inspect --target`` names each rule of a node's chain.

The parts, each a module, called in this order: :mod:`.target_rules` (the rules and engine options
the target gets), :mod:`.stages` (each stage weighed, settled and followed), :mod:`.trials` (what a
stage tries on the whole model), :mod:`.account` (the verdicts, from the first stage), into the
records of :mod:`.verdicts`. This module plans a model with them, lowers the result's opset where
the target needs it, and keeps the public API.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from pathlib import Path
from typing import Any

import onnx

from onnx_qrewrite.rewriter.catalogue import Catalogue
from onnx_qrewrite.rewriter.graph import iter_scopes
from onnx_qrewrite.targets.account import assemble
from onnx_qrewrite.targets.check import check_model, computed_differently
from onnx_qrewrite.targets.lower_opset import lowering_for_target
from onnx_qrewrite.targets.profile import TargetProfile
from onnx_qrewrite.targets.shapes import InputShapes, apply_input_shapes
from onnx_qrewrite.targets.stages import Context, plan_stage, stage_input
from onnx_qrewrite.targets.target_rules import (
    engine_options,
    form_rules,
    listed_as,
    profile_rule_options,
    target_catalogue,
    withheld_forms,
)
from onnx_qrewrite.targets.verdicts import NodeVerdict, TargetPlan

__all__ = [
    "NodeVerdict",
    "TargetPlan",
    "engine_options",
    "form_rules",
    "plan_for_model",
    "plan_for_target",
    "profile_rule_options",
    "stage_input",
    "target_catalogue",
]


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
    ctx = Context(profile, chosen_rules, rules, usable, form_of, listing, levels, external, target_opset, keep_opset)
    top = plan_stage(model, ctx, 0, before)
    label_of = {r: listed_as(profile.forms[i]) for r, i in listing.items()}
    plan = assemble(label, profile, before, top, rules, form_of, skipped, chosen_rules, label_of, set_options)
    _lower_opset(plan, profile, ctx.may_lower)
    _float64_note(plan, profile)
    plan.differs = computed_differently(plan.rewritten if plan.rewritten is not None else model, profile)
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
