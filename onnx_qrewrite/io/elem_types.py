"""ONNX tensor element types (``TensorProto.DataType``) by number: name and numpy dtype, without onnx.

Why: the verifier names and converts input and output types on every run, and importing onnx for
``TensorProto.DataType.Name`` and ``helper.tensor_dtype_to_np_dtype`` costs more than the rest of a
small model's verification (benchmarks/bench.py, verify case). The table holds what onnx 1.23
says; a type it does not hold is asked of the installed onnx, so the answers are always onnx's
(``tests/test_wire_model.py`` checks the table against onnx for every type onnx knows).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

__all__ = ["BFLOAT16", "FLOAT", "ml_dtypes_named", "np_dtype", "type_name"]

FLOAT = 1
BFLOAT16 = 16

#: number -> (name, numpy dtype: a numpy type name, or ``ml_dtypes.<name>``)
_TYPES: dict[int, tuple[str, str]] = {
    1: ("FLOAT", "float32"),
    2: ("UINT8", "uint8"),
    3: ("INT8", "int8"),
    4: ("UINT16", "uint16"),
    5: ("INT16", "int16"),
    6: ("INT32", "int32"),
    7: ("INT64", "int64"),
    8: ("STRING", "object"),
    9: ("BOOL", "bool"),
    10: ("FLOAT16", "float16"),
    11: ("DOUBLE", "float64"),
    12: ("UINT32", "uint32"),
    13: ("UINT64", "uint64"),
    14: ("COMPLEX64", "complex64"),
    15: ("COMPLEX128", "complex128"),
    16: ("BFLOAT16", "ml_dtypes.bfloat16"),
    17: ("FLOAT8E4M3FN", "ml_dtypes.float8_e4m3fn"),
    18: ("FLOAT8E4M3FNUZ", "ml_dtypes.float8_e4m3fnuz"),
    19: ("FLOAT8E5M2", "ml_dtypes.float8_e5m2"),
    20: ("FLOAT8E5M2FNUZ", "ml_dtypes.float8_e5m2fnuz"),
    21: ("UINT4", "ml_dtypes.uint4"),
    22: ("INT4", "ml_dtypes.int4"),
    23: ("FLOAT4E2M1", "ml_dtypes.float4_e2m1fn"),
    24: ("FLOAT8E8M0", "ml_dtypes.float8_e8m0fnu"),
    25: ("UINT2", "ml_dtypes.uint2"),
    26: ("INT2", "ml_dtypes.int2"),
    27: ("FLOAT6E2M3", "ml_dtypes.float6_e2m3fn"),
    28: ("FLOAT6E3M2", "ml_dtypes.float6_e3m2fn"),
}


def type_name(elem_type: int) -> str:
    """``TensorProto.DataType.Name(elem_type)`` (e.g. ``"FLOAT"``); a ValueError for an unknown
    number, as onnx raises."""
    known = _TYPES.get(elem_type)
    if known is not None:
        return known[0]
    from onnx import TensorProto

    return str(TensorProto.DataType.Name(elem_type))


def np_dtype(elem_type: int) -> Any:
    """``numpy.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))``."""
    import numpy as np

    known = _TYPES.get(elem_type)
    if known is None:
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    spec = known[1]
    if spec.startswith("ml_dtypes."):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, spec.removeprefix("ml_dtypes.")))
    return np.dtype(spec)


def ml_dtypes_named(names: tuple[str, ...]) -> frozenset[Any]:
    """The numpy dtypes of these ``ml_dtypes`` types; none while ml_dtypes is not imported, since
    no array or dtype can be one of its types before it is (importing it makes them), so testing
    membership never imports it (~15 ms, more than some whole verifications' own work)."""
    if "ml_dtypes" not in sys.modules:
        return frozenset()
    return _ml_dtypes_named(names)


@functools.cache
def _ml_dtypes_named(names: tuple[str, ...]) -> frozenset[Any]:
    import ml_dtypes
    import numpy as np

    return frozenset(np.dtype(getattr(ml_dtypes, name)) for name in names)
