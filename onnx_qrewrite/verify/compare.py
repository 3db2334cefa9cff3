"""Element-wise comparison of one value of the original and the rewritten model.

Integer and quantized values must match exactly (or within ``lsb`` units). Floating values follow
one of two element rules (``--tolerance-rule``):

``numpy`` (default)
    ``|rewritten - original| <= atol + rtol * |original|``: ``numpy.isclose`` with the original
    as the reference. One bound, the sum of both tolerances.
``polygraphy``
    ``|rewritten - original| <= atol`` OR ``|rewritten - original| / |rewritten| <= rtol``, zeros
    in the divisor replaced by 2.22e-16: Polygraphy's default ``--check-error-stat elemwise``
    (polygraphy 0.53.6, ``polygraphy/comparator/compare.py``, where an element mismatches when
    ``(absdiff > atol | isnan(absdiff)) & (reldiff > rtol | isnan(reldiff))`` and ``reldiff``
    divides by the second runner's output, here the rewritten model's). Either tolerance alone
    suffices, so it is looser than ``numpy`` for the same numbers.

In both rules, both sides NaN at the same place, or the same infinity, count as an exact match
(Polygraphy counts them as mismatches unless ``--infinities-compare-equal``); NaN on one side only
is always a mismatch. The statistics say not only *whether* the
models agree but *how*: the worst element (index, both values), the exact-match rate, and NaN/inf
counts on each side, because a quantization bug often shows up as one saturated element.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.io.elem_types import ml_dtypes_named
from onnx_qrewrite.verify.drift import Drift, DriftThreshold, measure_drift, merge_drifts

__all__ = [
    "DEFAULT_FLOAT_TOLERANCES",
    "MAX_LSB",
    "ROLES",
    "TOLERANCE_RULES",
    "Tolerance",
    "Tolerances",
    "Undefined",
    "UndefinedLookup",
    "ValueComparison",
    "Worst",
    "compare_values",
    "is_integer_dtype",
    "merge_comparisons",
    "parse_tolerance_option",
]

#: What a comparison row checks (:attr:`ValueComparison.role`).
ROLES: tuple[str, ...] = ("output", "bound", "value-read")

#: (atol, rtol) per floating dtype when no ``--atol`` / ``--rtol`` is given: about one unit in the
#: last place for the narrow types, a few for float32/float64. The default session settings compare
#: the two models op for op, where a correct rewrite is exact, so these are tight on purpose.
DEFAULT_FLOAT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-6, 1e-5),
    "float16": (1e-3, 1e-3),
    "bfloat16": (1e-2, 1e-2),
    "float8_e4m3fn": (0.125, 0.125),
    "float8_e4m3fnuz": (0.125, 0.125),
    "float8_e5m2": (0.25, 0.25),
    "float8_e5m2fnuz": (0.25, 0.25),
}
#: ml_dtypes' 4-bit integers (onnx_qrewrite.io.elem_types.ml_dtypes_named: ml_dtypes loads only if needed).
_INTEGER_EXTRA = ("int4", "uint4")
#: The element rules for floating values (see the module docstring).
TOLERANCE_RULES = ("numpy", "polygraphy")
#: Largest ``--lsb``: the largest difference two 64-bit integers can have (everything passes).
MAX_LSB = 2**64 - 1
#: Polygraphy's stand-in for a zero divisor in the relative error.
_POLYGRAPHY_EPSILON = 2.220446049250313e-16


def is_integer_dtype(dtype: np.dtype) -> bool:
    """Integers, bools and the 4-bit ml_dtypes: compared exactly (or within ``lsb``)."""
    return dtype.kind in "iub" or dtype in ml_dtypes_named(_INTEGER_EXTRA)


@dataclass(frozen=True)
class Tolerance:
    """The tolerance applied to one value; ``atol``/``rtol`` for floats, ``lsb`` for integers."""

    atol: float
    rtol: float
    lsb: int
    rule: str = "numpy"
    #: A bound that varies per element (verify/element_bounds.py) is described by its formula;
    #: ``atol``/``lsb`` then hold its largest value.
    text: str = ""

    def describe(self, integer: bool) -> str:
        if self.text:
            return self.text
        if integer:
            return "exact" if self.lsb == 0 else f"lsb {self.lsb}"
        joiner = " or " if self.rule == "polygraphy" else ", "
        return f"atol {self.atol:g}{joiner}rtol {self.rtol:g}"


@dataclass(frozen=True)
class Tolerances:
    """What the user asked for: defaults (``None``: by dtype) and per-output overrides."""

    atol: float | None = None
    rtol: float | None = None
    lsb: int = 0
    output_atol: Mapping[str, float] = dataclasses.field(default_factory=dict)
    output_rtol: Mapping[str, float] = dataclasses.field(default_factory=dict)
    output_lsb: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rule: str = "numpy"

    def __post_init__(self) -> None:
        if self.rule not in TOLERANCE_RULES:
            raise UsageError(f"--tolerance-rule: expected one of {', '.join(TOLERANCE_RULES)}, got {self.rule!r}")

    @classmethod
    def from_options(
        cls, atol: Sequence[str] = (), rtol: Sequence[str] = (), lsb: Sequence[str] = (), rule: str = "numpy"
    ) -> Tolerances:
        """From Polygraphy-style option values: ``1e-5`` (default) or ``name:1e-4`` (one output)."""
        atol_default, atol_per = parse_tolerance_option(atol, "--atol", float)
        rtol_default, rtol_per = parse_tolerance_option(rtol, "--rtol", float)
        lsb_default, lsb_per = parse_tolerance_option(lsb, "--lsb", int)
        return cls(atol_default, rtol_default, int(lsb_default or 0), atol_per, rtol_per, lsb_per, rule)

    def explicit(self, name: str) -> bool:
        """Whether the caller set a tolerance for the output ``name`` (its own, or ``--atol`` /
        ``--rtol`` / a non-zero ``--lsb`` for every output): it then keeps its meaning, a
        tolerance against the original model (no re-anchored reference, :mod:`.reanchor`)."""
        return self.atol is not None or self.rtol is not None or self.lsb != 0 or name in self.output_names()

    def output_names(self) -> set[str]:
        """Names of the outputs given their own tolerance (``NAME:VALUE``)."""
        return {*self.output_atol, *self.output_rtol, *self.output_lsb}

    def for_value(self, name: str, dtype: np.dtype) -> Tolerance:
        """The tolerance for the value ``name`` of ``dtype``: its own if given, else the global
        option, else the dtype's default."""
        default_atol, default_rtol = DEFAULT_FLOAT_TOLERANCES.get(dtype.name, (0.0, 0.0))
        atol = self.output_atol.get(name, default_atol if self.atol is None else self.atol)
        rtol = self.output_rtol.get(name, default_rtol if self.rtol is None else self.rtol)
        return Tolerance(atol, rtol, self.output_lsb.get(name, self.lsb), self.rule)


