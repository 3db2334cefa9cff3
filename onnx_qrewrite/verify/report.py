"""The verification report: one object, three renderings (table, JSON, JUnit XML).

The JSON form follows ``report.schema.json`` next to this module (JSON Schema 2020-12). JSON has no
infinity or NaN, so non-finite numbers are written as the strings ``"inf"``, ``"-inf"`` and
``"nan"``. The JUnit form has one test case per output so that CI systems list each model and
output, with the statistics in the failure text.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.io.outputs import write_report_file
from onnx_qrewrite.verify.compare import DEFAULT_FLOAT_TOLERANCES, ROLES, Tolerances, ValueComparison
from onnx_qrewrite.verify.drift import Drift, DriftDecision, DriftThresholds
from onnx_qrewrite.verify.inputs import GenerationOptions, Sample, ValueRange
from onnx_qrewrite.verify.session import SessionSettings

if TYPE_CHECKING:
    import xml.etree.ElementTree as ET

    from onnx_qrewrite.verify.hazards import Hazard
    from onnx_qrewrite.verify.localize import Localization

__all__ = ["SCHEMA_PATH", "VerifyReport", "VerifySettings"]

#: The JSON Schema every ``--report`` file validates against.
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")
TOOL_NAME = "onnx-qrewrite"


_REANCHOR_LINE = (
    "reference: outputs marked re-anchored are compared with the original re-run from the rewritten model's "
    "values at its {n} bounded replacement output(s), so only its exact part is held to the tolerance; their "
    "drift from the plain original ('vs original') is for information; every bounded replacement is checked "
    "against its own bound at its node, on the original's inputs and on the cut original's, and the values "
    "they read are compared with the cut original's"
)

#: How the summary names each kind of checked value beside the outputs (singular, plural): what
#: passed, and what failed ("1 of 4 bounded replacements beyond their bounds").
_CHECKED = {
    "bound": ("bounded replacement within its bound", "bounded replacements within their bounds"),
    "value-read": ("value a bounded replacement reads", "values the bounded replacements read"),
}
_FAILED = {
    "bound": ("bounded replacement beyond its bound", "bounded replacements beyond their bounds"),
    "value-read": ("value a bounded replacement reads differs", "values the bounded replacements read differ"),
}


def _plural(n: int, forms: tuple[str, str]) -> str:
    """``n`` and the singular or plural form; empty for 0."""
    return f"{n} {forms[n != 1]}" if n else ""


_U8S8_LINE = (
    "reference: {n} uint8 x int8 node(s) of the original (and any such node the rewritten model kept) ran with "
    "their int8 weights as uint8 (w + 128, zp + 128), as onnxruntime's session.x64quantprecision runs them: the "
    "ONNX definition, without the int16 pair saturation of its default kernel on x86 CPUs without AVX-VNNI; "
    "their replacements are checked against the default kernel at their node, within their bound"
)


@dataclass(frozen=True)
class VerifySettings:
    """Everything that decided the verdict besides the models themselves."""

    session: SessionSettings
    tolerances: Tolerances
    generation: GenerationOptions | None  # None: inputs were given
    inputs_file: str | None = None
    reference_kernels: bool = False  # vendor nodes of the original ran on the numpy kernels
    vendor_nodes: int = 0
    value_ranges: Mapping[str, ValueRange] = dataclasses.field(default_factory=dict)  # generated inputs
    runtime: Any = None  # verify.runtimes.RuntimeInfo: what ran the rewritten model (None: onnxruntime CPU)
    drift: DriftThresholds = dataclasses.field(default_factory=DriftThresholds)
    drift_decision: DriftDecision | None = None  # None: not decided (no rewritten model was read)
    #: Nodes of the original whose int8 weights ran as uint8 for the output comparison, as onnxruntime's
    #: session.x64quantprecision runs them (no int16 pair saturation; verify/u8s8_reference.py).
    u8s8_reference_nodes: int = 0
    #: The bounded replacements' output values the original was cut at for the re-anchored
    #: reference (verify/reanchor.py); empty when every output was compared with the plain original.
    anchors: tuple[str, ...] = ()


@dataclass(frozen=True)
class VerifyReport:
    """The verdict, per-output statistics, the inputs used and, on failure, the first bad node."""

    original: str
    rewritten: str
    outputs: tuple[ValueComparison, ...]
    samples: tuple[Sample, ...]
    settings: VerifySettings
    versions: dict[str, str | None]
    localization: Localization | None = None
    duration_seconds: float = 0.0
    #: Samples left out of the verdict: a NaN reached a node whose kernel is not deterministic on it.
    excluded: tuple[Hazard, ...] = ()
    #: Why nothing was compared although the models ran (e.g. the same file given twice).
    not_compared: str | None = None
    #: Bounded replacements whose bound is recorded but not checked at their node (verify/bounds.py
    #: UncheckedBound: a target plan's later stage computes through what they wrote, or rewrote part
    #: of it with a rule that is not exact); the model's outputs are still compared.
    unchecked_bounds: tuple[Any, ...] = ()
    #: On another runtime, when an output failed: the original itself run there on the failing
    #: samples, saying whose difference it is (verify/runtime_baseline.py).
    runtime_baseline: Any = None

    @property
    def inconclusive_reason(self) -> str | None:
        """Why no element was compared, when none was (and nothing failed); else None."""
        if any(not o.passed for o in self.outputs):
            return None
        if self.not_compared:
            return self.not_compared
        unverified = [o for o in self.outputs if o.verdict == "not-verified"]
        if unverified and sum(o.elements for o in self.outputs):
            names = ", ".join(o.name for o in unverified)
            what = _plural(len(unverified), ("value", "values"))
            return f"{what} not verified ({names}): {unverified[0].undefined_why}"
        if not self.outputs:
            return "the models have no outputs"
        if sum(o.elements for o in self.outputs) == 0:
            if self.excluded and all(any(h.sample == s.name for h in self.excluded) for s in self.samples):
                return f"every sample was excluded: {self.excluded[0].describe()}"
            if any(o.undefined for o in self.outputs):
                return "every element is one the original's kernel leaves undefined"
            return "every output has zero elements on every sample"
        return None

    @property
    def passed(self) -> bool:
        """True when something was compared and every value agreed (never on nothing)."""
        return self.verdict_key == "passed"

    @property
    def verdict_key(self) -> str:
        """``passed``, ``failed`` or ``inconclusive`` (nothing was compared: never a pass)."""
        if any(not o.passed for o in self.outputs):
            return "failed"
        return "inconclusive" if self.inconclusive_reason else "passed"

    @property
    def verdict(self) -> str:
        """``PASSED``, ``FAILED`` or ``INCONCLUSIVE``, as the final line of the table says."""
        return self.verdict_key.upper()

    @property
    def exit_code(self) -> int:
        """The command line's exit code for this result: 0 agreed, 1 disagreed, 6 nothing compared."""
        from onnx_qrewrite.errors import EXIT_DISAGREE, EXIT_INCONCLUSIVE, EXIT_OK

        return {"passed": EXIT_OK, "failed": EXIT_DISAGREE, "inconclusive": EXIT_INCONCLUSIVE}[self.verdict_key]

    @property
    def summary(self) -> str:
        """The final ``PASSED | ...`` / ``FAILED | ...`` / ``INCONCLUSIVE | ...`` line."""
        n_samples = len(self.samples) - len({h.sample for h in self.excluded})
        where = f"on {n_samples} sample{'s' * (n_samples != 1)} (opt-level {self.settings.session.opt_level})"
        excluded = ""
        if self.excluded:
            n_ex = len({h.sample for h in self.excluded})
            excluded = f"; {n_ex} sample{'s' * (n_ex != 1)} excluded (NaN into a non-deterministic kernel)"
        undefined = sum(o.undefined for o in self.outputs)
        if undefined:
            excluded += f"; {_plural(undefined, ('element', 'elements'))} the original leaves undefined not compared"
        reason = self.inconclusive_reason
        if reason is not None and any(o.elements for o in self.outputs):
            return f"INCONCLUSIVE | {reason}"
        if reason is not None:
            return f"INCONCLUSIVE | nothing was compared: {reason}"
        judged = self.settings.drift_decision is not None and self.settings.drift_decision.judged
        drift = "; judged by drift (approximate rewrite)" if judged else ""
        outputs = self.rows("output")
        anchored = sum(o.reference == "re-anchored" for o in outputs)
        if anchored:
            drift += f"; {anchored} against the re-anchored original (bounded rewrites)"
        if self.passed:
            n = len(outputs)
            empty = sum(o.verdict == "empty" for o in outputs)
            note = f" ({empty} of them empty: no element compared)" if empty else ""
            agree = "agree" if not judged else "within the drift thresholds"
            if not judged and n == 1:
                agree += "s"
            text = f"PASSED | {n} output{'s' * (n != 1)} {agree}{note} {where}{excluded}{drift}"
            checked = [_plural(len(self.rows(role)), _CHECKED[role]) for role in ("bound", "value-read")]
            checked = [c for c in checked if c]
            return text + (f"; also checked: {', '.join(checked)}" if checked else "") + self._unchecked_note()
        failed = [o.name for o in outputs if not o.passed]
        text = f"FAILED | {len(failed)} of {len(outputs)} outputs differ {where}"
        text += f": {', '.join(failed)}" if failed else ""
        for role in ("bound", "value-read"):
            rows = self.rows(role)
            bad = [o.name for o in rows if not o.passed]
            if bad:
                text += f"; {len(bad)} of {_plural(len(rows), _FAILED[role])}: {', '.join(bad)}"
        text += excluded + drift + self._unchecked_note() + self._baseline_note()
        loc = self.localization
        if loc is not None and loc.found:
            text += f"; first differing node {loc.node!r}"
            if loc.rule:
                text += f" (rule {loc.rule})"
        return text

    def _unchecked_note(self) -> str:
        """ "; N bounded replacements' bounds not checked at their node ..." ("" when none)."""
        n = len(self.unchecked_bounds)
        if not n:
            return ""
        what = _plural(n, ("bounded replacement's bound", "bounded replacements' bounds"))
        return f"; {what} NOT checked at the node (a later rewrite computes through or rewrote what they wrote)"

    def _baseline_note(self) -> str:
        """ "; the original on R is as far: R's own computation" and the like ("" when not run)."""
        b = self.runtime_baseline
        if b is None:
            return ""
        return {
            "runtime": f"; the original itself on {b.runtime} is as far: {b.runtime}'s own computation, "
            "not the rewrite",
            "rewrite": f"; the original on {b.runtime} agrees with onnxruntime: the rewrite's difference",
            "both": f"; the original on {b.runtime} is off too, and the rewrite adds to it",
            "not-run": f"; the original does not run on {b.runtime}",
        }[b.finding]

    def rows(self, role: str) -> list[ValueComparison]:
        """The comparison rows of ``role`` (``output``, ``bound`` or ``value-read``; see
        :attr:`ValueComparison.role`), in report order."""
        return [o for o in self.outputs if o.role == role]

    def counts(self) -> dict[str, dict[str, int]]:
        """Per role, how many rows were checked and how many failed (the JSON report's ``counts``):
        the outputs apart from the bounded replacements' values and the values they read."""
        return {
            role: {"checked": len(rows), "failed": sum(not o.passed for o in rows)}
            for role in ROLES
            for rows in [self.rows(role)]
        }

    # -- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON report as plain data (see ``report.schema.json``)."""
        s = self.settings
        generation = s.generation
        return {
            "tool": {"name": TOOL_NAME, "version": self.versions.get(TOOL_NAME)},
            "versions": {k: v for k, v in self.versions.items() if k != TOOL_NAME},
            "models": {"original": self.original, "rewritten": self.rewritten},
            "settings": {
                "ort_opt_level": s.session.opt_level,
                "threads": s.session.threads,
                "custom_op_library": None if s.session.custom_op_library is None else str(s.session.custom_op_library),
                "reference_kernels": s.reference_kernels,
                "vendor_nodes": s.vendor_nodes,
                "u8s8_reference_nodes": s.u8s8_reference_nodes,
                "re_anchored_at": list(s.anchors),
                "runtime": _runtime_dict(s.runtime),
                "drift": _drift_settings(s.drift, s.drift_decision),
                "tolerances": {
                    "atol": s.tolerances.atol,
                    "rtol": s.tolerances.rtol,
                    "lsb": s.tolerances.lsb,
                    "rule": s.tolerances.rule,
                    "per_output": _per_output(s.tolerances),
                    "float_defaults": {k: {"atol": a, "rtol": r} for k, (a, r) in DEFAULT_FLOAT_TOLERANCES.items()},
                },
                "inputs": {
                    "source": "generated" if generation is not None else "file",
                    "file": s.inputs_file,
                    "samples": None if generation is None else generation.samples,
                    "seed": None if generation is None else generation.seed,
                    "int_range": None
                    if generation is None or generation.int_range is None
                    else list(generation.int_range),
                    "battery": None if generation is None else generation.battery,
                    "input_shapes": {} if generation is None else {k: list(v) for k, v in generation.shapes.items()},
                    "input_dims": {} if generation is None else dict(generation.dims),
                    "value_ranges": {
                        name: {"low": r.low, "high": r.high, "why": r.why} for name, r in s.value_ranges.items()
                    },
                },
            },
            "inputs": {"samples": [_sample_dict(sample) for sample in self.samples]},
            "outputs": [_comparison_dict(o) for o in self.outputs],
            "counts": self.counts(),
            "verdict": self.verdict_key,
            "inconclusive_reason": self.inconclusive_reason,
            "excluded_samples": [_hazard_dict(h) for h in self.excluded],
            "unchecked_bounds": [{"node": u.origin, "rule": u.rule, "why": u.why} for u in self.unchecked_bounds],
            "runtime_baseline": None
            if self.runtime_baseline is None
            else self.runtime_baseline.to_dict(_comparison_dict),
            "summary": self.summary,
            "localization": None if self.localization is None else _localization_dict(self.localization),
            "duration_seconds": round(self.duration_seconds, 6),
        }

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON report (``report.schema.json``) to ``path``."""
        import json  # only --report needs it: not imported on every verify

        write_report_file(path, json.dumps(self.to_dict(), indent=2) + "\n", "--report")

    # -- JUnit ------------------------------------------------------------------------------

    def to_junit(self) -> ET.Element:
        """``<testsuites>`` with one ``<testsuite>`` per model pair and one test case per output."""
        import xml.etree.ElementTree as ET  # only JUnit needs it: not imported on every verify

        failures = sum(not o.passed for o in self.outputs)
        suites = ET.Element(
            "testsuites",
            name=f"{TOOL_NAME} verify",
            tests=str(len(self.outputs)),
            failures=str(failures),
            errors="0",
            time=f"{self.duration_seconds:.3f}",
        )
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=self.rewritten,
            tests=str(len(self.outputs)),
            failures=str(failures),
            errors="0",
            skipped=str(sum(o.verdict == "not-verified" for o in self.outputs)),
            time=f"{self.duration_seconds:.3f}",
        )
        properties = ET.SubElement(suite, "properties")
        for name, value in (
            ("original", self.original),
            ("rewritten", self.rewritten),
            ("ort_opt_level", self.settings.session.opt_level),
            ("threads", str(self.settings.session.threads)),
            ("samples", ", ".join(s.name for s in self.samples)),
            ("drift", _drift_line(self.settings.drift, self.settings.drift_decision) or "not judged"),
        ):
            ET.SubElement(properties, "property", name=name, value=value)
        classname = Path(self.rewritten).stem if self.rewritten else "model"
        for output in self.outputs:
            case = ET.SubElement(suite, "testcase", classname=classname, name=output.name, time="0")
            if not output.passed:
                failure = ET.SubElement(case, "failure", message=_failure_message(output), type="mismatch")
                failure.text = "\n".join(_stats_lines(output) + _localization_lines(self.localization))
            elif output.verdict == "not-verified":
                ET.SubElement(case, "skipped", message=f"not verified: {output.undefined_why}")
        return suites

    def junit_xml(self) -> str:
        """The JUnit document as text (what crosses process boundaries in batch runs)."""
        import xml.etree.ElementTree as ET

        root = self.to_junit()
        ET.indent(root)
        return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"

    def write_junit(self, path: str | os.PathLike[str]) -> None:
        """Write the JUnit XML report (one test case per output) to ``path``."""
        write_report_file(path, self.junit_xml(), "--junit")

    # -- table ------------------------------------------------------------------------------

    def to_table(self) -> str:
        """The human-readable report: settings, one row per output, localisation, verdict line."""
        lines = [*self._settings_lines(), ""]
        # A bounded rewrite adds rows that are not model outputs (their labels say "(node ..." or
        # "(read by the replacement of ..."): the column's header then says so too.
        header = (
            "output / checked value" if any(o.role != "output" for o in self.outputs) else "output",
            *_TABLE_COLUMNS,
        )
        rows: list[tuple[str, ...]] = [header]
        for o in self.outputs:
            rows += _output_rows(o, self.settings.anchors)
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines += ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        loc_lines = _localization_lines(self.localization)
        if loc_lines:
            lines += ["", *loc_lines]
        if self.runtime_baseline is not None:
            lines += ["", *self.runtime_baseline.lines()]
        if self.excluded:
            lines += [""] + [f"excluded sample {h.sample!r}: {h.describe()}" for h in self.excluded]
        if self.unchecked_bounds:
            lines += [""] + [f"bound not checked at {u.describe()}" for u in self.unchecked_bounds]
        lines += ["", self.summary]
        return "\n".join(lines)

    def _settings_lines(self) -> list[str]:
        """What was compared, and how: the lines above the table."""
        s = self.settings
        original = self.original
        if s.reference_kernels:
            original += f" ({s.vendor_nodes} vendor node{'s' * (s.vendor_nodes != 1)} on the numpy reference kernels)"
        elif s.session.custom_op_library is not None:
            original += f" (custom ops from {s.session.custom_op_library})"
        threads = s.session.threads or "default"
        return [
            f"original:  {original}",
            f"rewritten: {self.rewritten}",
            f"settings:  onnxruntime opt-level {s.session.opt_level}, threads {threads}; "
            f"samples: {', '.join(sample.name for sample in self.samples)}",
            *_runtime_lines(s.runtime),
            *([_U8S8_LINE.format(n=s.u8s8_reference_nodes)] if s.u8s8_reference_nodes else []),
            *(
                [_REANCHOR_LINE.format(n=len(s.anchors))]
                if any(o.reference == "re-anchored" for o in self.outputs)
                else []
            ),
            *([f"drift:     {line}"] if (line := _drift_line(s.drift, s.drift_decision)) else []),
        ]


# The table's columns after the first (whose title depends on the rows).
_TABLE_COLUMNS = (
    "dtype",
    "shape",
    "verdict",
    "tolerance",
    "max abs err",
    "max rel err",
    "worst element (sample index: original -> rewritten)",
    "mismatches",
    "exact",
)
_WORST = _TABLE_COLUMNS.index("worst element (sample index: original -> rewritten)") + 1


def _output_rows(o: ValueComparison, anchors: Sequence[str]) -> list[tuple[str, ...]]:
    """One output's row, then its notes (NaN/inf counts, drift, the comparison with the original
    where it was re-anchored) as rows holding text only in the worst-element column."""
    rows: list[tuple[str, ...]] = [
        (
            o.name,
            o.dtype,
            _fmt_shape(o.shape),
            o.verdict.upper(),
            o.tolerance_text + (" vs re-anchored" if o.reference == "re-anchored" else ""),
            _fmt(o.max_abs_error),
            _fmt(o.max_rel_error),
            _fmt_worst(o) if o.problem is None else o.problem,
            f"{o.mismatches}/{o.elements}",
            f"{100 * o.exact_match_rate:.2f}%",
        )
    ]
    notes = []
    if o.nan_original or o.nan_rewritten or o.inf_original or o.inf_rewritten:
        notes.append(
            f"NaN {o.nan_original} / {o.nan_rewritten}, inf {o.inf_original} / {o.inf_rewritten} (original / rewritten)"
        )
    if o.undefined:
        notes.append(_undefined_text(o))
    if o.drift is not None:
        notes.append(f"drift: {o.drift.describe()}")
    if o.against_original is not None:
        notes.append(_against_original_text(o.against_original))
        if o.name in anchors:
            notes.append("itself a bounded replacement's output: its row below (node ..., bound ...) decides")
    width = len(_TABLE_COLUMNS) + 1
    rows += [tuple(note if i == _WORST else "" for i in range(width)) for note in notes]
    return rows


# -- helpers ----------------------------------------------------------------------------------


def _num(value: float | int | None) -> float | int | str | None:
    """A JSON-safe number: non-finite floats become "inf", "-inf" or "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _fmt(value: float | int) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        return f"{value:.6g}"
    return str(value)


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _fmt_worst(o: ValueComparison) -> str:
    w = o.worst
    if w is None:
        return "-"
    return f"{w.sample} {_fmt_shape(w.index)}: {_fmt(w.original)} -> {_fmt(w.rewritten)}"


