"""Runs in the TFLite interpreter's own Python (3.12+, with onnx2tf and ai-edge-litert), never in
onnx-qrewrite's: onnx2tf pins its own onnx and onnxruntime, so it cannot share an environment with
the verifier. Imports nothing from onnx_qrewrite.

    python _tflite_child.py convert MODEL.onnx OUT_DIR    # prints the .tflite path
    python _tflite_child.py run MODEL.tflite IN.npz OUT.npz

onnx2tf rewrites its input file in place (renames nodes, strips domains): the caller hands it a
copy. Inputs of rank >= 3 keep their NCHW layout (keep_ncw_or_nchw_or_ncdhw_input_names), so the
same inputs feed both models.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any


def convert(model: str, out_dir: str) -> None:
    import onnx
    import onnx2tf

    graph = onnx.load(model).graph
    keep = [i.name for i in graph.input if len(i.type.tensor_type.shape.dim) >= 3]
    onnx2tf.convert(
        input_onnx_file_path=model,
        output_folder_path=out_dir,
        non_verbose=True,
        keep_ncw_or_nchw_or_ncdhw_input_names=keep or None,
    )
    found = sorted(glob.glob(os.path.join(out_dir, "*float32.tflite")))
    if not found:
        raise SystemExit("onnx2tf wrote no float32 .tflite model")
    print(found[0])


def run(tflite: str, inputs: str, outputs: str) -> None:
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=tflite)
    interpreter.allocate_tensors()
    runner = interpreter.get_signature_runner()
    feeds = dict(np.load(inputs))
    result = runner(**{name: feeds[name] for name in runner.get_input_details()})
    arrays: dict[str, Any] = {name: np.asarray(value) for name, value in result.items()}
    np.savez(outputs, **arrays)


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        convert(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[2], sys.argv[3], sys.argv[4])
