"""What a target refuses in a model today, which rewrite would fix each refusal, and what it would
still refuse after the rewrite: the answer of ``inspect --target``.

The "after" model comes from the engine itself (a rewrite in memory with ``allow_unlowered``), so
``inspect --target`` and ``rewrite`` cannot disagree. Rules are chosen for the target so that a
rewrite never makes things worse: rules that rewrite only ops the profile lists under
``[rewrites] keep`` (ops it runs natively) are left out, and so is any rule that turned a node
the target accepted into nodes it refuses (found by checking, not assumed).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

import onnx

from onnx_qrewrite.catalogue import Catalogue
from onnx_qrewrite.targets.check import Refused, check_model
from onnx_qrewrite.targets.profile import TargetProfile

__all__ = ["NodeVerdict", "TargetPlan", "engine_options", "plan_for_model", "plan_for_target", "target_catalogue"]


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
            "nodes": [{**dataclasses.asdict(n), "status": n.status} for n in self.nodes],
            "after": [dataclasses.asdict(r) for r in self.after],
        }


def target_catalogue(catalogue: Catalogue, profile: TargetProfile) -> tuple[Catalogue, dict[str, str]]:
    """The rules to use for ``profile``: without those that rewrite only ops it keeps."""
    skipped = {}
    for rule in catalogue:
        if rule.match and all(ref.domain in ("", "ai.onnx") and ref.op in profile.keep for ref in rule.match):
            ops = ", ".join(ref.op for ref in rule.match)
            skipped[rule.id] = f"{profile.id} runs {ops} natively {profile.cite(profile.rewrites_source)}"
    kept = [r.id for r in catalogue if r.id not in skipped]
    return catalogue.select(only=kept) if skipped else catalogue, skipped


def engine_options(
    profile: TargetProfile,
    *,
    target_opset: int | None = None,
    keep_opset: bool = False,
    allow: Collection[str] | None = None,
) -> Any:
    """The engine's options for ``profile``: a rewrite never raises the opset above what the
    target loads (``[opset] max``), so rules that would need more give way to the next rule.
    Exactness levels as for any rewrite (exact first, bounded where no exact rule applies,
    approximate only when ``allow`` names it)."""
    from onnx_qrewrite import engine
    from onnx_qrewrite.opset import MAX_RUNTIME_OPSET

    highest = min(MAX_RUNTIME_OPSET, profile.opset_max or MAX_RUNTIME_OPSET)
    levels = frozenset(allow) if allow is not None else engine.DEFAULT_ALLOW
    return engine.EngineOptions(
        target_opset=target_opset,
        keep_opset=keep_opset,
        allow_unlowered=True,
        max_opset=highest,
        provenance="full",
        allow=levels,
    )


def _rewrite(model: onnx.ModelProto, catalogue: Catalogue, external: Any, options: Any) -> tuple[Any, Any, Any]:
    from onnx_qrewrite import engine
    from onnx_qrewrite.encoded import to_proto
    from onnx_qrewrite.errors import LoweringError

    try:
        out, report = engine.run(copy.deepcopy(model), catalogue, options, external)
    except LoweringError:
        if options.keep_opset:
            raise
        # Raising the opset failed: plan with the opset kept, as `inspect` does.
        options = dataclasses.replace(options, keep_opset=True, target_opset=None)
        out, report = engine.run(copy.deepcopy(model), catalogue, options, external)
    return to_proto(out), report, options


def _exactness(catalogue: Catalogue, rule_id: str | None) -> str | None:
    if rule_id is None:
        return None
    rule = next((r for r in catalogue if r.id == rule_id), None)
    value = getattr(rule, "exactness", None)
    return str(value) if value else None


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
    from onnx_qrewrite import model_io

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
    before = check_model(model, profile)
    chosen, skipped = target_catalogue(catalogue, profile)
    refused_now = {(r.scope, r.node) for r in before}
    options = engine_options(profile, target_opset=target_opset, keep_opset=keep_opset, allow=allow)
    for _ in range(len(chosen) + 1):
        rewritten, report, used = _rewrite(model, chosen, external, options)
        after = check_model(rewritten, profile)
        # Never make things worse: a rule that turned an accepted node into refused ones is dropped.
        worse = {
            r.rule
            for r in after
            if r.rule is not None and r.origin is not None and ("main", r.origin) not in refused_now
        }
        worse -= set(skipped)
        if not worse:
            break
        for rule_id in worse:
            skipped[rule_id] = f"it would turn nodes {profile.id} runs into nodes it refuses"
        chosen = chosen.select(skip=sorted(worse))

    rule_of = {(r.scope, r.node): r.rule for r in report.rewrites}
    after_by_origin: dict[str, list[Refused]] = {}
    for r in after:
        if r.origin is not None:
            after_by_origin.setdefault(r.origin, []).append(r)
    after_same = {(r.scope, r.node): r for r in after if r.origin is None}
    nodes = []
    for r in before:
        rule = rule_of.get((r.scope, r.node)) or rule_of.get((r.scope, r.node.split(" (in ")[0]))
        if rule is not None:
            still = after_by_origin.get(r.node, [])
            reasons = tuple(f"{s.node} ({s.op_key}): {'; '.join(s.reasons)}" for s in still)
        else:
            same = after_same.get((r.scope, r.node))
            reasons = same.reasons if same is not None else ()
        nodes.append(NodeVerdict(r.scope, r.node, r.op_key, r.reasons, rule, _exactness(chosen, rule), reasons))
    return TargetPlan(
        label, profile.id, profile.version, profile.proof, before, after, nodes, skipped, rewritten, chosen, used
    )
