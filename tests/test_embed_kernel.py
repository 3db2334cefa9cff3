"""tests/_embed_kernel.py's fma32 against exact arithmetic: the contracted kernels it emulates (and
the bound measured on them) are only as right as its single rounding."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from _embed_kernel import fma32

F32 = np.float32


def _fma_exact(a: F32, b: F32, c: F32) -> F32:
    """fma(a, b, c) rounded once, to nearest even, from the exact rational a·b + c: of the float32
    nearest the float64 nearest it and that one's two neighbours (the answer is among them), the
    closest, the even one on a tie."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = F32(float(exact))
    candidates = (near, np.nextafter(near, F32(np.inf)), np.nextafter(near, F32(-np.inf)))
    return min(candidates, key=lambda x: (abs(Fraction(float(x)) - exact), int(np.array(x).view(np.uint32)) & 1))


def _ties(x: F32, toward: F32) -> tuple[F32, F32, F32]:
    """(a, b, c) whose a·b + c is c = ``x`` plus just less than half the way to its neighbour
    ``toward``: a·b = h·(1 - 2^-46), h that half. a·b + c in float64 is exactly the midpoint (the
    2^-46 is far below float64's precision there), so only the float64 sum's error says the answer
    is ``x``; rounding the midpoint to even says ``x`` or its neighbour, depending on ``x``."""
    h = (F32(toward) - x) / F32(2)
    return F32(1 + 2**-23), F32(h * F32(1 - 2**-23)), x


def _check(cases: list[tuple[F32, F32, F32]]) -> list[tuple[F32, ...]]:
    a, b, c = (np.array(column, F32) for column in zip(*cases, strict=True))
    got = fma32(a, b, c)
    return [(*case, got[i], _fma_exact(*case)) for i, case in enumerate(cases) if got[i] != _fma_exact(*case)]


def test_fma32_rounds_ties_below_a_power_of_two_once():
    """Just below a power of two the float32 spacing halves: a midpoint there is half the spacing
    above the power (np.spacing's), which an earlier fma32 took for the tie's width, missing every
    such tie: it rounded every one of the 122 here to the power, not to the nearer float32 below."""
    cases = []
    for k in range(-30, 31):
        power = F32(2.0**k)
        below = np.nextafter(power, F32(0))
        for sign in (F32(1), F32(-1)):
            cases.append(_ties(sign * below, sign * power))  # the answer is below, not the even power
            cases.append(_ties(sign * power, sign * below))  # from the power down: the power
    assert not _check(cases)


def test_fma32_is_the_exactly_rounded_fma_on_random_ties_and_operands():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(300) * 2.0 ** rng.integers(-40, 40, 300)).astype(F32)
    toward = np.where(rng.random(300) < 0.5, F32(np.inf), F32(-np.inf)).astype(F32)
    cases = [_ties(xi, np.nextafter(xi, ti)) for xi, ti in zip(x, toward, strict=True)]
    operands = (rng.standard_normal((3, 2000)) * 2.0 ** rng.integers(-20, 20, (3, 2000))).astype(F32)
    cases += list(zip(*operands, strict=True))
    assert not _check(cases)
