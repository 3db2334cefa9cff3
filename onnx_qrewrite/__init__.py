"""onnx-qrewrite: make quantized ONNX models portable, exactly.

Python API::

    import onnx_qrewrite
    result = onnx_qrewrite.rewrite("model.onnx")          # or an onnx.ModelProto / onnx_ir.Model
    result.save("model.portable.onnx")
    print(result.report.by_rule())

The stages are plain functions over ``onnx.ModelProto``: load -> match -> lower -> save -> verify.
"""

from __future__ import annotations

from onnx_qrewrite.api import RewriteResult, load_rules, rewrite
from onnx_qrewrite.errors import (
    InternalError,
    InvalidModelError,
    LoweringError,
    QRewriteError,
    UsageError,
)

#: The one place the version is written: pyproject.toml reads it from here (hatch), the command
#: line's --version prints it, and tests/test_packaging.py checks the installed metadata agrees.
__version__ = "0.1.0"

__all__ = [
    "InternalError",
    "InvalidModelError",
    "LoweringError",
    "QRewriteError",
    "RewriteResult",
    "UsageError",
    "__version__",
    "load_rules",
    "rewrite",
    "verify",
]


def verify(original, rewritten, **options):
    """Run both models in onnxruntime and compare them; see :func:`onnx_qrewrite.verify.verify`.

    Imported lazily: only the verifier needs onnxruntime.
    """
    from onnx_qrewrite.verify import verify as _verify

    return _verify(original, rewritten, **options)