def _per_output(t: Tolerances) -> dict[str, dict[str, float | int]]:
    per: dict[str, dict[str, float | int]] = {}
    for key, values in (("atol", t.output_atol), ("rtol", t.output_rtol), ("lsb", t.output_lsb)):
        for name, value in values.items():
            per.setdefault(name, {})[key] = value
    return per


def _sample_dict(sample: Sample) -> dict[str, Any]:
    inputs = []
    for name, array in sample.feeds.items():
        as_float = np.asarray(array).astype(np.float64)
        finite = as_float[np.isfinite(as_float)]
        inputs.append(
            {
                "name": name,
                "dtype": array.dtype.name,
                "shape": list(array.shape),
                "min": _num(float(finite.min())) if finite.size else None,
                "max": _num(float(finite.max())) if finite.size else None,
            }
        )
    return {"name": sample.name, "inputs": inputs}


def _hazard_dict(h: Hazard) -> dict[str, Any]:
    return {
        "sample": h.sample,
        "node": h.node,
        "op_type": h.op_type,
        "value": h.value,
        "nan_count": h.nan_count,
        "reason": h.describe(),
    }


def _comparison_dict(o: ValueComparison) -> dict[str, Any]:
    worst = None
    if o.worst is not None:
        w = o.worst
        worst = {
            "sample": w.sample,
            "index": list(w.index),
            "original": _num(w.original),
            "rewritten": _num(w.rewritten),
            "abs_error": _num(w.abs_error),
            "rel_error": _num(w.rel_error),
        }
    return {
        "name": o.name,
        "dtype": o.dtype,
        "shape": list(o.shape),
        "verdict": o.verdict,
        "comparison": "integer" if o.integer else "float",
        "tolerance": {
            "atol": o.tolerance.atol,
            "rtol": o.tolerance.rtol,
            "lsb": o.tolerance.lsb,
            "text": o.tolerance_text,
        },
        "elements": o.elements,
        "mismatches": o.mismatches,
        "exact_matches": o.exact_matches,
        "exact_match_rate": o.exact_match_rate,
        "max_abs_error": _num(o.max_abs_error),
        "max_rel_error": _num(o.max_rel_error),
        "worst": worst,
        "nan": {"original": o.nan_original, "rewritten": o.nan_rewritten},
        "inf": {"original": o.inf_original, "rewritten": o.inf_rewritten},
        "problem": o.problem,
        "failed_samples": list(dict.fromkeys(o.failed_samples)),
        "drift": None if o.drift is None else _drift_dict(o.drift),
        "reference": o.reference,
        "role": o.role,
        "against_original": None if o.against_original is None else _comparison_dict(o.against_original),
        "undefined": {"elements": o.undefined, "why": o.undefined_why},
    }


