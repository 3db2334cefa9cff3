"""Per target and per test model: what ``inspect --target`` refuses before and after the target's
rewrite, whether the original and the rewrite load, run and agree on the runtime installed here,
their errors against onnxruntime running the original (the recorded outputs), and the runtime's
latency for both. Prints a Markdown table (the README's Targets numbers come from it).

    python benchmarks/targets.py [--repeat 20] [--targets openvino,tract,qnn,tensorrt,...]

"default rewrite" is today's output without --target (every rule applied), for contrast.
Targets without a runtime here (tensorrt, nnapi, coreml, webgpu, tflite) get the refused counts
only. Latency: the fastest of ``--repeat`` runs after one warm-up (the least disturbed by other
work on a shared machine), one thread where the runtime takes a thread count, inputs from the
model's recorded ``.inputs.npz``. QNN runs on the HTP simulator: its latency says nothing about a
device. TFLite runs in its own interpreter process per call (verify/runtimes.py), so its latency is
mostly that process starting, not the model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[1]
MODELS = [
    REPO / "sample_models" / "dynamic_mlp.onnx",
    REPO / "sample_models" / "dynamic_cnn.onnx",
    REPO / "sample_models" / "qdq_contrib_u16.onnx",
    *sorted((REPO / "tests" / "data" / "models").glob("*.onnx")),
]


def _io(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    stem = str(path)[: -len(".onnx")]
    return dict(np.load(stem + ".inputs.npz")), dict(np.load(stem + ".outputs.npz"))


def _run(runtime: str, model: onnx.ModelProto, inputs, expected, repeat: int) -> dict[str, object]:
    from onnx_qrewrite.errors import QRewriteError
    from onnx_qrewrite.verify.runtimes import RUNTIMES, make_runner

    spec = RUNTIMES[runtime]
    try:
        runner = make_runner(runtime, model, label="model", threads=1, shapes={k: v.shape for k, v in inputs.items()})
        got = runner.run(inputs)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            runner.run(inputs)
            times.append(time.perf_counter() - start)
    except QRewriteError as exc:
        return {"runs": False, "why": str(exc).split(": ", 2)[-1][:60]}
    max_abs = rel_l2 = 0.0
    agrees = True
    for name, want in expected.items():
        have = np.asarray(got[name], np.float64)
        ref = np.asarray(want, np.float64)
        max_abs = max(max_abs, float(np.max(np.abs(have - ref))))
        rel_l2 = max(rel_l2, float(np.linalg.norm(have - ref) / max(np.linalg.norm(ref), 1e-30)))
        agrees &= bool(np.all(np.abs(have - ref) <= spec.atol + spec.rtol * np.abs(ref)))
    return {"runs": agrees, "max_abs": max_abs, "rel_l2": rel_l2, "ms": 1000 * min(times)}


def _cell(result: dict[str, object] | None) -> str:
    if result is None:
        return "-"
    if "max_abs" not in result:
        return f"no ({result['why']})"
    verdict = "yes" if result["runs"] else "WRONG"
    return f"{verdict}, {result['max_abs']:.2g} / {result['rel_l2']:.2g}, {result['ms']:.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--targets", default="openvino,tract,qnn,tensorrt,nnapi,coreml,webgpu,tflite,onnx")
    args = parser.parse_args(argv)

    from onnx_qrewrite.api import load_rules
    from onnx_qrewrite.errors import MissingDependencyError
    from onnx_qrewrite.targets import load_target, plan_for_target
    from onnx_qrewrite.verify.runtimes import RUNTIMES, runtime_info

    catalogue = load_rules()
    from onnx_qrewrite import rewrite

    print(
        "| target | model | refused before -> after | original on the runtime | default rewrite on the runtime "
        "| target rewrite on the runtime |"
    )
    print("|---|---|---|---|---|---|")
    for target in args.targets.split(","):
        profile = load_target(target)
        runtime = profile.runtime if profile.runtime in RUNTIMES and profile.runtime != "onnxruntime" else None
        if runtime is not None:
            try:
                runtime_info(runtime)
            except MissingDependencyError as exc:
                print(f"{target}: {exc}; counts only", file=sys.stderr)
                runtime = None
        for path in MODELS:
            plan = plan_for_target(path, catalogue, profile)
            original = default = rewritten = None
            if runtime is not None:
                inputs, expected = _io(path)
                original = _run(runtime, onnx.load(path), inputs, expected, args.repeat)
                default_model = rewrite(path, rules=catalogue, allow_unlowered=True).model
                default = _run(runtime, default_model, inputs, expected, args.repeat)
                rewritten = _run(runtime, plan.rewritten, inputs, expected, args.repeat)
            counts = f"{len(plan.before)} -> {len(plan.after)}"
            cells = " | ".join(_cell(c) for c in (original, default, rewritten))
            print(f"| {target} | {path.stem} | {counts} | {cells} |", flush=True)
    print(
        "\ncells: agrees with onnxruntime running the original (yes / WRONG numbers / no: fails to load or run), "
        "max abs error / relative L2 error, fastest run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
