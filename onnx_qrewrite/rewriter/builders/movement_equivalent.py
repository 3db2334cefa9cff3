"""Flatten -> Reshape and Gather -> GatherND: the same values by another standard op (form
``movement-equivalents``), for targets that run the second op but not the first.

onnxruntime's CoreML execution provider builds Flatten and Gather only as NeuralNetwork layers, not
in the ML Program format it recommends (rules/targets/coreml.toml cites the op builders); its ML
Program table does list Reshape, GatherND (batch_dims 0), Unsqueeze, Transpose and Cast. Both
rewrites only select and reorder values, so they are exact on every type and value; what has to
be right is the output's shape and which element lands where, which these rules prove from the
shapes the model records and check in onnxruntime on the edge cases (tests/test_movement_equivalent.py).

**Flatten(x, axis=a)** is ``[prod(d[:a]), prod(d[a:])]`` of x's shape d. As ``Reshape(x, shape)``
with a constant shape (``allowzero`` 0):

- ``[P, Q]`` when both products are known from the recorded shapes;
- ``[-1, Q]`` when only ``Q = prod(d[a:])`` is known (x's trailing dimensions, or the second
  dimension of the Flatten's recorded output): onnxruntime infers ``total / Q = P``, an empty
  batch included (0 / Q = 0);
- ``[P, -1]`` when only P is known (axis 0 gives P = 1 whatever the rank).

Given way: P or Q known to be 0 (a ``-1`` beside a 0 cannot be inferred, and a 0 in the shape would
copy the input's dimension instead), and neither product known. ``[0, -1]`` for axis 1 would read
well but onnxruntime refuses it on an empty batch, where Flatten gives ``(0, Q)`` (measured,
onnxruntime 1.31.1: "The input tensor cannot be reshaped to the requested shape"); a shape
computed at run time needs a product of dimensions, which the targets this form is for (CoreML: no
ReduceProd, no integer Mul) do not run, so such a Flatten is left as it is.

**Gather(data, indices, axis=a)** is, for a = 0, ``GatherND(data, indices[..., None])`` with
batch_dims 0: each index picks one slice along the first axis, output shape ``indices.shape +
d[1:]``; negative indices count from the end in both kernels and an index out of ``[-s, s-1]`` is
an error in both (measured in onnxruntime). Constant indices are reshaped when the rewrite is made;
run-time ones get an ``Unsqueeze`` on the last axis (and a ``Cast`` to int64 where they are not
int64: GatherND takes int64 only). For a != 0 (data of known rank r, indices of known rank q),
``Transpose`` brings axis a first, GatherND gathers, and a second ``Transpose`` puts the q index
dimensions back after the first a dimensions: ``d[:a] + indices.shape + d[a+1:]``, Gather's shape.
Given way: a != 0 where either rank is not recorded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import TensorProto

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import value_shape
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["MovementEquivalentBuilder", "flatten_shape"]


def _product(dims: tuple[int | None, ...]) -> int | None:
    return None if any(d is None for d in dims) else math.prod(d for d in dims if d is not None)


def flatten_shape(
    axis: int, in_shape: tuple[int | None, ...] | None, out_shape: tuple[int | None, ...] | None
) -> list[int] | str:
    """The constant Reshape shape that gives Flatten(axis)'s result (module docstring), or why
    there is none."""
    rank = len(in_shape) if in_shape is not None else None
    if axis < 0:
        if rank is None:
            return f"axis {axis} with an input of unrecorded rank"
        axis += rank
    if rank is not None and not 0 <= axis <= rank:
        return f"axis {axis} outside [0, {rank}]"
    lead: int | None = 1 if axis == 0 else None
    trail: int | None = None
    if in_shape is not None:
        lead = _product(in_shape[:axis])
        trail = _product(in_shape[axis:])
    if out_shape is not None and len(out_shape) == 2:
        lead = lead if lead is not None else out_shape[0]
        trail = trail if trail is not None else out_shape[1]
    if lead == 0 or trail == 0:
        return "an empty tensor by its recorded shape: a constant shape cannot say it (0 copies a dimension)"
    if lead is not None and trail is not None:
        return [lead, trail]
    if trail is not None:
        return [-1, trail]
    if lead is not None:
        return [lead, -1]
    return (
        "neither the size before nor the size from the axis is recorded: a shape computed at run time would "
        "need a product of dimensions"
    )


def _rank(site: Site, name: str) -> int | None:
    constant = site.constant(name)
    if constant is not None:
        return constant.ndim
    shape = value_shape(site.scope, name, site.same_shape_ops)
    return None if shape is None else len(shape)


class MovementEquivalentBuilder:
    """Flatten -> Reshape with a constant shape; Gather -> (Transpose ->) GatherND (-> Transpose)."""

    name = "movement_equivalent"
    contract = CONTRACTS["movement_equivalent"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(0))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        op = site.node.op_type
        if op == "Flatten":
            return self._check_flatten(site)
        if op == "Gather":
            return self._check_gather(site)
        raise NotApplicable(f"{op}: this builder rewrites Flatten and Gather")

    def _check_flatten(self, site: Site) -> Plan:
        axis = int(site.attribute("axis", 1))
        x, y = site.input(0), site.outputs[0]
        found = flatten_shape(
            axis,
            value_shape(site.scope, x, site.same_shape_ops),
            value_shape(site.scope, y, site.same_shape_ops),
        )
        if isinstance(found, str):
            raise NotApplicable(found)
        return Plan(min_opset=kernel_opsets.FORMS["reshape"], notes=(f"shape {found}",), data={"shape": found})

    def _check_gather(self, site: Site) -> Plan:
        axis = int(site.attribute("axis", 0))
        data, indices = site.input(0), site.input(1)
        r = _rank(site, data)
        if axis < 0:
            if r is None:
                raise NotApplicable(f"axis {axis} with data of unrecorded rank")
            axis += r
        if axis == 0:
            return Plan(min_opset=kernel_opsets.FORMS["gather-nd"], notes=("axis 0",), data={"axis": 0})
        q = _rank(site, indices)
        if r is None or q is None:
            raise NotApplicable(f"axis {axis} with data or indices of unrecorded rank (the Transposes need both)")
        if not 0 <= axis < r:
            raise NotApplicable(f"axis {axis} outside data of rank {r}")
        return Plan(
            min_opset=kernel_opsets.FORMS["gather-nd"],
            notes=(f"axis {axis}, through Transposes",),
            data={"axis": axis, "r": r, "q": q},
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        out = site.outputs[0]
        if site.node.op_type == "Flatten":
            emit.op1("Reshape", [site.input(0), emit.const(np.array(plan.data["shape"], np.int64))], out)
            return
        data, indices = site.input(0), site.input(1)
        constant = site.constant(indices)
        if constant is not None:
            nd_indices = emit.const(constant.astype(np.int64)[..., None])
        else:
            if site.elem_type(indices) != TensorProto.INT64:
                indices = emit.op1("Cast", [indices], to=TensorProto.INT64)
            if emit.opset >= kernel_opsets.OP_VERSIONS["unsqueeze-axes-input"]:
                nd_indices = emit.op1("Unsqueeze", [indices, emit.const(np.array([-1], np.int64))])
            else:
                nd_indices = emit.op1("Unsqueeze", [indices], axes=[-1])
        axis = plan.data["axis"]
        if axis == 0:
            emit.op1("GatherND", [data, nd_indices], out)
            return
        r, q = plan.data["r"], plan.data["q"]
        front = [axis, *range(axis), *range(axis + 1, r)]
        moved = emit.op1("Transpose", [data], perm=front)
        gathered = emit.op1("GatherND", [moved, nd_indices])
        back = [*range(q, q + axis), *range(q), *range(q + axis, q + r - 1)]
        emit.op1("Transpose", [gathered], out, perm=back)


register(MovementEquivalentBuilder())
