"""Lowering a model's declared IR version, for a target whose runtime or parser knows only lower ones.

onnx 1.23's ``make_model`` writes IR 14, which onnxruntime 1.31.1 refuses ("Unsupported model IR
version: 14, max supported IR version: 13"), and an exporter at opset 23-26 writes IR 11-13 while
TensorRT 10.1's parser is built on onnx 1.16's onnx.proto (IR 10). The IR version is a
declaration: a model that uses nothing added after IR N means the same declared at N. This checks
that against ``rules/opsets/ir_versions.toml`` (what each IR version added, from onnx.proto) and
changes only ``ir_version``; a model that uses something newer keeps its IR version and the
target's refusal names what it uses. Neither onnx's checker nor onnxruntime holds a model to its
declaration (measured), so the table is the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import onnx

from onnx_qrewrite.rewriter.ir_table import IrAddition, ir_additions, ir_with_field

if TYPE_CHECKING:
    from onnx_qrewrite.targets.profile import TargetProfile

__all__ = ["IrAddition", "ir_additions", "ir_blockers", "ir_lowering", "ir_reason", "ir_with_field"]

_TABLE = "rules/opsets/ir_versions.toml"
#: Integer attributes that name an element type (Cast's ``to``, QuantizeLinear's ``output_dtype``,
#: EyeLike's and the Random ops' ``dtype``).
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "output_dtype"})


def _type_name(elem: int) -> str:
    return onnx.TensorProto.DataType.Name(elem).lower() if elem in onnx.TensorProto.DataType.values() else ""


def _type_proto(tp: onnx.TypeProto, where: str) -> Iterator[tuple[str, str]]:
    """("type:<name>" or "field:<Message.field>", where) for what a TypeProto uses."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield f"type:{_type_name(getattr(tp, kind).elem_type)}", where
    elif kind in ("sequence_type", "optional_type"):
        yield from _type_proto(getattr(tp, kind).elem_type, where)
    elif kind == "map_type":
        yield f"type:{_type_name(tp.map_type.key_type)}", where
        yield from _type_proto(tp.map_type.value_type, where)
    elif kind == "opaque_type":
        yield "field:TypeProto.opaque_type", where


def _tensor(t: onnx.TensorProto, where: str) -> Iterator[tuple[str, str]]:
    yield f"type:{_type_name(t.data_type)}", where
    if t.metadata_props:
        yield "field:TensorProto.metadata_props", where


