"""Measurements behind rules/targets/qnn.toml and tflite.toml that no shipped rewrite makes, so
benchmarks/targets.py cannot show them (docs/targets-notes.md cites them):

- ``tflite-recorded-shapes``: benchmarks/target_models.py's ortqop_bert with every value's shape
  recorded (onnxruntime runs it on the recorded inputs; shape inference cannot see through its
  com.microsoft ops, so the reduction lengths of its activation x activation QLinearMatMuls are
  unknown), rewritten for tflite and run on LiteRT; ``--cut NAME`` also makes that value a graph
  output and compares it (how the wrong embedding sum was found: onnx2tf's output changes with the
  cuts, so cut a few at a time); ``--skip qop-add`` leaves the embedding's QLinearAdd as it is (as
  before tflite.toml refused it).
- ``qnn-by-hand``: ortqdq_bert with its Erf written as a float formula (Abramowitz-Stegun 7.1.26,
  not a shipped rule) and its int32 biases folded to float, run on QNN's HTP simulator: how far its
  outputs are from onnxruntime's, in steps of the output's own quantization scale.
- ``qnn-gelu``: ortqdq_bert and ortqop_bert rewritten ``--target qnn`` with their recorded input
  shapes, then each quantized GELU (Div -> Erf -> Add -> Mul with a QuantizeLinear ->
  DequantizeLinear pair after each op) replaced by hand with one QDQ node unit DequantizeLinear ->
  Gelu -> QuantizeLinear (ONNX Gelu at opset 20, and com.microsoft Gelu), which the QNN EP builds
  (its op builder registry has Gelu, no Erf): how far that is from the original in onnxruntime and
  on QNN; then the rewrite cut at each quantized value, run on QNN and in onnxruntime: where
  QNN's own difference from onnxruntime starts and how it grows, in steps of that value's scale.
- ``qnn-drift``: the same rewrites (GELUs fused, so QNN places every node), each node unit alone on
  QNN, fed onnxruntime's exact quantized inputs, against onnxruntime: whether an op of QNN's drifts
  or the network amplifies each op's one-step rounding differences (beside the network cut at the
  same value); and onnxruntime at its default optimization level (its QDQ fusions into integer
  kernels) on the original against the reference (optimizations off), beside QNN.
- ``qnn-dynamic``: the quantize_dynamic models QNN runs as given (sample_models' dynamic_mlp and
  dynamic_cnn, the battery's ortdyn_cnn and ortdyn_cnn_s8), on verify's wide-range sample (the
  one ``verify --runtime qnn`` fails them on): QNN against onnxruntime running the model, and
  against onnxruntime running its weight-only form (the float activation, weights dequantized), to
  tell whether QNN quantizes the activation to 8 bits as the model says. Then the battery's
  ortdyn_bert, whose Q/K/V DynamicQuantizeLinear three MatMulIntegers share (QNN refuses that, and
  ``rewrite --target qnn`` writes those projections in the approximate weight-only form): with that
  DynamicQuantizeLinear copied per reader by hand (exact), every group is QNN's again; both on QNN,
  on the recorded inputs and two seeded ones, against onnxruntime running the original.
- ``tflite-add-ties``: a com.microsoft QLinearAdd (QuantizeLinear -> QLinearAdd -> DequantizeLinear;
  its second operand a uint8 constant, which onnx2tf converts to TFLite's quantized ADD, or a second
  quantized input, which it converts to DEQUANTIZE -> ADD -> its own requantization) on LiteRT
  against onnxruntime, with scales whose ratios are short binary fractions (0.02, 0.03 -> 0.04: the
  exact result is often k + 1/2) and with calibrated-looking ones; per element off, the exact
  value from the float32 scales as fractions and how each side rounded it. Then the same models
  after qop-add (DequantizeLinear -> Add -> QuantizeLinear).
- ``verify-default RUNTIME``: each battery model rewritten ``--target RUNTIME`` (QNN with its
  recorded input shapes) and verified on that runtime with verify's default samples (two random
  ones, then zeros, constant, wide-range and negative), as ``rewrite --target T --verify`` does;
  benchmarks/targets.py runs the recorded inputs only. A failing model's line says whose difference
  it is (verify/runtime_baseline.py).

    python benchmarks/target_experiments.py tflite-recorded-shapes [--cut NAME ...] [--skip RULE] [-o DIR]
    python benchmarks/target_experiments.py qnn-by-hand [-o DIR]
    python benchmarks/target_experiments.py qnn-gelu [-o DIR]
    python benchmarks/target_experiments.py qnn-drift [-o DIR]
    python benchmarks/target_experiments.py qnn-dynamic [-o DIR]
    python benchmarks/target_experiments.py tflite-add-ties
    python benchmarks/target_experiments.py verify-default openvino|tract|qnn|tflite [-o DIR]

TFLite needs $ONNX_QREWRITE_TFLITE_PYTHON (verify/runtimes.py), QNN the [qnn] extra.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper
from onnx import numpy_helper as nh

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from target_models import CONFIRM_SEEDS, make_battery, seeded_like  # noqa: E402


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _every_value(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    probe.graph.output.extend(
        onnx.ValueInfoProto(name=o) for n in probe.graph.node for o in n.output if o and o not in have
    )
    session = _session(probe)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def record_shapes(model: onnx.ModelProto, feeds) -> onnx.ModelProto:
    """``model`` with its inputs' shapes fixed to ``feeds``' and every value's shape as onnxruntime
    computed it on them."""
    from onnx_qrewrite.verify.runtimes import fix_input_shapes

    fixed = fix_input_shapes(model, {k: v.shape for k, v in feeds.items()})
    outputs = {o.name for o in fixed.graph.output}
    del fixed.graph.value_info[:]
    for name, value in _every_value(fixed, feeds).items():
        if name not in outputs:
            elem = helper.np_dtype_to_tensor_dtype(value.dtype)
            fixed.graph.value_info.append(helper.make_tensor_value_info(name, elem, list(value.shape)))
    return fixed


def _models(folder: str | None, name: str) -> tuple[Path, dict[str, np.ndarray]]:
    folder = folder or tempfile.mkdtemp(prefix="target-experiments-")
    (battery,) = [b for b in make_battery(folder, {name}) if b.name == name]
    return battery.path, dict(np.load(str(battery.path)[: -len(".onnx")] + ".inputs.npz"))


def tflite_recorded_shapes(folder: str | None, cut: list[str], skip: list[str]) -> None:
    from onnx_qrewrite.api import load_rules
    from onnx_qrewrite.targets import load_target, plan_for_target
    from onnx_qrewrite.verify.runtimes import make_runner

    path, feeds = _models(folder, "ortqop_bert")
    original = onnx.load(path)
    recorded = record_shapes(original, feeds)
    shaped = path.with_name("ortqop_bert.recorded_shapes.onnx")
    onnx.save(recorded, shaped)
    plan = plan_for_target(shaped, load_rules(skip=skip), load_target("tflite"))
    print(f"inspect --target tflite, shapes recorded: refused {len(plan.before)} -> {plan.refused_after}")
    rewritten = plan.rewritten
    typed = {v.name: v for v in recorded.graph.value_info}
    for name in cut:  # cut the model there too: each value a graph output, compared
        rewritten.graph.output.append(typed[name])
    runner = make_runner("tflite", rewritten, label="rewrite")
    reference, same = _session(original), _session(rewritten)
    for seed in (None, *CONFIRM_SEEDS):
        inputs = feeds if seed is None else seeded_like(feeds, seed)
        want = dict(zip([o.name for o in original.graph.output], reference.run(None, inputs), strict=True))
        mine = dict(zip([o.name for o in rewritten.graph.output], same.run(None, inputs), strict=True))
        got = runner.run(inputs)
        for name, value in mine.items():
            base = want.get(name, value)
            have = np.asarray(got[name], np.float64)
            err = np.abs(have - base)
            print(
                f"inputs {'recorded' if seed is None else f'seed {seed}'}: {name}: LiteRT max abs {err.max():.3g} "
                f"({int((err > 1e-5).sum())} of {err.size} off by > 1e-5)"
            )
        if cut:
            break


def _erf_formula(graph: onnx.GraphProto, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """erf(x) = sign(x) (1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-x^2)), t = 1 / (1 + p|x|)."""
    x, y, p = node.input[0], node.output[0], node.name + "/erf_formula/"
    coefficients = [0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429]
    consts = {"p": 0.3275911, "one": 1.0} | {f"a{i}": v for i, v in enumerate(coefficients)}
    graph.initializer.extend(nh.from_array(np.float32(v), p + k) for k, v in consts.items())

    def op(kind: str, inputs: list[str], out: str) -> onnx.NodeProto:
        return helper.make_node(kind, [i if i == x else p + i for i in inputs], [y if out == y else p + out])

    nodes = [
        op("Sign", [x], "sign"),
        op("Abs", [x], "abs"),
        op("Mul", ["abs", "p"], "px"),
        op("Add", ["px", "one"], "den"),
        op("Div", ["one", "den"], "t"),
        op("Mul", ["t", "a4"], "h4"),
    ]
    for i in (3, 2, 1, 0):
        nodes += [op("Add", [f"h{i + 1}", f"a{i}"], f"s{i}"), op("Mul", [f"s{i}", "t"], f"h{i}")]
    nodes += [
        op("Mul", [x, x], "x2"),
        op("Neg", ["x2"], "nx2"),
        op("Exp", ["nx2"], "e"),
        op("Mul", ["h0", "e"], "pe"),
        op("Sub", ["one", "pe"], "r"),
        op("Mul", ["sign", "r"], y),
    ]
    return nodes


def qnn_by_hand(folder: str | None) -> None:
    from onnx_qrewrite.verify.runtimes import make_runner

    path, feeds = _models(folder, "ortqdq_bert")
    original = onnx.load(path)
    model = onnx.ModelProto()
    model.CopyFrom(original)
    graph, inits = model.graph, {i.name: i for i in model.graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        if n.op_type == "Erf":
            nodes += _erf_formula(graph, n)
        elif (
            n.op_type == "DequantizeLinear"
            and n.input[0] in inits
            and inits[n.input[0]].data_type == onnx.TensorProto.INT32
        ):
            q = nh.to_array(inits[n.input[0]]).astype(np.int64)
            zp = nh.to_array(inits[n.input[2]]).astype(np.int64) if len(n.input) > 2 and n.input[2] else 0
            scale = nh.to_array(inits[n.input[1]])
            graph.initializer.append(nh.from_array((q - zp).astype(np.float32) * scale, n.output[0]))
        else:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
    (out,) = [o.name for o in graph.output]
    producer = {o: n for n in original.graph.node for o in n.output}
    last = producer[out]
    while last.op_type != "DequantizeLinear":  # the output's own DequantizeLinear (through Identity)
        last = producer[last.input[0]]
    step = float(nh.to_array({i.name: i for i in original.graph.initializer}[last.input[1]]))
    runner = make_runner("qnn", model, label="by hand", shapes={k: v.shape for k, v in feeds.items()})
    reference, same = _session(original), _session(model)
    for seed in (None, *CONFIRM_SEEDS, 13, 14):
        inputs = feeds if seed is None else seeded_like(feeds, seed)
        want = reference.run(None, inputs)[0]
        exact = float(np.abs(same.run(None, inputs)[0] - want).max())
        err = np.abs(np.asarray(runner.run(inputs)[out], np.float64) - want)
        steps = np.rint(err / step).astype(int)
        counts = {int(k): int(c) for k, c in zip(*np.unique(steps, return_counts=True), strict=True)}
        beyond = int((err > 5e-2 + 5e-2 * np.abs(want)).sum())
        print(
            f"inputs {'recorded' if seed is None else f'seed {seed}'}: by hand in onnxruntime {exact:.3g}; "
            f"QNN max abs {err.max():.3g}, output step {step:.4g}, elements by steps off {counts}, "
            f"{beyond} of {err.size} beyond QNN's 5e-2 tolerance"
        )


def fuse_quantized_gelu(model: onnx.ModelProto, domain: str) -> onnx.ModelProto:
    """``model`` with each GELU quantize_static writes, x/sqrt2 -> Erf -> Q/DQ -> Add 1 -> Q/DQ ->
    Mul (x*0.5 -> Q/DQ) -> its output's QuantizeLinear, as one Gelu of ``domain`` reading the
    DequantizeLinear of x: the inner quantizations are dropped, so this is approximate."""
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    graph = fused.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    # keyed by output name, not node name: unnamed nodes ("") would collide
    dropped: set[str] = set()
    gelus: dict[str, onnx.NodeProto] = {}
    for erf in [n for n in graph.node if n.op_type == "Erf"]:
        div, chain = producer[erf.input[0]], [erf]
        for _ in range(6):  # Q, DQ, Add, Q, DQ, Mul
            (after,) = readers[chain[-1].output[0]]
            chain.append(after)
        mul = chain[-1]
        half = [producer[x] for x in mul.input if x != chain[-2].output[0]]
        while half[-1].op_type != "Mul":  # the DequantizeLinear, QuantizeLinear of x * 0.5
            half.append(producer[half[-1].input[0]])
        dropped.update(n.output[0] for n in [div, *chain, *half])
        gelus[mul.output[0]] = helper.make_node(
            "Gelu", [div.input[0]], [mul.output[0]], f"{erf.name or erf.output[0]}/gelu", domain=domain
        )
    nodes = [gelus.get(n.output[0], n) for n in graph.node if n.output[0] not in dropped or n.output[0] in gelus]
    del graph.node[:]
    graph.node.extend(nodes)
    if domain:
        fused.opset_import.append(helper.make_opsetid(domain, 1))
    else:
        (std,) = [o for o in fused.opset_import if o.domain in ("", "ai.onnx")]
        std.version = max(std.version, 20)
    return fused


def _cut(model: onnx.ModelProto, value: str) -> onnx.ModelProto:
    """``model`` up to ``value``, its one output."""
    inferred = onnx.shape_inference.infer_shapes(model)
    return onnx.utils.Extractor(inferred).extract_model([i.name for i in model.graph.input], [value])


def qnn_gelu(folder: str | None) -> None:
    from onnx_qrewrite.api import rewrite
    from onnx_qrewrite.targets.shapes import InputShapes

    for name in ("ortqdq_bert", "ortqop_bert"):
        path, feeds = _models(folder, name)
        shapes = InputShapes({k: v.shape for k, v in feeds.items()})
        model = rewrite(onnx.load(path), target="qnn", input_shapes=shapes, allow_unlowered=True).model
        _gelu_on_qnn(name, onnx.load(path), model, feeds)
        _qnn_by_cut(name, fuse_quantized_gelu(model, ""), feeds)  # onnx's shape inference types Gelu


def _gelu_on_qnn(name: str, original: onnx.ModelProto, model: onnx.ModelProto, feeds) -> None:
    """The GELUs fused into Gelu, in onnxruntime and on QNN, against the original in onnxruntime."""
    from onnx_qrewrite.verify.runtimes import make_runner

    reference = _session(original)
    for domain in ("", "com.microsoft"):
        fused = fuse_quantized_gelu(model, domain)
        (out,) = [o.name for o in fused.graph.output]
        runner = make_runner("qnn", fused, label="gelu", shapes={k: v.shape for k, v in feeds.items()})
        same = _session(fused)
        for seed in (None, *CONFIRM_SEEDS):
            inputs = feeds if seed is None else seeded_like(feeds, seed)
            want = reference.run(None, inputs)[0]
            ort_err = float(np.abs(same.run(None, inputs)[0] - want).max())
            err = np.abs(np.asarray(runner.run(inputs)[out], np.float64) - want)
            beyond = int((err > 5e-2 + 5e-2 * np.abs(want)).sum())
            print(
                f"{name} {domain or 'ai.onnx'} Gelu, inputs {'recorded' if seed is None else f'seed {seed}'}: "
                f"in onnxruntime {ort_err:.3g} from the original; on QNN max abs {err.max():.3g}, "
                f"{beyond} of {err.size} beyond QNN's 5e-2 tolerance"
            )


def _qnn_by_cut(name: str, model: onnx.ModelProto, feeds) -> None:
    """``model`` cut at each quantized value (its DequantizeLinear's output) on QNN and in
    onnxruntime, on the recorded inputs: the difference in steps of the value's scale."""
    from onnx_qrewrite.errors import InvalidModelError
    from onnx_qrewrite.verify.runtimes import make_runner

    inits = {i.name: i for i in model.graph.initializer}
    read = {x for n in model.graph.node for x in n.input}
    dequantized = {
        n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in read
    }
    for q in [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[1] in inits]:
        value = dequantized.get(q.output[0])
        if value is None:
            continue
        part = _cut(model, value)
        try:
            got = make_runner("qnn", part, label="cut", shapes={k: v.shape for k, v in feeds.items()}).run(feeds)
        except InvalidModelError:  # a cut QNN does not place whole (CPU fallback disabled)
            print(f"{name} cut at {q.input[0]}: not placed wholly on QNN")
            continue
        err = np.abs(np.asarray(got[value], np.float64) - _session(part).run(None, feeds)[0])
        step = float(nh.to_array(inits[q.input[1]]))
        steps = np.rint(err / step).astype(int)
        counts = {int(k): int(c) for k, c in zip(*np.unique(steps, return_counts=True), strict=True)}
        print(f"{name} cut at {q.input[0]}: QNN vs onnxruntime max abs {err.max():.3g}, step {step:.4g}, {counts}")


def _unit_inputs(model: onnx.ModelProto, value: str) -> list[str]:
    """The quantized activations (and graph inputs) the node unit computing ``value`` reads: walking
    back through float ops, stopping at each DequantizeLinear of a computed value (its quantized
    input is the unit's input) and at constants (weights, shapes: inside the unit)."""
    constant = {i.name for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    found: list[str] = []
    stack, seen = [value], set()
    while stack:
        name = stack.pop()
        if not name or name in seen or name in constant:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            found.append(name)
        elif node.op_type == "DequantizeLinear" and node.input[0] not in constant:
            found.append(node.input[0])
        elif node.op_type == "QuantizeLinear":
            found.append(name)
        elif node.op_type != "Constant":
            stack.extend(node.input)
    return sorted(set(found))


def _steps(err: np.ndarray, step: float) -> dict[int, int]:
    steps = np.rint(err / step).astype(int)
    return {int(k): int(c) for k, c in zip(*np.unique(steps, return_counts=True), strict=True)}


def _on_qnn(model: onnx.ModelProto, feeds, value: str):
    from onnx_qrewrite.errors import QRewriteError
    from onnx_qrewrite.verify.runtimes import make_runner

    try:
        runner = make_runner("qnn", model, label="cut", shapes={k: v.shape for k, v in feeds.items()})
        return np.asarray(runner.run(feeds)[value], np.float64)
    except QRewriteError:  # not placed wholly on QNN (CPU fallback disabled)
        return None


def drift_model(path: Path, feeds) -> onnx.ModelProto:
    """The BERT at ``path`` rewritten --target qnn with ``feeds``' shapes, its GELUs fused so that
    QNN places every node, every value's shape recorded (for cutting)."""
    from onnx_qrewrite.api import rewrite
    from onnx_qrewrite.targets.shapes import InputShapes

    shapes = InputShapes({k: v.shape for k, v in feeds.items()})
    model = rewrite(onnx.load(path), target="qnn", input_shapes=shapes, allow_unlowered=True).model
    return record_shapes(fuse_quantized_gelu(model, ""), feeds)


def quantized_units(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    """Each QuantizeLinear of a constant scale whose value is dequantized again, with that
    DequantizeLinear's output (the value a node unit computes), in node order."""
    inits = {i.name for i in model.graph.initializer}
    read = {x for n in model.graph.node for x in n.input}
    dequantized = {
        n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in read
    }
    return [
        (q, dequantized[q.output[0]])
        for q in model.graph.node
        if q.op_type == "QuantizeLinear" and q.input[1] in inits and q.output[0] in dequantized
    ]


def unit_alone(
    model: onnx.ModelProto, exact, feeds, q: onnx.NodeProto, value: str
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The node unit ending in ``q`` and the DequantizeLinear giving ``value`` as a model of its own,
    and its inputs as onnxruntime computed them (``exact``: every value of ``model`` there)."""
    inputs = _unit_inputs(model, q.input[0])
    unit = onnx.utils.Extractor(model).extract_model(inputs, [value])
    return unit, {k: exact[k] if k in exact else feeds[k] for k in inputs}


def qnn_drift(folder: str | None) -> None:
    """Each BERT rewritten --target qnn with its recorded input shapes and its GELUs fused (so that
    QNN places every node): per quantized value, QNN's difference from onnxruntime (graph
    optimizations off) in steps of that value's scale, for the node unit alone (fed onnxruntime's
    exact quantized inputs) and for the network up to it; then onnxruntime itself at its default
    optimization level (its QDQ fusions into integer kernels, what QNN's session also runs at) on
    the original, and QNN's output against that."""
    for name in ("ortqdq_bert", "ortqop_bert"):
        path, feeds = _models(folder, name)
        fused = drift_model(path, feeds)
        exact = _every_value(fused, feeds)
        inits = {i.name: i for i in fused.graph.initializer}
        producer = {o: n for n in fused.graph.node for o in n.output}
        print(f"{name}: value | ops | step | alone: steps off (count) | network up to it: steps off (count)")
        for q, value in quantized_units(fused):
            step = float(nh.to_array(inits[q.input[1]]))
            unit, unit_feeds = unit_alone(fused, exact, feeds, q, value)
            ops = sorted({n.op_type for n in unit.graph.node} - {"QuantizeLinear", "DequantizeLinear"})
            alone = _on_qnn(unit, unit_feeds, value)
            whole = _on_qnn(_cut(fused, value), feeds, value)
            want = np.asarray(exact[value], np.float64)
            cells = ["not placed" if got is None else str(_steps(np.abs(got - want), step)) for got in (alone, whole)]
            label = producer[q.input[0]].name or q.input[0]
            print(f"  {label} | {','.join(ops)} | {step:.4g} | {cells[0]} | {cells[1]}")
        _default_level(name, path, fused, feeds)


def _default_level(name: str, path: Path, fused: onnx.ModelProto, feeds) -> None:
    """onnxruntime at its default optimization level on the original, against it with optimizations
    off (the reference), and QNN (the fused rewrite) against both, on the recorded and seeded inputs."""
    import onnxruntime as ort

    from onnx_qrewrite.verify.runtimes import make_runner

    original = onnx.load(path)
    reference = _session(original)
    default = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    runner = make_runner("qnn", fused, label="fused", shapes={k: v.shape for k, v in feeds.items()})
    (out,) = [o.name for o in fused.graph.output]
    for seed in (None, *CONFIRM_SEEDS):
        inputs = feeds if seed is None else seeded_like(feeds, seed)
        want, fast = reference.run(None, inputs)[0], default.run(None, inputs)[0]
        got = np.asarray(runner.run(inputs)[out], np.float64)
        e1, e2, e3 = np.abs(fast - want), np.abs(got - want), np.abs(got - fast)
        print(
            f"{name} inputs {'recorded' if seed is None else f'seed {seed}'}: onnxruntime default level vs off "
            f"{e1.max():.3g} ({_beyond(e1, want)} beyond 5e-2); QNN vs off {e2.max():.3g} ({_beyond(e2, want)}); "
            f"QNN vs default level {e3.max():.3g} ({_beyond(e3, fast)})"
        )


def qnn_dynamic(folder: str | None) -> None:
    """Each quantize_dynamic model QNN runs as given, on verify's wide-range sample: QNN's outputs
    against onnxruntime's for the model and for its weight-only form (float activation)."""
    folder = folder or tempfile.mkdtemp(prefix="target-experiments-")
    paths = [REPO / "sample_models" / "dynamic_mlp.onnx", REPO / "sample_models" / "dynamic_cnn.onnx"]
    paths += [b.path for b in make_battery(folder, {"ortdyn_cnn", "ortdyn_cnn_s8"})]
    for path in paths:
        _dynamic_on_qnn(path, Path(folder))
    _shared_dql_on_qnn(make_battery(folder, {"ortdyn_bert"})[0].path)


def _split_shared_dql(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each DynamicQuantizeLinear that several MatMulIntegers read, copied once per reader, each copy
    read by one MatMulInteger and by the Mul of its scale (quantize_dynamic names it
    ``<matmul>_scales_mul``): the same values, so exact."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_name = {n.name: n for n in out.graph.node}
    nodes = []
    for node in out.graph.node:
        users = [n for n in out.graph.node if n.op_type == "MatMulInteger" and node.output[0] in n.input]
        if node.op_type != "DynamicQuantizeLinear" or len(users) < 2:
            nodes.append(node)
            continue
        for k, user in enumerate(users):
            outs = [f"{o}__{k}" for o in node.output]
            nodes.append(helper.make_node("DynamicQuantizeLinear", list(node.input), outs, name=f"{node.name}__{k}"))
            for reader in (user, by_name[user.name + "_scales_mul"]):
                reader.input[:] = [outs[list(node.output).index(i)] if i in node.output else i for i in reader.input]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _shared_dql_on_qnn(path: Path) -> None:
    from onnx_qrewrite.api import load_rules
    from onnx_qrewrite.targets import load_target, plan_for_model
    from onnx_qrewrite.targets.shapes import InputShapes
    from onnx_qrewrite.verify.runtimes import make_runner

    model = onnx.load(path)
    inputs = dict(np.load(str(path)[: -len(".onnx")] + ".inputs.npz"))
    shapes = {k: v.shape for k, v in inputs.items()}
    plans = {
        form: plan_for_model(candidate, load_rules(), load_target("qnn"), input_shapes=InputShapes(dict(shapes)))
        for form, candidate in (("as planned", model), ("shared DQL copied", _split_shared_dql(model)))
    }
    for form, plan in plans.items():
        rules = sorted({f"{v.rule} ({v.exactness})" for v in plan.nodes if v.rule})
        print(f"ortdyn_bert for qnn, {form}: refused after {plan.refused_after}; rules {', '.join(rules)}")
    runners = {form: make_runner("qnn", p.rewritten, label=form, shapes=shapes) for form, p in plans.items()}
    for seed in (None, *CONFIRM_SEEDS):
        feeds = inputs if seed is None else seeded_like(inputs, seed)
        want = _session(model).run(None, feeds)[0]
        got = {form: next(iter(r.run(feeds).values())) for form, r in runners.items()}
        a, b = got.values()
        print(
            f"  {'recorded' if seed is None else f'seed {seed}'}: on QNN vs onnxruntime running the original "
            f"{np.abs(a - want).max():.3g} (as planned), {np.abs(b - want).max():.3g} (copied); "
            f"the two on QNN {np.abs(a - b).max():.3g} apart"
        )


def _dynamic_on_qnn(path: Path, folder: Path) -> None:
    from onnx_qrewrite import rewrite
    from onnx_qrewrite.rewriter.catalogue import named_form
    from onnx_qrewrite.verify import verify
    from onnx_qrewrite.verify.runtimes import make_runner

    model = onnx.load(path)
    inputs = dict(np.load(str(path)[: -len(".onnx")] + ".inputs.npz"))
    shapes = {k: v.shape for k, v in inputs.items()}
    samples = folder / f"{path.stem}.samples.npz"
    verify(path, model, input_shapes=shapes, save_inputs=samples, localize_failures=False)
    with np.load(samples) as saved:
        feeds = {k.split("::", 1)[1]: saved[k] for k in saved.files if k.startswith("wide-range::")}
    weight_only = rewrite(model, rules=[named_form("weight-only")], allow=("exact", "bounded", "approximate")).model
    (name,) = [o.name for o in model.graph.output]
    want = _session(model).run([name], feeds)[0]
    float_activation = _session(weight_only).run([name], feeds)[0]
    got = make_runner("qnn", model, label=path.stem, shapes=shapes).run(feeds)[name]
    (x,) = feeds.values()
    step = (max(float(x.max()), 0.0) - min(float(x.min()), 0.0)) / 255  # DynamicQuantizeLinear's scale
    print(
        f"{path.stem} (wide-range, input step {step:.3g}): QNN vs onnxruntime {np.abs(got - want).max():.3g} "
        f"({_beyond(np.abs(got - want), want)} beyond 5e-2); QNN vs weight-only in onnxruntime "
        f"{np.abs(got - float_activation).max():.3g}; onnxruntime vs weight-only "
        f"{np.abs(want - float_activation).max():.3g}; largest |output| {np.abs(want).max():.3g}"
    )


def _qlinear_add(scales: tuple[float, float, float], constant: bool) -> onnx.ModelProto:
    """x -> QuantizeLinear -> QLinearAdd (with a uint8 constant, or with y quantized) -> DequantizeLinear."""
    rng = np.random.default_rng(0)
    xs, bs, cs = scales
    consts = [
        *(nh.from_array(np.float32(v), n) for n, v in (("xs", xs), ("bs", bs), ("cs", cs))),
        *(nh.from_array(np.uint8(v), n) for n, v in (("xz", 128), ("bz", 120), ("cz", 125))),
    ]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"])]
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 8])]
    if constant:
        consts.append(nh.from_array(rng.integers(0, 256, (4, 8)).astype(np.uint8), "b"))
    else:
        nodes.append(helper.make_node("QuantizeLinear", ["y", "bs", "bz"], ["b"]))
        inputs.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8]))
    args = ["xq", "xs", "xz", "b", "bs", "bz", "cs", "cz"]
    nodes.append(helper.make_node("QLinearAdd", args, ["c"], name="add", domain="com.microsoft"))
    nodes.append(helper.make_node("DequantizeLinear", ["c", "cs", "cz"], ["out"]))
    output = helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [4, 8])
    graph = helper.make_graph(nodes, "qlinear_add", inputs, [output], consts)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def tflite_add_ties() -> None:
    """QLinearAdd on LiteRT against onnxruntime at exact ties and away from them."""
    from onnx_qrewrite import rewrite
    from onnx_qrewrite.verify.runtimes import make_runner

    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": rng.standard_normal((4, 8)).astype(np.float32)}
    for scales in ((0.02, 0.03, 0.04), (0.0123, 0.0371, 0.0297)):
        for constant in (True, False):
            model = _qlinear_add(scales, constant)
            lowered = rewrite(model, only=["qop-add"]).model
            inputs = {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}}
            want = _session(model).run(["out"], inputs)[0]
            kind = "constant operand (quantized ADD)" if constant else "two run-time operands (float ADD)"
            ties = _exact_ties(model, inputs, scales)
            for form, candidate in (("as given", model), ("qop-add", lowered)):
                got = make_runner("tflite", candidate, label=form).run(inputs)["out"]
                same = _session(candidate).run(["out"], inputs)[0]
                off = np.argwhere(got != want)
                print(
                    f"scales {scales}, {kind}, {form}: {len(off)} of {want.size} elements off onnxruntime "
                    f"running the model ({ties} exact ties); LiteRT vs onnxruntime running this form: "
                    f"{int((got != same).sum())} off"
                )
                for index in map(tuple, off):
                    print(
                        f"    {index}: onnxruntime {want[index] / np.float32(scales[2]) + 125:.0f}, "
                        f"LiteRT {got[index] / np.float32(scales[2]) + 125:.0f}"
                    )


