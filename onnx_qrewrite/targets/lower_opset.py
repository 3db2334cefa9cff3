"""Lowering a model's default-domain opset exactly, for a target that loads only lower opsets.

TensorRT's parser loads opsets up to 20, while onnxruntime.quantization writes opset 21 for 16-bit
Q/DQ and newer exporters write 22-26; once the rewrite has replaced what needed the newer opset, the
model often runs unchanged at 20. This proves that node by node, one opset step at a time (26 -> 25
... 21 -> 20), and only then changes the opset import; nothing else in the model changes (node
metadata and provenance included).

Why not onnx's ``version_converter.convert_version(model, 20)``: measured on onnx 1.23.2, it
drops every node's ``metadata_props`` (our provenance), rewrites value_info, and refuses by
assertion what it cannot adapt (uint16 QuantizeLinear, blocked DequantizeLinear, output_dtype,
GroupNormalization-21) with C++ messages; the exact cases it handles are exactly those where the
import alone may change, which is what this step does with reasons a user can read.

Policy (which ops changed between two opsets and whether lowering each is exact) is data:
``rules/opsets/lowering.toml``, citing onnx's Changelog; the per-node check uses onnx's own
schemas (``onnx.defs.get_schema(op, max_inclusive_version=...)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from onnx import defs

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InternalError, LoweringError
from onnx_qrewrite.rewriter.graph import Scope, iter_scopes
from onnx_qrewrite.rewriter.opset_tables import opset_table
from onnx_qrewrite.targets.check import Refused, _inferred, check_model

if TYPE_CHECKING:
    from collections.abc import Iterator

    from onnx_qrewrite.targets.profile import TargetProfile

__all__ = [
    "LoweringStep",
    "OpChange",
    "check_for_target",
    "lower_default_opset",
    "lowering_blockers",
    "lowering_for_target",
    "lowering_steps",
    "set_default_opset",
]

_EXACT = ("when-valid", "never", "absent")


@dataclass(frozen=True)
class OpChange:
    """What changed in one op between a step's two opsets, and whether a node of it lowers exactly."""

    change: str
    exact: str  # "when-valid" (only types/attributes added), "never" (semantics changed), "absent" (new op)
    #: "when-valid" ops whose semantics changed only for some attribute values or tensor types: a
    #: node setting one of these values (``ceil_mode = 1``) or using one of these types blocks.
    differs_if_attribute: tuple[tuple[str, int | float | str], ...] = ()
    differs_if_type: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoweringStep:
    """One opset step down (``source`` -> ``target``), with every op that changed at ``source``."""

    source: int
    target: int
    ops: dict[str, OpChange]
    cite: str  # "[opsets/<source id>]"


@functools.cache
def lowering_steps() -> dict[int, LoweringStep]:
    """The shipped lowering table, keyed by the opset each step lowers from."""
    table = opset_table("lowering")
    path = table.path
    steps = {}
    for raw in table.rows("step"):
        if not table.cites(raw) or raw["to"] != raw["from"] - 1:
            step = f"step {raw.get('from')} -> {raw.get('to')}"
            raise InternalError(f"{path}: {step} cites no [[source]] or skips an opset")
        ops: dict[str, OpChange] = {}
        for entry in raw.get("op", []):
            if twice := sorted(set(entry["names"]) & set(ops)):
                raise InternalError(f"{path}: step {raw['from']} -> {raw['to']} lists {', '.join(twice)} twice")
            ops.update(dict.fromkeys(entry["names"], _op_change(path, entry)))
        steps[raw["from"]] = LoweringStep(raw["from"], raw["to"], ops, f"[opsets/{raw['source']}]")
    return steps


def _op_change(path: Path, entry: dict[str, Any]) -> OpChange:
    """One ``[[step.op]]`` entry of the table, checked."""
    if entry["exact"] not in _EXACT:
        raise InternalError(f"{path}: exact = {entry['exact']!r} (one of {', '.join(_EXACT)})")
    attrs = tuple(sorted(entry.get("differs_if_attribute", {}).items()))
    types = tuple(entry.get("differs_if_type", ()))
    if (attrs or types) and entry["exact"] != "when-valid":
        raise InternalError(f'{path}: {entry["names"]}: differs_if_* only qualifies exact = "when-valid"')
    return OpChange(entry["change"], entry["exact"], attrs, types)