def parse_tolerance_option(values: Sequence[str], option: str, kind: type) -> tuple[float | int | None, dict]:
    """Split ``[value | name:value, ...]`` into a default and per-name values, checked now, before
    any inference runs. The name is everything before the last ``:`` (names like ``out:0`` work)."""
    default = None
    per_name: dict[str, float | int] = {}
    for text in values:
        name, sep, raw = str(text).rpartition(":")
        try:
            value = kind(raw)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise UsageError(f"{option}: expected {expected} or NAME:VALUE, got {text!r}") from None
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{option}: must be a finite value >= 0, got {text!r}")
        if kind is int and value > MAX_LSB:
            raise UsageError(f"{option}: at most {MAX_LSB} (any 64-bit difference), got {text!r}")
        if sep and not name:
            raise UsageError(f"{option}: empty output name in {text!r}")
        if sep:
            per_name[name] = value
        else:
            default = value
    return default, per_name


class Undefined(NamedTuple):
    """Elements of the original's value that its kernel leaves undefined (it never writes them:
    they hold whatever the memory held), so they are not compared, and why (:mod:`.undefined`)."""

    mask: np.ndarray  # True where undefined, broadcastable to the value's shape
    why: str


#: Which elements of a value are undefined on a sample: (value name, sample name, shape) -> the
#: Undefined elements, or None where every element is defined (:mod:`.undefined`).
UndefinedLookup = Callable[[str, str, tuple[int, ...]], Undefined | None]


