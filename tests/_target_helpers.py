"""Issue 11's invariant, as one check the test files with real models share: `rewrite --target T`
never leaves T more to refuse than the model as given, nor turns a node T accepts into nodes it
refuses (what `rewrite` writes is checked, not only what the plan says)."""

from __future__ import annotations

from pathlib import Path

import onnx

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.targets import check_model, load_targets, plan_for_model


def assert_never_worse(model: onnx.ModelProto | Path) -> dict[str, tuple[int, int]]:
    """For every shipped target: refused after <= before; returns {target: (before, after)}."""
    proto = onnx.load(model) if isinstance(model, Path) else model
    catalogue = load_rules()
    counts = {}
    for profile in load_targets().values():
        plan = plan_for_model(proto, catalogue, profile)
        written = rewrite(proto, rules=catalogue, target=profile.id, allow_unlowered=True, provenance="full").model
        after = check_model(written, profile)
        assert len(after) == plan.refused_after <= len(plan.before), (profile.id, len(plan.before), len(after))
        accepted_before = {(r.scope, r.node) for r in plan.before}
        newly = [r for r in after if (r.scope, r.origin or r.node) not in accepted_before]
        assert not newly, (profile.id, newly[:2])
        counts[profile.id] = (len(plan.before), len(after))
    return counts
