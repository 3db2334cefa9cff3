"""The 13-op DynamicQuantizeLinear expansion against onnxruntime's native kernel on thousands of
random inputs, beyond the hand-picked battery of test_dynamic_quantize.py.

The expansion computes the zero point with one QuantizeLinear (scale -1) instead of the kernel's
clip, round and cast; these draws aim at the places such a change could differ: zero points that
are exact ties k+0.5 or one ulp either side of them, at every binade of scale from denormal to
1e36; scales that underflow; ±inf; signed zeros; raw random bit patterns.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_bitwise_equal, session
from test_dynamic_quantize import dql_model

import onnx_qrewrite


def _draws(seed: int, n: int):
    rng = np.random.default_rng(seed)
    specials = [0.0, -0.0, 1.4e-45, -1.4e-45, 2.8e-45, 1e-40, np.inf, -np.inf, 3.4e38, -3.4e38, 1.0]
    for _ in range(n):
        kind = int(rng.integers(0, 8))
        size = int(rng.integers(1, 40))
        if kind == 0:  # normal, at a random magnitude from denormal to huge
            x = rng.standard_normal(size) * 10.0 ** rng.integers(-45, 38)
        elif kind == 1:  # zero point an exact tie (scale 1): [-t, 255 - t] with t = k + 0.5
            t = rng.integers(0, 256) + 0.5
            x = np.concatenate([[-t, 255 - t], rng.uniform(-t, 255 - t, size)])
        elif kind == 2:  # ties and near-ties at a power-of-two scale, from 2^-140 to 2^119
            s = 2.0 ** int(rng.integers(-140, 120))
            t = np.float32(rng.integers(0, 256) + 0.5)
            t = rng.choice([t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(512)), np.floor(t)])
            x = np.array([-t * s, (255 - t) * s])
        elif kind == 3:  # one sign only
            x = np.abs(rng.standard_normal(size)) * 10.0 ** rng.integers(-45, 5) * rng.choice([-1, 1])
        elif kind == 4:
            x = rng.choice(specials, size)
        elif kind == 5:
            x = rng.integers(-300, 300, size).astype(np.float64)
        elif kind == 6:  # raw bit patterns (NaN excluded: the kernel is not deterministic there)
            x = rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32).view(np.float32)
            x = x[~np.isnan(x)]
            x = x if x.size else np.zeros(1)
        else:
            x = rng.standard_cauchy(size) * 1e3
        yield np.asarray(x, dtype=np.float32)


@pytest.mark.parametrize("opt", ["disable", "all"])
def test_random_inputs_bit_exact_with_the_kernel(opt):
    original = dql_model(13)
    rewritten = onnx_qrewrite.rewrite(original).model
    want_session, got_session = session(original, opt=opt), session(rewritten, opt=opt)
    for i, x in enumerate(_draws(seed=2026, n=3000)):
        want = want_session.run(None, {"x": x})
        got = got_session.run(None, {"x": x})
        for name, w, g in zip(("y", "y_scale", "y_zero_point"), want, got, strict=True):
            assert_bitwise_equal(g, w, f"draw {i} ({x[:4]}...), {name}")
