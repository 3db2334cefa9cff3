"""An initializer the graph also lists as an input is a default a caller may feed (review 4 R6).

The rewrite must read it as the input it is (never fold its value in), and verify feeds it, so a
rewrite that folded it fails. Before IR 4 every initializer had to be listed, which says nothing:
such a model's initializers stay constants (else no old model would find a constant weight).
"""

from __future__ import annotations

import numpy as np
import onnx
from conftest import assert_bitwise_equal, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.verify import verify

RNG = np.random.default_rng(11)


def _dql_matmul(ir_version: int = 8, list_all: bool = False) -> onnx.ModelProto:
    """x -> DynamicQuantizeLinear -> MatMulInteger(w, zero point wz) -> Cast -> Mul(scale); ``wz``
    listed as a graph input (with ``list_all``, every initializer, as before IR 4)."""
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["a", "s", "z"]),
        helper.make_node("MatMulInteger", ["a", "w", "z", "wz"], ["m"], name="mm"),
        helper.make_node("Cast", ["m"], ["c"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["c", "s"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(RNG.integers(0, 256, (4, 3)).astype(np.uint8), "w"),
        numpy_helper.from_array(np.array(49, np.uint8), "wz"),
    ]
    listed = inits if list_all else inits[1:]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in listed]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits
    )
    return helper.make_model(graph, ir_version=ir_version, opset_imports=[helper.make_opsetid("", 11)])


def _feeds(wz: int | None) -> dict[str, np.ndarray]:
    feeds = {"x": (RNG.standard_normal((2, 4)) * 3).astype(np.float32)}
    return feeds if wz is None else feeds | {"wz": np.array(wz, np.uint8)}


def test_a_listed_initializer_is_read_as_the_input_it_is():
    model = _dql_matmul()
    result = onnx_qrewrite.rewrite(model)
    assert "MatMulInteger" not in {n.op_type for n in result.model.graph.node}
    assert any("wz" in n.input for n in result.model.graph.node), "the rewrite no longer reads the input"
    for wz in (None, 200, 0):
        feeds = _feeds(wz)
        assert_bitwise_equal(run(result.model, feeds)["y"], run(model, feeds)["y"], f"wz fed {wz}")


def test_verify_feeds_a_listed_initializer_and_catches_a_rewrite_that_folded_it():
    model = _dql_matmul()
    assert verify(model, onnx_qrewrite.rewrite(model).model).passed
    # A rewrite as before the fix: the zero point folded in (rewritten as a plain initializer),
    # the input still listed but read by nothing.
    unlisted = onnx.ModelProto()
    unlisted.CopyFrom(model)
    del unlisted.graph.input[1:]
    folded = onnx_qrewrite.rewrite(unlisted).model
    folded.graph.input.append(model.graph.input[1])
    if not any(t.name == "wz" for t in folded.graph.initializer):
        folded.graph.initializer.append(numpy_helper.from_array(np.array(49, np.uint8), "wz"))
    assert not verify(model, folded).passed


def test_before_ir_4_listed_initializers_stay_constants():
    model = _dql_matmul(ir_version=3, list_all=True)
    result = onnx_qrewrite.rewrite(model)
    assert "MatMulInteger" not in {n.op_type for n in result.model.graph.node}
    assert not any("wz" in n.input for n in result.model.graph.node)  # folded, as the format's listing allows
    feeds = _feeds(None)
    assert_bitwise_equal(run(result.model, feeds)["y"], run(model, feeds)["y"])
