"""End-to-end drift of an approximate rewrite: how far the outputs moved, judged against thresholds.

An approximate rule (``onnx_qrewrite.rewriter.contract``) changes the model's numerics by design (weight-only
dequantization, Q -> DQ pairs dropped): element-wise tolerances made for exact rewrites would fail
it, and widened until it passes they would no longer catch a broken rewrite. So when the rewritten
model carries approximate rewrites (its nodes' ``onnx_qrewrite.exactness`` metadata says so), each
output is judged by statistics of the whole tensor, on each sample:

- **relative L2 error** ``||rewritten - original|| / ||original||`` (at most ``rel_l2``);
- **cosine similarity** ``<original, rewritten> / (||original|| ||rewritten||)`` (at least
  ``cosine``; two all-zero tensors count as 1);
- **argmax agreement**, for classifier-shaped outputs (floating, at least 2-D, last dimension > 1,
  e.g. logits ``[N, C]`` or ``[N, S, C]``): the fraction of rows whose argmax over the last axis is
  the same (at least ``argmax``; rows pooled over the samples);
- **max abs error**, with the worst element (index and both values), as for exact rewrites; judged
  only when a ``max_abs`` threshold is given, because its scale is the output's.

The relative L2 error and cosine similarity are the worst over the samples (a sample where the
drift is large must not hide behind others where it is small). An element that is NaN or infinite
on one side only (or an infinity of the other sign) fails the output: no threshold covers it.

The defaults come from measurement (``python benchmarks/drift.py``, numbers in the README): the
weight-only form of five quantize_dynamic models drifts at most 0.014 rel L2 (cosine 0.99991),
3.5x within ``rel_l2``; one layer's weight scale 25 % off (rel L2 0.085 to 0.31) or a weight zero
point dropped (5.3 to 49) fail. A 2 % scale error (at most 0.030) is within weight-only's own
drift: end to end it cannot be told from the approximation, which is why exact and bounded rules
are checked element-wise and per node instead. ``argmax`` tolerates one flipped row in the six a
default run has for a batch-1 model (near-ties flip legitimately: 1 row of 54 in the MLP's
weight-only form); two flipped rows fail.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import UsageError

#: ``onnx.AttributeProto.GRAPH`` (this module does not import onnx).
_GRAPH = 5

__all__ = [
    "DEFAULT_ARGMAX",
    "DEFAULT_COSINE",
    "DEFAULT_REL_L2",
    "DRIFT_MODES",
    "Drift",
    "DriftThreshold",
    "DriftThresholds",
    "is_classifier_shaped",
    "measure_drift",
    "merge_drifts",
]

#: Defaults (see the module docstring and the README for the measurements behind them).
DEFAULT_REL_L2 = 0.05
DEFAULT_COSINE = 0.999
DEFAULT_ARGMAX = 0.8
#: ``auto``: judge by drift when the rewritten model carries approximate rewrites; ``always``: also
#: when it does not say (``--provenance none``); ``never``: element-wise tolerances only.
DRIFT_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class DriftThreshold:
    """The thresholds applied to one value."""

    rel_l2: float = DEFAULT_REL_L2
    cosine: float = DEFAULT_COSINE
    argmax: float = DEFAULT_ARGMAX
    max_abs: float | None = None

    def describe(self) -> str:
        """The thresholds in one line, as the table's tolerance column shows them."""
        text = f"drift: rel L2 <= {self.rel_l2:g}, cosine >= {self.cosine:g}, argmax >= {self.argmax:g}"
        return text + (f", max abs <= {self.max_abs:g}" if self.max_abs is not None else "")


def _check(value: float, option: str, text: str, at_most_one: bool) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{option}: must be a finite value >= 0, got {text!r}")
    if at_most_one and value > 1:
        raise UsageError(f"{option}: must be between 0 and 1, got {text!r}")
    return value


