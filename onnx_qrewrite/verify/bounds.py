"""Check every bounded rewrite at its own output, on the original model's own inputs to it.

A bounded rule (``onnx_qrewrite.rewriter.contract``) promises that the nodes replacing one original node
compute that node's outputs within ``Plan.bound``; the engine writes the rule, the origin and the
bound into the created nodes' metadata (``Emitter.BOUND_KEY``). Comparing intermediate values of
the two whole models cannot check that promise: a one-step difference upstream changes what every
downstream node sees, so downstream differences grow without any rule being wrong. So each
bounded replacement is cut out of the rewritten model and run alone, fed with the values the
*original* model computes for its inputs, and its outputs are compared with the original's
within the recorded bound (integer outputs: ``lsb = bound``; float outputs: ``atol = bound``).
A bound that grows with the data (``Plan.bound_scale``: float32 accumulation of a run-time
activation's products) is ``bound + per_unit * max|unit|``, ``unit`` a value of the original
model, evaluated on each sample from the original's own value of it.

Replacements are found through their provenance (:mod:`onnx_qrewrite.rewriter.provenance`: contiguous
nodes, the first carrying the rule, the origin and the bound); their outputs are the values the
original model also produces (replacements keep the replaced node's output names). A model
rewritten with ``--provenance none`` records no bound, so nothing is checked here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter import provenance
from onnx_qrewrite.rewriter.builders import Emitter
from onnx_qrewrite.verify import element_bounds, probe, reanchor
from onnx_qrewrite.verify.compare import Tolerance, ValueComparison, compare_values, merge_comparisons
from onnx_qrewrite.verify.inputs import Sample
from onnx_qrewrite.verify.localize import with_outputs
from onnx_qrewrite.verify.reanchor import Anchored
from onnx_qrewrite.verify.session import ModelRunner

__all__ = ["BoundedRewrite", "UncheckedBound", "bounded_rewrites", "check_bounds", "unchecked_bounds"]


@dataclass(frozen=True)
class BoundedRewrite:
    """The nodes that replaced one original node under a bounded rule."""

    rule: str
    origin: str
    bound: float
    nodes: tuple[onnx.NodeProto, ...]
    #: Values the replacement reads that it does not compute (graph values and initializers).
    inputs: tuple[str, ...]
    #: The replaced node's outputs (same names in both models).
    outputs: tuple[str, ...]
    #: The bound grows by ``per_unit * max|unit|`` (``unit`` a value of the original model); '' none.
    unit: str = ""
    per_unit: float = 0.0

    #: A per-element bound's formula (verify/element_bounds.py), or None: ``bound`` everywhere.
    formula: str | None = None
    #: The part of ``bound`` only onnxruntime's u8 x s8 int16 pair saturation uses (``Plan.bound_u8s8``).
    u8s8: float = 0.0
    #: That part, left out because this CPU's kernel was measured not to saturate (:func:`without_u8s8`).
    u8s8_dropped: float = 0.0

    @property
    def label(self) -> str:
        if self.formula:
            bound = element_bounds.describe(self.formula)
        else:
            bound = f"{self.bound:g}" + (f" + {self.per_unit:g}·max|{self.unit}|" if self.unit else "")
        if self.u8s8_dropped:
            bound += f", +{self.u8s8_dropped:g} where the u8 x s8 kernel saturates: not on this CPU"
        return f"{', '.join(self.outputs)} (node {self.origin or '<unnamed>'}, rule {self.rule}, bound {bound})"

    def without_u8s8(self) -> BoundedRewrite:
        """This rewrite checked against a uint8 x int8 kernel that does not saturate (CPUs with VNNI,
        ARM): its bound without the part only that saturation uses."""
        if not self.u8s8:
            return self
        return dataclasses.replace(self, bound=max(self.bound - self.u8s8, 0.0), u8s8=0.0, u8s8_dropped=self.u8s8)

    def bound_for(self, values: dict[str, np.ndarray]) -> float:
        """The bound on one sample: ``values`` holds the original model's value of ``unit``."""
        if not self.unit:
            return self.bound
        unit = np.asarray(values[self.unit], np.float64)
        largest = float(np.max(np.abs(unit))) if unit.size else 0.0
        return self.bound + self.per_unit * largest


