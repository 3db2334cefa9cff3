"""The part of onnx that reading and rewriting a model needs, without ``import onnx`` when the
console script runs a command in a process of its own.

Why: ``import onnx`` costs about 0.1 s of CPU on top of numpy and protobuf, a quarter of
``polygraphy --help`` on the benchmark's machine (its ``__init__`` reads its version through
importlib.metadata and imports its JSON and text formats, ml_dtypes, its helpers, compose,
parser, printer...; ``python benchmarks/bench.py --cases startup``). ``inspect`` of a small model
needs none of that: onnx's message classes, the checker, schemas and shape inference of onnx's
extension module, and four helpers.

How, in a process :func:`onnx_qrewrite.cli.run` started (:func:`allow_unpackaged`) when onnx is
not imported yet:

- the message classes come from onnx's generated ``onnx_ml_pb2.py``, executed under a name of
  ours. protobuf's default pool accepts the identical file again when onnx itself loads it later
  in the process, and hands back the same classes (tests/test_onnx_lite.py checks both);
- onnx's extension module is loaded under its own name, ``onnx.onnx_cpp2py_export``, and
  registered in ``sys.modules``: a later ``import onnx`` takes it from there (its bindings refuse
  a second initialisation in one process). What that leaves different: that later ``onnx``
  package has no ``onnx_cpp2py_export`` attribute (``import onnx.onnx_cpp2py_export`` still
  works); nothing in onnx, onnxruntime or this package reads it, and no one else's code runs in
  the console script's process;
- :data:`helper` and :data:`numpy_helper` do what onnx's functions of the same names do for the
  cases this package meets (tests/test_onnx_lite.py compares them with onnx's), and call onnx's
  for anything else;
- any other name asked of this module imports onnx and returns onnx's.

Everywhere else (tests, the Python API, a process that imported onnx first), every name here is
onnx's own, so in-process behaviour is onnx's by construction. Modules on ``inspect``'s path
import this module as ``onnx``; the rest import onnx itself.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import numbers
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onnx import (
        AttributeProto,
        FunctionProto,
        GraphProto,
        ModelProto,
        NodeProto,
        OperatorSetIdProto,
        StringStringEntryProto,
        TensorProto,
        ValueInfoProto,
        checker,
        defs,
        helper,
        numpy_helper,
        shape_inference,
    )

__all__ = [
    "AttributeProto",
    "FunctionProto",
    "GraphProto",
    "ModelProto",
    "NodeProto",
    "OperatorSetIdProto",
    "StringStringEntryProto",
    "TensorProto",
    "ValueInfoProto",
    "allow_unpackaged",
    "checker",
    "defs",
    "helper",
    "numpy_helper",
    "shape_inference",
    "unpackaged",
]

_MESSAGES = (
    "AttributeProto",
    "FunctionProto",
    "GraphProto",
    "ModelProto",
    "NodeProto",
    "OperatorSetIdProto",
    "StringStringEntryProto",
    "TensorProto",
    "ValueInfoProto",
)
_NATIVE = "onnx.onnx_cpp2py_export"
_STATE: dict[str, Any] = {"allowed": False, "resolved": False, "unpackaged": False}


def allow_unpackaged() -> None:
    """Called by :func:`onnx_qrewrite.cli.run` before any command module loads: this process is
    the command's own, so the names here may come from onnx's files without ``import onnx``."""
    _STATE["allowed"] = True


def unpackaged() -> bool:
    """Whether the names here came from onnx's files without ``import onnx`` (for the tests)."""
    _resolve()
    return bool(_STATE["unpackaged"])


def __getattr__(name: str) -> Any:
    """Every name resolves on first use (PEP 562), after :func:`allow_unpackaged` had its say."""
    if name.startswith("__"):
        raise AttributeError(name)
    if not _STATE["resolved"]:
        _resolve()
        if name in globals():
            return globals()[name]
    return getattr(importlib.import_module("onnx"), name)


def _resolve() -> None:
    if _STATE["resolved"]:
        return
    parts = _unpackaged_parts() if _STATE["allowed"] and "onnx" not in sys.modules else None
    if parts is None:
        _from_onnx(importlib.import_module("onnx"))
    else:
        _from_files(*parts)
    _STATE["resolved"] = True


def _from_onnx(onnx: Any) -> None:
    names = globals()
    for name in _MESSAGES:
        names[name] = getattr(onnx, name)
    for name in ("checker", "defs", "helper", "numpy_helper", "shape_inference"):
        names[name] = importlib.import_module(f"onnx.{name}")


