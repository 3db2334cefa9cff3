"""Targets: the runtimes a rewritten model is deployed to, as data (``rules/targets/*.toml``).

:mod:`.profile` loads and validates a target's profile, :mod:`.check` says which nodes of a model
the target refuses and why, :mod:`.plan` adds which rewrite fixes each refusal and what the target
would still refuse afterwards (``inspect --target``).

The names below are imported from their modules when first asked for: importing this package's
profiles, checks and planner cost ~0.1 s of CPU, which a plain ``rewrite`` (it reads only the IR
table, :mod:`onnx_qrewrite.rewriter.ir_table`) need not pay.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onnx_qrewrite.targets.check import Refused, check_model
    from onnx_qrewrite.targets.plan import NodeVerdict, TargetPlan, plan_for_model, plan_for_target, target_catalogue
    from onnx_qrewrite.targets.profile import TargetProfile, load_target, load_targets, shipped_targets_dir

#: Each exported name -> the module defining it.
_HOME = {
    "Refused": "check",
    "check_model": "check",
    "NodeVerdict": "plan",
    "TargetPlan": "plan",
    "plan_for_model": "plan",
    "plan_for_target": "plan",
    "target_catalogue": "plan",
    "TargetProfile": "profile",
    "load_target": "profile",
    "load_targets": "profile",
    "shipped_targets_dir": "profile",
}

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


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
