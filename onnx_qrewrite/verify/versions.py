"""The versions a report states (this tool, onnx, onnxruntime, numpy, onnxruntime-extensions),
read without importing onnx or importlib.metadata where the installed files answer: both cost more
start-up time than a small model's verification takes."""

from __future__ import annotations

import os
import sys

import numpy as np

from onnx_qrewrite.verify._ort import ort
from onnx_qrewrite.verify.report import TOOL_NAME


def _distribution_version(name: str) -> str | None:
    """The installed distribution's version, as ``importlib.metadata.version`` reads it (the
    ``Version`` of the first ``<name>-<version>.dist-info`` on ``sys.path``), without importing
    importlib.metadata (~0.07 s, a tenth of a small model's verification); that module answers
    when no such folder is found."""
    prefix = name.replace("-", "_").lower() + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            if folder.lower().startswith(prefix) and folder.endswith(".dist-info"):
                try:
                    with open(os.path.join(entry or ".", folder, "METADATA"), encoding="utf-8") as f:
                        for line in f:
                            if line.startswith("Version:"):
                                return line.partition(":")[2].strip()
                            if not line.strip():
                                break
                except OSError:
                    pass
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _onnx_version() -> str:
    """``onnx.__version__``, without importing onnx when it is not imported yet (it reads its own
    version from the distribution, ``onnx`` then ``onnx-weekly``, else ``unknown``)."""
    onnx_module = sys.modules.get("onnx")
    if onnx_module is not None:
        return str(onnx_module.__version__)
    return _distribution_version("onnx") or _distribution_version("onnx-weekly") or "unknown"


def versions(reference_kernels: bool) -> dict[str, str | None]:
    from onnx_qrewrite import __version__

    versions: dict[str, str | None] = {
        TOOL_NAME: __version__,
        "onnx": _onnx_version(),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "onnxruntime_extensions": None,
    }
    if reference_kernels:
        import importlib.metadata

        versions["onnxruntime_extensions"] = importlib.metadata.version("onnxruntime-extensions")
    return versions