def _unpackaged_parts() -> tuple[ModuleType, ModuleType] | None:
    """onnx's extension module and generated message module, loaded without running onnx's
    ``__init__``; None when they are not where onnx keeps them (then onnx is imported)."""
    spec = importlib.util.find_spec("onnx")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    messages = folder / "onnx_ml_pb2.py"
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    native = next((p for p in (folder / f"onnx_cpp2py_export{s}" for s in suffixes) if p.is_file()), None)
    if native is None or not messages.is_file() or sys.byteorder != "little":
        return None
    loader = importlib.machinery.ExtensionFileLoader(_NATIVE, str(native))
    native_spec = importlib.util.spec_from_file_location(_NATIVE, native, loader=loader)
    if native_spec is None:
        return None
    extension = importlib.util.module_from_spec(native_spec)
    sys.modules[_NATIVE] = extension  # before it runs, as the import system does: onnx later reuses it
    try:
        loader.exec_module(extension)
    except BaseException:
        del sys.modules[_NATIVE]  # no half-initialised module left for a later `import onnx` to find
        raise
    if not getattr(extension, "ONNX_ML", False):  # onnx built without ML: its onnx_pb2 then
        return None
    message_spec = importlib.util.spec_from_file_location(f"{__name__}_ml_pb2", messages)
    if message_spec is None or message_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(message_spec)
    message_spec.loader.exec_module(module)
    return extension, module


def _from_files(extension: Any, messages: ModuleType) -> None:
    names = globals()
    for name in _MESSAGES:
        names[name] = getattr(messages, name)
    names["checker"] = _Fallback("checker", check_model=_check_model, ValidationError=extension.checker.ValidationError)
    names["defs"] = _Fallback("defs", get_schema=extension.defs.get_schema)
    names["shape_inference"] = _Fallback("shape_inference", infer_shapes=_infer_shapes)
    names["helper"] = _Fallback(
        "helper",
        get_attribute_value=_get_attribute_value,
        make_attribute=_make_attribute,
        make_opsetid=_make_opsetid,
    )
    names["numpy_helper"] = _Fallback("numpy_helper", to_array=_to_array, from_array=_from_array)
    _STATE["native"] = extension
    _STATE["unpackaged"] = True


class _Fallback(SimpleNamespace):
    """The functions given, and onnx's module ``onnx.<module>`` for any other name."""

    def __init__(self, module: str, **functions: Any) -> None:
        super().__init__(**functions)
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(f"onnx.{self._module}"), name)


# What follows does what onnx 1.23's functions of the same names do (onnx/checker.py,
# shape_inference.py, helper.py, numpy_helper.py; Apache-2.0, the ONNX Project Contributors),
# for the cases listed; anything else goes to onnx's own. tests/test_onnx_lite.py compares them.

_MAXIMUM_PROTOBUF = 2147483647


def _check_model(model: Any, full_check: bool = False) -> None:
    """``onnx.checker.check_model`` of a ModelProto or its bytes."""
    serialized = model if isinstance(model, bytes) else model.SerializeToString()
    if len(serialized) > _MAXIMUM_PROTOBUF:
        raise ValueError("This protobuf of onnx model is too large (>2GiB). Call check_model with model path instead.")
    _STATE["native"].checker.check_model(serialized, full_check, False, False)


def _infer_shapes(model: Any, check_type: bool = False, strict_mode: bool = False, data_prop: bool = False) -> Any:
    """``onnx.shape_inference.infer_shapes`` of a ModelProto."""
    if not isinstance(model, globals()["ModelProto"]):
        return importlib.import_module("onnx.shape_inference").infer_shapes(model, check_type, strict_mode, data_prop)
    inferred = _STATE["native"].shape_inference.infer_shapes(
        model.SerializeToString(), check_type, strict_mode, data_prop
    )
    result = globals()["ModelProto"]()
    result.ParseFromString(inferred)
    return result


def _make_opsetid(domain: str, version: int) -> Any:
    opsetid = globals()["OperatorSetIdProto"]()
    opsetid.domain = domain
    opsetid.version = version
    return opsetid


#: AttributeProto type -> the field get_attribute_value returns (a list for the repeated ones).
_ATTRIBUTE_FIELDS = {
    1: ("f", False),
    2: ("i", False),
    3: ("s", False),
    4: ("t", False),
    5: ("g", False),
    11: ("sparse_tensor", False),
    13: ("tp", False),
    6: ("floats", True),
    7: ("ints", True),
    8: ("strings", True),
    9: ("tensors", True),
    10: ("graphs", True),
    12: ("sparse_tensors", True),
    14: ("type_protos", True),
}


def _get_attribute_value(attr: Any) -> Any:
    field = _ATTRIBUTE_FIELDS.get(attr.type)
    if attr.ref_attr_name or field is None:  # a reference, UNDEFINED or an unknown type: onnx's answer
        return importlib.import_module("onnx.helper").get_attribute_value(attr)
    name, repeated = field
    return list(getattr(attr, name)) if repeated else getattr(attr, name)


