"""Measure the end-to-end drift of approximate rewrites, where verify's default drift thresholds
(onnx_qrewrite/verify/drift.py) come from.

    python benchmarks/drift.py [--samples 50] [--work-dir DIR]

For each model made by a real producer (onnxruntime.quantization.quantize_dynamic on the sample and
benchmark networks, and the checked-in quantize_dynamic CNN), the *weight-only* form (rule form
"weight-only", ``--form weight-only --allow-approximate``): every DynamicQuantizeLinear ->
MatMulInteger/ConvInteger -> Cast -> Mul(scale) chain becomes DequantizeLinear(weights) -> float
MatMul/Conv, the activation left float; ``verify`` (which sees the approximate rules in the
provenance) reports its relative L2 error, cosine similarity and argmax agreement against the
quantized original on ``--samples`` random samples plus the battery. Then the same form made by a
small graph edit (:func:`weight_only`; unbroken it drifts exactly as the rule form, which
tests/test_verify_drift.py checks) with one bug (the first layer's weight scale 2 % or 25 % too
large; the last layer's weight zero point dropped), and the "qdq-to-float" form of
the static QDQ sample (activation Q -> DQ pairs dropped), to show how far a calibrated model moves.

Prints one table row per case: the worst rel L2 and cosine over the samples, the argmax agreement
(rows pooled), and the verdict under the default thresholds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
RULE = "bench.weight-only"
RULE_KEY, ORIGIN_KEY, EXACTNESS_KEY = "onnx_qrewrite.rule", "onnx_qrewrite.origin", "onnx_qrewrite.exactness"
sys.path.insert(0, str(ROOT / "sample_models"))


def weight_only(
    model: onnx.ModelProto, *, break_scale: str | None = None, factor: float = 1.0, drop_zp: str | None = None
) -> onnx.ModelProto:
    """quantize_dynamic's chains with float activations and dequantized weights (see the docstring).
    ``break_scale`` / ``drop_zp``: the integer node whose weight scale is multiplied by ``factor``,
    or whose weight zero point is left out."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for node in g.node:
        if node.op_type not in ("MatMulInteger", "ConvInteger"):
            continue
        dql = producer.get(node.input[0])
        if dql is None or dql.op_type != "DynamicQuantizeLinear":
            continue
        (cast,) = consumers[node.output[0]]
        (mul,) = consumers[cast.output[0]]
        scale_mul = producer[next(i for i in mul.input if i != cast.output[0])]
        w_scale = next(i for i in scale_mul.input if i != dql.output[1])
        w_zp = node.input[3] if len(node.input) > 3 else ""
        scale_array = numpy_helper.to_array(inits[w_scale])
        if node.name == break_scale:
            w_scale = f"{w_scale}_broken"
            g.initializer.append(
                numpy_helper.from_array((scale_array * np.float32(factor)).astype(np.float32), w_scale)
            )
        if node.name == drop_zp:
            w_zp = ""
        axis = (
            {}
            if scale_array.ndim == 0 or scale_array.size == 1
            else {"axis": 0 if node.op_type == "ConvInteger" else 1}
        )
        w_float = f"{node.name}/weight_only_w"
        dq = helper.make_node(
            "DequantizeLinear",
            [node.input[1], w_scale] + ([w_zp] if w_zp else []),
            [w_float],
            name=f"{node.name}/weight_only_dq",
            **axis,
        )
        # Provenance as the engine writes it (onnx_qrewrite.rewriter.provenance), so verify sees the rewrite
        # is approximate: on the replacement's first node, the others named under the same prefix.
        for key, value in ((RULE_KEY, RULE), (ORIGIN_KEY, node.name), (EXACTNESS_KEY, "approximate")):
            entry = dq.metadata_props.add()
            entry.key, entry.value = key, value
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        op = "MatMul" if node.op_type == "MatMulInteger" else "Conv"
        float_op = helper.make_node(
            op, [dql.input[0], w_float], [mul.output[0]], name=f"{node.name}/weight_only", **attrs
        )
        index = {id(n): i for i, n in enumerate(g.node)}
        replace[index[id(node)]] = [dq, float_op]
        drop |= {index[id(cast)], index[id(mul)]}
    nodes = []
    for i, n in enumerate(g.node):
        if i in drop:
            continue
        nodes.extend(replace.get(i, [n]))
    del g.node[:]
    g.node.extend(nodes)
    # The DynamicQuantizeLinear nodes and scale products now feed nothing: drop them.
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(o in used for o in n.output if o)]
        if not dead:
            break
        keep = [n for n in g.node if n not in dead]
        del g.node[:]
        g.node.extend(keep)
    onnx.checker.check_model(out)
    return out