@dataclass(frozen=True)
class UncheckedBound:
    """A bounded replacement whose bound is recorded but cannot be checked at its node: a later
    rewrite (a target plan's later stage, which continues the replacement's provenance) left it
    without the original node's outputs, or joined it to values the original does not compute; or
    a later stage's rule that is not exact rewrote part of it (it does not continue the
    provenance: ``provenance.SUPERSEDED_KEY`` marks its replacement)."""

    rule: str
    origin: str
    why: str

    def describe(self) -> str:
        return f"node {self.origin or '<unnamed>'} (rule {self.rule}): {self.why}"


def _meta(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def bounded_rewrites(original: onnx.ModelProto, rewritten: onnx.ModelProto) -> list[BoundedRewrite]:
    """Every bounded replacement in the rewritten model's main graph that can be checked at its
    node. The bound is on a replacement's first node (every provenance mode but ``none``, which
    records no bound); :func:`onnx_qrewrite.rewriter.provenance.attribute_nodes` finds the
    replacement's other nodes."""
    return _scan(original, rewritten)[0]


def unchecked_bounds(original: onnx.ModelProto, rewritten: onnx.ModelProto) -> list[UncheckedBound]:
    """The bounded replacements whose bound cannot be checked at their node (:class:`UncheckedBound`)."""
    return _scan(original, rewritten)[1]


#: Why a bounded replacement is not checked at its node (UncheckedBound.why).
_NO_OUTPUTS = (
    "the values it wrote for the original node are not values of the rewritten model (a later rewrite "
    "computes through them)"
)
_NOT_ORIGINAL = (
    "it reads values the original model does not compute (a later rewrite joined it to another "
    "replacement), so it cannot be run alone on the original's values"
)
_SUPERSEDED = (
    "a later stage's {rule} ({exactness}) rewrote part of its replacement, so the bound it declared is "
    "not that of the model's nodes; only the model's outputs are compared"
)


def _scan(original: onnx.ModelProto, rewritten: onnx.ModelProto) -> tuple[list[BoundedRewrite], list[UncheckedBound]]:
    """The bounded replacements, split into those checked at their node and those that cannot be."""
    produced_by_original = {out for node in original.graph.node for out in node.output if out}
    available = (
        produced_by_original | {i.name for i in original.graph.input} | {t.name for t in rewritten.graph.initializer}
    )
    found: list[BoundedRewrite] = []
    unchecked: list[UncheckedBound] = []
    nodes = list(rewritten.graph.node)
    owners = provenance.attribute_nodes(nodes)
    # One replacement: contiguous nodes of the same owner whose names share the "<prefix>/" the
    # engine gives every node it creates (in "full" mode every node carries the entries).
    keys = [(owner, node.name.rpartition("/")[0]) if owner else None for owner, node in zip(owners, nodes, strict=True)]
    index = 0
    while index < len(nodes):
        end = index + 1
        while end < len(nodes) and keys[end] is not None and keys[end] == keys[index]:
            end += 1
        meta = _meta(nodes[index])
        bound = meta.get(Emitter.BOUND_KEY)
        formula = meta.get(Emitter.BOUND_FORMULA_KEY)
        if bound is None and formula is not None:
            bound = "inf"  # the formula's bound depends on the inputs only
        owner = owners[index]
        if bound is not None and owner is not None:
            run = nodes[index:end]
            made = {o for n in run for o in n.output}
            read = tuple(dict.fromkeys(i for n in run for i in n.input if i and i not in made))
            outputs = tuple(o for n in run for o in n.output if o in produced_by_original)
            unit = meta.get(Emitter.BOUND_UNIT_KEY, "")
            per_unit = float(meta.get(Emitter.BOUND_PER_UNIT_KEY, "0")) if unit else 0.0
            u8s8 = float(meta.get(Emitter.BOUND_U8S8_KEY, "0"))
            if not outputs:
                unchecked.append(UncheckedBound(owner[0], owner[1], _NO_OUTPUTS))
            elif not set(read) <= available:
                unchecked.append(UncheckedBound(owner[0], owner[1], _NOT_ORIGINAL))
            else:
                found.append(
                    BoundedRewrite(
                        owner[0], owner[1], float(bound), tuple(run), read, outputs, unit, per_unit, formula, u8s8
                    )
                )
        index = end
    return _superseded(nodes, found, unchecked)


def _superseded(
    nodes: Sequence[onnx.NodeProto], found: list[BoundedRewrite], unchecked: list[UncheckedBound]
) -> tuple[list[BoundedRewrite], list[UncheckedBound]]:
    """``found`` and ``unchecked`` with the bounded replacements a later stage's inexact rule
    rewrote part of (``provenance.SUPERSEDED_KEY``) moved to the unchecked, with why."""
    why: dict[tuple[str, str], str] = {}
    for node in nodes:
        meta = _meta(node)
        mark = meta.get(provenance.SUPERSEDED_KEY)
        if mark is not None:
            rule, _, origin = mark.partition("\t")
            later = meta.get(provenance.RULE_KEY, "?")
            why.setdefault(
                (rule, origin), _SUPERSEDED.format(rule=later, exactness=meta.get(provenance.EXACTNESS_KEY, "?"))
            )
    if not why:
        return found, unchecked
    kept = [b for b in found if (b.rule, b.origin) not in why]
    listed = {(u.rule, u.origin) for u in unchecked}
    unchecked = [dataclasses.replace(u, why=why.get((u.rule, u.origin), u.why)) for u in unchecked]
    unchecked += [
        UncheckedBound(rule, origin, text) for (rule, origin), text in why.items() if (rule, origin) not in listed
    ]
    return kept, unchecked


def _alone(rewrite: BoundedRewrite, rewritten: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The replacement as a model of its own: initializers it reads, everything else an input."""
    initializers = {t.name: t for t in rewritten.graph.initializer}
    inits = [initializers[n] for n in rewrite.inputs if n in initializers]
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(feeds[n].dtype), feeds[n].shape)
        for n in rewrite.inputs
        if n not in initializers
    ]
    graph = helper.make_graph(
        list(rewrite.nodes),
        "bounded_rewrite",
        graph_inputs,
        [onnx.ValueInfoProto(name=o) for o in rewrite.outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=list(rewritten.opset_import), ir_version=rewritten.ir_version)


def _original_node(original: onnx.ModelProto, rewrite: BoundedRewrite) -> onnx.NodeProto | None:
    """The node the replacement replaced: by its name, else by its outputs (unnamed nodes)."""
    for node in original.graph.node:
        if (rewrite.origin and node.name == rewrite.origin) or (
            not rewrite.origin and set(rewrite.outputs) <= set(node.output)
        ):
            return node
    return None


def _constants(original: onnx.ModelProto, names: set[str]) -> dict[str, np.ndarray]:
    """The values of those ``names`` that are initializers of the original model."""
    return {t.name: numpy_helper.to_array(t) for t in original.graph.initializer if t.name in names}


#: Judges one output of one sample, given its formula's part read from constants (or None).
_Judge = Callable[[Any], ValueComparison]


@dataclass
class _Reads:
    """What the per-element bounds read: each formula rewrite's original node, the names of that
    node's inputs its formula reads, and those of them that are constants of the original."""

    originals: dict[int, onnx.NodeProto | None]
    names: dict[int, list[str]]
    constants: dict[str, np.ndarray]

    @classmethod
    def of(cls, original: onnx.ModelProto, rewrites: Sequence[BoundedRewrite]) -> _Reads:
        originals = {id(r): _original_node(original, r) for r in rewrites if r.formula}
        names = {
            id(r): element_bounds.needed_inputs(r.formula, node)
            for r in rewrites
            if r.formula and (node := originals[id(r)]) is not None
        }
        return cls(originals, names, _constants(original, {n for ns in names.values() for n in ns}))

    def prepared_later(self, rewrites: Sequence[BoundedRewrite]) -> set[int]:
        """The rewrites whose formula has a part read from constants only (element_bounds.prepare)."""
        return {
            index
            for index, r in enumerate(rewrites)
            if len(r.outputs) == 1
            and (node := self.originals.get(id(r))) is not None
            and element_bounds.preparable(r.formula, node, self.constants)
        }


def check_bounds(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    samples: Sequence[Sample],
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
    anchored: Anchored | None = None,
) -> list[ValueComparison]:
    """One comparison per bounded replacement's output, merged over ``samples``; empty when the
    rewritten model has no bounded replacement.

    Each replacement is run alone on the original's values of its inputs and, with ``anchored``
    (:mod:`.reanchor`), also on the values the original cut at the bounded outputs computes for them
    from the rewritten model's values upstream (samples named ``<sample> (re-anchored)``), against
    the original kernel on the same inputs: the inputs each bounded replacement sees in the
    rewritten model, up to the exact part's tolerance (which :mod:`.reanchor` checks at the
    replacements' inputs).

    A formula whose bound has a part read from constants only (MatMulNBits' dequantized weights)
    is judged after every sample has run, one node at a time: that part is computed once per node,
    not once per sample, and only one node's is held at a time (and the samples' values of those
    nodes meanwhile, up to ``_PENDING_BYTES``: beyond it they are judged, and the part computed
    again for the rest)."""
    rewrites, saturates = _for_this_cpu(bounded_rewrites(original, rewritten))
    if not rewrites:
        return []
    reads = _Reads.of(original, rewrites)
    later = reads.prepared_later(rewrites)
    per_value: dict[str, list[ValueComparison | None]] = {}
    pending: _Pending = {}
    held = 0
    for index, label, judge in _cases(original, rewritten, rewrites, samples, make_runner, anchored, reads, saturates):
        parts = per_value.setdefault(label, [])
        parts.append(None if index in later else judge(None))
        if index in later:
            pending.setdefault(index, []).append((parts, len(parts) - 1, judge))
            held += _held_bytes(judge, reads.constants)
            if held > _PENDING_BYTES:
                _judge_pending(pending, rewrites, reads)
                held = 0
    _judge_pending(pending, rewrites, reads)
    # A data-dependent bound differs per sample: each sample is judged by its own, the row shows the largest.
    rows = [
        dataclasses.replace(
            merge_comparisons(done), tolerance=max((p.tolerance for p in done), key=_size), role="bound"
        )
        for done in ([p for p in parts if p is not None] for parts in per_value.values())
    ]
    return rows + _identity_probes(original, rewritten, rewrites, reads.originals, make_runner)


#: Outputs awaiting their formula's part read from constants: per rewrite index, (the row's
#: parts, the slot, the judge).
_Pending = dict[int, list[tuple[list[ValueComparison | None], int, _Judge]]]

#: The values pending judgements may hold (the node's inputs and outputs per sample) before they
#: are judged: beyond it (long sequences), the weights' part is computed again for the next ones.
_PENDING_BYTES = 1 << 28


def _case(judge: _Judge) -> _Case:
    """The case a pending judgement judges."""
    assert isinstance(judge, functools.partial)
    return judge.args[0]


def _held_bytes(judge: _Judge, constants: dict[str, np.ndarray]) -> int:
    """The bytes a pending judgement holds: its sample's values of the node (not the constants)."""
    assert isinstance(judge, functools.partial)
    case, expected, actual = judge.args
    reads = sum(v.nbytes for n, v in case.reads.items() if n not in constants)
    return int(expected.nbytes + actual.nbytes + reads)


def _judge_pending(pending: _Pending, rewrites: Sequence[BoundedRewrite], reads: _Reads) -> None:
    """Judge every pending output, node by node: the formula's part read from constants (the
    dequantized weights) computed once per node, and one node's held at a time."""
    for index, jobs in pending.items():
        node, formula = reads.originals[id(rewrites[index])], rewrites[index].formula
        assert node is not None and formula is not None
        prepared = element_bounds.prepare(formula, node, reads.constants, [_case(judge).reads for _, _, judge in jobs])
        for parts, slot, judge in jobs:
            parts[slot] = judge(prepared)
        del prepared
    pending.clear()


def _cases(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    rewrites: Sequence[BoundedRewrite],
    samples: Sequence[Sample],
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
    anchored: Anchored | None,
    reads: _Reads,
    saturates: bool,
) -> Iterator[tuple[int, str, _Judge]]:
    """(rewrite index, row label, its judge) for each output of each bounded replacement on each
    sample (and re-anchored sample): the replacement run alone on the original's values of its inputs."""
    initializers = {t.name for t in rewritten.graph.initializer}
    needed = [
        n for r in rewrites for n in (*r.inputs, *r.outputs, *([r.unit] if r.unit else ())) if n not in initializers
    ]
    needed = list(dict.fromkeys(needed + [n for ns in reads.names.values() for n in ns if n not in reads.constants]))
    alone_runners: dict[int, ModelRunner] = {}
    for model, feeds_of, suffix, expected_name in _original_runs(original, samples, anchored):
        # In the cut model a replacement's output is a graph input (the rewritten model's value, what
        # a replacement downstream reads) and the original kernel's value of it is expected_name(it).
        wanted = list(dict.fromkeys([*needed, *(expected_name(n) for r in rewrites for n in r.outputs)]))
        runner = make_runner(with_outputs(model, wanted), "original")
        graph_inputs = {i.name for i in model.graph.input}
        fetch = [n for n in wanted if n not in graph_inputs]
        for given in samples:
            sample = feeds_of(given)
            values = dict(sample.feeds)
            values.update(runner.run(sample.feeds, fetch))
            for index, rewrite in enumerate(rewrites):
                feeds = {n: values[n] for n in rewrite.inputs if n not in initializers}
                if index not in alone_runners:
                    alone_runners[index] = make_runner(_alone(rewrite, rewritten, feeds), "rewritten")
                actual = alone_runners[index].run(feeds, list(rewrite.outputs))
                node = reads.originals.get(id(rewrite))
                formula_values = {
                    n: reads.constants[n] if n in reads.constants else values[n]
                    for n in reads.names.get(id(rewrite), ())
                }
                for name in rewrite.outputs:
                    label = rewrite.label if len(rewrite.outputs) == 1 else f"{name} of {rewrite.label}"
                    case = _Case(
                        rewrite,
                        node,
                        formula_values,
                        rewrite.bound_for(values),
                        saturates,
                        label,
                        sample.name + suffix,
                        name,
                    )
                    yield index, label, functools.partial(_judge, case, values[expected_name(name)], actual[name])


def _for_this_cpu(rewrites: list[BoundedRewrite]) -> tuple[list[BoundedRewrite], bool]:
    """The rewrites with the bounds that hold against this CPU's kernels, and whether its u8 x s8
    kernel saturates (measured only where some bound depends on it): where it does not, the part
    of a bound only that saturation uses is left out (``Plan.bound_u8s8``; the u8s8 formulas)."""
    if not any(r.u8s8 or element_bounds.uses_saturation(r.formula) for r in rewrites):
        return rewrites, True
    from onnx_qrewrite.verify.u8s8_reference import default_kernel_saturates

    if default_kernel_saturates():
        return rewrites, True
    return [r.without_u8s8() for r in rewrites], False


#: (model giving the original's values, its feeds per sample, sample suffix, where it holds an output's value)
_Run = tuple[onnx.ModelProto, Callable[[Sample], Sample], str, Callable[[str], str]]


def _original_runs(original: onnx.ModelProto, samples: Sequence[Sample], anchored: Anchored | None) -> list[_Run]:
    """The original on the samples and, with ``anchored``, the original cut at the bounded outputs
    on the rewritten model's values there."""
    runs: list[_Run] = [(original, lambda s: s, "", lambda name: name)]
    if anchored is not None:
        # Cut this original (the one with the kernels the bounds are stated against), not the one the
        # outputs were compared with (whose uint8 x int8 nodes may run without saturation).
        first = anchored.values[samples[0].name]
        cut_model = reanchor.cut_at(original, {a: first[a].dtype for a in anchored.anchors})
        cut = set(anchored.anchors)
        runs.append(
            (cut_model, anchored.sample, reanchor.SAMPLE_SUFFIX, lambda n: reanchor.renamed(n) if n in cut else n)
        )
    return runs


@dataclass(frozen=True)
class _Case:
    """One output of one bounded replacement on one sample: what judging it needs besides the values."""

    rewrite: BoundedRewrite
    node: onnx.NodeProto | None
    reads: dict[str, np.ndarray]
    bound: float  # the rewrite's scalar bound on this sample (BoundedRewrite.bound_for)
    saturates: bool
    label: str
    sample: str
    output: str = ""  # which of the replacement's outputs


def _judge(case: _Case, expected: np.ndarray, actual: np.ndarray, prepared: Any) -> ValueComparison:
    """The comparison of one output on one sample within its bound; ``prepared``: the formula's
    part read from constants (element_bounds.prepare), or None."""
    tol, per_element = _tolerance(case, expected, actual, prepared)
    return compare_values(case.label, case.sample, expected, actual, tol, element_bound=per_element)


def _tolerance(
    case: _Case, expected: np.ndarray, actual: np.ndarray, prepared: Any
) -> tuple[Tolerance, np.ndarray | None]:
    """The tolerance of one output of one sample: the rewrite's bound (integer outputs: in steps),
    or its formula's per-element bound where it has one, and that per-element bound."""
    bound, rewrite, node = case.bound, case.rewrite, case.node
    integer = expected.dtype.kind in "iub"
    formula = rewrite.formula if node is not None and _per_output(rewrite, node, case.output) else None
    per_element = None
    if formula and node is not None:
        per_element = element_bounds.element_bound(
            formula,
            node,
            case.reads,
            expected,
            actual,
            saturates=case.saturates,
            prepared=prepared,
            output=list(node.output).index(case.output),
        )
    if per_element is None or not formula:
        if not math.isfinite(bound):
            # Only a formula bounds this rewrite (the bound depends on run-time values) and it could
            # not be evaluated here: nothing is allowed, rather than everything.
            return Tolerance(0.0, 0.0, 0, text="exact: its bound's formula could not be evaluated here"), None
        return Tolerance(0.0 if integer else bound, 0.0, math.floor(bound) if integer else 0), None
    # An element bounded by nothing (inf: GroupQueryAttention's output_qk where the kernel writes
    # nothing) passes any finite value; the row states the largest finite bound.
    finite = per_element[np.isfinite(per_element)] if np.isposinf(per_element).any() else per_element
    largest = float(np.max(finite, initial=0.0)) if finite.size or not per_element.size else math.inf
    if not math.isfinite(largest):
        # run-time-k at a K with no float32 summation bound (K + 4 >= 2^24): unbounded, not passed.
        return Tolerance(0.0, 0.0, 0, text="exact: its bound's formula is infinite on this sample"), None
    text = f"{element_bounds.describe(formula, case.node, case.reads)}, at most {largest:g}"
    return Tolerance(0.0 if integer else largest, 0.0, math.floor(largest) if integer else 0, text=text), per_element


def _per_output(rewrite: BoundedRewrite, node: onnx.NodeProto, output: str) -> bool:
    """Whether the rewrite's formula bounds ``output``: a formula for one output where the
    replacement has one, an :data:`element_bounds.EVERY_OUTPUT` formula at each of the node's."""
    if (rewrite.formula or "").partition(":")[0] in element_bounds.EVERY_OUTPUT:
        return output in node.output
    return len(rewrite.outputs) == 1


def _identity_probes(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    rewrites: Sequence[BoundedRewrite],
    originals: dict[int, onnx.NodeProto | None],
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
) -> list[ValueComparison]:
    """The replacements a summation-order bound cannot check finely (MatMulNBits) read through a
    selector input, exactly (:mod:`.probe`): one row each, where their weights are constants."""
    initializers = {t.name for t in rewritten.graph.initializer}
    rows: list[ValueComparison] = []
    for rewrite in rewrites:
        node = originals.get(id(rewrite))
        if node is None or (rewrite.formula or "").partition(":")[0] != probe.PROBED_FORMULA:
            continue
        if len(rewrite.outputs) != 1 or any(n not in initializers for n in rewrite.inputs if n != node.input[0]):
            continue
        label = f"{rewrite.outputs[0]} (identity probe of node {rewrite.origin or '<unnamed>'}, rule {rewrite.rule})"

        def alone(feeds: dict[str, np.ndarray], rewrite: BoundedRewrite = rewrite) -> onnx.ModelProto:
            return _alone(rewrite, rewritten, feeds)

        rows += probe.identity_probe(original, node, alone, label, make_runner)
    return [dataclasses.replace(row, role="bound") for row in rows]


def _size(tolerance: Tolerance) -> float:
    return max(tolerance.atol, float(tolerance.lsb))