def _exact_ties(model: onnx.ModelProto, inputs, scales: tuple[float, float, float]) -> int:
    """Elements whose exact result, from the float32 scales as fractions, is k + 1/2."""
    from fractions import Fraction

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend([helper.make_empty_tensor_value_info(n) for n in ("xq", "b")])
    xq, b = _session(probe).run(["xq", "b"], inputs)
    sx, sb, sc = (Fraction(float(np.float32(v))) for v in scales)
    exact = [((int(p) - 128) * sx + (int(q) - 120) * sb) / sc for p, q in zip(xq.ravel(), b.ravel(), strict=True)]
    return sum(v.denominator == 2 for v in exact)


def verify_default(folder: str | None, runtime: str) -> None:
    """Every battery model's rewrite for ``runtime`` verified there on verify's default samples."""
    from onnx_qrewrite.api import load_rules
    from onnx_qrewrite.targets import load_target, plan_for_target
    from onnx_qrewrite.targets.shapes import InputShapes

    folder = folder or tempfile.mkdtemp(prefix="target-experiments-")
    profile = load_target(runtime)
    passed = reached = 0
    for battery in make_battery(folder):
        inputs = dict(np.load(str(battery.path)[: -len(".onnx")] + ".inputs.npz"))
        shapes = {k: v.shape for k, v in inputs.items()}
        static = InputShapes(dict(shapes)) if profile.static_shapes else None
        plan = plan_for_target(battery.path, load_rules(), profile, input_shapes=static)
        if plan.refused_after:
            print(f"{battery.name}: not reached ({plan.refused_after} refused)")
            continue
        reached += 1
        passed += _verify_on(battery.name, battery.path, plan.rewritten, runtime, shapes)
    print(f"{runtime}: verify passes on {passed} of the {reached} models reached")


