"""The catalogue as a rule set for onnxscript's pattern rewriter, for export pipelines built on it::

    from onnxscript import rewriter
    import onnx_qrewrite.onnxscript_rules as qrw

    model = rewriter.rewrite(model, pattern_rewrite_rules=qrw.rule_set())

Each catalogue rule becomes one onnxscript rule per op it matches. The replacement is not written
twice: for a match, ``check`` builds a one-node model holding the matched node (its constant inputs
as initializers, the others as typed graph inputs) and runs onnx-qrewrite's own engine on it;
``rewrite`` replays the nodes the engine emitted through onnxscript's builder. So the rule set
computes exactly what ``onnx_qrewrite.rewrite`` does, and a rule that does not apply fails the
match with the engine's reason (visible through onnxscript's ``MatchingTracer``). The opset is
never changed here (a rule needing a higher one gives way, as with ``--keep-opset``): raising it
is a whole-model operation the pattern rewriter cannot do.

Rules marked ``on_replacements`` (the ``float-emulation`` form's) also lower what earlier rules of
the set created, as the engine's later passes do: onnxscript's walk visits the nodes a rewrite
inserts right after it, and the rule set remembers, per node it created, the rules that made it and
its ancestors (its lineage). A created node is matched only by ``on_replacements`` rules not in its
lineage (the match fails with the reason), so a rule never lowers what it emitted and the walk
ends, and the other rules leave replacements alone, as :func:`onnx_qrewrite.rewrite` does.

Ops with optional outputs (Attention's ``present``, MultiHeadAttention's ``present_key`` /
``present_value``): a rule gets one pattern per number of outputs its builder's contract declares
types for, and a node is matched by the one binding exactly the outputs it declares (trailing
omitted ones not counted), so every output the engine writes is replaced. A node with an omitted
output before its last one is not matched (onnxscript would give the replacement's value that
empty name).

Prefer :func:`onnx_qrewrite.rewrite` for whole models: it is much faster (ENGINE_NOTES.md: the
pattern rewriter costs ~30x an onnx load+save on node-heavy graphs) and handles opset raises.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from onnx_qrewrite.errors import MissingDependencyError, QRewriteError
from onnx_qrewrite.io.encoded import to_proto
from onnx_qrewrite.rewriter import engine
from onnx_qrewrite.rewriter.catalogue import ANY_DOMAIN, Catalogue, OpRef, Rule, load_catalogue

try:
    from onnxscript.rewriter import pattern
except ImportError:
    raise MissingDependencyError(
        "onnx_qrewrite.onnxscript_rules needs onnxscript, which is not installed: "
        "pip install 'onnx-qrewrite[onnxscript]'"
    ) from None

__all__ = ["rule_set", "rules_for"]


def _mini_model(node: ir.Node, model: ir.Model, count: int) -> tuple[onnx.ModelProto, dict[str, ir.Value]]:
    """The matched node alone with its first ``count`` outputs, with what the engine needs to decide
    (types, shapes, constant values), and which of the match's values each of its input names
    stands for."""
    inputs, initializers, names = [], [], []
    values: dict[str, ir.Value] = {}
    for i, value in enumerate(node.inputs):
        if value is None:
            names.append("")
            continue
        name = f"input_{i}"
        names.append(name)
        values[name] = value
        if value.const_value is not None:
            initializers.append(numpy_helper.from_array(value.const_value.numpy(), name))
        else:
            elem = int(value.dtype) if value.dtype is not None else onnx.TensorProto.FLOAT
            shape = None if value.shape is None else [d if isinstance(d, int) else None for d in value.shape]
            inputs.append(helper.make_tensor_value_info(name, elem, shape))
    outputs = [f"output_{i}" for i in range(count)]
    proto = onnx.NodeProto()
    proto.CopyFrom(ir.serde.serialize_node(node))
    del proto.input[:]
    proto.input.extend(names)
    del proto.output[:]
    proto.output.extend(outputs)
    out_infos = [
        helper.make_tensor_value_info(o, int(v.dtype) if v.dtype is not None else 0, None)
        for o, v in zip(outputs, node.outputs[:count], strict=True)
    ]
    graph = helper.make_graph([proto], "match", inputs, out_infos, initializers)
    opsets = [helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    if node.domain not in model.opset_imports:
        opsets.append(helper.make_opsetid(node.domain, 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version), values


class _Lineage:
    """The nodes the rule set created during one walk of a graph, each with its lineage: the ids
    of the rules that made it and its ancestors (the engine's later passes keep the same).

    Shared by the rules of one :func:`rules_for` call. onnxscript calls every rule's ``setup``
    before it walks a graph (a subgraph's walk nests inside its parent's) and ``cleanup`` after;
    when the outermost walk ends, the record is dropped, so a model rewritten again starts afresh,
    as with :func:`onnx_qrewrite.rewrite`."""

    def __init__(self) -> None:
        self._of: weakref.WeakKeyDictionary[ir.Node, frozenset[str]] = weakref.WeakKeyDictionary()
        self._walks = 0

    def enter(self) -> None:
        self._walks += 1

    def leave(self) -> None:
        self._walks = max(0, self._walks - 1)
        if self._walks == 0:
            self._of.clear()

    def of(self, node: ir.Node) -> frozenset[str] | None:
        """The rules that made ``node`` (None: not created by this rule set in this walk)."""
        return self._of.get(node)

    def record(self, nodes: Iterable[ir.Node], lineage: frozenset[str]) -> None:
        for node in nodes:
            self._of[node] = lineage


class _CatalogueRule(pattern.RewriteRuleClassBase):
    def __init__(
        self, rule: Rule, ref: OpRef, catalogue: Catalogue, lineage: _Lineage | None = None, outputs: int | None = None
    ):
        self._outputs = outputs or rule.contract.outputs
        suffix = "" if self._outputs == rule.contract.outputs else f":{self._outputs}-outputs"
        super().__init__(name=f"{rule.id}:{ref}{suffix}")
        self._rule, self._ref = rule, ref
        self._catalogue = catalogue.select(only=[rule.id])
        self._lineage = lineage if lineage is not None else _Lineage()
        # onnxscript calls ``rewrite`` right after a successful ``check`` of the same match.
        self._pending: tuple[onnx.ModelProto, dict[str, ir.Value], list[int], frozenset[str]] | None = None

    def setup(self) -> None:
        self._lineage.enter()

    def cleanup(self) -> None:
        self._lineage.leave()

    def pattern(self, op, x):
        domain = "" if self._ref.domain == ANY_DOMAIN else self._ref.domain
        return getattr(op, self._ref.op)(x, _domain=domain, _allow_other_inputs=True, _outputs=self._outputs)

    def check(self, op: Any, *_: Any, **__: Any) -> Any:
        # onnxscript passes the match context first; its base class names that parameter ``op``.
        context = op
        result = pattern.MatchResult()
        node = context.root
        if not self._ref.matches(node.domain, node.op_type):
            return result.fail(f"{node.domain}::{node.op_type} is not {self._ref}")
        made_by = self._lineage.of(node)
        if made_by is not None:
            if not self._rule.on_replacements:
                return result.fail(
                    f"the node was created by rule {', '.join(sorted(made_by))}: rule {self._rule.id} "
                    "does not run on replacements (on_replacements is not set)"
                )
            if self._rule.id in made_by:
                return result.fail(f"rule {self._rule.id} is in the node's lineage ({', '.join(sorted(made_by))})")
        why = _unbound_outputs(node, self._outputs)
        if why:
            return result.fail(why)
        mini, values = _mini_model(node, context.model, self._outputs)
        # The engine itself (the one-node model is ours: nothing to validate on the way in).
        options = engine.EngineOptions(keep_opset=True)
        try:
            rewritten, report = engine.run(mini, self._catalogue, options)
        except QRewriteError as exc:
            return result.fail(str(exc))
        if not report.rewrites:
            return result.fail(f"rule {self._rule.id} does not apply")
        lowered = to_proto(rewritten)
        # The lowered outputs' element types, so that a later match reading them (a dequantize fed
        # by a quantize just rewritten) knows its input's type: models rarely record value_info.
        inferred = onnx.shape_inference.infer_shapes(lowered)
        types = [o.type.tensor_type.elem_type for o in inferred.graph.output]
        self._pending = (lowered, values, types, (made_by or frozenset()) | {self._rule.id})
        return result

    def rewrite(self, op, x, **_: Any):
        assert self._pending is not None, "rewrite() without a successful check()"
        mini, values, types, lineage = self._pending
        self._pending = None
        env: dict[str, Any] = dict(values)
        created: list[ir.Node] = []
        for t in mini.graph.initializer:  # constants the lowering added (the match's inputs stay values)
            if t.name not in env:
                # A Constant node, not an initializer: initializer names would collide across matches.
                env[t.name] = op.Constant(value=ir.tensor(numpy_helper.to_array(t)))
        for n in mini.graph.node:
            attrs = {a.name: _attr_value(a) for a in n.attribute}
            outs = getattr(op, n.op_type)(
                *[env[i] if i else None for i in n.input], _domain=n.domain, _outputs=len(n.output), **attrs
            )
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            created.extend(p for p in (outs[0].producer(),) if p is not None)
            env.update(zip(n.output, outs, strict=True))
        self._lineage.record(created, lineage)
        results = [env[o.name] for o in mini.graph.output]
        for value, elem in zip(results, types, strict=True):
            if value.type is None and elem:
                value.type = ir.TensorType(ir.DataType(elem))
        return results if len(results) > 1 else results[0]


def _unbound_outputs(node: ir.Node, count: int) -> str:
    """Why a pattern binding ``count`` outputs cannot replace ``node`` ('' if it can): the node has
    another number of outputs (trailing omitted ones not counted; the engine writes every output a
    node declares), or an omitted one among them (its replacement would have to be named '')."""
    declared = len(node.outputs)
    while declared and not node.outputs[declared - 1].name:
        declared -= 1
    if declared != count:
        return f"the node has {declared} outputs; this pattern binds {count}"
    if not all(value.name for value in node.outputs[:count]):
        return "an output before the node's last is omitted: not matched by the onnxscript rule set"
    return ""


def _output_counts(rule: Rule, ref: OpRef) -> range:
    """The numbers of outputs to match ``ref`` with, most first: from as many as the builder
    declares types for down to the contract's ``outputs``."""
    declared = rule.contract.output_types(rule.options, ref.op) if rule.contract.output_types else None
    most = max(len(declared or ()), rule.contract.outputs)
    return range(most, rule.contract.outputs - 1, -1)


def _attr_value(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, onnx.TensorProto):
        return ir.tensor(numpy_helper.to_array(value))
    return value


def rules_for(catalogue: Catalogue | None = None) -> list[pattern.RewriteRule]:
    """One onnxscript rule per (catalogue rule, matched op, number of outputs). They share one record
    of the nodes they create, for ``on_replacements`` (module docstring): use them in one rule set."""
    catalogue = catalogue or load_catalogue()
    lineage = _Lineage()
    return [
        _CatalogueRule.rule(rule, ref, catalogue, lineage, count)
        for rule in catalogue
        for ref in rule.match
        for count in _output_counts(rule, ref)
    ]


def rule_set(catalogue: Catalogue | None = None) -> pattern.RewriteRuleSet:
    """The catalogue (default: the shipped rules) as an onnxscript ``RewriteRuleSet``, to pass as
    ``pattern_rewrite_rules``."""
    return pattern.RewriteRuleSet(rules_for(catalogue))