def _drift_dict(d: Drift) -> dict[str, Any]:
    t = d.threshold
    return {
        "verdict": "passed" if d.passed else "failed",
        "rel_l2": _num(d.rel_l2),
        "rel_l2_sample": d.rel_l2_sample,
        "cosine": _num(d.cosine),
        "cosine_sample": d.cosine_sample,
        "argmax_agreement": d.argmax_agreement,
        "argmax_rows": d.argmax_rows,
        "one_sided_non_finite": d.one_sided_non_finite,
        "max_abs_error": _num(d.max_abs),
        "thresholds": {"rel_l2": t.rel_l2, "cosine": t.cosine, "argmax": t.argmax, "max_abs": t.max_abs},
        "failures": d.failures,
    }


def _drift_settings(thresholds: DriftThresholds, decision: DriftDecision | None) -> dict[str, Any]:
    return {
        "mode": thresholds.mode,
        "judged": bool(decision and decision.judged),
        "approximate_rules": {} if decision is None else dict(decision.approximate_rules),
        "note": None if decision is None else decision.note,
        **thresholds.to_dict(),
    }


def _drift_line(thresholds: DriftThresholds, decision: DriftDecision | None) -> str | None:
    """Why the outputs are (or, with a note, might have to be) judged by drift; None otherwise."""
    if decision is None or not (decision.judged or decision.note):
        return None
    if not decision.judged:
        return f"not judged by drift: {decision.note}"
    rules = ", ".join(f"{rule} x{n}" for rule, n in decision.approximate_rules.items())
    why = f"approximate rules {rules}" if rules else f"--drift {decision.mode}"
    t = thresholds
    limits = f"rel L2 <= {t.rel_l2:g}, cosine >= {t.cosine:g}, argmax agreement >= {t.argmax:g}"
    if t.max_abs is not None:
        limits += f", max abs <= {t.max_abs:g}"
    return f"outputs judged by drift ({why}): {limits}"


