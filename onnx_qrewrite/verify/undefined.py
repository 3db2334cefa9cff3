"""Elements of the original model's values that its kernel leaves undefined: not compared.

A rewrite cannot be held to values the original kernel never writes. One such case is known and
measured (tests/test_verify_undefined.py), and verify sets those elements aside on every
comparison it makes (the outputs, the values compared against the re-anchored original, and the
intermediate values the localiser walks), counting them apart with the reason:

com.microsoft GroupQueryAttention's output_qk (B, N, S, total_sequence_length), ``qk_output`` 1 or 2.
onnxruntime 1.31.1's CPU kernel computes each batch entry's score rows over that entry's own keys
only (``total_b = seqlens_k[b] + 1`` columns: ``gqa_attention_base.h``) and copies them into
output_qk, so the keys at or beyond ``seqlens_k[b] + 1`` are never written: they hold whatever the
memory held before (-5.2e32, or a previous run's values, measured). That happens wherever
``seqlens_k[b] + 1`` is less than total_sequence_length: uneven lengths across the batch, or a
padded first prompt, whatever the past buffer's length (measured with one longer than
total_sequence_length: the same keys, and only those). The rewrite writes 0 there
(``builders/contrib_gqa.py``).

Values computed from output_qk carry that garbage on. Through the standard ops that compute each
output element from the elements at the same broadcast position (:data:`_ELEMENTWISE`: Identity,
Cast, unary math, arithmetic and comparisons, Where, Clip; and :data:`_QDQ`, standard or
com.microsoft, per-tensor or per-axis, not blocked, reading it as input 0), the undefined elements
are those that read an undefined one: output_qk's mask broadcast to the value's shape. Every other consumer (Softmax,
Reduce*, MatMul, Reshape, Transpose, Gather, ...) mixes or moves elements in ways this does not
follow: where output_qk has undefined keys on a sample, its outputs, and all computed from them, are
not comparable and not compared at all there (counted, with why; on samples where every key is
written they are compared in full). A value compared on no sample at all is reported not verified
(row ``NOT-VERIFIED``, verdict ``INCONCLUSIVE``, exit 6), never passed, and its why names the
sample that would compare it: seqlens_k[b] = total_sequence_length - 1 in every entry.

The mask comes from the original's own seqlens_k and total_sequence_length on each sample: a graph
input (the sample's feed), an initializer, or a value the original computes (one more run of the
original, with it exposed, per sample; only for such models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.verify.compare import Undefined
from onnx_qrewrite.verify.inputs import Sample
from onnx_qrewrite.verify.localize import with_outputs
from onnx_qrewrite.verify.session import ModelRunner

__all__ = ["UndefinedElements", "undefined_elements"]

#: Standard ops whose every output element is computed from the inputs' elements at the same
#: (multidirectionally broadcast) position, and nothing else: undefinedness follows positions.
_ELEMENTWISE = frozenset(
    {"Identity", "Cast", "CastLike", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Relu", "Sigmoid", "Tanh"}
    | {"Erf", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf", "Not", "Softplus", "Softsign"}
    | {"Elu", "Selu", "LeakyRelu", "HardSigmoid", "HardSwish", "Gelu", "Mish", "ThresholdedRelu", "Celu"}
    | {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Mean", "Sum", "PRelu", "Where", "Clip"}
    | {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "BitShift"}
)

#: QuantizeLinear / DequantizeLinear (standard or com.microsoft): element for element in their
#: input 0 when not blocked (no ``block_size``, or 0): per-tensor or per-axis, each output element
#: reads the input's element at its own position and a scale / zero point chosen by position only.
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _element_for_element(node: onnx.NodeProto, reached: Iterable[str]) -> bool:
    """Whether ``node`` computes each output element from the ``reached`` inputs' elements at the
    same (broadcast) position only: :data:`_ELEMENTWISE`, or unblocked Q/DQ reached at input 0."""
    if node.domain in ("", "ai.onnx") and node.op_type in _ELEMENTWISE:
        return True
    if node.domain not in ("", "ai.onnx", "com.microsoft") or node.op_type not in _QDQ:
        return False
    blocked = any(a.name == "block_size" and a.i != 0 for a in node.attribute)
    return not blocked and set(reached) == {node.input[0]}


@dataclass(frozen=True)
class _Source:
    """A GroupQueryAttention node's output_qk: the names of its seqlens_k and total_sequence_length
    inputs, and the node's label."""

    seqlens: str
    total: str
    node: str


@dataclass(frozen=True)
class _Reach:
    """How a value reads a source: element for element (``via`` None), or through ``via`` (an op
    and node that does not compute element for element), which makes it not comparable."""

    source: _Source
    via: str | None = None