@dataclass(frozen=True)
class DriftThresholds:
    """What the user asked for: when to judge by drift, defaults and per-output overrides."""

    mode: str = "auto"
    rel_l2: float = DEFAULT_REL_L2
    cosine: float = DEFAULT_COSINE
    argmax: float = DEFAULT_ARGMAX
    max_abs: float | None = None
    per_output: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in DRIFT_MODES:
            raise UsageError(f"--drift: expected one of {', '.join(DRIFT_MODES)}, got {self.mode!r}")

    @classmethod
    def from_options(
        cls,
        mode: str = "auto",
        rel_l2: Sequence[str] = (),
        cosine: Sequence[str] = (),
        argmax: Sequence[str] = (),
        max_abs: Sequence[str] = (),
    ) -> DriftThresholds:
        """From option values in the ``--atol`` forms: ``0.05`` (default) or ``name:0.1`` (one output)."""
        from onnx_qrewrite.verify.compare import parse_tolerance_option

        values: dict[str, float | None] = {}
        per_output: dict[str, dict[str, float]] = {}
        for key, option, given, at_most_one in (
            ("rel_l2", "--drift-rel-l2", rel_l2, False),
            ("cosine", "--drift-cosine", cosine, True),
            ("argmax", "--drift-argmax", argmax, True),
            ("max_abs", "--drift-atol", max_abs, False),
        ):
            default, per = parse_tolerance_option(given, option, float)
            if default is not None:
                values[key] = _check(float(default), option, str(default), at_most_one)
            for name, value in per.items():
                per_output.setdefault(name, {})[key] = _check(float(value), option, f"{name}:{value}", at_most_one)
        return cls(mode, **values, per_output=per_output)  # type: ignore[arg-type]

    def output_names(self) -> set[str]:
        """Names of the outputs given their own thresholds."""
        return set(self.per_output)

    def for_value(self, name: str) -> DriftThreshold:
        """The thresholds of value ``name``: its own where given, else the defaults."""
        own = self.per_output.get(name, {})
        return DriftThreshold(
            rel_l2=own.get("rel_l2", self.rel_l2),
            cosine=own.get("cosine", self.cosine),
            argmax=own.get("argmax", self.argmax),
            max_abs=own.get("max_abs", self.max_abs),
        )

    def to_dict(self) -> dict[str, object]:
        """The thresholds as the JSON report's ``settings.drift`` holds them."""
        return {
            "rel_l2": self.rel_l2,
            "cosine": self.cosine,
            "argmax": self.argmax,
            "max_abs": self.max_abs,
            "per_output": {k: dict(v) for k, v in self.per_output.items()},
        }


def is_classifier_shaped(dtype: np.dtype, shape: Sequence[int]) -> bool:
    """Floating, at least 2-D, last dimension > 1: rows of scores whose argmax is the answer."""
    floating = dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))
    return floating and len(shape) >= 2 and shape[-1] > 1