def _type_name(elem: int) -> str:
    return onnx.TensorProto.DataType.Name(elem).lower()


def _io_problem(node: onnx.NodeProto, scope: Scope, schema: defs.OpSchema, opset: int) -> str | None:
    """Why ``node``'s inputs or outputs are not valid for ``schema`` (the op at ``opset``), if so."""
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    variadic = defs.OpSchema.FormalParameterOption.Variadic
    bound: dict[str, tuple[str, str]] = {}  # type parameter -> (the type it is bound to, by which value)
    for kind, names, params in (("input", node.input, schema.inputs), ("output", node.output, schema.outputs)):
        for index, name in enumerate(names):
            if not name:
                continue
            if index >= len(params) and not (params and params[-1].option == variadic):
                return f"has {len(names)} {kind}s, more than {node.op_type} takes at opset {opset}"
            param = params[min(index, len(params) - 1)]
            elem = scope.elem_type(name)
            if not elem:
                return f"the type of {kind} {name!r} is not known, so it cannot be shown valid at opset {opset}"
            if f"tensor({_type_name(elem)})" not in allowed.get(param.type_str, {param.type_str}):
                return f"{kind} {name!r} is {_type_name(elem)}, which {node.op_type} does not take at opset {opset}"
            first = bound.setdefault(param.type_str, (_type_name(elem), name))
            if first[0] != _type_name(elem) and param.type_str in allowed and param.is_homogeneous:
                return (
                    f"{kind} {name!r} is {_type_name(elem)} and {first[1]!r} is {first[0]}, which {node.op_type} "
                    f"requires to be one type ({param.type_str}) at opset {opset}"
                )
    return None


def _node_problem(node: onnx.NodeProto, scope: Scope, step: LoweringStep) -> str | None:
    """Why ``node`` does not compute the same at ``step.target`` (None: it does)."""
    try:
        current = defs.get_schema(node.op_type, step.source, "")
    except defs.SchemaError:
        return f"{node.op_type} does not exist at opset {step.source}"
    if current.since_version < step.source:
        return None  # the same schema at both opsets
    change = step.ops.get(node.op_type)
    if change is None:
        return f"{node.op_type} changed at opset {step.source} and the lowering table does not describe it"
    if change.exact == "never":
        return f"{node.op_type} computes something else at opset {step.target}: {change.change}"
    try:
        lower = defs.get_schema(node.op_type, step.target, "")
    except defs.SchemaError:
        return f"{node.op_type} does not exist at opset {step.target} ({change.change})"
    extra = [a.name for a in node.attribute if a.name not in lower.attributes]
    if extra:
        return f"sets {', '.join(extra)}, which {node.op_type} does not have at opset {step.target} ({change.change})"
    problem = _io_problem(node, scope, lower, step.target) or _differs(node, scope, change, step.target)
    return f"{problem} ({change.change})" if problem else None


def _differs(node: onnx.NodeProto, scope: Scope, change: OpChange, opset: int) -> str | None:
    """Why a node valid at ``opset`` still computes something else there: it sets an attribute
    value, or uses a tensor type, for which the op's semantics changed (None: neither)."""
    for attr in node.attribute:
        for name, value in change.differs_if_attribute:
            if attr.name == name and _attribute_value(attr) == value:
                return f"sets {name} = {value!r}, for which {node.op_type} computes something else at opset {opset}"
    names = [n for n in (*node.input, *node.output) if n]
    for name in names:
        elem = scope.elem_type(name)
        if elem and _type_name(elem) in change.differs_if_type:
            return f"{name!r} is {_type_name(elem)}, for which {node.op_type} computes something else at opset {opset}"
    return None


def _attribute_value(attr: onnx.AttributeProto) -> object:
    """An attribute's value as Python (a string attribute decoded)."""
    value = onnx.helper.get_attribute_value(attr)
    return value.decode() if isinstance(value, bytes) else value


def _problems(model: onnx.ModelProto, step: LoweringStep) -> list[str]:
    """Per default-domain node that blocks ``step``: "<node> (<op>): why"."""
    out = []
    for scope in iter_scopes(model):
        if scope.default_opset != step.source:
            continue
        for node in scope.container.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            why = _node_problem(node, scope, step)
            if why:
                name = node.name or (node.output[0] if node.output else "")
                where = "" if scope.path == "main" else f" in {scope.path}"
                out.append(
                    f"node {name} ({node.op_type}){where}: {why} [step {step.source} -> {step.target}] {step.cite}"
                )
    return out


