"""Errors the reference kernels met while onnxruntime ran them, collected for the session that
called (a custom op's Python exception does not reach the caller of ``run``).

Its own module so that :mod:`onnx_qrewrite.verify.session` reads it on every run without importing
:mod:`onnx_qrewrite.verify.reference_ops` (which imports onnx) for models that have no vendor op.
"""

from __future__ import annotations

__all__ = ["ERRORS", "take"]

#: Appended to by the reference kernels (reference_ops), emptied by :func:`take`.
ERRORS: list[str] = []


def take() -> list[str]:
    """Errors the reference kernels met since the last call (and forget them)."""
    errors = list(ERRORS)
    ERRORS.clear()
    return errors
