"""What each ONNX IR version added (``rules/opsets/ir_versions.toml``): the table the target IR
lowering (``targets/lower_ir.py``) checks a model against, and what a plain rewrite asks of it
(the IR version its node provenance needs, ``api._provenance_needs_ir``).

A module of its own, outside :mod:`onnx_qrewrite.targets`: importing anything under that package
imports the package's ``__init__``, i.e. the target profiles, the planner and the shape inference
(~30 ms of CPU), which a rewrite without ``--target`` does not use.
"""

from __future__ import annotations

import functools

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InternalError
from onnx_qrewrite.rewriter.opset_tables import opset_table

__all__ = ["IrAddition", "ir_additions", "ir_with_field"]


@dataclass(frozen=True)
class IrAddition:
    """What one IR version added that a model can use."""

    version: int
    added: str
    types: frozenset[str]
    fields: tuple[str, ...]
    cite: str


@functools.cache
def ir_additions() -> dict[int, IrAddition]:
    """The shipped table, by IR version; checked so that a typo cannot make a feature invisible."""
    table = opset_table("ir_versions")
    known_types = {name.lower() for name, _ in onnx.TensorProto.DataType.items()}
    out = {}
    for raw in table.rows("ir"):
        where = f"{table.path}: [[ir]] version {raw.get('version')}"
        if not table.cites(raw):
            raise InternalError(f"{where} cites no [[source]]")
        if unknown := sorted(set(raw["types"]) - known_types):
            raise InternalError(f"{where}: unknown element type {unknown[0]!r}")
        for field in raw["fields"]:
            message, _, name = field.partition(".")
            # From the descriptor of onnx.proto's file: a name the package's message classes do not
            # list would import onnx in a process that needs none of it (onnx_qrewrite/_onnx.py).
            proto = onnx.ModelProto.DESCRIPTOR.file.message_types_by_name.get(message)
            if proto is None or name not in proto.fields_by_name:
                raise InternalError(f"{where}: no field {field!r} in onnx's protos")
        out[raw["version"]] = IrAddition(
            raw["version"], raw["added"], frozenset(raw["types"]), tuple(raw["fields"]), f"[opsets/{raw['source']}]"
        )
    return out


def ir_with_field(field: str) -> int:
    """The IR version that added ``field`` ("NodeProto.metadata_props": 10), from the table."""
    return min(v for v, a in ir_additions().items() if field in a.fields)