def _default_opset(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def lowering_blockers(model: onnx.ModelProto, target: int) -> list[str]:
    """Why lowering ``model``'s default-domain opset to ``target`` would not be exact (empty: it
    would be). ``model`` should carry inferred types (value_info): a changed op whose types are
    unknown cannot be shown valid and blocks the step.

    The steps run one opset at a time (23 -> 22 -> 21 -> 20), each judging the model as declared
    at its ``from``; the first step a node blocks is the answer, since the model at the steps
    below it would not be the same model (an Attention-23 node has no schema at 22 to judge)."""
    current = _default_opset(model)
    if current is None or current <= target:
        return []
    steps = lowering_steps()
    for version in range(current, target, -1):
        step = steps.get(version)
        if step is None:
            table = "rules/opsets/lowering.toml"
            return [f"no exact lowering from opset {version} to {version - 1} is described ({table})"]
        with _declared_at(model, version):
            blockers = _problems(model, step)
        if blockers:
            return blockers
    return []


@contextlib.contextmanager
def _declared_at(model: onnx.ModelProto, version: int) -> Iterator[None]:
    """``model`` declaring ``version`` for the duration (its imports restored after): judging each
    step on a copy would copy the weights once per step."""
    imports = [*model.opset_import, *(o for fn in model.functions for o in fn.opset_import)]
    saved = [(entry, entry.version) for entry in imports if entry.domain in ("", "ai.onnx")]
    set_default_opset(model, version)
    try:
        yield
    finally:
        for entry, before in saved:
            entry.version = before


def _with_default_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """``model`` as it is at ``version`` (the model itself when it declares it already)."""
    if _default_opset(model) == version:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    set_default_opset(copy, version)
    return copy


def set_default_opset(model: onnx.ModelProto, version: int) -> None:
    """The default-domain import of the model and of each local function that imports a higher one."""
    imports = [*model.opset_import, *(o for fn in model.functions for o in fn.opset_import)]
    for entry in imports:
        if entry.domain in ("", "ai.onnx") and entry.version > version:
            entry.version = version


def lower_default_opset(
    model: onnx.ModelProto, target: int, inferred: onnx.ModelProto | None = None
) -> onnx.ModelProto:
    """A copy of ``model`` with its default-domain opset lowered to ``target``, when that is exact
    (:func:`lowering_blockers`, judged on ``inferred``, the model with inferred types, computed
    when not given); otherwise :class:`LoweringError` naming the first node that blocks it.
    The result passes onnx's checker and strict shape inference at ``target``."""
    blockers = lowering_blockers(inferred if inferred is not None else _inferred(model), target)
    if blockers:
        more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
        raise LoweringError(f"cannot lower the opset to {target} exactly: {blockers[0]}{more}")
    lowered = _with_default_opset(model, target)
    _check_lowered(lowered, target)
    return lowered


def _check_lowered(lowered: onnx.ModelProto, target: int) -> None:
    """onnx's checker and strict shape inference on the lowered model: our per-node proof and
    onnx's own must agree, or it is a bug here (exit 5), never a model to ship."""
    from onnx_qrewrite.errors import InternalError, first_line
    from onnx_qrewrite.io import model_io

    what = f"the model lowered to opset {target} (a bug, please report it)"
    model_io.check_model(lowered, what=what, error=InternalError)
    try:
        onnx.shape_inference.infer_shapes(lowered, check_type=True, strict_mode=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types for what it cannot infer
        raise InternalError(f"{what}: onnx's shape inference: {first_line(exc)}") from None


def check_for_target(
    model: onnx.ModelProto,
    profile: TargetProfile,
    *,
    may_lower: bool = True,
    inferred: onnx.ModelProto | None = None,
) -> list[Refused]:
    """What ``profile`` refuses of ``model`` as ``rewrite --target`` would ship it: lowered to the
    target's highest opset when the model declares a higher one and the lowering is exact, and to
    its highest IR version when the model uses nothing newer (lower_ir.py); then neither is a
    refusal. Otherwise the model-wide refusal says what blocks the lowering.
    ``inferred``: ``model`` with inferred types (check._inferred), when the caller has it."""
    from onnx_qrewrite.targets.check import _opset_reasons
    from onnx_qrewrite.targets.lower_ir import ir_lowering, ir_reason

    if inferred is None:
        inferred = _inferred(model)
    lower_to, opset_why = _opset_plan(inferred, profile, may_lower)
    ir_low, ir_why = ir_lowering(inferred, profile)
    ir_to = ir_low["to"] if ir_low else None
    if lower_to is not None:
        refused = check_model(_declared(model, lower_to, ir_to), profile)
    else:
        with _ir_declared(inferred, ir_to):
            refused = check_model(model, profile, inferred=inferred)
    suffix = dict.fromkeys(_opset_reasons(inferred, profile), opset_why or "")
    if ir_why:
        suffix[ir_reason(inferred, profile) or ""] = ir_why
    return [
        dataclasses.replace(r, reasons=tuple(reason + suffix.get(reason, "") for reason in r.reasons))
        if r.node == "(model)"
        else r
        for r in refused
    ]


def _opset_plan(inferred: onnx.ModelProto, profile: TargetProfile, may_lower: bool) -> tuple[int | None, str | None]:
    """(the opset to lower to, None) when the model declares more than ``profile`` loads and the
    lowering is exact; (None, why not) when it is not; (None, None) when nothing is to lower."""
    limit, opset = profile.opset_max, _default_opset(inferred)
    if limit is None or opset is None or opset <= limit:
        return None, None
    if not may_lower:
        return None, "; not lowered: the opset is kept (--keep-opset) or chosen (--target-opset)"
    if blockers := lowering_blockers(inferred, limit):
        more = f" (and {len(blockers) - 1} more node(s))" if len(blockers) > 1 else ""
        return None, f"; not lowered to {limit}: {blockers[0]}{more}"
    return limit, None


def _declared(model: onnx.ModelProto, opset: int, ir_version: int | None) -> onnx.ModelProto:
    """A copy of ``model`` declaring ``opset`` (and ``ir_version``, when given)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    set_default_opset(copy, opset)
    if ir_version is not None:
        copy.ir_version = ir_version
    return copy


@contextlib.contextmanager
def _ir_declared(model: onnx.ModelProto, ir_version: int | None) -> Iterator[None]:
    """``model`` declaring ``ir_version`` for the duration (None: as it is)."""
    before = model.ir_version
    if ir_version is not None:
        model.ir_version = ir_version
    try:
        yield
    finally:
        model.ir_version = before


def lowering_for_target(
    model: onnx.ModelProto, profile: TargetProfile, *, may_lower: bool = True
) -> tuple[onnx.ModelProto, dict[str, Any] | None, dict[str, Any] | None]:
    """``model`` as it ships to ``profile``: its opset lowered to the target's highest when it
    declares a higher one and that is exact, its IR version lowered when the target loads only
    lower ones and the model uses nothing newer; with what was done to each ({"from", "to",
    "why"}, or None)."""
    from onnx_qrewrite.targets.lower_ir import ir_lowering, ir_reason

    limit, opset = profile.opset_max, _default_opset(model)
    if (not may_lower or limit is None or opset is None or opset <= limit) and ir_reason(model, profile) is None:
        return model, None, None  # nothing to lower: no shape inference of the whole model
    inferred = _inferred(model)
    lower_to, _ = _opset_plan(inferred, profile, may_lower)
    ir_low, _ = ir_lowering(inferred, profile)
    opset_low = None
    if lower_to is not None:
        opset = _default_opset(model)
        steps = lowering_steps()
        cites = " ".join(sorted({steps[v].cite for v in range(opset or lower_to, lower_to, -1)}))
        why = (
            f"target {profile.id} loads opsets up to {lower_to} {profile.cite(profile.opset_source)}; every node "
            f"computes the same at {lower_to} {cites}"
        )
        model = lower_default_opset(model, lower_to, inferred)
        opset_low = {"from": opset, "to": lower_to, "why": why}
    if ir_low is not None:
        if opset_low is None:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            model = copy
        model.ir_version = ir_low["to"]
    return model, opset_low, ir_low
