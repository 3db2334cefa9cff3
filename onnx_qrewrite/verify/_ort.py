"""The verifier's one import of onnxruntime, an optional dependency (the ``verify`` extra).

Any onnxruntime flavour serves: onnxruntime, onnxruntime-gpu, -openvino and -directml are separate
distributions of the same ``onnxruntime`` module, so the module is what is looked for, never a
distribution name (depending on ``onnxruntime`` would install the CPU build beside a GPU one, and
the two overwrite each other's files). Without it, importing the verifier raises
:class:`~onnx_qrewrite.errors.MissingDependencyError`, which the command line reports as one line
and exit 2.
"""

from __future__ import annotations

from onnx_qrewrite.errors import VERIFY_EXTRA, MissingDependencyError

try:
    import onnxruntime as ort
except ImportError:
    raise MissingDependencyError(
        f"verify needs onnxruntime, which is not installed: {VERIFY_EXTRA} "
        "(or any onnxruntime flavour, e.g. onnxruntime-gpu)"
    ) from None

__all__ = ["ort"]
