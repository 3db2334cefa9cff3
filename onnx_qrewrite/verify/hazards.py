"""Nodes whose onnxruntime kernel is not deterministic on some inputs, and a check that says when a
disagreement came from such inputs rather than from the rewrite.

The facts are measured (``NUMERICS.md`` of the project's shared notes, onnxruntime 1.31.1):
DynamicQuantizeLinear on a tensor that contains NaN gives a scale and zero point that depend on
the NaN's position and on the thread count, so two runs of the *same* model can differ, and no
rewrite can match it. ``-inf`` and ``+inf`` are deterministic there (zero point 255, or a range
that overflows to inf) and are reproduced exactly, so only NaN is a hazard.

When a sample fails, :class:`NanHazardCheck` runs the original once more with the inputs of such
nodes exposed as outputs; a NaN reaching one of them makes the sample *inconclusive* (it is
excluded from the verdict and named in the report) instead of a plain disagreement. Only
main-graph nodes are checked (what a session can expose as outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite._dataclass import dataclass

if TYPE_CHECKING:
    import onnx

__all__ = ["NAN_DETERMINISTIC_BELOW", "NAN_NONDETERMINISTIC", "Hazard", "NanHazardCheck"]

#: (domain, op_type) -> why a NaN in its first input makes its result unrepeatable.
NAN_NONDETERMINISTIC: Mapping[tuple[str, str], str] = {
    ("", "DynamicQuantizeLinear"): (
        "onnxruntime's kernel is not deterministic on NaN (its scale and zero point depend on where "
        "the NaN is and on the thread count)"
    ),
}

#: (domain, op_type) -> (n, why): below n elements the kernel *is* deterministic on NaN (its scalar
#: min/max loop skips it), and a rewrite disagrees only if it did not guard the range there.
NAN_DETERMINISTIC_BELOW: Mapping[tuple[str, str], tuple[int, str]] = {
    ("", "DynamicQuantizeLinear"): (
        8,
        "onnxruntime's kernel skips NaN below 8 elements, which the rewrite matches only where the input's "
        "shape is recorded (rewrite --target onnx --input-shape) or with --rule-option dql-expand.nan_guard=run-time",
    ),
}


@dataclass(frozen=True)
class Hazard:
    """A NaN that reached a node whose kernel is not deterministic on it, on one sample."""

    sample: str
    node: str
    op_type: str
    value: str  # the node's input that held NaN
    nan_count: int
    why: str

    def describe(self) -> str:
        """One line for the table and the JSON report: what reached which node, why it matters, and
        what to do about it."""
        return (
            f"NaN reached {self.op_type} {self.node!r} (input {self.value!r}, {self.nan_count} NaN); {self.why}. "
            "Choose inputs that keep the model finite (--val-range / --int-range)"
        )


def _op_key(node: onnx.NodeProto) -> tuple[str, str]:
    """The (domain, op_type) the tables above are keyed by ("ai.onnx" read as "")."""
    return (node.domain if node.domain != "ai.onnx" else "", node.op_type)


def _sensitive_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    nodes = []
    for node in model.graph.node:
        why = NAN_NONDETERMINISTIC.get(_op_key(node))
        if why is not None and node.input and node.input[0]:
            nodes.append((node, why))
    return nodes


class NanHazardCheck:
    """Finds, per sample, the first main-graph node of ``model`` (topological order) whose input
    holds NaN and whose kernel is not deterministic on NaN.

    ``open_runner(model_with_outputs)`` opens a session on a copy of the model with those inputs
    exposed (the verifier's session settings); it is called at most once, and only when the model
    has such nodes whose inputs are not graph inputs, so checking many failing samples costs one
    extra session, not one per sample."""

    def __init__(self, model: onnx.ModelProto, open_runner: Callable[[onnx.ModelProto], Any]) -> None:
        self.model = model
        self.nodes = _sensitive_nodes(model)
        self._open_runner = open_runner
        self._runner: Any = None

    def _exposed_runner(self, names: list[str]) -> Any:
        if self._runner is None:
            import onnx

            exposed = onnx.ModelProto()
            exposed.CopyFrom(self.model)
            present = {o.name for o in exposed.graph.output}
            for name in names:
                if name not in present:
                    exposed.graph.output.append(onnx.ValueInfoProto(name=name))
            self._runner = self._open_runner(exposed)
        return self._runner

    def check(self, sample_name: str, feeds: Mapping[str, np.ndarray]) -> Hazard | None:
        """The hazard on this sample, or None."""
        if not self.nodes:
            return None
        names = list(dict.fromkeys(node.input[0] for node, _ in self.nodes))
        values: dict[str, np.ndarray] = {n: feeds[n] for n in names if n in feeds}
        inner = [n for n in names if n not in values]
        if inner:
            values.update(self._exposed_runner(inner).run(feeds, inner))
        for node, why in self.nodes:
            value = values.get(node.input[0])
            if value is None or value.dtype.kind in "iub":
                continue
            count = int(np.isnan(value.astype(np.float64)).sum())
            if count:
                below, small_why = NAN_DETERMINISTIC_BELOW.get(_op_key(node), (0, why))
                reason = small_why if value.size < below else why
                return Hazard(sample_name, node.name or node.output[0], node.op_type, node.input[0], count, reason)
        return None
