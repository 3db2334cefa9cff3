"""Targets: the runtimes a rewritten model is deployed to, as data (``rules/targets/*.toml``).

:mod:`.profile` loads and validates a target's profile, :mod:`.check` says which nodes of a model
the target refuses and why, :mod:`.plan` adds which rewrite fixes each refusal and what the target
would still refuse afterwards (``inspect --target``).
"""

from __future__ import annotations

from onnx_qrewrite.targets.check import Refused, check_model
from onnx_qrewrite.targets.plan import NodeVerdict, TargetPlan, plan_for_model, plan_for_target, target_catalogue
from onnx_qrewrite.targets.profile import TargetProfile, load_target, load_targets, shipped_targets_dir

__all__ = [
    "NodeVerdict",
    "Refused",
    "TargetPlan",
    "TargetProfile",
    "check_model",
    "load_target",
    "load_targets",
    "plan_for_model",
    "plan_for_target",
    "shipped_targets_dir",
    "target_catalogue",
]