def _localization_dict(loc: Localization) -> dict[str, Any]:
    return {
        "found": loc.found,
        "sample": loc.sample,
        "node": loc.node,
        "op_type": loc.op_type,
        "domain": loc.domain,
        "rule": loc.rule,
        "origin": loc.origin,
        "value": None if loc.comparison is None else loc.comparison.name,
        "compared_values": loc.compared_values,
        "comparison": None if loc.comparison is None else _comparison_dict(loc.comparison),
        "note": loc.note,
    }


def _failure_message(o: ValueComparison) -> str:
    if o.problem:
        return o.problem
    if o.drift is not None:
        return "drift beyond thresholds: " + "; ".join(o.drift.failures) if o.drift.failures else o.drift.describe()
    return (
        f"{o.mismatches} of {o.elements} elements differ ({o.tolerance_text}); "
        f"max abs error {_fmt(o.max_abs_error)}, max rel error {_fmt(o.max_rel_error)}"
    )


def _against_original_text(plain: ValueComparison) -> str:
    """The plain comparison beside a re-anchored one: informational."""
    return (
        f"vs original (informational): max abs err {_fmt(plain.max_abs_error)}, max rel err "
        f"{_fmt(plain.max_rel_error)}, {plain.mismatches}/{plain.elements} beyond {plain.tolerance_text}"
    )