@dataclass(frozen=True)
class Worst:
    """The element with the largest absolute error."""

    sample: str
    index: tuple[int, ...]
    original: float | int
    rewritten: float | int
    abs_error: float
    rel_error: float


@dataclass(frozen=True)
class ValueComparison:
    """How one value (an output, or an intermediate during localisation) compares, over samples."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tolerance: Tolerance
    integer: bool  # compared as integers (exact / lsb), not as floats (atol / rtol)
    elements: int = 0
    mismatches: int = 0
    exact_matches: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    worst: Worst | None = None
    nan_original: int = 0
    nan_rewritten: int = 0
    inf_original: int = 0
    inf_rewritten: int = 0
    problem: str | None = None  # why no element-wise comparison was possible
    failed_samples: tuple[str, ...] = ()
    #: Set when the value is judged by its drift (approximate rewrites, :mod:`.drift`) instead of
    #: element by element; ``mismatches`` then only informs.
    drift: Drift | None = None
    #: What the rewritten value was compared with: ``original`` (the original model's value) or
    #: ``re-anchored`` (the original re-run from the rewritten model's values at its bounded
    #: replacements, :mod:`.reanchor`).
    reference: str = "original"
    #: With a re-anchored reference: the same value compared with the plain original, for
    #: information (its drift through the bounded replacements); it does not decide the verdict.
    against_original: ValueComparison | None = None
    #: What the row checks (:data:`ROLES`): a model ``output``; a bounded replacement's value
    #: within its ``bound`` at its node (:mod:`.bounds`); or a ``value-read``, an intermediate value
    #: a bounded replacement reads, against the re-anchored original (:mod:`.reanchor`). Only
    #: outputs are counted as outputs in the summary.
    role: str = "output"
    #: Elements not compared because the original's kernel leaves them undefined (not counted in
    #: ``elements``), and why (:class:`Undefined`).
    undefined: int = 0
    undefined_why: str | None = None

    @property
    def passed(self) -> bool:
        """Nothing prevented the comparison and no element differs (or, judged by drift, the drift
        is within its thresholds); also true of 0 elements."""
        if self.problem is not None:
            return False
        return self.drift.passed if self.drift is not None else self.mismatches == 0

    @property
    def verdict(self) -> str:
        """``failed``, ``empty`` (nothing to compare: zero-size in every sample), ``not-verified``
        (no element compared because every one was set aside as undefined or not comparable on
        every sample: the report is then never a pass) or ``passed``."""
        if not self.passed:
            return "failed"
        if self.elements:
            return "passed"
        return "not-verified" if self.undefined else "empty"

    @property
    def exact_match_rate(self) -> float:
        """Fraction of elements bit-for-bit equal (1.0 for an empty value)."""
        return self.exact_matches / self.elements if self.elements else 1.0

    @property
    def tolerance_text(self) -> str:
        """The tolerance applied, as the report prints it."""
        if self.drift is not None:
            return self.drift.threshold.describe()
        return self.tolerance.describe(self.integer)


def _scalar(value: np.generic) -> float | int:
    return int(value) if isinstance(value, (int, np.integer, np.bool_)) else float(value)


def _errors(
    original: np.ndarray, rewritten: np.ndarray, tol: Tolerance, element_bound: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per element: exact match, within tolerance (``element_bound``: the largest absolute error
    allowed at each element, instead of ``tol``), absolute error, |original| (for rel error)."""
    if element_bound is not None:
        exact, _, abs_error, magnitude = _errors(original, rewritten, Tolerance(0.0, 0.0, 0))
        with np.errstate(invalid="ignore"):
            within = exact | (np.isfinite(abs_error) & (abs_error <= element_bound))
        return exact, within, abs_error, magnitude
    if is_integer_dtype(original.dtype):
        extra = ml_dtypes_named(_INTEGER_EXTRA)
        a = original.astype(np.int64) if original.dtype in extra else original
        b = rewritten.astype(np.int64) if rewritten.dtype in extra else rewritten
        # |a - b| exactly for every integer type: the modular uint64 difference of max and min.
        hi, lo = np.maximum(a, b), np.minimum(a, b)
        diff = hi.astype(np.uint64) - lo.astype(np.uint64)
        exact = diff == 0
        within = diff <= np.uint64(tol.lsb)
        magnitude = np.abs(a.astype(np.float64))
        return exact, within, diff.astype(np.float64), magnitude
    a = original.astype(np.float64)
    b = rewritten.astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    exact = (a == b) | both_nan
    with np.errstate(invalid="ignore", over="ignore"):
        abs_error = np.where(exact, 0.0, np.abs(a - b))
    abs_error = np.where(np.isnan(abs_error), np.inf, abs_error)  # NaN on one side, inf - inf
    if tol.rule == "polygraphy":
        divisor = np.abs(b)
        divisor = np.where(divisor == 0, _POLYGRAPHY_EPSILON, divisor)
        with np.errstate(invalid="ignore", over="ignore"):
            close = (abs_error <= tol.atol) | (abs_error / divisor <= tol.rtol)
    else:
        with np.errstate(invalid="ignore"):  # rtol 0 times an infinite original
            bound = tol.atol + tol.rtol * np.abs(a)
        close = abs_error <= bound
    # An infinite error is never within tolerance, however large the original (inf vs -inf).
    within = exact | (np.isfinite(abs_error) & close)
    return exact, within, abs_error, np.abs(a)


