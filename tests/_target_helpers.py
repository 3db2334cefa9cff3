"""Issue 11's invariant, as one check the test files with real models share: `rewrite --target T`
never leaves T more to refuse than the model as given, nor turns a node T accepts into nodes it
refuses (what `rewrite` writes is checked, not only what the plan says)."""

from __future__ import annotations

from pathlib import Path

import onnx

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.targets import check_model, load_targets


def assert_never_worse(model: onnx.ModelProto | Path) -> dict[str, tuple[int, int]]:
    """For every shipped target: refused after <= before; returns {target: (before, after)}.

    The plan checked is the one ``rewrite`` made and wrote by (its report's ``target``,
    targets.TargetPlan.to_dict()): planning it again beside the rewrite gave the same plan at the
    cost of a second rewrite per target. What the target refuses before is checked here, on the
    model as given."""
    proto = onnx.load(model) if isinstance(model, Path) else model
    catalogue = load_rules()
    counts = {}
    for profile in load_targets().values():
        before = check_model(proto, profile)
        result = rewrite(proto, rules=catalogue, target=profile.id, allow_unlowered=True, provenance="full")
        plan = result.report.target
        assert plan is not None, profile.id
        after = check_model(result.model, profile)
        assert len(after) == plan["refused_after"] <= plan["refused_before"] == len(before), (
            profile.id,
            len(before),
            plan["refused_before"],
            plan["refused_after"],
            len(after),
        )
        accepted_before = {(r.scope, r.node) for r in before}
        newly = [r for r in after if (r.scope, r.origin or r.node) not in accepted_before]
        assert not newly, (profile.id, newly[:2])
        counts[profile.id] = (len(before), len(after))
    return counts