@dataclass(frozen=True)
class Drift:
    """Drift of one value over one or more samples."""

    threshold: DriftThreshold
    rel_l2: float = 0.0  # worst over samples
    rel_l2_sample: str | None = None
    cosine: float = 1.0  # worst (lowest) over samples
    cosine_sample: str | None = None
    argmax_rows: int = 0  # 0: not classifier-shaped (or no rows)
    argmax_agree: int = 0
    one_sided_non_finite: int = 0  # elements NaN/inf on one side only, or infinities that differ
    max_abs: float = 0.0

    @property
    def argmax_agreement(self) -> float | None:
        """Fraction of rows whose argmax agrees; None when the value is not classifier-shaped."""
        return self.argmax_agree / self.argmax_rows if self.argmax_rows else None

    @property
    def failures(self) -> list[str]:
        """Each threshold broken, in words (empty: within every threshold)."""
        t = self.threshold
        out = []
        if self.one_sided_non_finite:
            out.append(f"{self.one_sided_non_finite} element(s) NaN or infinite on one side only")
        if not self.rel_l2 <= t.rel_l2:
            out.append(f"rel L2 {self.rel_l2:.6g} > {t.rel_l2:g} (sample {self.rel_l2_sample})")
        if not self.cosine >= t.cosine:
            out.append(f"cosine {self.cosine:.6g} < {t.cosine:g} (sample {self.cosine_sample})")
        agreement = self.argmax_agreement
        if agreement is not None and agreement < t.argmax:
            out.append(f"argmax agreement {self.argmax_agree}/{self.argmax_rows} < {t.argmax:g}")
        if t.max_abs is not None and not self.max_abs <= t.max_abs:
            out.append(f"max abs {self.max_abs:.6g} > {t.max_abs:g}")
        return out

    @property
    def passed(self) -> bool:
        """Within every threshold."""
        return not self.failures

    def describe(self) -> str:
        """One line: every statistic with its threshold."""
        t = self.threshold
        parts = [f"rel L2 {self.rel_l2:.3g} (<= {t.rel_l2:g})", f"cosine {self.cosine:.6g} (>= {t.cosine:g})"]
        if self.argmax_rows:
            parts.append(f"argmax {self.argmax_agree}/{self.argmax_rows} rows agree (>= {t.argmax:g})")
        if t.max_abs is not None:
            parts.append(f"max abs {self.max_abs:.3g} (<= {t.max_abs:g})")
        if self.one_sided_non_finite:
            parts.append(f"{self.one_sided_non_finite} one-sided NaN/inf")
        return ", ".join(parts)


def measure_drift(
    sample: str,
    original: np.ndarray,
    rewritten: np.ndarray,
    threshold: DriftThreshold,
    max_abs: float,
    *,
    undefined: np.ndarray | None = None,
) -> Drift:
    """The drift of one value on one sample (same shape and dtype: the caller checked).

    ``undefined`` (broadcast to the value's shape): elements the original's kernel leaves
    undefined (:mod:`.undefined`), measured nowhere. They count as 0 on both sides in rel L2 and
    cosine (a 0 adds nothing to either norm, the difference or the dot product, so those are the
    statistics of the defined elements alone), and as -inf in each argmax, so a filler value
    cannot win a row; a row with no defined element is not compared (not among the rows)."""
    shape = np.shape(original)
    defined = None if undefined is None else ~np.broadcast_to(np.asarray(undefined, bool), shape)
    a = np.asarray(original).astype(np.float64)
    b = np.asarray(rewritten).astype(np.float64)
    if defined is not None:
        a, b = np.where(defined, a, 0.0), np.where(defined, b, 0.0)
    a, b = a.ravel(), b.ravel()
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    finite = np.isfinite(a) & np.isfinite(b)
    one_sided = int(np.count_nonzero(~same & ~finite))
    a_f, b_f = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
    norm_a, norm_b = float(np.linalg.norm(a_f)), float(np.linalg.norm(b_f))
    norm_d = float(np.linalg.norm(a_f - b_f))
    rel_l2 = norm_d / norm_a if norm_a > 0 else (0.0 if norm_d == 0 else math.inf)
    if norm_a > 0 and norm_b > 0:
        cosine = float(np.dot(a_f, b_f)) / (norm_a * norm_b)
    else:
        cosine = 1.0 if norm_a == norm_b else 0.0  # both all-zero: identical
    rows, agree = _argmax_agreement(original, rewritten, defined)
    return Drift(
        threshold,
        rel_l2=rel_l2,
        rel_l2_sample=sample,
        cosine=cosine,
        cosine_sample=sample,
        argmax_rows=rows,
        argmax_agree=agree,
        one_sided_non_finite=one_sided,
        max_abs=max_abs,
    )


