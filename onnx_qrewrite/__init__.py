"""onnx-qrewrite: make quantized ONNX models portable, exactly.

Python API::

    import onnx_qrewrite
    result = onnx_qrewrite.rewrite("model.onnx")          # or an onnx.ModelProto / onnx_ir.Model
    result.save("model.portable.onnx")
    print(result.report.by_rule())

The stages are plain functions over ``onnx.ModelProto``: load -> match -> lower -> save -> verify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


if TYPE_CHECKING:
    from onnx_qrewrite.api import RewriteResult, load_rules, rewrite

#: Loaded on first use (PEP 562): importing the package must not import onnx, numpy and the engine,
#: which every command-line start would otherwise pay for (``--help``, ``rules``, ``verify``).
_LAZY = {"RewriteResult": "onnx_qrewrite.api", "load_rules": "onnx_qrewrite.api", "rewrite": "onnx_qrewrite.api"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onnx_qrewrite' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def verify(original, rewritten, **options):
    """Run both models in onnxruntime and compare them; see :func:`onnx_qrewrite.verify.verify`.

    Imported lazily: only the verifier needs onnxruntime.
    """
    from onnx_qrewrite.verify import verify as _verify

    return _verify(original, rewritten, **options)
