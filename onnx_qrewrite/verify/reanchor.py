"""The re-anchored reference: the original model re-run from the rewritten model's own values at
its bounded replacements, so that a bounded rewrite's outputs are judged without a hand-tuned
tolerance.

A bounded rule (:mod:`onnx_qrewrite.rewriter.contract`) may change its node's output by up to a
stated bound, and :mod:`.bounds` checks that bound at the node. Downstream, the difference is
carried through the rest of the graph, where it can grow (a matmul of 256 products near
cancellation turns a 1e-7 relative difference into 1e-4), so the model outputs cannot be held to
the exact-rewrite tolerance against the original, and no fixed looser tolerance is both safe and
meaningful: it would hide a broken exact node downstream, or fail a correct rewrite of a wider
model.

Instead, the original is *cut* at the bounded replacements' outputs (the names both models share:
a replacement keeps the replaced node's output names): each becomes a graph input of a copy of the
original, fed with the value the rewritten model computed there on the same sample. The rest of
the copy is the original graph, which the rest of the rewritten model must reproduce exactly, so
the rewritten outputs are compared with the copy's outputs at the exact-rewrite tolerance, and so
are the values the bounded replacements read (:func:`boundary_values`: the cut hides whatever lies
between two bounded replacements from the outputs, so the exact part is checked where it ends).
With :mod:`.bounds` (every bounded replacement within its bound, on the original's inputs and on
the cut original's), every difference at the outputs is accounted for: the rewritten model is the
original with each bounded node's value moved within its bound. A broken exact node after a
bounded one fails at the outputs, one between two at the next one's inputs, and either is
localised against the cut original.

The nodes that produced the cut values stay in the copy with their outputs renamed
(``<name>@original``): they compute the original kernel on the values *this* run gives them,
which :mod:`.bounds` compares with the replacement run alone on the same inputs. onnxruntime runs
both sides: other runtimes keep the plain comparison (their own rounding differs everywhere by a
little, see :mod:`.drift`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.verify.compare import (
    Tolerances,
    UndefinedLookup,
    ValueComparison,
    compare_values,
    merge_comparisons,
)
from onnx_qrewrite.verify.inputs import Sample
from onnx_qrewrite.verify.localize import with_outputs
from onnx_qrewrite.verify.session import ModelRunner

__all__ = [
    "ORIGINAL_SUFFIX",
    "SAMPLE_SUFFIX",
    "Anchored",
    "boundary_values",
    "cut_at",
    "judged_outputs",
    "localize_against_cut",
    "renamed",
    "run_anchored",
]

#: The suffix of a cut value's original producer's output in the cut copy (not a valid name in a
#: model the rewriter wrote: '@' never appears in the names it creates).
ORIGINAL_SUFFIX = "@original"


#: How a bound row names a sample checked on the rewritten model's own inputs (verify/bounds.py).
SAMPLE_SUFFIX = " (re-anchored)"


def renamed(name: str) -> str:
    """The name the cut copy gives the original producer's value of ``name``."""
    return name + ORIGINAL_SUFFIX