@dataclass(frozen=True)
class UndefinedElements:
    """The values with undefined elements and, per sample name, the seqlens_k and
    total_sequence_length values that say which; called as an :data:`~.compare.UndefinedLookup`."""

    sources: dict[str, tuple[_Reach, ...]]
    seqlens: dict[str, dict[str, np.ndarray]]

    def __call__(self, name: str, sample: str, shape: tuple[int, ...]) -> Undefined | None:
        """The undefined elements of ``name`` on ``sample`` (of that ``shape``), or None."""
        values = self.seqlens.get(sample)
        if values is None:
            return None
        mask, whys = np.zeros((), bool), []
        for reach in self.sources.get(name, ()):
            keys = _unwritten(reach.source, values)
            if keys is None:
                continue
            part = np.ones(shape, bool) if reach.via is not None else _broadcast(keys, shape)
            if part is None:
                continue  # not output_qk's layout broadcast: compared in full
            mask = mask | part
            whys.append(_why(reach))
        if not mask.any():
            return None
        return Undefined(np.broadcast_to(mask, shape), "; ".join(dict.fromkeys(whys)))


def _unwritten(source: _Source, values: dict[str, np.ndarray]) -> np.ndarray | None:
    """(B, 1, 1, total_sequence_length): True at the keys >= seqlens_k[b] + 1, or None if none."""
    if source.seqlens not in values or source.total not in values:
        return None
    lengths = np.asarray(values[source.seqlens]).reshape(-1).astype(np.int64) + 1
    total = int(np.asarray(values[source.total]).reshape(-1)[0])
    mask = np.arange(total) >= lengths[:, None, None, None]
    return mask if mask.any() else None


def _broadcast(mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``mask`` at the positions of a value of ``shape`` computed element for element from output_qk
    (right-aligned broadcast), or None if output_qk does not broadcast to it."""
    try:
        return np.broadcast_to(mask, shape) if len(shape) >= 4 and shape[-4] == mask.shape[0] else None
    except ValueError:
        return None


def _why(reach: _Reach) -> str:
    written = (
        f"the keys at or beyond seqlens_k[b] + 1 of the output_qk of GroupQueryAttention {reach.source.node}, "
        "which onnxruntime's kernel leaves unwritten (undefined)"
    )
    if reach.via is None:
        return written
    return (
        f"computed from {written} by {reach.via}, not element for element: not comparable; compared on a sample "
        f"whose seqlens_k ({reach.source.seqlens!r}) is total_sequence_length ({reach.source.total!r}) - 1 "
        "in every batch entry (every key written)"
    )


def _gqa_sources(model: onnx.ModelProto) -> dict[str, tuple[_Reach, ...]]:
    """output_qk of every GroupQueryAttention node of the main graph that writes it, and the values
    computed from it: element for element (:data:`_ELEMENTWISE`) or otherwise."""
    sources: dict[str, tuple[_Reach, ...]] = {}
    for node in model.graph.node:
        if node.domain == "com.microsoft" and node.op_type == "GroupQueryAttention":
            qk_output = next((a.i for a in node.attribute if a.name == "qk_output"), 0)
            if qk_output in (1, 2) and len(node.output) > 3 and node.output[3] and len(node.input) > 6:
                label = repr(node.name) if node.name else f"writing {node.output[0]!r}"
                sources[node.output[3]] = (_Reach(_Source(node.input[5], node.input[6], label)),)
    if not sources:
        return sources
    for node in model.graph.node:  # topological order: a value's consumers follow it
        reached = [r for name in node.input if name in sources for r in sources[name]]
        if not reached or (node.domain == "com.microsoft" and node.op_type == "GroupQueryAttention"):
            continue
        if not _element_for_element(node, (name for name in node.input if name in sources)):
            label = f"{node.op_type} {node.name!r}" if node.name else f"{node.op_type} writing {node.output[0]!r}"
            reached = [_Reach(r.source, r.via or label) for r in reached]
        for out in node.output:
            if out:
                sources[out] = tuple(dict.fromkeys(reached))
    return sources


def undefined_elements(
    model: onnx.ModelProto, samples: Sequence[Sample], run_original: Callable[[onnx.ModelProto], ModelRunner]
) -> UndefinedElements | None:
    """The undefined elements of ``model``'s values on ``samples`` (None when it has none);
    ``run_original(model)`` opens a runner of the original side (for a value it computes)."""
    sources = _gqa_sources(model)
    if not sources:
        return None
    sources_read = {r.source for reaches in sources.values() for r in reaches}
    names = list(dict.fromkeys(n for s in sources_read for n in (s.seqlens, s.total)))
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in names}
    inputs = {i.name for i in model.graph.input}
    computed = [n for n in names if n not in inputs and n not in constants]
    runner = run_original(with_outputs(model, computed)) if computed else None
    seqlens = {}
    for sample in samples:
        values = {**constants, **_fed(sample, names)}
        if runner is not None:
            values.update(runner.run(sample.feeds, computed))
        seqlens[sample.name] = values
    return UndefinedElements(sources, seqlens)


def _fed(sample: Sample, names: Iterable[str]) -> dict[str, np.ndarray]:
    return {n: np.asarray(sample.feeds[n]) for n in names if n in sample.feeds}