def _integer_nodes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.op_type in ("MatMulInteger", "ConvInteger")]


def _models(work: Path) -> list[tuple[str, Path, dict]]:
    import make_samples
    import models as bench_models

    found = []
    for name in ("dynamic_mlp", "dynamic_cnn"):
        found.append((f"sample_models/{name}", ROOT / "sample_models" / f"{name}.onnx", {}))
    found.append(("tests/data ortdyn_cnn_op17_w8u", ROOT / "tests/data/models/ortdyn_cnn_op17_w8u.onnx", {}))
    cnn = bench_models.make_cnn(work / "bench_cnn.onnx")
    found.append(("benchmarks cnn 16-32-64", cnn, {"input_shapes": {"pixels": (1, 3, 32, 32)}}))
    bert = bench_models.make_bert(work / "bench_bert.onnx")
    found.append(("benchmarks bert 2x128 (seq 16)", bert, {"input_shapes": {"input_ids": (1, 16)}}))
    del make_samples
    return found


def _row(label: str, case: str, report) -> str:
    from onnx_qrewrite.verify import VerifyReport

    assert isinstance(report, VerifyReport)
    cells = []
    for o in report.outputs:
        d = o.drift
        if d is None:
            cells.append(f"{o.name}: not judged ({o.problem})")
            continue
        agreement = "-" if d.argmax_agreement is None else f"{d.argmax_agree}/{d.argmax_rows}"
        cells.append(
            f"{o.name}: rel L2 {d.rel_l2:.3g} ({d.rel_l2_sample}), cosine {d.cosine:.6f} ({d.cosine_sample}), "
            f"argmax {agreement}, max abs {d.max_abs:.3g}"
        )
    return f"| {label} | {case} | {'; '.join(cells)} | {report.verdict} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    from onnx_qrewrite import rewrite
    from onnx_qrewrite.rewriter.catalogue import named_form
    from onnx_qrewrite.verify import DriftThresholds, verify

    drift = DriftThresholds(mode="always")
    with tempfile.TemporaryDirectory(prefix="drift-bench-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("| model | form | drift (worst sample) | verdict (defaults) |")
        print("|---|---|---|---|")
        for label, path, options in _models(work):
            original = onnx.load(path)
            names = _integer_nodes(original)
            form = rewrite(original, rules=[named_form("weight-only")], allow=("exact", "bounded", "approximate"))
            cases = [("weight-only (rule form)", form.model)]
            for factor in (1.02, 1.25):
                broken = weight_only(original, break_scale=names[0], factor=factor)
                cases.append((f"broken: scale of {names[0]} x{factor}", broken))
            cases.append((f"broken: zero point of {names[-1]} dropped", weight_only(original, drop_zp=names[-1])))
            for case, rewritten in cases:
                report = verify(
                    original, rewritten, samples=args.samples, drift=drift, localize_failures=False, **options
                )
                print(_row(label, case, report), flush=True)
        form = ["qdq-to-float-fold-weights", "qdq-to-float-drop-dq", "qdq-to-float-drop-q"]
        for name in ("qdq_contrib_u16",):
            path = ROOT / "sample_models" / f"{name}.onnx"
            standard = rewrite(path).model
            floated = rewrite(
                standard, rules=[named_form("qdq-to-float")], only=form, allow=("exact", "bounded", "approximate")
            )
            report = verify(str(path), floated.model, samples=args.samples, drift=drift, localize_failures=False)
            print(_row(f"sample_models/{name}", "qdq-to-float", report), flush=True)
            report = verify(
                str(path), floated.model, samples=args.samples, drift=drift, localize_failures=False, battery=False
            )
            print(_row(f"sample_models/{name}", "qdq-to-float, no battery", report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
