"""What a NaN guard for DynamicQuantizeLinear inputs of unrecorded shape would cost at inference.

onnxruntime's DynamicQuantizeLinear skips NaN in its min/max search below 8 elements
(onnx_qrewrite/rewriter/builders/dynamic_quantize.py); dql-expand matches that only where the
input's shape is recorded to hold 1-7 elements. Matching it where the shape is not recorded needs
a run-time test on every DynamicQuantizeLinear. This measures three exact forms against the default
rewrite of benchmarks/bench.py's "infer" models (quantize_dynamic's BERT-like and CNN), with the
same interleaved timing as bench.py (onnxruntime CPU, one thread):

- run-time: what ``--rule-option dql-expand.nan_guard=run-time`` emits, the range over
  ``Where(IsNaN(x), Where(Less(Size(x), 8), 0, NaN), x)`` (the shipped form);
- elementwise: the range over ``Where(And(IsNaN(x), Less(Size(x), 8)), 0, x)``;
- If: ``If(Less(Size(x), 8))`` choosing ``Where(IsNaN(x), 0, x)`` or ``x`` for the range.

Both give the default rewrite's outputs on these (NaN-free) inputs, checked here.

    python benchmarks/nan_guard_cost.py [--seconds 6] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench


def _guard_nodes(x: str, prefix: str, form: str) -> list[onnx.NodeProto]:
    """The nodes computing ``<prefix>/g_x``: ``x`` with NaN read as 0 where it holds < 8 elements."""
    n = helper.make_node
    size = [n("Size", [x], [f"{prefix}/g_size"]), n("Less", [f"{prefix}/g_size", "g_eight"], [f"{prefix}/g_small"])]
    if form == "elementwise":
        return [
            *size,
            n("IsNaN", [x], [f"{prefix}/g_nan"]),
            n("And", [f"{prefix}/g_nan", f"{prefix}/g_small"], [f"{prefix}/g_skip"]),
            n("Where", [f"{prefix}/g_skip", "g_zero", x], [f"{prefix}/g_x"]),
        ]
    out = onnx.TensorProto.FLOAT
    small = helper.make_graph(
        [n("IsNaN", [x], [f"{prefix}/b_nan"]), n("Where", [f"{prefix}/b_nan", "g_zero", x], [f"{prefix}/b_x"])],
        "small",
        [],
        [helper.make_tensor_value_info(f"{prefix}/b_x", out, None)],
    )
    large = helper.make_graph(
        [n("Identity", [x], [f"{prefix}/c_x"])],
        "large",
        [],
        [helper.make_tensor_value_info(f"{prefix}/c_x", out, None)],
    )
    return [*size, n("If", [f"{prefix}/g_small"], [f"{prefix}/g_x"], then_branch=small, else_branch=large)]


def guarded(src: Path, dst: Path, form: str) -> int:
    """``src`` (a default rewrite) with every DynamicQuantizeLinear expansion's range guarded."""
    model = onnx.load(src)
    graph = model.graph
    graph.initializer.extend(
        [numpy_helper.from_array(np.asarray(8, np.int64), "g_eight"), numpy_helper.from_array(np.float32(0), "g_zero")]
    )
    guarded_inputs: set[str] = set()
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        prefix, _, hint = node.name.rpartition("/")
        if node.op_type in ("ReduceMin", "ReduceMax") and hint in ("min", "max"):
            if node.input[0] not in guarded_inputs:
                guarded_inputs.add(node.input[0])
                nodes += _guard_nodes(node.input[0], prefix, form)
            node.input[0] = f"{prefix}/g_x"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    onnx.save(model, dst)
    return len(guarded_inputs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="timing budget per case")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.gettempdir()) / "onnx-qrewrite-nan-guard"
    work.mkdir(parents=True, exist_ok=True)
    bert, cnn = bench._small_models(work)
    for model, label, shapes in ((bert, "bert-tiny", ([1, 8], [1, 64], [8, 64])), (cnn, "cnn", ([1, 3, 16, 16],))):
        default = work / f"{model.stem}.portable.onnx"
        subprocess.run([*bench.CLI, "-q", "rewrite", str(model), "-o", str(default)], check=True)
        forms = {form: work / f"{model.stem}.{form}.onnx" for form in ("run-time", "elementwise", "if")}
        option = ["--rule-option", "dql-expand.nan_guard=run-time"]
        subprocess.run([*bench.CLI, "-q", "rewrite", str(model), "-o", str(forms["run-time"]), *option], check=True)
        counts = {guarded(default, path, form) for form, path in forms.items() if form != "run-time"}
        for shape in shapes:
            spec = {
                "paths": [str(default), *map(str, forms.values())],
                "optimized": [str(work / f"{model.stem}.{k}.ort.onnx") for k in ("default", *forms)],
                "shape": shape,
                "rounds": 7,
                "seconds": args.seconds,
            }
            child = [bench.PY, "-c", bench._INFER_CHILD, json.dumps(spec)]
            done = subprocess.run(child, check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.splitlines()[-1])
            base, *rest = result["median"]
            costs = ", ".join(f"{f} {t * 1e3:.3f} ({t / base - 1:+.0%})" for f, t in zip(forms, rest, strict=True))
            print(
                f"{label} {'x'.join(map(str, shape))}: {max(counts)} DynamicQuantizeLinear; ms per run: rewrite "
                f"{base * 1e3:.3f}, {costs}; same outputs: {result['same']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