def _undefined_text(o: ValueComparison) -> str:
    """The elements set aside as undefined in the original (verify/undefined.py), and why."""
    return f"{o.undefined} of {o.elements + o.undefined} elements not compared: {o.undefined_why}"


def _stats_lines(o: ValueComparison) -> list[str]:
    return [
        f"output {o.name}: {o.dtype} {_fmt_shape(o.shape)}, tolerance {o.tolerance_text}",
        *([f"reference: {o.reference} original"] if o.reference != "original" else []),
        _failure_message(o),
        f"worst element: {_fmt_worst(o)}",
        f"exact matches: {o.exact_matches}/{o.elements} ({100 * o.exact_match_rate:.2f}%)",
        f"NaN original/rewritten: {o.nan_original}/{o.nan_rewritten}; inf: {o.inf_original}/{o.inf_rewritten}",
        f"failing samples: {', '.join(dict.fromkeys(o.failed_samples)) or '-'}",
        *([_undefined_text(o)] if o.undefined else []),
        *([f"drift: {o.drift.describe()}"] if o.drift is not None else []),
        *([_against_original_text(o.against_original)] if o.against_original is not None else []),
    ]


def _localization_lines(loc: Localization | None) -> list[str]:
    if loc is None:
        return []
    if not loc.found:
        return [f"localisation: {loc.note}"]
    c = loc.comparison
    assert c is not None
    made_by = f"rule {loc.rule}" if loc.rule else ("rule not recorded" if loc.note else "not created by the rewrite")
    origin = f", replacing original node {loc.origin!r}" if loc.origin else ""
    return [
        f"first differing node: {loc.node!r} ({loc.domain}::{loc.op_type}, {made_by}{origin})",
        f"  value {c.name!r} on sample {loc.sample!r}: {_failure_message(c)}; worst {_fmt_worst(c)}",
        *([f"  note: {loc.note}"] if loc.note else []),
    ]


def _runtime_dict(runtime: Any) -> dict[str, Any] | None:
    if runtime is None:
        return None
    return {"name": runtime.name, "version": runtime.version, "settings": dict(runtime.settings)}


def _runtime_lines(runtime: Any) -> list[str]:
    """Which runtime ran the rewritten model and how: settings that decide its numbers are stated."""
    if runtime is None or (
        runtime.name == "onnxruntime" and runtime.settings.get("providers") == "CPUExecutionProvider"
    ):
        return []
    settings = ", ".join(f"{k}={v}" for k, v in runtime.settings.items())
    return [
        f"runtime:   rewritten ran on {runtime.name} {runtime.version or ''} ({settings}); original on onnxruntime CPU"
    ]
