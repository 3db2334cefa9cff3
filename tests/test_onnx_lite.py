"""onnx_qrewrite._onnx: what it does without ``import onnx`` is what onnx does.

The helpers it uses in the console script's own process are compared here with onnx's own, case
by case; the whole path (``inspect``, then ``import onnx`` and a rewrite in the same process) runs
in a subprocess, as the console script runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx_qrewrite import _onnx

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"

_VALUES = {
    "float32": [0.0, -0.0, 1.5, -3.25, np.inf, -np.inf, np.nan, 3.4e38, 1e-45],
    "float64": [0.0, -0.0, 1.5, np.inf, np.nan, 1.7e308, 5e-324],
    "float16": [0.0, -0.0, 1.5, np.inf, np.nan, 65504.0, 6e-8],
    "uint8": [0, 1, 127, 128, 255],
    "int8": [0, 1, -1, 127, -128],
    "uint16": [0, 1, 65535, 32768],
    "int16": [0, -1, 32767, -32768],
    "int32": [0, -1, 2**31 - 1, -(2**31)],
    "int64": [0, -1, 2**63 - 1, -(2**63)],
    "uint32": [0, 1, 2**32 - 1],
    "uint64": [0, 1, 2**64 - 1],
    "bool": [True, False, True],
}


def _arrays(dtype: str) -> list[np.ndarray]:
    flat = np.array(_VALUES[dtype], dtype=dtype)
    return [flat, flat[:1].reshape(()), flat[:0], np.resize(flat, (2, 3)), np.resize(flat, (3, 2)).T]


def _same_array(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if ours.dtype == object:
        assert ours.tolist() == theirs.tolist()
    else:
        assert ours.tobytes() == theirs.tobytes()
    assert ours.flags.writeable == theirs.flags.writeable


@pytest.mark.parametrize("dtype", sorted(_VALUES))
def test_to_array_is_onnxs_for_raw_and_typed_storage(dtype):
    code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for array in _arrays(dtype):
        raw = numpy_helper.from_array(np.ascontiguousarray(array))
        typed = helper.make_tensor("t", code, array.shape, np.ascontiguousarray(array).ravel().tolist())
        assert not typed.HasField("raw_data")
        for tensor in (raw, typed):
            _same_array(_onnx._to_array(tensor), numpy_helper.to_array(tensor))


@pytest.mark.parametrize("dtype", sorted(_VALUES))
def test_from_array_is_onnxs(dtype):
    for array in _arrays(dtype):
        for name in (None, "w"):
            ours = _onnx._from_array(array, name)
            assert ours.SerializeToString() == numpy_helper.from_array(array, name).SerializeToString()


def test_other_tensors_are_onnxs_own():
    """Types and storage outside the table go to onnx's functions, with onnx's answers."""
    import ml_dtypes

    bf16 = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    strings = np.array(["a", "bc"], dtype=object)
    big_endian = np.array([1, 2], dtype=">i4")
    for array in (bf16, strings):
        tensor = _onnx._from_array(array)
        assert tensor.SerializeToString() == numpy_helper.from_array(array).SerializeToString()
        _same_array(_onnx._to_array(tensor), numpy_helper.to_array(tensor))
    with pytest.raises(ValueError):
        numpy_helper.from_array(big_endian)
    with pytest.raises(ValueError):
        _onnx._from_array(big_endian)
    undefined = onnx.TensorProto(dims=[1])
    with pytest.raises(TypeError):
        _onnx._to_array(undefined)


_ATTRIBUTE_VALUES = [
    3,
    True,
    np.int64(5),
    2.5,
    np.float32(0.1),
    "text",
    b"bytes",
    numpy_helper.from_array(np.arange(3, dtype=np.int64)),
    helper.make_graph([], "g", [], []),
    [1, 2],
    (4, np.int32(5)),
    np.arange(3),
    [1.0, 2],
    [np.float32(1.5)],
    ["a", b"b"],
    [numpy_helper.from_array(np.zeros(1, np.float32))],
]


@pytest.mark.parametrize("value", _ATTRIBUTE_VALUES, ids=lambda v: type(v).__name__)
def test_make_and_read_attributes_as_onnx_does(value):
    ours = _onnx._make_attribute("a", value)
    theirs = helper.make_attribute("a", value)
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert _onnx._get_attribute_value(ours) == helper.get_attribute_value(theirs)


def test_attributes_onnx_refuses_are_refused_alike():
    for bad in ([], [object()], object()):
        with pytest.raises((ValueError, TypeError)) as theirs:
            helper.make_attribute("a", bad)
        with pytest.raises(theirs.type):
            _onnx._make_attribute("a", bad)
    reference = onnx.AttributeProto(name="a", ref_attr_name="b", type=onnx.AttributeProto.INT)
    with pytest.raises(ValueError):
        _onnx._get_attribute_value(reference)
    assert _onnx._get_attribute_value(onnx.AttributeProto(name="u")) is None


def _attributes_model() -> onnx.ModelProto:
    node = helper.make_node("Relu", ["x"], ["y"])
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    return helper.make_model(helper.make_graph([node], "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])


def test_checker_and_shape_inference_wrappers_are_onnxs():
    """The wrappers call onnx's extension as onnx's Python functions do (run here with onnx's
    extension module, the one they use in the console script's process)."""
    _onnx._STATE.setdefault("native", onnx.onnx_cpp2py_export)
    model = _attributes_model()
    _onnx._check_model(model)
    _onnx._check_model(model.SerializeToString(), full_check=True)
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    bad.ir_version = 99
    with pytest.raises(onnx.checker.ValidationError) as ours:
        _onnx._check_model(bad.SerializeToString())
    with pytest.raises(onnx.checker.ValidationError) as theirs:
        onnx.checker.check_model(bad.SerializeToString())
    assert str(ours.value) == str(theirs.value)
    inferred = _onnx._infer_shapes(model)
    assert inferred.SerializeToString() == onnx.shape_inference.infer_shapes(model).SerializeToString()
    assert _onnx._make_opsetid("ai.x", 3).SerializeToString() == helper.make_opsetid("ai.x", 3).SerializeToString()


_CONSOLE = """
import contextlib, io, json, sys
from onnx_qrewrite import cli
out, runs, extra = {}, json.loads(sys.argv[1]), sys.argv[2:]
for args in runs:
    sys.argv = ["onnx-qrewrite", *args]
    buffer, code = io.StringIO(), 0
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            cli.run()
        except SystemExit as exc:
            code = exc.code or 0
    out[" ".join(args)] = [code, buffer.getvalue()]
from onnx_qrewrite import _onnx
out["unpackaged"] = _onnx.unpackaged()
out["onnx imported"] = "onnx" in sys.modules
import onnx
out["same classes"] = onnx.ModelProto is _onnx.ModelProto and onnx.NodeProto is _onnx.NodeProto
out["same checker"] = onnx.checker.ValidationError is _onnx.checker.ValidationError
if extra:
    from onnx_qrewrite.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["rewrite", extra[0], "-o", extra[1], "-q"])
        except SystemExit as exc:
            assert not exc.code, exc.code
    onnx.checker.check_model(onnx.load(extra[1]))
    out["rewritten"] = True
print(json.dumps(out))
"""


def _console(runs: list[list[str]], *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CONSOLE, json.dumps(runs), *extra], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _in_process(args: list[str], capsys) -> list:
    from onnx_qrewrite.cli import main

    capsys.readouterr()
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return [code, captured.out + captured.err]


def test_console_inspect_without_onnx_says_what_onnx_says(capsys, tmp_path):
    """Every sample model, text, --all-nodes and --json, and models onnx's checker refuses or
    that do not parse: the console script's answers (output and exit code) without
    ``import onnx`` are the in-process ones, made with onnx."""
    models = sorted(SAMPLES.glob("*.onnx"))
    runs = [["inspect", str(p), *flags] for p in models for flags in ([], ["-a"], ["--json"])]
    data = (SAMPLES / "dynamic_mlp.onnx").read_bytes()
    (tmp_path / "truncated.onnx").write_bytes(data[: len(data) // 2])
    future = onnx.load_from_string(data)
    future.ir_version = 99
    onnx.save(future, tmp_path / "future.onnx")
    unsorted = onnx.load_from_string(data)
    nodes = list(unsorted.graph.node)
    del unsorted.graph.node[:]
    unsorted.graph.node.extend(reversed(nodes))
    onnx.save(unsorted, tmp_path / "unsorted.onnx")
    runs += [["inspect", str(tmp_path / name)] for name in ("truncated.onnx", "future.onnx", "unsorted.onnx")]
    out = _console(runs)
    assert out["unpackaged"] and out["same classes"] and out["same checker"]
    for args in runs:
        assert out[" ".join(args)] == _in_process(args, capsys), args
    assert [out[" ".join(r)][0] for r in runs[-3:]] == [3, 3, 0]


def test_onnx_imported_after_inspect_works(tmp_path):
    """``import onnx`` after an inspect that did without it: the same classes and checker, and a
    rewrite whose output onnx's checker passes."""
    model = SAMPLES / "dynamic_mlp.onnx"
    out = _console([["inspect", str(model)]], str(model), str(tmp_path / "out.onnx"))
    assert not out["onnx imported"] and out["unpackaged"]
    assert out["same classes"] and out["same checker"] and out["rewritten"]


def test_console_rewrite_without_onnx_writes_what_onnx_writes(tmp_path):
    """``rewrite`` in the console script's process loads no ``onnx`` for the sample models' rules
    it needs none for (the package's modules on its path use this module), and writes the bytes
    an in-process rewrite, made with onnx, writes."""
    from onnx_qrewrite.cli import main

    for model in sorted(SAMPLES.glob("*.onnx")):
        console = tmp_path / f"console_{model.name}"
        runs = [["rewrite", str(model), "-o", str(console), "-q"]]
        out = _console(runs)
        assert out[" ".join(runs[0])][0] == 0, out
        inside = tmp_path / f"inside_{model.name}"
        with pytest.raises(SystemExit) as done:
            main(["rewrite", str(model), "-o", str(inside), "-q"])
        assert not done.value.code
        assert console.read_bytes() == inside.read_bytes(), model.name
    # The benchmark's chain: its rules build from templates, without onnx's helpers.
    chain = _bench_models().make_dql_chain(4, tmp_path / "chain.onnx")
    assert not _console([["rewrite", str(chain), "-o", str(tmp_path / "c.onnx")]])["onnx imported"]


def _bench_models():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import models

    return models
