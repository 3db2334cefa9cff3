"""Fixtures for the tests of rules that lower what other rules emit (``on_replacements``): the
engine's later passes (test_float_emulation_passes.py) and the onnxscript rule set's walk
(test_onnxscript_rules.py) are checked on the same rule and the same model, so both see the same
case when either changes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: A rule that matches what it emits: QuantizeLinear -> QuantizeLinear, run on replacements.
LOOPING = """
[[rule]]
id = "q-again"
summary = "QuantizeLinear -> QuantizeLinear: a rule that matches what it emits"
emits = "QuantizeLinear"
builder = "standard_qdq"
exactness = "exact"
match = [{ domain = "", op = "QuantizeLinear" }]
options = { direction = "quantize" }
on_replacements = true
"""


def ms_quantize() -> onnx.ModelProto:
    """One com.microsoft QuantizeLinear (float[4] -> uint8[4]): the shipped vendor rule makes it a
    standard QuantizeLinear, which LOOPING then matches."""
    inits = [numpy_helper.from_array(np.float32(0.05), "s"), numpy_helper.from_array(np.uint8(7), "z")]
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], domain="com.microsoft", name="q")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [4])],
        inits,
    )
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)
