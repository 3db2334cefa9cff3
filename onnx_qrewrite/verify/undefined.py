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
padded first prompt. The rewrite writes 0 there (``builders/contrib_gqa.py``). A value read from
output_qk through Identity or Cast (element for element) is set aside at the same elements; values
computed from it otherwise are compared in full.

The mask comes from the original's own seqlens_k on each sample: a graph input (the sample's
feed), an initializer, or a value the original computes (one more run of the original, with it
exposed, per sample; only for such models).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnx_qrewrite.verify.compare import Undefined
from onnx_qrewrite.verify.inputs import Sample
from onnx_qrewrite.verify.localize import with_outputs
from onnx_qrewrite.verify.session import ModelRunner

__all__ = ["UndefinedElements", "undefined_elements"]

#: Ops through which a value keeps its elements' positions and definedness (one input, one output).
_ELEMENTWISE_COPIES = frozenset({"Identity", "Cast"})


@dataclasses.dataclass(frozen=True)
class _Source:
    """A value read from a GroupQueryAttention node's output_qk: the node's seqlens_k and label."""

    seqlens: str
    node: str


@dataclasses.dataclass(frozen=True)
class UndefinedElements:
    """The values with undefined elements and, per sample name, the seqlens_k values that say
    which; called as an :data:`~.compare.UndefinedLookup`."""

    sources: dict[str, _Source]
    seqlens: dict[str, dict[str, np.ndarray]]

    def __call__(self, name: str, sample: str, shape: tuple[int, ...]) -> Undefined | None:
        """The undefined elements of ``name`` on ``sample`` (of that ``shape``), or None."""
        source = self.sources.get(name)
        values = self.seqlens.get(sample)
        if source is None or values is None or source.seqlens not in values or len(shape) != 4:
            return None
        lengths = np.asarray(values[source.seqlens]).reshape(-1).astype(np.int64) + 1
        if lengths.shape[0] != shape[0]:
            return None  # not the layout the kernel writes: compared in full
        mask = np.arange(shape[3]) >= lengths[:, None, None, None]
        if not mask.any():
            return None
        why = (
            f"the keys at or beyond seqlens_k[b] + 1 of the output_qk of GroupQueryAttention {source.node}, "
            "which onnxruntime's kernel leaves unwritten (undefined)"
        )
        return Undefined(mask, why)


def _gqa_sources(model: onnx.ModelProto) -> dict[str, _Source]:
    """output_qk of every GroupQueryAttention node of the main graph that writes it, and the values
    read from it element for element (:data:`_ELEMENTWISE_COPIES`)."""
    sources: dict[str, _Source] = {}
    for node in model.graph.node:
        if node.domain == "com.microsoft" and node.op_type == "GroupQueryAttention":
            qk_output = next((a.i for a in node.attribute if a.name == "qk_output"), 0)
            if qk_output in (1, 2) and len(node.output) > 3 and node.output[3] and len(node.input) > 5:
                label = repr(node.name) if node.name else f"writing {node.output[0]!r}"
                sources[node.output[3]] = _Source(node.input[5], label)
    if not sources:
        return sources
    for node in model.graph.node:  # topological order: a copy's copy follows it
        copies = node.domain in ("", "ai.onnx") and node.op_type in _ELEMENTWISE_COPIES and len(node.input) == 1
        if copies and node.input[0] in sources and node.output and node.output[0]:
            sources[node.output[0]] = sources[node.input[0]]
    return sources


def undefined_elements(
    model: onnx.ModelProto, samples: Sequence[Sample], run_original: Callable[[onnx.ModelProto], ModelRunner]
) -> UndefinedElements | None:
    """The undefined elements of ``model``'s values on ``samples`` (None when it has none);
    ``run_original(model)`` opens a runner of the original side (for a seqlens_k it computes)."""
    sources = _gqa_sources(model)
    if not sources:
        return None
    names = list(dict.fromkeys(s.seqlens for s in sources.values()))
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