def compare_values(
    name: str,
    sample: str,
    original: np.ndarray,
    rewritten: np.ndarray,
    tol: Tolerance,
    drift: DriftThreshold | None = None,
    element_bound: np.ndarray | None = None,
    undefined: Undefined | None = None,
) -> ValueComparison:
    """Compare one value of one sample; with ``drift``, judge it by its drift (:mod:`.drift`);
    with ``element_bound`` (broadcast to the value's shape), each element within its own bound;
    ``undefined``: elements the original's kernel leaves undefined, not compared (counted apart)."""
    original, rewritten = np.asarray(original), np.asarray(rewritten)
    floating = not is_integer_dtype(original.dtype)
    base: dict[str, Any] = {  # the fields every outcome shares
        "name": name,
        "dtype": original.dtype.name,
        "shape": tuple(original.shape),
        "tolerance": tol,
        "integer": not floating,
    }
    if original.dtype != rewritten.dtype:
        return ValueComparison(
            **base,
            problem=f"dtype differs: original {original.dtype.name}, rewritten {rewritten.dtype.name}",
            failed_samples=(sample,),
        )
    if original.shape != rewritten.shape:
        return ValueComparison(
            **base,
            problem=f"shape differs: original {list(original.shape)}, rewritten {list(rewritten.shape)}",
            failed_samples=(sample,),
        )
    if element_bound is not None:
        element_bound = np.broadcast_to(np.asarray(element_bound, np.float64), original.shape)
    skipped, why = 0, None
    if undefined is not None:
        original, rewritten, skipped = _defined_only(original, rewritten, undefined.mask)
        why = undefined.why if skipped else None
    exact, within, abs_error, magnitude = _errors(original, rewritten, tol, element_bound)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_error = np.where(abs_error == 0, 0.0, np.where(np.isinf(abs_error), np.inf, abs_error / magnitude))
    (nan_original, inf_original), (nan_rewritten, inf_rewritten) = (
        _non_finite(original) if floating else (0, 0),
        _non_finite(rewritten) if floating else (0, 0),
    )
    mismatches = int(original.size - np.count_nonzero(within))
    max_abs_error = float(abs_error.max()) if original.size else 0.0
    measured = None
    if drift is not None:
        mask = undefined.mask if undefined is not None and skipped else None
        measured = measure_drift(sample, original, rewritten, drift, max_abs_error, undefined=mask)
    failed = not measured.passed if measured is not None else bool(mismatches)
    return ValueComparison(
        **base,
        elements=int(original.size) - skipped,
        mismatches=mismatches,
        exact_matches=int(np.count_nonzero(exact)) - skipped,
        max_abs_error=max_abs_error,
        max_rel_error=float(rel_error.max()) if original.size else 0.0,
        worst=_worst(sample, original, rewritten, abs_error, rel_error),
        failed_samples=(sample,) if failed else (),
        nan_original=nan_original,
        nan_rewritten=nan_rewritten,
        inf_original=inf_original,
        inf_rewritten=inf_rewritten,
        drift=measured,
        undefined=skipped,
        undefined_why=why,
    )