def _make_attribute(key: str, value: Any) -> Any:
    """``onnx.helper.make_attribute(key, value)`` for a number, a string, a tensor, a graph, or a
    non-empty list of numbers or of strings; onnx's for anything else."""
    names = globals()
    attribute = names["AttributeProto"]
    attr = attribute()
    attr.name = key
    if isinstance(value, numbers.Integral):
        attr.i, attr.type = int(value), attribute.INT
    elif isinstance(value, numbers.Real):
        attr.f, attr.type = float(value), attribute.FLOAT
    elif isinstance(value, (str, bytes)):
        attr.s, attr.type = _to_bytes(value), attribute.STRING
    elif isinstance(value, names["TensorProto"]):
        attr.t.CopyFrom(value)
        attr.type = attribute.TENSOR
    elif isinstance(value, names["GraphProto"]):
        attr.g.CopyFrom(value)
        attr.type = attribute.GRAPH
    elif not _list_attribute(attr, value):
        return importlib.import_module("onnx.helper").make_attribute(key, value)
    return attr


def _list_attribute(attr: Any, value: Any) -> bool:
    """Fill ``attr`` from a non-empty list of integers, of numbers or of strings, as onnx does;
    False (``attr`` untouched) for anything else."""
    if isinstance(value, (bytes, str)) or not isinstance(value, Iterable):
        return False
    items = list(value)
    types = {type(v) for v in items}
    if not items:
        return False
    if all(issubclass(t, numbers.Integral) for t in types):
        attr.ints.extend(items)
        attr.type = attr.INTS
    elif all(issubclass(t, numbers.Real) for t in types):
        attr.floats.extend(items)
        attr.type = attr.FLOATS
    elif all(issubclass(t, (str, bytes)) for t in types):
        attr.strings.extend(_to_bytes(v) for v in items)
        attr.type = attr.STRINGS
    else:
        return False
    return True


def _to_bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else value


#: TensorProto data_type -> (numpy dtype, the field holding values when there is no raw_data, the
#: dtype onnx reads that field as), for the types handled here.
_TENSOR_TYPES = {
    1: ("float32", "float_data", "float32"),
    2: ("uint8", "int32_data", "int32"),
    3: ("int8", "int32_data", "int32"),
    4: ("uint16", "int32_data", None),
    5: ("int16", "int32_data", None),
    6: ("int32", "int32_data", "int32"),
    7: ("int64", "int64_data", "int64"),
    9: ("bool", "int32_data", None),
    10: ("float16", "int32_data", None),
    11: ("float64", "double_data", "float64"),
    12: ("uint32", "uint64_data", "uint64"),
    13: ("uint64", "uint64_data", "uint64"),
}
_EXTERNAL = 1


def _to_array(tensor: Any, base_dir: str = "") -> Any:
    """``onnx.numpy_helper.to_array`` of a tensor of a type in :data:`_TENSOR_TYPES` whose data
    is in the tensor; onnx's for anything else (external data, segments, other types)."""
    kind = _TENSOR_TYPES.get(tensor.data_type)
    external = tensor.HasField("data_location") and tensor.data_location == _EXTERNAL
    if kind is None or external or tensor.HasField("segment"):
        return importlib.import_module("onnx.numpy_helper").to_array(tensor, base_dir)
    import numpy as np

    np_dtype, field, storage = kind
    dims = tensor.dims
    if tensor.HasField("raw_data"):
        return np.frombuffer(tensor.raw_data, dtype=np_dtype).reshape(dims)
    if storage is not None:
        return np.asarray(getattr(tensor, field), dtype=storage).astype(np_dtype).reshape(dims)
    words = np.array(tensor.int32_data, dtype=np.int32).view(np.uint32)
    if np_dtype == "bool":
        return words.astype(np.uint8).view(np_dtype).reshape(dims)
    return words.astype(np.uint16).reshape(dims).view(np_dtype)  # 16-bit types: the low 16 bits


def _from_array(array: Any, name: str | None = None) -> Any:
    """``onnx.numpy_helper.from_array`` of a native-order array of a type in
    :data:`_TENSOR_TYPES`; onnx's for anything else."""
    import numpy as np

    if not _NUMPY_TYPES:
        _NUMPY_TYPES.update({np.dtype(v[0]): k for k, v in _TENSOR_TYPES.items()})
    native = isinstance(array, np.ndarray) and array.dtype.isnative
    code = _NUMPY_TYPES.get(array.dtype) if native else None
    if code is None:
        return importlib.import_module("onnx.numpy_helper").from_array(array, name)
    tensor = globals()["TensorProto"]()
    tensor.dims.extend(array.shape)
    if name:
        tensor.name = name
    tensor.raw_data = array.tobytes()
    tensor.data_type = code
    return tensor


#: numpy dtype -> TensorProto data_type, filled on first use (numpy is imported then).
_NUMPY_TYPES: dict[Any, int] = {}