def _attribute(attr: onnx.AttributeProto, node: str) -> Iterator[tuple[str, str]]:
    where = f"attribute {attr.name} of node {node}"
    if attr.type == onnx.AttributeProto.INT and attr.name in _TYPE_ATTRIBUTES:
        yield f"type:{_type_name(attr.i)}", where
    for t in (*([attr.t] if attr.HasField("t") else []), *attr.tensors):
        yield from _tensor(t, where)
    for sparse in (*([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []), *attr.sparse_tensors):
        yield from _tensor(sparse.values, where)
    for tp in (*([attr.tp] if attr.HasField("tp") else []), *attr.type_protos):
        yield from _type_proto(tp, where)
    for g in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
        yield from _graph(g, f"subgraph {attr.name} of node {node}")


def _node(node: onnx.NodeProto) -> Iterator[tuple[str, str]]:
    name = node.name or (node.output[0] if node.output else node.op_type)
    where = f"node {name} ({node.op_type})"
    for field in ("overload", "metadata_props", "device_configurations"):
        if node.HasField(field) if field == "overload" else len(getattr(node, field)):
            yield f"field:NodeProto.{field}", where
    for attr in node.attribute:
        yield from _attribute(attr, name)


def _graph(graph: onnx.GraphProto, where: str) -> Iterator[tuple[str, str]]:
    if graph.metadata_props:
        yield "field:GraphProto.metadata_props", where
    for t in graph.initializer:
        yield from _tensor(t, f"initializer {t.name!r}")
    for sparse in graph.sparse_initializer:
        yield from _tensor(sparse.values, f"initializer {sparse.values.name!r}")
    for vi in (*graph.input, *graph.output, *graph.value_info):
        yield from _type_proto(vi.type, f"value {vi.name!r}")
        if vi.metadata_props:
            yield "field:ValueInfoProto.metadata_props", f"value {vi.name!r}"
    for node in graph.node:
        yield from _node(node)


def _function(fn: onnx.FunctionProto) -> Iterator[tuple[str, str]]:
    where = f"function {fn.domain}.{fn.name}"
    for field in ("attribute_proto", "overload", "metadata_props"):
        if fn.HasField(field) if field == "overload" else len(getattr(fn, field)):
            yield f"field:FunctionProto.{field}", where
    for vi in fn.value_info:
        yield from _type_proto(vi.type, f"value {vi.name!r} of {where}")
    for node in fn.node:
        yield from _node(node)


def uses(model: onnx.ModelProto) -> Iterator[tuple[str, str]]:
    """Everything the model uses that an IR version may have added: ("type:<name>" or
    "field:<Message.field>", where in the model). ``model`` should carry inferred types."""
    if model.configuration:
        yield "field:ModelProto.configuration", "the model"
    yield from _graph(model.graph, "the main graph")
    for fn in model.functions:
        yield from _function(fn)


def ir_blockers(model: onnx.ModelProto, target: int) -> list[str]:
    """Why ``model`` cannot be declared at IR ``target`` (empty: it can): each use of something
    added after ``target``, or an IR version on the way that the table does not describe."""
    table = ir_additions()
    missing = [v for v in range(target + 1, model.ir_version + 1) if v not in table]
    if missing:
        return [f"what IR {missing[0]} added is not described ({_TABLE}), so lowering to IR {target} is not proven"]
    added = {f"type:{t}": a for v, a in table.items() if v > target for t in a.types}
    added.update({f"field:{f}": a for v, a in table.items() if v > target for f in a.fields})
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for use, where in uses(model):
        addition = added.get(use)
        if addition is None or (use, where) in seen:
            continue
        seen.add((use, where))
        kind, _, name = use.partition(":")
        what = f"is {name}" if kind == "type" else f"sets {name}"
        out.append(f"{where} {what}, added in IR {addition.version} {addition.cite}")
    return out


def ir_reason(model: onnx.ModelProto, profile: TargetProfile) -> str | None:
    """The target's model-wide refusal of the declared IR version, if it loads no higher."""
    if profile.ir_max is None or model.ir_version <= profile.ir_max:
        return None
    return (
        f"IR version {model.ir_version} is above the highest the target loads ({profile.ir_max}) "
        f"{profile.cite(profile.ir_source)}"
    )


def ir_lowering(inferred: onnx.ModelProto, profile: TargetProfile) -> tuple[dict[str, Any] | None, str | None]:
    """({"from", "to", "why"}, None) when ``profile`` loads IR versions only below the model's and
    the model uses nothing added after the target's; (None, why not) when it uses something;
    (None, None) when nothing is to lower. ``inferred``: the model with inferred types."""
    if ir_reason(inferred, profile) is None:
        return None, None
    limit = profile.ir_max
    assert limit is not None  # ir_reason said so
    blockers = ir_blockers(inferred, limit)
    if blockers:
        more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
        return None, f"; not lowered to IR {limit}: {blockers[0]}{more}"
    table = ir_additions()
    span = range(limit + 1, inferred.ir_version + 1)
    versions = f"IR {span[0]}" if len(span) == 1 else f"IR {span[0]}-{span[-1]}"
    cites = " ".join(sorted({table[v].cite for v in span}))
    why = (
        f"target {profile.id} loads IR versions up to {limit} {profile.cite(profile.ir_source)}; the model uses "
        f"nothing {versions} added {cites}"
    )
    return {"from": inferred.ir_version, "to": limit, "why": why}, None
