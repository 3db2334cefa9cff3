"""Measure the form qlinear-exact against onnxruntime's kernels on a random battery (one-off, wider
than tests/test_lower_qlinear_integer.py): QLinearMatMul, QLinearConv (grouped, depthwise, strided,
with bias) and com.microsoft QGemm (alpha, transA, transB, C, float output), every dtype triple the
kernels take, per-tensor and per-column scales, random and zero zero points, random or extreme
(qmin/qmax only) values, scales that put results on ties (0.5) or push most of them to the rails;
each case on 1 and 2 threads. Prints per op the cases the form took (bit for bit or not) and those
it declined (the bounded rule takes them), with the elements compared.

    python tools/measure_qlinear_exact.py [--seed N] [--reps R] [--opt-level disable|all]
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter import u8s8
from onnx_qrewrite.rewriter.catalogue import named_form

TYPES = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8}
RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
TRIPLES = (("uint8", "uint8"), ("uint8", "int8"), ("int8", "int8"))  # (activation, weights); output = activation


#: The optimisation level the models run at (--opt-level): verify's default, or onnxruntime's.
LEVEL = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
_LEVEL = ["disable"]


def _session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = LEVEL[_LEVEL[0]]
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _values(rng: np.random.Generator, dtype: str, shape: tuple[int, ...], extreme: bool) -> np.ndarray:
    lo, hi = RANGES[dtype]
    if extreme:
        return rng.choice([lo, hi], size=shape).astype(dtype)
    return rng.integers(lo, hi + 1, size=shape).astype(dtype)


def _scale(rng: np.random.Generator, kind: str) -> np.float32:
    return np.float32(0.5) if kind == "tie" else np.float32(np.exp(rng.uniform(-7, 0)))


def _model(op: str, x: np.ndarray, params: dict, attrs: dict, float_out: bool) -> onnx.ModelProto:
    order = {
        "QLinearMatMul": ["xs", "xz", "w", "ws", "wz", "ys", "yz"],
        "QLinearConv": ["xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
        "QGemm": ["xs", "xz", "w", "ws", "wz", "b", "ys", "yz"],
    }[op]
    names = [n if n in params else "" for n in order]
    while names and not names[-1]:
        names.pop()
    domain = "com.microsoft" if op == "QGemm" else ""
    node = helper.make_node(op, ["x", *names], ["y"], domain=domain, **attrs)
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in params.items()]
    out_type = TensorProto.FLOAT if float_out else TYPES[str(x.dtype)]
    graph = helper.make_graph(
        [node], "m", [helper.make_tensor_value_info("x", TYPES[str(x.dtype)], list(x.shape))], [], inits
    )
    graph.output.append(helper.make_tensor_value_info("y", out_type, None))
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid("com.microsoft", 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    shape = _session(model, 1).run(None, {"x": x})[0].shape
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", out_type, list(shape)))
    return model


def _case(rng: np.random.Generator, op: str, types: tuple[str, str], per_column: bool, kind: str, extreme: bool):
    xt, wt = types
    attrs: dict = {}
    if op == "QLinearMatMul":
        k, m, n = int(rng.choice([1, 3, 16, 64, 257])), int(rng.integers(1, 9)), int(rng.integers(1, 40))
        xshape, wshape, columns = ((2, m, k) if rng.random() < 0.4 else (m, k)), (k, n), n
    elif op == "QLinearConv":
        c, o, group = int(rng.integers(1, 9)), int(rng.integers(1, 12)), 1
        if rng.random() < 0.3:
            group, o = c, c * int(rng.integers(1, 3))
        kh = int(rng.choice([1, 3, 5]))
        attrs = {
            "kernel_shape": [kh, kh],
            "pads": [kh // 2] * 4,
            "group": group,
            "strides": [int(rng.integers(1, 3))] * 2,
        }
        xshape, wshape, columns = (1, c, 9, 8), (o, c // group, kh, kh), o
    else:
        ta, tb = int(rng.integers(0, 2)), int(rng.integers(0, 2))
        m, k, n = int(rng.integers(1, 9)), int(rng.choice([1, 7, 64, 200])), int(rng.integers(1, 30))
        attrs = {"transA": ta, "transB": tb, "alpha": float(rng.choice([1.0, 0.5, 1.7]))}
        xshape, wshape, columns = ((k, m) if ta else (m, k)), ((n, k) if tb else (k, n)), n
    w = _values(rng, wt, wshape, extreme)
    if u8s8.saturating_operands(xt, wt, conv=False) and rng.random() < 0.5:  # pairs within int16, half the time
        w = np.clip(w.astype(np.int64) // 2, -64, 63).astype(np.int8)
    float_out = op == "QGemm" and rng.random() < 0.3
    params: dict = {
        "xs": _scale(rng, kind),
        "xz": np.asarray(rng.integers(*RANGES[xt]) if rng.random() < 0.7 else 0, xt),
    }
    params["w"] = w
    ws = [_scale(rng, kind) for _ in range(columns)] if per_column else _scale(rng, kind)
    params["ws"] = np.asarray(ws, np.float32)
    wz = np.asarray(rng.integers(*RANGES[wt]) if rng.random() < 0.5 else 0, wt)
    params["wz"] = np.full(columns, wz, wt) if per_column and op == "QGemm" else wz
    if op != "QLinearMatMul" and rng.random() < 0.5:
        params["b"] = rng.integers(-20000, 20000, size=columns).astype(np.int32)
    if not float_out:
        ys = _scale(rng, kind) * (np.float32(1e-3) if kind == "rails" else np.float32(1))
        params["ys"], params["yz"] = (
            np.float32(ys),
            np.asarray(rng.integers(*RANGES[xt]) if rng.random() < 0.7 else 0, xt),
        )
    x = _values(rng, xt, xshape, extreme)
    return _model(op, x, params, attrs, float_out), x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--opt-level", choices=sorted(LEVEL), default="disable")
    args = parser.parse_args()
    _LEVEL[0] = args.opt_level
    rng = np.random.default_rng(args.seed)
    form = [named_form("qlinear-exact")]
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for _ in range(args.reps):
        for op in ("QLinearMatMul", "QLinearConv", "QGemm"):
            for types in TRIPLES:
                for per_column in (False, True):
                    for kind in ("random", "tie", "rails"):
                        for extreme in (False, True):
                            model, x = _case(rng, op, types, per_column, kind, extreme)
                            result = onnx_qrewrite.rewrite(model, rules=form)
                            if not result.report.rewrites[0].rule.endswith("-exact"):
                                counts[op]["declined"] += 1
                                continue
                            for threads in (1, 2):
                                want = _session(model, threads).run(None, {"x": x})[0]
                                got = _session(result.model, threads).run(None, {"x": x})[0]
                                same = want.dtype == got.dtype and np.array_equal(
                                    want.view(np.uint8), got.view(np.uint8)
                                )
                                counts[op]["runs bit-exact" if same else "runs DIFFERENT"] += 1
                                counts[op]["elements"] += want.size
    for op, c in counts.items():
        print(op, dict(sorted(c.items())))


if __name__ == "__main__":
    main()