def cut_at(original: onnx.ModelProto, anchors: Mapping[str, np.dtype]) -> onnx.ModelProto:
    """A copy of ``original`` where every name in ``anchors`` is a graph input of that dtype; the
    node that produced it keeps computing it under :func:`renamed` (nothing reads that)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(original)
    graph = copy.graph
    for node in graph.node:
        for index, name in enumerate(node.output):
            if name in anchors:
                node.output[index] = renamed(name)
    kept = [v for v in graph.value_info if v.name not in anchors]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    for name, dtype in anchors.items():
        elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        graph.input.append(helper.make_tensor_value_info(name, elem_type, None))
        # The renamed output keeps its type: onnxruntime cannot infer some outputs' types alone
        # (MultiHeadAttention's qk: "type inference failed, inferred types: ... bfloat16, float16, float").
        graph.value_info.append(helper.make_tensor_value_info(renamed(name), elem_type, None))
    return copy


@dataclass
class Anchored:
    """Per sample: the rewritten model's values at the anchors and its comparisons with the cut
    original (output name -> one comparison per sample, as :func:`.judge.run_samples`)."""

    anchors: tuple[str, ...]
    cut: onnx.ModelProto
    values: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)
    per_output: dict[str, list[tuple[str, ValueComparison]]] = dataclasses.field(default_factory=dict)
    #: The values the bounded replacements read that the exact part computes (row label -> one
    #: comparison per sample): where the exact part meets the bounded replacements.
    boundary: dict[str, list[tuple[str, ValueComparison]]] = dataclasses.field(default_factory=dict)

    def boundary_rows(self) -> list[ValueComparison]:
        """One row per boundary value, merged over the samples, judged against the cut original."""
        return [merge_comparisons([c for _, c in parts]) for parts in self.boundary.values()]

    def sample(self, sample: Sample) -> Sample:
        """``sample`` with the rewritten model's anchor values added to its feeds (what the cut
        original reads; the rewritten model ignores them)."""
        return Sample(sample.name, {**sample.feeds, **self.values[sample.name]})


def boundary_values(original: onnx.ModelProto, rewritten: onnx.ModelProto, rewrites: Sequence[Any]) -> dict[str, str]:
    """The values bounded replacements (:class:`.bounds.BoundedRewrite`) read that the rest of the
    rewritten model computes and the original also has (not graph inputs, initializers or other
    replacements' outputs), each with its row label. The cut original computes them from the
    rewritten model's bounded values upstream, so they must agree at the exact tolerance: a broken
    exact node *between* two bounded replacements shows here (the next replacement's output is cut,
    so it cannot show at the model outputs)."""
    produced = {o for node in original.graph.node for o in node.output if o}
    skip = {i.name for i in rewritten.graph.input} | {t.name for t in rewritten.graph.initializer}
    skip |= {o for r in rewrites for o in r.outputs}
    found: dict[str, list[str]] = {}
    for rewrite in rewrites:
        for name in rewrite.inputs:
            if name in produced and name not in skip:
                found.setdefault(name, []).append(rewrite.origin or rewrite.outputs[0])
    return {name: f"{name} (read by the replacement of {', '.join(dict.fromkeys(by))})" for name, by in found.items()}


def run_anchored(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    anchors: Sequence[str],
    names: Sequence[str],
    samples: Sequence[Sample],
    tolerances: Tolerances,
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
    boundary: Mapping[str, str] | None = None,
    undefined: UndefinedLookup | None = None,
) -> Anchored:
    """Run the rewritten model with ``anchors`` exposed, the original cut there and fed with them,
    and compare the outputs ``names`` element-wise at ``tolerances`` (the values the rewritten
    model returns with the anchors exposed are the ones compared, so that both come from one run),
    and likewise the ``boundary`` values (name -> row label; :func:`boundary_values`), the
    original's ``undefined`` elements (:mod:`.undefined`) set aside."""

    def unset(name: str, sample: Sample, value: np.ndarray) -> Any:
        return None if undefined is None else undefined(name, sample.name, value.shape)

    boundary = dict(boundary or {})
    rewritten_runner = make_runner(with_outputs(rewritten, [*anchors, *boundary]), "rewritten")
    shared = [n for n in names if n in rewritten_runner.output_types]
    fetch = list(dict.fromkeys([*shared, *anchors, *boundary]))
    result: Anchored | None = None
    cut_runner: ModelRunner | None = None
    for sample in samples:
        actual = rewritten_runner.run(sample.feeds, fetch)
        if result is None:
            cut = cut_at(original, {a: actual[a].dtype for a in anchors})
            result = Anchored(tuple(anchors), cut, per_output={n: [] for n in shared})
            cut_runner = make_runner(with_outputs(cut, list(boundary)), "original")
        assert cut_runner is not None
        result.values[sample.name] = {a: actual[a] for a in anchors}
        expected = cut_runner.run(result.sample(sample).feeds, list(dict.fromkeys([*shared, *boundary])))
        for name in shared:
            tol = tolerances.for_value(name, expected[name].dtype)
            unset_here = unset(name, sample, expected[name])
            comparison = compare_values(name, sample.name, expected[name], actual[name], tol, undefined=unset_here)
            result.per_output[name].append((sample.name, comparison))
        for name, label in boundary.items():
            tol = tolerances.for_value(name, expected[name].dtype)
            unset_here = unset(name, sample, expected[name])
            comparison = compare_values(label, sample.name, expected[name], actual[name], tol, undefined=unset_here)
            comparison = dataclasses.replace(comparison, reference="re-anchored", role="value-read")
            result.boundary.setdefault(label, []).append((sample.name, comparison))
    assert result is not None, "verify always has at least one sample"
    return result


def judged_outputs(
    plain: Mapping[str, list[tuple[str, ValueComparison]]], anchored: Anchored, tolerances: Tolerances
) -> dict[str, list[tuple[str, ValueComparison]]]:
    """Per output and sample, the comparison that decides: the re-anchored one, with the plain one
    beside it for information, unless the caller set a tolerance for that output (it keeps its
    meaning: against the original) or the re-anchored run did not compare it."""
    decided: dict[str, list[tuple[str, ValueComparison]]] = {}
    for name, parts in plain.items():
        by_sample = dict(anchored.per_output.get(name, ()))
        if tolerances.explicit(name) or any(sample not in by_sample for sample, _ in parts):
            decided[name] = list(parts)
            continue
        decided[name] = [
            (sample, dataclasses.replace(by_sample[sample], reference="re-anchored", against_original=comparison))
            for sample, comparison in parts
        ]
    return decided


def localize_against_cut(outputs: Sequence[ValueComparison]) -> bool:
    """Whether every failure is seen against the cut original: an output judged re-anchored, or a
    bounded replacement out of bound only on the rewritten model's own inputs. Then what differs is
    in the exact part, and localising against the cut original names it; against the plain
    original, the first bounded replacement (within its bound) would be named instead."""
    for o in outputs:
        if o.passed or o.reference == "re-anchored":
            continue
        if not (o.failed_samples and all(s.endswith(SAMPLE_SUFFIX) for s in o.failed_samples)):
            return False
    return True
