"""An initializer the graph also lists as an input is a default a caller may feed (review 4 R6).

The rewrite must read it as the input it is (never fold its value in), and verify feeds it, so a
rewrite that folded it fails. Before IR 4 every initializer had to be listed, which says nothing:
such a model's initializers stay constants (else no old model would find a constant weight).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.verify import verify
from onnx_qrewrite.verify.inputs import input_specs

DATA = Path(__file__).parent / "data" / "models"

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


def _list_every_initializer(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as torch's ``keep_initializers_as_inputs=True`` writes it: every initializer also
    a graph input (IR kept, so each is an overridable default)."""
    listed = onnx.ModelProto()
    listed.CopyFrom(model)
    have = {i.name for i in listed.graph.input}
    listed.graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in listed.graph.initializer
        if t.name not in have
    )
    return listed


def test_a_model_listing_its_shapes_as_inputs_verifies():
    """Review 5 R1: verify fed random values to a listed Reshape shape, the original failed to run
    and verify blamed it (exit 3). Shapes keep their value; the float data around them is fed."""
    model = _list_every_initializer(onnx.load(DATA / "ortdyn_cnn_op17_w8u.onnx"))
    assert model.ir_version >= 4
    specs = {s.name: s for s in input_specs(model, defaults=True) if s.default}
    shapes = [t.name for t in model.graph.initializer if t.data_type == TensorProto.INT64]
    assert shapes, "the model no longer has the integer shape initializer this test is about"
    assert not set(shapes) & set(specs)
    assert any(s.elem_type == TensorProto.FLOAT for s in specs.values()), "no float default is fed any more"
    assert verify(model, onnx_qrewrite.rewrite(model).model).passed


def _reader_model(op: str, inputs: list[str], init: onnx.TensorProto, **attributes: object) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attributes)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2]),
            helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [init],
    )
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize(
    ("op", "inputs", "value", "fed"),
    [
        ("Mul", ["x", "d"], np.array(2.0, np.float32), True),  # float data
        ("Resize", ["x", "", "d"], np.array([1, 1, 2, 2], np.float32), False),  # scales decide a shape
        ("Reshape", ["x", "d"], np.array([1, -1], np.int64), False),  # a shape
        ("Where", ["d", "x", "x"], np.array(True), True),  # a condition is data
        ("QuantizeLinear", ["x", "s", "d"], np.array(3, np.uint8), True),  # a zero point
    ],
)
def test_which_listed_defaults_the_samples_feed(op: str, inputs: list[str], value: np.ndarray, fed: bool) -> None:
    model = _reader_model(op, inputs, numpy_helper.from_array(value, "d"))
    if "s" in inputs:
        model.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "s"))
    assert ("d" in {s.name for s in input_specs(model, defaults=True) if s.default}) is fed


def _two_branches() -> onnx.ModelProto:
    """IR 3, every initializer listed: a com.microsoft DequantizeLinear of ``xq`` and a MatMulInteger
    of ``a`` with constant weights and weight zero point (which a lowering reads as constants)."""
    nodes = [
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["y1"], name="dq", domain="com.microsoft"),
        helper.make_node("MatMulInteger", ["a", "w", "", "wz"], ["y2"], name="mm"),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.25, np.float32), "xs"),
        numpy_helper.from_array(np.array(3, np.uint8), "xz"),
        numpy_helper.from_array(RNG.integers(0, 256, (4, 3)).astype(np.uint8), "w"),
        numpy_helper.from_array(np.array(49, np.uint8), "wz"),
    ]
    inputs = [
        helper.make_tensor_value_info("xq", TensorProto.UINT8, [5]),
        helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 4]),
    ]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    outputs = [
        helper.make_tensor_value_info("y1", TensorProto.FLOAT, [5]),
        helper.make_tensor_value_info("y2", TensorProto.INT32, [2, 3]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 11), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, ir_version=3, opset_imports=opsets)


def test_raising_ir_3_to_4_unlists_the_initializers_so_a_second_rewrite_gives_the_same_model():
    """From IR 4 on a listed initializer is an input a caller may override: the listings IR 3
    demanded go when the rewrite raises the IR version. Else a second rewrite (here the rules the
    first one did not run) reads the weights' zero point as an input, and any reader may feed it."""
    model = _two_branches()
    once = onnx_qrewrite.rewrite(model)
    assert [v.name for v in once.model.graph.input] == ["xq", "a"]
    assert any("initializer(s) listed as inputs for that rule are no longer listed" in w for w in once.report.warnings)
    first = onnx_qrewrite.rewrite(model, only=["ms-dq-standard"], allow_unlowered=True).model
    assert [v.name for v in first.graph.input] == ["xq", "a"]
    twice = onnx_qrewrite.rewrite(first).model
    assert [v.name for v in twice.graph.input] == ["xq", "a"]
    assert [(n.op_type, list(n.input)) for n in twice.graph.node] == [
        (n.op_type, list(n.input)) for n in once.model.graph.node
    ]
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in twice.graph.initializer} == {
        t.name: numpy_helper.to_array(t).tobytes() for t in once.model.graph.initializer
    }
    feeds = {"xq": np.arange(0, 250, 50, dtype=np.uint8), "a": RNG.integers(0, 256, (2, 4)).astype(np.uint8)}
    for name in ("y1", "y2"):
        assert_bitwise_equal(run(twice, feeds)[name], run(model, feeds)[name], name)
    assert verify(model, once.model).passed
