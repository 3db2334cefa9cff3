"""IR version lowering (targets/lower_ir.py, rules/opsets/ir_versions.toml): a target that loads
only lower IR versions (onnxruntime 1.31.1: 13; TensorRT 10.1's parser: onnx 1.16's proto, 10) gets
the model declared at its highest when the model uses nothing added after it, and the rewritten
model loads and computes the same bits in onnxruntime; a model that uses something newer keeps its
IR version and the refusal names the value or field."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
import pytest
import test_lower_opset as lower_opset_tests
from _cli_helpers import cli_in_process
from onnx import TensorProto, helper, numpy_helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.errors import LoweringError
from onnx_qrewrite.targets import load_target, plan_for_model
from onnx_qrewrite.targets.check import _inferred
from onnx_qrewrite.targets.lower_ir import ir_additions, ir_blockers

ort = pytest.importorskip("onnxruntime")

#: Element types onnx had before IR 9 (the lowest version the table describes).
_BEFORE_IR_9 = {
    "undefined", "float", "uint8", "int8", "uint16", "int16", "int32", "int64", "string", "bool", "float16",
    "double", "uint32", "uint64", "complex64", "complex128", "bfloat16",
}  # fmt: skip


def _qdq_matmul(opset: int, ir_version: int) -> onnx.ModelProto:
    """test_lower_opset's symmetric int8 Q/DQ + per-channel int8 weight + MatMul (TensorRT runs it
    as it is), declared at ``ir_version``."""
    model = lower_opset_tests._qdq_matmul(opset)
    model.ir_version = ir_version
    onnx.checker.check_model(model, full_check=True)
    return model


def _dynamic_matmul(ir_version: int) -> onnx.ModelProto:
    """quantize_dynamic's MatMul at opset 26: DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.integers(-127, 128, (8, 4)).astype(np.int8), "w"),
        numpy_helper.from_array(np.array(0.01, np.float32), "ws"),
    ]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql"),
        helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["acc"], name="mmi"),
        helper.make_node("Cast", ["acc"], ["accf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xs", "ws"], ["s"], name="scale"),
        helper.make_node("Mul", ["accf", "s"], ["y"], name="out"),
    ]
    model = lower_opset_tests._model(nodes, inits, [2, 8], opset=26, out=[2, 4])
    model.ir_version = ir_version
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _cli(*args: object) -> subprocess.CompletedProcess:
    """The command line in this process (tests/_cli_helpers.py): what it prints, writes and exits with."""
    return cli_in_process(*args)


def test_the_table_describes_every_ir_version_from_9_to_the_installed_onnx_and_every_type_it_added():
    table = ir_additions()
    assert sorted(table) == list(range(9, onnx.IR_VERSION + 1))  # a newer onnx needs its entry
    described = set().union(*(a.types for a in table.values()))
    every = {name.lower() for name, _ in TensorProto.DataType.items()}
    assert described | _BEFORE_IR_9 == every and not described & _BEFORE_IR_9
    assert onnx.helper.VERSION_TABLE[-1][1] == onnx.IR_VERSION


def test_onnxruntime_refuses_ir_14_and_the_onnx_target_gets_the_model_at_13_computing_the_same():
    """onnx 1.23's make_model writes IR 14, which onnxruntime 1.31.1 does not load; the model uses
    nothing IR 14 added, so `rewrite --target onnx` declares it at 13, and it runs bit for bit as
    the same model declared at 13 by hand does."""
    model = _dynamic_matmul(14)
    with pytest.raises(Exception, match="Unsupported model IR version: 14, max supported IR version: 13"):
        _run(model, np.zeros((2, 8), np.float32))
    result = rewrite(model, target="onnx")
    assert result.model.ir_version == 13 and model.ir_version == 14
    assert result.report.ir_version_change is not None
    assert (result.report.ir_version_change["from"], result.report.ir_version_change["to"]) == (14, 13)
    onnx.checker.check_model(result.model, full_check=True)
    by_hand = _dynamic_matmul(13)
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    assert _run(result.model, x).tobytes() == _run(by_hand, x).tobytes()
    # Runtimes observed to load IR 14 keep it.
    for target in ("openvino", "tract", "tflite"):
        plan = plan_for_model(model, load_rules(), load_target(target))
        assert plan.ir_lowering is None, target


