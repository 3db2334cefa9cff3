"""Run vendor ops inside onnxruntime with the numpy reference kernels of :mod:`.kernels`.

onnxruntime cannot load ``com.amd.quark`` / ``com.vai.quantize`` / oneDNN ops without the vendor's
library, so the original model is prepared before its session is created: every vendor node is
*retargeted* to an op of the private domain :data:`REFERENCE_DOMAIN` whose name encodes its dtypes
(``QuarkQuantize_int16``, ``DynamicDequantize_uint8_int8_float``, ...), and each of those ops is an
onnxruntime-extensions Python op calling the numpy kernel. A Python op has fixed input and output
types per registration, hence one registration per dtype combination.

Facts about onnxruntime-extensions 0.15.2 with onnxruntime 1.31.1 this module is built on (each
was run):

* Python ops work, in any domain (``"domain::Op"`` as the op type), for uint8/int8/uint16/int16/
  uint32/int32/float32 tensors and int64/string attributes.
* A declared attribute must be present on the node (the kernel fails to build otherwise), so the
  retargeted node always carries every attribute, with the vendor's default filled in: which
  default applies is part of the measured semantics (Quark: axis 0 when absent).
* float16 and bfloat16 tensors **abort the process** in a Python op ("Type float16 not supported
  by python customops api"). They cross the boundary as float32 instead: a ``Cast`` to float32
  before the op and a ``Cast`` back after it. Both casts are exact (every float16/bfloat16 value is
  a float32 value, and a float32 holding one rounds to itself), and the kernel converts back to the
  narrow type before computing, so the rounding that matters happens in numpy, in the kernel.
* The extension keeps its op factories in a ``std::vector`` per domain and hands sessions
  pointers into it: registering an op after a session exists can move the vector (a later session
  crashed with a segfault). All variants are therefore registered at once, on first use, before
  any session that needs them is created, and never again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import VERIFY_EXTRA, InvalidModelError, MissingDependencyError
from onnx_qrewrite.rewriter.graph import NameAllocator, iter_scopes, subgraphs
from onnx_qrewrite.verify import _kernel_errors, kernels

__all__ = [
    "REFERENCE_DOMAIN",
    "find_vendor_nodes",
    "iter_all_nodes",
    "register_reference_kernels",
    "retarget_vendor_nodes",
    "take_kernel_errors",
    "vendor_kind",
]

logger = logging.getLogger(__name__)

#: Private domain of the retargeted nodes; never written to a saved model.
REFERENCE_DOMAIN = "ai.onnx_qrewrite.reference"

_QUARK_QUANTIZE = {("com.amd.quark", "ExtendedQuantizeLinear"), ("com.vai.quantize", "VitisQuantizeLinear")}
_QUARK_DEQUANTIZE = {("com.amd.quark", "ExtendedDequantizeLinear"), ("com.vai.quantize", "VitisDequantizeLinear")}
_STANDARD_DOMAINS = ("", "ai.onnx")

#: Zero-point types Quark's kernels accept (the output type of its quantize op).
QUARK_TYPES = (
    TensorProto.UINT8,
    TensorProto.INT8,
    TensorProto.UINT16,
    TensorProto.INT16,
    TensorProto.UINT32,
    TensorProto.INT32,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
)
DYNAMIC_DEQUANTIZE_SRC_TYPES = (TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32)
DYNAMIC_DEQUANTIZE_ZP_TYPES = (None, TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32)
DYNAMIC_DEQUANTIZE_SCALE_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)

_NARROW_FLOATS = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _type_name(elem_type: int | None) -> str:
    return "nozp" if elem_type is None else TensorProto.DataType.Name(elem_type).lower()


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def _boundary_type(elem_type: int) -> int:
    """The type a tensor has while it crosses into or out of a Python op."""
    return TensorProto.FLOAT if elem_type in _NARROW_FLOATS else elem_type


@dataclass(frozen=True)
class _Variant:
    """One registered Python op: a numpy kernel at fixed input and output dtypes."""

    op_type: str
    input_types: tuple[int, ...]
    output_type: int
    attrs: tuple[tuple[str, str], ...]  # (name, "int" | "string")
    kernel: Callable[..., np.ndarray]

    def __call__(self, *arrays: np.ndarray, node: str = "", **attrs: object) -> np.ndarray:
        # An exception must not escape: onnxruntime-extensions 0.15.2 aborts the whole process when
        # a Python op raises. The error is recorded for ModelRunner to raise after the run, and an
        # empty tensor goes downstream instead.
        try:
            # Narrow floats arrive widened to float32 (module docstring): narrow them back, exactly,
            # so the kernel sees the dtypes the vendor kernel sees.
            args = [
                a.astype(_np_dtype(t)) if t in _NARROW_FLOATS else a
                for a, t in zip(arrays, self.input_types, strict=True)
            ]
            y = np.asarray(self.kernel(*args, **attrs))
        except Exception as exc:  # noqa: BLE001 - reported by take_kernel_errors(), see above
            _KERNEL_ERRORS.append(f"node {node!r}: reference kernel {self.op_type}: {exc}")
            y = np.zeros(0, _np_dtype(self.output_type))
        return y.astype(_np_dtype(_boundary_type(self.output_type)))


_KERNEL_ERRORS = _kernel_errors.ERRORS
#: Errors the reference kernels met since the last call (and forget them).
take_kernel_errors = _kernel_errors.take


def _quark_variants() -> Iterator[_Variant]:
    attrs = (("axis", "int"), ("node", "string"))
    for t in QUARK_TYPES:
        yield _Variant(
            f"QuarkQuantize_{_type_name(t)}",
            (TensorProto.FLOAT, TensorProto.FLOAT, t),
            t,
            attrs,
            kernels.quark_quantize,
        )
        yield _Variant(
            f"QuarkDequantize_{_type_name(t)}",
            (t, TensorProto.FLOAT, t),
            TensorProto.FLOAT,
            attrs,
            kernels.quark_dequantize,
        )


def _dynamic_dequantize_name(src: int, zp: int | None, scale: int) -> str:
    return f"DynamicDequantize_{_type_name(src)}_{_type_name(zp)}_{_type_name(scale)}"


def _dynamic_dequantize_variants() -> Iterator[_Variant]:
    attrs = (("qtype", "string"), ("axis", "int"), ("node", "string"))
    for src in DYNAMIC_DEQUANTIZE_SRC_TYPES:
        for zp in DYNAMIC_DEQUANTIZE_ZP_TYPES:
            for scale in DYNAMIC_DEQUANTIZE_SCALE_TYPES:
                inputs = (src, scale) if zp is None else (src, scale, zp)
                yield _Variant(
                    _dynamic_dequantize_name(src, zp, scale),
                    inputs,
                    scale,
                    attrs,
                    kernels.dynamic_dequantize,
                )


@functools.cache
def _variants() -> dict[str, _Variant]:
    return {v.op_type: v for v in (*_quark_variants(), *_dynamic_dequantize_variants())}


@functools.cache
def register_reference_kernels() -> str:
    """Register every reference Python op (once per process); returns the library to load.

    Cached: the second call must not register again (see the module docstring on why
    registering after a session exists is unsafe).
    """
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path
        from onnxruntime_extensions._ocos import Opdef
    except ImportError:
        raise MissingDependencyError(
            "verifying a model with vendor ops runs them on reference kernels, which need "
            f"onnxruntime-extensions (not installed): {VERIFY_EXTRA}, or give --custom-op-library"
        ) from None

    pytype: dict[int, Any] = {
        TensorProto.FLOAT: PyCustomOpDef.dt_float,
        TensorProto.UINT8: PyCustomOpDef.dt_uint8,
        TensorProto.INT8: PyCustomOpDef.dt_int8,
        TensorProto.UINT16: PyCustomOpDef.dt_uint16,
        TensorProto.INT16: PyCustomOpDef.dt_int16,
        TensorProto.UINT32: PyCustomOpDef.dt_uint32,
        TensorProto.INT32: PyCustomOpDef.dt_int32,
    }
    attr_type = {"int": PyCustomOpDef.dt_int64, "string": PyCustomOpDef.dt_string}
    for variant in _variants().values():
        Opdef.create(
            variant,
            op_type=f"{REFERENCE_DOMAIN}::{variant.op_type}",
            inputs=[pytype[_boundary_type(t)] for t in variant.input_types],
            outputs=[pytype[_boundary_type(variant.output_type)]],
            attrs={name: attr_type[kind] for name, kind in variant.attrs},
        )
    logger.debug("registered %d reference kernels in %s", len(_variants()), REFERENCE_DOMAIN)
    return get_library_path()


def vendor_kind(node: onnx.NodeProto) -> str | None:
    """``"quantize"``, ``"dequantize"`` or ``"dynamic_dequantize"`` for a vendor node we can run."""
    key = (node.domain, node.op_type)
    if key in _QUARK_QUANTIZE:
        return "quantize"
    if key in _QUARK_DEQUANTIZE:
        return "dequantize"
    if node.op_type == "DynamicDequantize" and node.domain not in _STANDARD_DOMAINS:
        return "dynamic_dequantize"
    return None


def iter_all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node: main graph, If/Loop/Scan bodies at any depth, model-local functions."""
    for scope in iter_scopes(model):
        yield from scope.container.node


