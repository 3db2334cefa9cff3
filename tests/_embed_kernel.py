"""onnxruntime 1.31.1's QEmbedLayerNormalization CPU kernel (``qembed_layer_norm.cc``), row loop for
row loop in numpy float32, as built without and with fused multiply-adds: a compiler that contracts
``a * b + c`` into one fma (GCC's default ``-ffp-contract=fast`` where the target has FMA, aarch64
always; clang's ``-ffp-contract=on`` within one expression) rounds once where the source rounds
twice. x86-64 builds without ``-mfma`` contract nothing: the uncontracted emulation is then the
kernel bit for bit (asserted in tests/test_unfuse_attention.py). The contraction sites of the loop:

- ``deq``: ``Dequantize(w) + Dequantize(p)`` (+ ``Dequantize(s)``), each ``(q - zp) * scale``
  inlined: the word's and segment's products fused into the additions (GCC across the inline call;
  clang's ``on`` does not cross it);
- ``var``: ``sum += a * a``, the second pass;
- ``out``: ``output[i] / e * gamma + beta``, as fma(x̂, γ, β);
- ``beta``: the same statement with Dequantize(beta)'s product fused instead, fma(qb - zp, s, x̂·γ).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
from onnx import ModelProto, numpy_helper

F32, F64 = np.float32, np.float64


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c) correctly rounded. The float32 product is exact in float64 and TwoSum
    gives the float64 sum's rounding error, so the exact result is ``s + err``. Rounding ``s`` to
    float32 is right unless ``s`` fell exactly on the midpoint between two float32 neighbours
    while the exact result was not there (``err`` != 0): then the neighbour on ``err``'s side is.
    The midpoint is found from that neighbour itself, not from the spacing above ``r``: below a
    power of two the spacing is half (``np.spacing`` of the power is the spacing above it)."""
    p = np.asarray(a, F64) * np.asarray(b, F64)
    c = np.asarray(c, F64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(F32)
    d = s - r.astype(F64)
    other = np.nextafter(r, np.where(d > 0, F32(np.inf), F32(-np.inf)).astype(F32))
    tie = (d != 0) & (2 * d == other.astype(F64) - r.astype(F64)) & (err != 0)
    return np.where(tie & (np.sign(err) == np.sign(d)), other, r)


def qembed_kernel(model: ModelProto, feeds: dict, fused: Collection[str] = ()) -> np.ndarray:
    """Output 0 of ``model`` (tests' qembed_model: constant tables, segment embedding present) on
    ``feeds``, with the contractions ``fused`` (module docstring) made."""
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}

    def centred(name: str, rows: np.ndarray | slice = slice(None)) -> tuple[np.ndarray, np.float32]:
        return (init[f"{name}_q"][rows].astype(np.int32) - np.int32(init[f"{name}_zp"])).astype(F32), F32(
            init[f"{name}_s"]
        )

    (w, sw), (p, sp) = centred("words", feeds["ids"]), centred("positions", slice(0, feeds["ids"].shape[1]))
    s, ss = centred("segments", feeds["seg"])
    x = fma32(s, ss, fma32(w, sw, p * sp)) if "deq" in fused else (w * sw + p * sp) + s * ss
    hidden = x.shape[-1]
    total = np.zeros(x.shape[:-1], F32)
    for i in range(hidden):
        total = total + x[..., i]
    a = x - (total / F32(hidden))[..., None]
    total = np.zeros(x.shape[:-1], F32)
    for i in range(hidden):
        total = fma32(a[..., i], a[..., i], total) if "var" in fused else total + a[..., i] * a[..., i]
    normalized = a / np.sqrt(total / F32(hidden) + F32(1e-12))[..., None]
    (g, sg), (b, sb) = centred("gamma"), centred("beta")
    if "out" in fused:
        return fma32(normalized, g * sg, b * sb)
    if "beta" in fused:
        return fma32(b, sb, normalized * (g * sg))
    return normalized * (g * sg) + b * sb