@pytest.mark.parametrize(("opset", "ir_version"), [(23, 11), (24, 12), (25, 13), (26, 13)])
def test_an_exporters_ir_version_goes_down_to_tensorrts_10_with_the_opset_and_computes_the_same(opset, ir_version):
    """onnx 1.18-1.21 write IR 11-13 with opsets 23-26; TensorRT 10.1's parser is built on onnx
    1.16's proto (IR 10). The model uses nothing IR 11-13 added: opset 20, IR 10, same bits."""
    model = _qdq_matmul(opset, ir_version)
    result = rewrite(model, target="tensorrt")
    lowered = result.model
    assert (lowered.ir_version, model.ir_version) == (10, ir_version)
    assert [(c.before, c.after) for c in result.report.opset_changes] == [(opset, 20)]
    assert result.report.ir_version_change is not None and result.report.ir_version_change["to"] == 10
    assert "IR version: " in "\n".join(result.report.summary_lines())
    onnx.checker.check_model(lowered, full_check=True)
    onnx.shape_inference.infer_shapes(lowered, check_type=True, strict_mode=True)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 8)) * 10).astype(np.float32)
    x.flat[:3] = [np.inf, -np.inf, np.nan]
    assert _run(model, x).tobytes() == _run(lowered, x).tobytes()


def test_a_model_that_uses_what_a_newer_ir_added_keeps_its_ir_and_the_refusal_names_it(tmp_path):
    """A multi-device configuration (IR 11) at opset 20: TensorRT's IR 10 cannot declare it."""
    model = _qdq_matmul(20, 11)
    model.configuration.add(name="two", num_devices=2)
    plan = plan_for_model(model, load_rules(), load_target("tensorrt"))
    assert plan.ir_lowering is None and [r.node for r in plan.after] == ["(model)"]
    (reason,) = plan.after[0].reasons
    assert reason.startswith("IR version 11 is above the highest the target loads (10) [tensorrt/parser-proto]")
    assert "not lowered to IR 10: the model sets ModelProto.configuration, added in IR 11" in reason
    with pytest.raises(LoweringError, match=r"ModelProto\.configuration"):
        rewrite(model, target="tensorrt")
    source = tmp_path / "multi.onnx"
    onnx.save(model, source)
    proc = _cli("inspect", source, "--target", "tensorrt", "--json")
    assert proc.returncode == 4, proc.stderr
    assert json.loads(proc.stdout)["ir_lowering"] is None
    out = tmp_path / "out.onnx"
    proc = _cli("rewrite", source, "-o", out, "--target", "tensorrt")
    assert proc.returncode == 4 and not out.exists()
    assert "ModelProto.configuration, added in IR 11" in proc.stderr


def test_blockers_name_each_value_or_field_and_the_ir_version_that_added_it():
    cast = helper.make_node("Cast", ["x"], ["y"], name="to_f4", to=TensorProto.FLOAT4E2M1)
    graph = helper.make_graph(
        [cast],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT4E2M1, [4])],
        [helper.make_tensor("w4", TensorProto.INT4, [2], [1, -1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
    blockers = ir_blockers(_inferred(model), 10)
    assert blockers == [
        "value 'y' is float4e2m1, added in IR 11 [opsets/onnx-proto]",
        "attribute to of node to_f4 is float4e2m1, added in IR 11 [opsets/onnx-proto]",
    ]
    assert "initializer 'w4' is int4, added in IR 10 [opsets/onnx-proto]" in ir_blockers(model, 9)
    # The rewrite's own provenance is node metadata (IR 10): never declared below it.
    rewritten = rewrite(_dynamic_matmul(10)).model
    assert any("sets NodeProto.metadata_props, added in IR 10" in b for b in ir_blockers(rewritten, 9))
    # Below what the table describes nothing is proven.
    assert ir_blockers(_qdq_matmul(20, 9), 7) == [
        "what IR 8 added is not described (rules/opsets/ir_versions.toml), so lowering to IR 7 is not proven"
    ]
