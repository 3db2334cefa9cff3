"""The com.microsoft fusions' float inputs: one policy, one wording, for every builder that lowers them.

onnxruntime 1.31.1 has float32 CPU kernels for these ops and, for most, no float16 one: it runs the
float32 kernel between Casts it inserts and keeps float32 between neighbouring nodes it runs so
(measured: a FusedMatMul -> BiasGelu chain, an EmbedLayerNormalization -> FastGelu one), so a node's
float16 result depends on its neighbours and no per-node rewrite matches it. Their builders emit
float32 constants, so an input's type must be known, declared or traced from its producer
(:meth:`Site.value_type`), never assumed.
"""

from __future__ import annotations

import onnx

from onnx_qrewrite.rewriter.builders import NoMatch, Site

__all__ = ["no_float16_kernel", "refuse_float16", "unknown_type"]


def no_float16_kernel(name: str) -> NoMatch:
    """Why a float16 ``name`` is not lowered (see the module docstring)."""
    return NoMatch(
        f"{name!r} is float16; onnxruntime's CPU has no float16 kernel for the op: it runs it in float32 "
        "between Casts it inserts, keeping float32 between neighbouring such nodes (measured), so the "
        "node's float16 result depends on its neighbours"
    )


def unknown_type(name: str) -> NoMatch:
    """Why an input whose type neither the model nor its producer says is not lowered."""
    return NoMatch(f"the type of {name!r} is not declared and its producer does not say; only float32 was measured")


def refuse_float16(site: Site, *names: str) -> None:
    """Raise :func:`no_float16_kernel` for the first named input known to be float16."""
    for name in names:
        if name and site.value_type(name) == onnx.TensorProto.FLOAT16:
            raise no_float16_kernel(name)