def _defined_only(original: np.ndarray, rewritten: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Both values with their undefined elements (``mask``) set to 0 on both sides, so they match
    exactly and count nowhere but in the number returned (subtracted from the elements and exact
    matches): the worst element's index stays that of the value."""
    undefined = np.broadcast_to(np.asarray(mask, bool), original.shape)
    count = int(np.count_nonzero(undefined))
    if not count:
        return original, rewritten, 0
    zero = np.zeros((), original.dtype)
    return np.where(undefined, zero, original), np.where(undefined, zero, rewritten), count


def _non_finite(values: np.ndarray) -> tuple[int, int]:
    """How many NaN and how many infinities a floating value holds."""
    as_float = values.astype(np.float64)
    return int(np.isnan(as_float).sum()), int(np.isinf(as_float).sum())


def _worst(
    sample: str, original: np.ndarray, rewritten: np.ndarray, abs_error: np.ndarray, rel_error: np.ndarray
) -> Worst | None:
    """The element with the largest absolute error (the first of equals), or None when all agree."""
    if not (original.size and abs_error.max() > 0):  # a NaN maximum is not > 0 either
        return None
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(abs_error)), original.shape))
    return Worst(
        sample,
        index,
        _scalar(original[index]),
        _scalar(rewritten[index]),
        float(abs_error[index]),
        float(rel_error[index]),
    )


def merge_comparisons(parts: Sequence[ValueComparison]) -> ValueComparison:
    """One value over several samples: counts add up, the worst element is the worst of all."""
    first = parts[0]
    problems = [p for p in parts if p.problem]
    worst_part = max(parts, key=lambda p: p.max_abs_error)
    drifts = [p.drift for p in parts if p.drift is not None]
    plain = [p.against_original for p in parts if p.against_original is not None]
    return dataclasses.replace(
        first,
        elements=sum(p.elements for p in parts),
        mismatches=sum(p.mismatches for p in parts),
        exact_matches=sum(p.exact_matches for p in parts),
        max_abs_error=worst_part.max_abs_error,
        max_rel_error=max(p.max_rel_error for p in parts),
        worst=worst_part.worst,
        nan_original=sum(p.nan_original for p in parts),
        nan_rewritten=sum(p.nan_rewritten for p in parts),
        inf_original=sum(p.inf_original for p in parts),
        inf_rewritten=sum(p.inf_rewritten for p in parts),
        problem=problems[0].problem if problems else None,
        failed_samples=tuple(s for p in parts for s in p.failed_samples),
        drift=merge_drifts(drifts) if drifts else None,
        against_original=merge_comparisons(plain) if plain else None,
        undefined=sum(p.undefined for p in parts),
        undefined_why=next((p.undefined_why for p in parts if p.undefined_why), None),
    )
