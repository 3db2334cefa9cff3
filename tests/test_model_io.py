"""Model I/O for real sizes: lazy external weights, streamed or zero-copy output, >2 GB split,
atomic writes, inputs never modified."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.io import model_io


def _dql_matmul_model(folder: Path, *, external: bool = True) -> Path:
    """DQL -> MatMulInteger with a 64x32 uint8 weight stored as external data."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.integers(0, 255, (64, 32), dtype=np.uint8), "w")
    wzp = numpy_helper.from_array(np.array(128, np.uint8), "w_zp")
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"], name="dql"),
        helper.make_node("MatMulInteger", ["xq", "w", "xzp", "w_zp"], ["acc"], name="mm"),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["accf", "xs"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
        [w, wzp],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "model.onnx"
    onnx.save(
        model,
        path,
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    return path


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


X = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)


def test_weights_stay_on_disk_while_rewriting(tmp_path):
    path = _dql_matmul_model(tmp_path)
    result = onnx_qrewrite.rewrite(path)
    w = next(t for t in result.model.graph.initializer if t.name == "w")
    assert w.data_location == TensorProto.EXTERNAL and not w.raw_data


def test_output_elsewhere_streams_weights_to_its_own_data_file(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    path = _dql_matmul_model(src)
    before = _digest(src)
    out = dst / "portable.onnx"
    info = onnx_qrewrite.rewrite(path).save(out)
    assert info.data_path == dst / "portable.onnx.data" and not info.referenced
    assert sorted(p.name for p in dst.iterdir()) == ["portable.onnx", "portable.onnx.data"]
    assert _digest(src) == before  # the input is never modified
    onnx.checker.check_model(str(out))
    assert_bitwise_equal(run(out, {"x": X})["y"], run(path, {"x": X})["y"], "y")


def test_zero_copy_references_the_input_data_file(tmp_path):
    path = _dql_matmul_model(tmp_path)
    before = _digest(tmp_path)
    out = tmp_path / "portable.onnx"
    info = onnx_qrewrite.rewrite(path).save(out, reference_external_data=True)
    assert info.referenced == ("model.onnx.data",) and info.data_path is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "portable.onnx"]
    assert {k: v for k, v in _digest(tmp_path).items() if k != "portable.onnx"} == before
    assert_bitwise_equal(run(out, {"x": X})["y"], run(path, {"x": X})["y"], "y")


def test_zero_copy_needs_the_same_folder(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    path = _dql_matmul_model(tmp_path / "a")
    with pytest.raises(UsageError, match="needs the output in the input's folder"):
        onnx_qrewrite.rewrite(path).save(tmp_path / "b" / "o.onnx", reference_external_data=True)
    assert list((tmp_path / "b").iterdir()) == []


def test_models_over_the_protobuf_limit_are_split(tmp_path, monkeypatch):
    path = _dql_matmul_model(tmp_path, external=False)
    # Pretend the limit is tiny: the same code path as a >2 GB model, without writing 2 GB.
    monkeypatch.setattr(model_io, "_PROTOBUF_LIMIT", 1500)
    monkeypatch.setattr(model_io, "_LIMIT_MARGIN", 0)
    out = tmp_path / "big.onnx"
    info = onnx_qrewrite.rewrite(path).save(out)
    assert info.data_path == tmp_path / "big.onnx.data" and info.external_bytes >= 64 * 32
    w = next(t for t in onnx.load(out, load_external_data=False).graph.initializer if t.name == "w")
    assert w.data_location == TensorProto.EXTERNAL
    assert_bitwise_equal(run(out, {"x": X})["y"], run(path, {"x": X})["y"], "y")


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    path = _dql_matmul_model(src)
    result = onnx_qrewrite.rewrite(path)

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_io, "_copy_range", broken)
    with pytest.raises(UsageError, match="No space left on device"):
        result.save(dst / "o.onnx")
    assert list(dst.iterdir()) == []


def test_an_existing_output_survives_a_failed_write(tmp_path, monkeypatch):
    path = _dql_matmul_model(tmp_path)
    out = tmp_path / "o.onnx"
    out.write_bytes(b"previous")
    monkeypatch.setattr(model_io, "_copy_range", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(UsageError):
        onnx_qrewrite.rewrite(path).save(out)
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "o.onnx"]


def test_missing_external_data_is_an_invalid_model(tmp_path):
    path = _dql_matmul_model(tmp_path)
    (tmp_path / "model.onnx.data").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "onnx_qrewrite", "rewrite", str(path), "-o", str(tmp_path / "o.onnx")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 3, proc.stderr
    assert str(path) in proc.stderr and not (tmp_path / "o.onnx").exists()


def _tensor_with_location(key: bytes, value: bytes) -> onnx.TensorProto:
    """A TensorProto whose ``data_location`` field is encoded as ``key`` + ``value`` (wire bytes)."""
    plain = numpy_helper.from_array(np.zeros(2, np.float32), "t")
    plain.ClearField("data_location")
    tensor = onnx.TensorProto()
    tensor.ParseFromString(plain.SerializeToString() + key + value)
    return tensor


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (b"\x70", b"\x01"),  # as protobuf writes it
        (b"\x70", b"\x81\x00"),  # an overlong value
        (b"\x70", b"\x81\x80\x80\x80\x10"),  # 2**32 + 1: an int32 enum keeps the low 32 bits
        (b"\xf0\x00", b"\x01"),  # an overlong key
        (b"\xf0\x80\x00", b"\x81\x00"),
    ],
)
def test_every_encoding_of_an_external_tensor_takes_the_external_data_path(tmp_path, key, value):
    """The byte scan that lets a model without external data skip a parse must never miss one:
    each encoding protobuf reads as ``data_location: EXTERNAL`` is found."""
    tensor = _tensor_with_location(key, value)
    assert tensor.data_location == TensorProto.EXTERNAL  # protobuf reads it so
    assert not model_io._no_external_data(tensor.SerializeToString())
    assert not model_io._no_external_data(b"\x00" + key + value + b"\x00")
    assert model_io._no_external_data(_tensor_with_location(b"\x70", b"\x00").SerializeToString())


def test_a_model_without_external_data_loads_as_with_the_parse_first(tmp_path, monkeypatch):
    """The fast path (checker first, one parse) gives the model the general path gives, and a
    model the checker refuses gets the general path's error."""
    src = _dql_matmul_model(tmp_path, external=False)
    fast = model_io.open_model(src)
    monkeypatch.setattr(model_io, "_no_external_data", lambda data: False)
    slow = model_io.open_model(src)
    assert fast.external is None and slow.external is None
    assert fast.proto.SerializeToString() == slow.proto.SerializeToString()
    monkeypatch.undo()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(src.read_bytes()[:-7])
    with pytest.raises(onnx_qrewrite.errors.InvalidModelError, match="cannot parse the protobuf"):
        model_io.open_model(truncated)
