"""The integer-matmul rule's statistics of constant weights, gathered slab by slab (so that
gigabytes of external weights stream through the checked descriptor), equal the same statistics
of the whole array, whatever the slab size; and the slab reader reads what the file holds."""

from __future__ import annotations

import itertools
import os

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.io.external_data import ExternalData
from onnx_qrewrite.rewriter.builders._qdq import INTEGER_RANGES
from onnx_qrewrite.rewriter.builders.integer_matmul import _Operand, _Read, _weight_statistics
from onnx_qrewrite.rewriter.graph import ConstantSlabs, split_slabs


def _reference(weights: np.ndarray, read: _Read) -> tuple[float | None, bool | None]:
    """The statistics from the whole array, written plainly: [column or channel, K] rows."""
    if read.conv:
        rows = weights.reshape(weights.shape[0], -1)
    elif weights.ndim < 2:
        rows = weights.reshape(1, -1)
    else:
        rows = np.moveaxis(weights, -2, -1).reshape(-1, weights.shape[-2])
    rows = rows.astype(np.int64)
    b = read.b
    if b.has_zp and b.zp_value is None:
        columns = None
    else:
        zp = np.zeros(1, np.int64) if b.zp_value is None else b.zp_value.astype(np.int64).reshape(-1)
        zp = np.tile(zp, rows.shape[0] // zp.size) if zp.size > 1 else zp
        shifted = rows - (zp[:, None] if zp.size > 1 else zp[0])
        columns = float(np.abs(shifted).sum(axis=1).max(initial=0))
    u8, s8 = (read.a.dtype, b.dtype) if not read.conv else (b.dtype, read.a.dtype)
    if u8 == "int8" or s8 == "uint8":
        return columns, False
    lo, hi = INTEGER_RANGES[read.a.dtype]
    if rows.shape[1] < 2:
        return columns, False
    most, least = np.maximum(rows * lo, rows * hi), np.minimum(rows * lo, rows * hi)
    pair_most, pair_least = most[:, :-1] + most[:, 1:], least[:, :-1] + least[:, 1:]
    return columns, bool(pair_most.max() > 32767 or pair_least.min() < -32768)


def _read(conv: bool, a_dtype: str, b_dtype: str, zp: np.ndarray | None) -> _Read:
    a = _Operand(0, 2, a_dtype, None, 1, True)
    b = _Operand(1, 3 if zp is not None else None, b_dtype, zp, None if zp is None else zp.size)
    return _Read(conv, a, b, None, None)


SHAPES = {
    "matmul-2d": ((37, 5), False),
    "matmul-1d": ((11,), False),
    "matmul-batched": ((3, 9, 4), False),
    "conv": ((6, 3, 2, 2), True),
}


#: (shape case, B's type, zero point): a 1-D B has one column, so no per-column zero point.
CASES = [
    (case, b_dtype, zp_kind)
    for case in sorted(SHAPES)
    for b_dtype in ("uint8", "int8")
    for zp_kind in ("none", "scalar", "per-column")
    if not (case == "matmul-1d" and zp_kind == "per-column")
]


@pytest.mark.parametrize(("case", "b_dtype", "zp_kind"), CASES)
def test_slab_statistics_equal_the_whole_array_statistics(case, b_dtype, zp_kind):
    shape, conv = SHAPES[case]
    rng = np.random.default_rng(len(case) + len(b_dtype) + len(zp_kind))
    lo, hi = INTEGER_RANGES[b_dtype]
    # Extreme values often, so that pairs do and do not saturate across the cases.
    weights = rng.choice(np.array([lo, hi, 0, 1, -1 if lo < 0 else 2, hi // 2], np.int64), shape).astype(b_dtype)
    if zp_kind == "none":
        zp = None
    elif zp_kind == "scalar":
        zp = np.array(rng.integers(lo, hi + 1), b_dtype)
    else:
        count = shape[0] if conv else shape[-1]
        zp = rng.integers(lo, hi + 1, count).astype(b_dtype)
    for a_dtype in ("uint8", "int8"):
        read = _read(conv, a_dtype, b_dtype, zp)
        expected = _reference(weights, read)
        row = weights[:1].nbytes if weights.ndim else 1
        for max_bytes in (1, row, 3 * row + 1, weights.nbytes, 1 << 20):
            got = _weight_statistics(ConstantSlabs(weights.shape, split_slabs(weights, max_bytes)), read)
            assert got == expected, (a_dtype, max_bytes)


def test_a_pair_across_two_slabs_is_seen():
    """B [K, N]: slabs cut K, and the one saturating pair straddles two slabs."""
    weights = np.zeros((8, 3), np.int8)
    weights[3, 1] = weights[4, 1] = 127  # 255 * 127 * 2 > 32767
    read = _read(False, "uint8", "int8", None)
    for max_bytes in (3, 6, 12, 24):
        _, saturates = _weight_statistics(ConstantSlabs(weights.shape, split_slabs(weights, max_bytes)), read)
        assert saturates is True, max_bytes


def test_nothing_is_read_when_no_statistic_needs_the_values():
    """A zero point computed at run time and types that never pair: the slabs are not touched."""

    def untouchable():
        raise AssertionError("read")
        yield

    read = _read(False, "uint8", "uint8", None)
    read = _Read(False, read.a, _Operand(1, 3, "uint8", None, None), None, None)
    assert _weight_statistics(ConstantSlabs((4, 4), untouchable()), read) == (None, False)


def _external_model(tmp_path, array: np.ndarray) -> tuple[onnx.ModelProto, ExternalData]:
    tensor = numpy_helper.from_array(array, "w")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", numpy_helper.helper.np_dtype_to_tensor_dtype(array.dtype), None)],
        [tensor],
    )
    model = helper.make_model(graph)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    model = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    external = ExternalData.for_model(model, tmp_path, "m.onnx")
    assert external is not None
    return model, external


@pytest.mark.parametrize("dtype", ["uint8", "int8", "float32", "int64", "float16"])
def test_external_slabs_concatenate_to_the_tensor(tmp_path, dtype):
    array = (np.arange(7 * 5 * 3) % 251 - 100).astype(dtype).reshape(7, 5, 3)
    model, external = _external_model(tmp_path, array)
    tensor = model.graph.initializer[0]
    with external:
        for max_bytes in (1, array[:1].nbytes, 2 * array[:1].nbytes + 3, 1 << 20):
            slabs = list(external.iter_slabs(tensor, max_bytes))
            assert all(s.shape[1:] == array.shape[1:] for s in slabs)
            assert len(slabs) == (len(array) if max_bytes <= array[:1].nbytes else len(slabs))
            np.testing.assert_array_equal(np.concatenate(slabs), array)


def test_external_slabs_of_a_file_that_shrank_are_an_invalid_model(tmp_path):
    array = np.arange(64 * 16, dtype=np.uint8).reshape(64, 16)
    model, external = _external_model(tmp_path, array)
    with external:
        os.truncate(tmp_path / "m.data", 100)  # after the check: the descriptor sees the shorter file
        with pytest.raises(InvalidModelError, match="ends before offset"):
            list(itertools.islice(external.iter_slabs(model.graph.initializer[0], 64), 4))
