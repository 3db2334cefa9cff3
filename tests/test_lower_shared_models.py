"""Every real model in tests/data/models rewrites, with the default rules, to standard ONNX that stock
onnxruntime (no custom-op library) runs, reproducing the outputs the original produced.

The stored outputs were made with onnxruntime's default settings (graph optimisation on) and, for
the Quark models, Quark's own CPU library. The rewrites are compared with graph optimisation off
(ORT_DISABLE_ALL), and they match the stored outputs bit for bit, except the dynamic-quantization
model: with optimisation on, onnxruntime fuses its native DynamicQuantizeLinear + MatMulInteger
into DynamicQuantizeMatMul, which rounds differently from the unfused ops (a few 1e-8 on the
logits). That model is compared exactly with its original under the same settings, both ways.
"""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import onnx
import pytest
from conftest import REAL_MODEL_NAMES, REAL_MODELS, assert_bitwise_equal, run

import onnx_qrewrite

MODELS = list(REAL_MODEL_NAMES)
#: Models whose original stock onnxruntime runs, with a fusion under optimisation (see above). The
#: others need a custom-op library: for them the stored outputs are the only reference.
FUSED_IN_ORT = {"ortdyn_cnn_op17_w8u"}


def stored(name: str, kind: str) -> dict[str, np.ndarray]:
    with np.load(REAL_MODELS / f"{name}.{kind}.npz") as data:
        return {k: data[k] for k in data.files}


def assert_standard(model: onnx.ModelProto, original: onnx.ModelProto) -> None:
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert all(domain == "" for domain, _ in ops), sorted(set(ops))
    assert ("", "DynamicQuantizeLinear") not in ops
    # The imports of the domains whose ops were rewritten are gone; every other import stays as it
    # was (Quark writes many it never uses, com.microsoft among them).
    rewritten = {n.domain for n in original.graph.node if n.domain}
    before = {o.domain: o.version for o in original.opset_import}
    after = {o.domain: o.version for o in model.opset_import}
    assert {d: v for d, v in after.items() if d} == {d: v for d, v in before.items() if d and d not in rewritten}
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("keep_opset", [False, True], ids=["default", "keep-opset"])
@pytest.mark.parametrize("name", MODELS)
def test_shared_model_rewrites_to_standard_onnx_and_reproduces_stored_outputs(name, keep_opset):
    path = REAL_MODELS / f"{name}.onnx"
    original = onnx.load(path)
    result = onnx_qrewrite.rewrite(path, keep_opset=keep_opset)
    model = result.model
    assert_standard(model, original)
    if keep_opset:
        assert model.opset_import[0].version == original.opset_import[0].version
    assert model.ir_version == max(original.ir_version, 10)  # node provenance is IR 10 (test_provenance_ir.py)
    inputs, want = stored(name, "inputs"), stored(name, "outputs")
    if name in FUSED_IN_ORT:
        for opt in ("disable", "all"):
            reference = run(original, inputs, opt=opt)
            got = run(model, inputs, opt=opt)
            for k in want:
                assert_bitwise_equal(got[k], reference[k], f"{name}:{k} vs original, optimisation {opt}")
        # The stored outputs come from the fused kernel: equal with optimisation on, within float
        # rounding of the unfused ops with it off.
        assert_bitwise_equal(run(model, inputs, opt="all")["logits"], want["logits"], f"{name} vs stored")
        np.testing.assert_allclose(run(model, inputs)["logits"], want["logits"], rtol=0, atol=1e-6)
    else:
        got = run(model, inputs)
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{name}:{k}")


def test_opset_raise_keeps_external_data_untouched(tmp_path):
    # int16 needs opset 21: the version converter runs on a model whose weights stay on disk.
    name = "quark_cnn_op17_a16w8_ext"
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(
        onnx.load(REAL_MODELS / f"{name}.onnx"),
        src / "m.onnx",
        save_as_external_data=True,
        location="m.data",
        size_threshold=0,
    )
    digest = hashlib.sha256((src / "m.data").read_bytes()).hexdigest()
    result = onnx_qrewrite.rewrite(src / "m.onnx")
    assert [(c.domain, c.before, c.after) for c in result.report.opset_changes] == [
        ("", 17, 21),
        ("com.amd.quark", 1, None),
    ]
    out = tmp_path / "out"
    out.mkdir()
    result.save(out / "m.onnx")
    assert hashlib.sha256((src / "m.data").read_bytes()).hexdigest() == digest
    shutil.rmtree(src)  # the output must not depend on the input's files
    got = run(str(out / "m.onnx"), stored(name, "inputs"))
    assert_bitwise_equal(got["logits"], stored(name, "outputs")["logits"], "external data")