def _argmax_agreement(original: np.ndarray, rewritten: np.ndarray, defined: np.ndarray | None) -> tuple[int, int]:
    """(rows compared, rows whose argmax agrees) of a classifier-shaped value, over its defined
    elements only (``defined``: None, all); (0, 0) for any other value."""
    original = np.asarray(original)
    if not is_classifier_shaped(original.dtype, original.shape) or not original.size:
        return 0, 0
    width = original.shape[-1]
    scores_a = original.astype(np.float64).reshape(-1, width)
    scores_b = np.asarray(rewritten).astype(np.float64).reshape(-1, width)
    if defined is not None:
        keep = defined.reshape(-1, width)
        compared = keep.any(axis=-1)
        scores_a = np.where(keep, scores_a, -np.inf)[compared]
        scores_b = np.where(keep, scores_b, -np.inf)[compared]
    agree = np.argmax(scores_a, axis=-1) == np.argmax(scores_b, axis=-1)
    return int(scores_a.shape[0]), int(np.count_nonzero(agree))


def merge_drifts(parts: Sequence[Drift]) -> Drift:
    """One value over several samples: the worst rel L2 and cosine, argmax rows pooled."""
    worst_l2 = max(parts, key=lambda d: d.rel_l2)
    worst_cos = min(parts, key=lambda d: d.cosine)
    return dataclasses.replace(
        parts[0],
        rel_l2=worst_l2.rel_l2,
        rel_l2_sample=worst_l2.rel_l2_sample,
        cosine=worst_cos.cosine,
        cosine_sample=worst_cos.cosine_sample,
        argmax_rows=sum(d.argmax_rows for d in parts),
        argmax_agree=sum(d.argmax_agree for d in parts),
        one_sided_non_finite=sum(d.one_sided_non_finite for d in parts),
        max_abs=max(d.max_abs for d in parts),
    )


@dataclass(frozen=True)
class DriftDecision:
    """Whether the outputs are judged by drift, and why (as the report states it)."""

    mode: str
    judged: bool
    #: Approximate rules the rewritten model records, with how many replacements each made.
    approximate_rules: Mapping[str, int]
    note: str | None = None


def approximate_rules(model: object) -> dict[str, int]:
    """Rule id -> number of replacements the model's provenance marks approximate (every graph,
    subgraphs included; a replacement's first node carries the exactness, see
    :mod:`onnx_qrewrite.rewriter.provenance`). ``model``: an ``onnx.ModelProto`` or a wire view of
    one (:mod:`onnx_qrewrite.io.wire_model`); read through the fields both spell alike."""
    from onnx_qrewrite.rewriter import provenance

    found: dict[str, int] = {}

    def walk(nodes: Any) -> None:
        for node in nodes:
            meta = {p.key: p.value for p in node.metadata_props}
            if meta.get(provenance.EXACTNESS_KEY) == "approximate" and provenance.RULE_KEY in meta:
                rule = meta[provenance.RULE_KEY]
                found[rule] = found.get(rule, 0) + 1
            for attr in node.attribute:
                if attr.type == _GRAPH:
                    walk(attr.g.node)
                for sub in attr.graphs:
                    walk(sub.node)

    walk(model.graph.node)  # type: ignore[attr-defined]
    for function in model.functions:  # type: ignore[attr-defined]
        walk(function.node)
    return found


def decide(mode: str, model: object, rules: dict[str, int] | None = None) -> DriftDecision:
    """Apply ``mode`` (:data:`DRIFT_MODES`) to the rewritten ``model``; ``rules``: its
    :func:`approximate_rules`, when the caller already knows them."""
    from onnx_qrewrite.rewriter import provenance

    if rules is None:
        rules = approximate_rules(model)
    note = None
    if mode == "auto" and not rules and provenance.model_mode(model) == "none":  # type: ignore[arg-type]
        note = (
            "the rewritten model records no provenance (--provenance none), so approximate rewrites "
            "cannot be seen in it: give --drift always if it has some"
        )
    judged = mode == "always" or (mode == "auto" and bool(rules))
    return DriftDecision(mode, judged, rules, note)