def find_vendor_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Vendor nodes of every graph of ``model`` that a reference kernel can run."""
    found = []
    for scope in iter_scopes(model):
        for node in scope.container.node:
            if not vendor_kind(node):
                continue
            if scope.is_function:
                raise InvalidModelError(
                    f"node {node.name or node.op_type!r} ({node.domain}::{node.op_type}) is inside the local "
                    f"function {scope.root.container.name!r}, where the reference kernels cannot run it; "
                    "pass --custom-op-library with the vendor's library"
                )
            found.append(node)
    return found


def _known_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of every value whose type is declared or inferable by onnx."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as exc:  # noqa: BLE001 - inference is a convenience; declared types still count
        logger.debug("shape inference failed (%s); using declared types only", exc)
        inferred = model
    types: dict[str, int] = {}
    for scope in iter_scopes(inferred):
        if not scope.is_function:
            types.update(scope.declared_types)
    return types


class _Retargeter:
    """Rewrites vendor nodes of one model into reference-domain nodes (see the module docstring)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.types = _known_types(model)
        self.fresh = NameAllocator(model).fresh

    def graph(self, graph: onnx.GraphProto) -> int:
        new_nodes: list[onnx.NodeProto] = []
        count = 0
        for node in graph.node:
            for _, sub in subgraphs(node):
                count += self.graph(sub)
            if vendor_kind(node):
                new_nodes.extend(self.node(node))
                count += 1
            else:
                new_nodes.append(node)
        del graph.node[:]
        graph.node.extend(new_nodes)
        return count

    def _type_of(self, *names: str) -> int | None:
        for name in names:
            if name and name in self.types:
                return self.types[name]
        return None

    def _quark_call(self, node: onnx.NodeProto, label: str) -> tuple[_Variant, list[str], dict[str, Any]]:
        if len(node.input) != 3 or not all(node.input):
            raise InvalidModelError(f"{label}: needs exactly three inputs (x, scale, zero point)")
        x, scale, zp = node.input
        quantize = vendor_kind(node) == "quantize"
        qtype = self._type_of(zp, node.output[0] if quantize else x)
        if qtype not in QUARK_TYPES:
            what = "unknown" if qtype is None else TensorProto.DataType.Name(qtype)
            raise InvalidModelError(f"{label}: no reference kernel for zero point type {what}")
        variant = _variants()[f"{'QuarkQuantize' if quantize else 'QuarkDequantize'}_{_type_name(qtype)}"]
        axis = next((a.i for a in node.attribute if a.name == "axis"), kernels.QUARK_DEFAULT_AXIS)
        return variant, [x, scale, zp], {"axis": int(axis)}

    def _dynamic_dequantize_call(self, node: onnx.NodeProto, label: str) -> tuple[_Variant, list[str], dict[str, Any]]:
        src, scales = node.input[0], node.input[1]
        zps = node.input[2] if len(node.input) > 2 and node.input[2] else None
        src_t, scale_t = self._type_of(src), self._type_of(scales)
        zp_t = self._type_of(zps) if zps else None
        name = None
        if src_t is not None and scale_t is not None and (zps is None or zp_t is not None):
            name = _dynamic_dequantize_name(src_t, zp_t, scale_t)
        if name not in _variants():
            given = [("src", src_t), ("scales", scale_t)] + ([("zps", zp_t)] if zps else [])
            types = ", ".join(f"{what} {_type_name(t) if t else 'unknown'}" for what, t in given)
            raise InvalidModelError(f"{label}: no reference kernel for {types}")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        qtype = attrs.get("qtype", b"per_tensor")
        return (
            _variants()[name],
            [src, scales] + ([zps] if zps else []),
            {
                "qtype": qtype.decode() if isinstance(qtype, bytes) else str(qtype),
                "axis": int(attrs.get("axis", kernels.DYNAMIC_DEQUANTIZE_DEFAULT_AXIS)),
            },
        )

    def node(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """The reference-domain node replacing ``node``, with Casts around it for narrow floats."""
        label = f"node {node.name or node.output[0]!r} ({node.domain}::{node.op_type})"
        if vendor_kind(node) == "dynamic_dequantize":
            variant, inputs, new_attrs = self._dynamic_dequantize_call(node, label)
        else:
            variant, inputs, new_attrs = self._quark_call(node, label)

        created: list[onnx.NodeProto] = []
        wired_inputs = []
        for name, elem_type in zip(inputs, variant.input_types, strict=True):
            if elem_type not in _NARROW_FLOATS:
                wired_inputs.append(name)
                continue
            widened = self.fresh(f"{name}__qrw_ref_f32")
            created.append(
                helper.make_node("Cast", [name], [widened], name=self.fresh(f"{widened}_cast"), to=TensorProto.FLOAT)
            )
            wired_inputs.append(widened)
        output = node.output[0]
        kernel_output = self.fresh(f"{output}__qrw_ref_f32") if variant.output_type in _NARROW_FLOATS else output
        created.append(
            helper.make_node(
                variant.op_type,
                wired_inputs,
                [kernel_output],
                name=node.name,
                domain=REFERENCE_DOMAIN,
                node=node.name or output,
                **new_attrs,
            )
        )
        if kernel_output != output:
            created.append(
                helper.make_node(
                    "Cast", [kernel_output], [output], name=self.fresh(f"{output}_cast"), to=variant.output_type
                )
            )
        self.types[output] = variant.output_type
        return created


def retarget_vendor_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose vendor nodes run the reference kernels (``model`` is not changed).

    Output names are kept, so every value of the original can still be compared by name.
    """
    find_vendor_nodes(model)  # refuses vendor nodes in local functions with a clear message
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    count = _Retargeter(copy).graph(copy.graph)
    if count:
        copy.opset_import.append(helper.make_opsetid(REFERENCE_DOMAIN, 1))
        logger.info("running %d vendor node(s) with the numpy reference kernels", count)
    return copy
