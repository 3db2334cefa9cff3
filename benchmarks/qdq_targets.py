"""The "qdq" form on the runtimes installed here, against what ``rewrite`` and ``rewrite --target``
give today: does each runtime load and run it, does it agree with onnxruntime running the original,
and what does it cost.

    python benchmarks/qdq_targets.py [--runtimes openvino,qnn,tract] [--folder DIR] [--rounds 7]

On the quantize_dynamic models of the targets battery (benchmarks/target_models.py), each runtime
runs: the original; the default rewrite; ``--target RUNTIME``'s rewrite; the qdq form
(DynamicQuantizeLinear expanded by the default rule); the qdq form with the DynamicQuantizeLinear
kept (``--skip dql-expand --form-option quantize=keep``). "agrees" is the runtime's default
tolerance against onnxruntime running the same model (for the original and the exact rewrites, the
original's outputs), as benchmarks/targets.py judges it; max abs is against onnxruntime running the
original. Latency: median over ``--rounds`` interleaved rounds of 30 runs each, one thread; on a
shared machine, compare the ratios, and say the load (printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import target_models  # noqa: E402

import onnx_qrewrite  # noqa: E402
from onnx_qrewrite.errors import QRewriteError  # noqa: E402
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form  # noqa: E402

MODELS = (
    "dynamic_mlp",
    "dynamic_cnn",
    "ortdyn_cnn_op17_w8u",
    "ortdyn_bert",
    "ortdyn_cnn",
    "ortdyn_cnn_s8",
    "ortdyn_bert_optimized",
)


def _targets_module() -> Any:
    spec = importlib.util.spec_from_file_location("benchmarks_targets_for_qdq", HERE / "targets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variants(model: onnx.ModelProto, runtime: str) -> dict[str, onnx.ModelProto | None]:
    form = load_catalogue([named_form("qdq")])
    out: dict[str, onnx.ModelProto | None] = {"original": model, "default": onnx_qrewrite.rewrite(model).model}
    try:
        out["--target"] = onnx_qrewrite.rewrite(model, target=runtime).model
    except QRewriteError:
        out["--target"] = None
    out["qdq"] = onnx_qrewrite.rewrite(model, rules=form).model
    keep = form.with_option("quantize", "keep")
    out["qdq, DQL kept"] = onnx_qrewrite.rewrite(model, rules=keep, skip=["dql-expand"]).model
    return out


def _latency(runtime: str, models: dict[str, onnx.ModelProto], inputs: dict, rounds: int) -> dict[str, float]:
    from onnx_qrewrite.verify.runtimes import make_runner

    shapes = {k: v.shape for k, v in inputs.items()}
    runners = {k: make_runner(runtime, m, label=k, threads=1, shapes=shapes) for k, m in models.items()}
    per: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            runner.run(inputs)
            start = time.perf_counter()
            for _ in range(30):
                runner.run(inputs)
            per[name].append((time.perf_counter() - start) / 30 * 1000)
    return {k: statistics.median(v) for k, v in per.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtimes", default="openvino,qnn,tract")
    parser.add_argument("--folder", default=None, help="where the battery's models are made (default: a temporary one)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    bt = _targets_module()
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        battery = target_models.make_battery(args.folder or tmp, only=set(MODELS))
        print(f"{'model':24} {'runtime':9} {'variant':14} {'runs, agrees':14} {'max abs':>9} {'median ms':>9}")
        for b in battery:
            model = onnx.load(b.path)
            inputs, expected = bt._io(b.path)
            for runtime in args.runtimes.split(","):
                variants = _variants(model, runtime)
                ran: dict[str, onnx.ModelProto] = {}
                results: dict[str, dict[str, Any]] = {}
                for name, m in variants.items():
                    if m is None:
                        results[name] = {"runs": False, "why": "--target refuses it"}
                        continue
                    exact = name in ("original", "default", "--target")
                    same = None if exact else bt._OrtRunner(m).run(inputs)
                    results[name] = bt._run(runtime, m, inputs, expected, repeat=0, same=same)
                    if results[name].get("max_abs") is not None:
                        ran[name] = m
                latency = _latency(runtime, ran, inputs, args.rounds) if ran else {}
                for name, r in results.items():
                    if r.get("max_abs") is None:
                        print(f"{b.name:24} {runtime:9} {name:14} refused: {r.get('why', '')[:60]}")
                        continue
                    verdict = "yes" if r["runs"] else "NO"
                    print(f"{b.name:24} {runtime:9} {name:14} {verdict:14} {r['max_abs']:9.3g} {latency[name]:9.3f}")
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