def _verify_on(name: str, path: Path, rewritten: onnx.ModelProto, runtime: str, shapes) -> bool:
    from onnx_qrewrite.errors import QRewriteError
    from onnx_qrewrite.verify import verify

    try:
        report = verify(path, rewritten, runtime=runtime, input_shapes=shapes, localize_failures=False)
    except QRewriteError as exc:
        print(f"{name}: {exc}")
        return False
    print(f"{name}: {report.summary}")
    if report.runtime_baseline is not None:
        print("\n".join(f"    {line}" for line in report.runtime_baseline.lines()))
    return report.passed


def _beyond(err: np.ndarray, want: np.ndarray) -> int:
    """How many elements are beyond QNN's verify tolerance (atol = rtol = 5e-2)."""
    return int((err > 5e-2 + 5e-2 * np.abs(want)).sum())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "experiment",
        choices=[
            "tflite-recorded-shapes",
            "tflite-add-ties",
            "qnn-by-hand",
            "qnn-gelu",
            "qnn-drift",
            "qnn-dynamic",
            "verify-default",
        ],
    )
    parser.add_argument("runtime", nargs="?", default="qnn", help="verify-default: the target and runtime")
    parser.add_argument("--cut", action="append", default=[], help="tflite: a value also compared (recorded inputs)")
    parser.add_argument("--skip", action="append", default=[], help="tflite: a rule left out of the catalogue")
    parser.add_argument("-o", "--output", help="folder for the battery's models (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.experiment == "tflite-recorded-shapes":
        tflite_recorded_shapes(args.output, args.cut, args.skip)
    elif args.experiment == "qnn-by-hand":
        qnn_by_hand(args.output)
    elif args.experiment == "qnn-drift":
        qnn_drift(args.output)
    elif args.experiment == "qnn-dynamic":
        qnn_dynamic(args.output)
    elif args.experiment == "tflite-add-ties":
        tflite_add_ties()
    elif args.experiment == "verify-default":
        verify_default(args.output, args.runtime)
    else:
        qnn_gelu(args.output)


if __name__ == "__main__":
    main()
