"""com.microsoft GatherBlockQuantized -> Gather + blocked DequantizeLinear, bit for bit against
onnxruntime's CPU kernel: every storage (uint8 with bits 4 and 8, int4, uint4), with and without
zero points, block sizes 16-128 with a partial last block, negative and repeated indices; below
opset 21 (and for float16 scales, bits 2) the packed table unpacked per lookup, and the table
dequantized at rewrite time, on one battery."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from _pairwise import pairwise
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter.builders.matmul_nbits import pack

RNG = np.random.default_rng(17)


def _constants(storage: str, bits: int, q, zp, scale, with_zp: bool) -> tuple[list, list[str]]:
    """The node's constants (the table and zero points stored as ``storage`` keeps them: uint8
    packed along the last axis, int4, uint4) and its input names."""
    if storage.startswith("uint8"):
        data, zps = pack(q, bits).reshape(*q.shape[:-1], -1), pack(zp, bits).reshape(*zp.shape[:-1], -1)
    elif storage == "int4":
        data = (q.astype(np.int16) - 8).astype(ml_dtypes.int4)
        zps = (zp.astype(np.int16) - 8).astype(ml_dtypes.int4)
    else:
        data, zps = q.astype(ml_dtypes.uint4), zp.astype(ml_dtypes.uint4)
    inits = [numpy_helper.from_array(data, "table"), numpy_helper.from_array(scale, "scales")]
    inputs = ["table", "ids", "scales"]
    if with_zp:
        inits.append(numpy_helper.from_array(zps, "zps"))
        inputs.append("zps")
    return inits, inputs


def gbq_model(storage: str, with_zp: bool, block: int, vocab: int = 50, hidden: int = 80, **attrs):
    bits = 8 if storage == "uint8-8" else 4
    nb = -(-hidden // block)
    q = RNG.integers(0, 2**bits, (vocab, hidden)).astype(np.uint8)
    zp = RNG.integers(0, 2**bits, (vocab, nb)).astype(np.uint8)
    scale = RNG.uniform(1e-3, 1.0, (vocab, nb)).astype(np.float32)
    scale.flat[:3] = [0.0, 1e-40, 3e30]
    attrs = {"gather_axis": 0, "quantize_axis": 1, "block_size": block, **attrs}
    if storage.startswith("uint8"):
        attrs["bits"] = bits
    inits, inputs = _constants(storage, bits, q, zp, scale, with_zp)
    node = helper.make_node("GatherBlockQuantized", inputs, ["emb"], name="gbq", domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", "s", hidden])],
        inits,
    )
    return helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )


# Every storage with every block size and with and without zero points (pairwise, tests/_pairwise.py:
# each storage x block size once, each meeting both zero point settings).
CASES = pairwise(("uint8-4", "uint8-8", "int4", "uint4"), (False, True), (16, 32, 128))


@rule_marker("gather-block-quantized", "positive")
@pytest.mark.parametrize("storage, with_zp, block", CASES, ids=[f"{s}-zp{z}-bs{b}" for s, z, b in CASES])
def test_gathered_rows_dequantize_bit_for_bit(storage, with_zp, block):
    original = gbq_model(storage, with_zp, block)
    result = onnx_qrewrite.rewrite(original)
    assert result.report.by_rule() == {"gather-block-quantized": 1}
    assert op_types(result.model) == ["Gather", "Gather"] + ["Gather"] * with_zp + ["DequantizeLinear"]
    assert {o.domain for o in result.model.opset_import} == {""}
    ids = np.concatenate([np.arange(-50, 50), [0, 0, 49, -1]]).reshape(8, 13).astype(np.int64)
    feeds = {"ids": ids}
    assert_bitwise_equal(run(result.model, feeds)["emb"], run(original, feeds)["emb"], f"{storage}, zp {with_zp}")


@rule_marker("gather-block-quantized", "negative")
def test_other_axes_and_runtime_tables_are_not_lowered():
    original = gbq_model("uint4", False, 16, gather_axis=1, quantize_axis=0)
    with pytest.raises(onnx_qrewrite.LoweringError, match="gather_axis=1, quantize_axis=0 on rank 2"):
        onnx_qrewrite.rewrite(original)
    original = gbq_model("uint8-4", True, 16)
    table = original.graph.initializer[0]
    original.graph.input.append(helper.make_tensor_value_info("table", TensorProto.UINT8, list(table.dims)))
    original.graph.initializer.remove(table)
    with pytest.raises(onnx_qrewrite.LoweringError, match="data 'table' is computed at run time"):
        onnx_qrewrite.rewrite(original)


@pytest.mark.parametrize("symmetric", [False, True])
def test_an_embedding_and_matmul_quantized_by_onnxruntimes_quantizer(symmetric):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from onnx_qrewrite.verify import verify

    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((100, 64)).astype(np.float32), "E")
    weight = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["e"], axis=0), helper.make_node("MatMul", ["e", "W"], ["y"])],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 5, 32])],
        [table, weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    config = DefaultWeightOnlyQuantConfig(
        block_size=32,
        is_symmetric=symmetric,
        op_types_to_quantize=("MatMul", "Gather"),
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    quantizer = MatMulNBitsQuantizer(model, algo_config=config)
    quantizer.process()
    original = quantizer.model.model
    assert [n.op_type for n in original.graph.node] == ["GatherBlockQuantized", "MatMulNBits"]
    result = onnx_qrewrite.rewrite(original)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {"gather-block-quantized": 1, "matmul-nbits-blocked-dq": 1}
    ids = rng.integers(0, 100, (3, 5)).astype(np.int64)
    report = verify(original, result.model, inputs={"ids": ids})
    assert report.passed, report.to_table()


# --- gather-block-quantized-table: the table dequantized at rewrite time, then Gather ------------


def table_model(storage, with_zp, block, scale_type, opset, shape=(40, 300), gather_axis=0, quantize_axis=-1):
    """A GatherBlockQuantized node over a constant table of ``shape`` (unpacked values), edge scales
    (0, a float32 subnormal, a float16 overflow, negative) included."""
    bits = {"uint8-2": 2, "uint8-4": 4, "uint8-8": 8}.get(storage, 4)
    qaxis = quantize_axis % len(shape)
    sshape = list(shape)
    sshape[qaxis] = -(-shape[qaxis] // block)
    q = RNG.integers(0, 2**bits, shape).astype(np.uint8)
    zp = RNG.integers(0, 2**bits, sshape).astype(np.uint8)
    scale = RNG.uniform(-1.0, 1.0, sshape).astype(np.float32)
    scale.flat[:4] = [0.0, 1e-40, 3e30, -7e4]
    with np.errstate(over="ignore"):
        scale = scale.astype(scale_type)
    attrs = {"gather_axis": gather_axis, "quantize_axis": quantize_axis, "block_size": block}
    if storage.startswith("uint8"):
        attrs["bits"] = bits
    inits, inputs = _constants(storage, bits, q, zp, scale, with_zp)
    out_type = TensorProto.FLOAT16 if scale_type == np.float16 else TensorProto.FLOAT
    node = helper.make_node("GatherBlockQuantized", inputs, ["emb"], name="gbq", domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("emb", out_type, [*shape[:gather_axis], "b", "s", *shape[gather_axis + 1 :]])],
        inits,
    )
    return helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )


STORAGES = ("uint8-2", "uint8-4", "uint8-8", "int4", "uint4")


def _table_cases() -> list[tuple]:
    """(storage, with_zp, block, scale type, opset, form): every storage in both forms at both opsets
    with float16 scales (never the blocked form), and again with float32 scales at opset 13 (never
    blocked either), zero points and block sizes taking turns; bits 2 with float32 scales at opset
    21 in both forms (the one float32 storage that opset does not send to the blocked form); then
    rows until every value of each dimension has met every value of each other (tests/_pairwise.py).
    The kept rows carry the pairs on the path the packed/table builders run: a float32 row at 21
    takes the blocked form, where ``form`` is not read, so the pairs it meets do not count for
    them (the blocked form's own battery is test_gathered_rows_dequantize_bit_for_bit). The full
    product was 240 cases of one rewrite and two sessions each."""
    zp_blocks = list(itertools.product((False, True), (16, 64, 256)))
    triples = itertools.product(STORAGES, (13, 21), ("packed", "table"))
    keep = [(s, *zp_blocks[i % 6], np.float16, o, f) for i, (s, o, f) in enumerate(triples)]
    pairs = itertools.product(STORAGES, ("packed", "table"))
    keep += [(s, *zp_blocks[i % 6], np.float32, 13, f) for i, (s, f) in enumerate(pairs)]
    keep += [("uint8-2", True, 64, np.float32, 21, "packed"), ("uint8-2", False, 16, np.float32, 21, "table")]
    return pairwise(
        STORAGES, (False, True), (16, 64, 256), (np.float32, np.float16), (13, 21), ("packed", "table"), keep=keep
    )


TABLE_CASES = _table_cases()


def _ids(vocab: int) -> np.ndarray:
    return np.concatenate([np.arange(-vocab, vocab), [0, 0, vocab - 1, -1]]).reshape(4, -1).astype(np.int64)


@rule_marker("gather-block-quantized-packed", "positive")
@rule_marker("gather-block-quantized-table", "positive")
@pytest.mark.parametrize(
    "storage, with_zp, block, scale_type, opset, form",
    TABLE_CASES,
    ids=[f"{s}-zp{z}-bs{b}-{np.dtype(t).name}-{o}-{f}" for s, z, b, t, o, f in TABLE_CASES],
)
def test_dequantized_table_gathers_bit_for_bit(storage, with_zp, block, scale_type, opset, form):
    """Where the blocked form does not apply, the packed table (the default: unpacked per lookup)
    and the dequantized one (``--skip gather-block-quantized-packed``) are both the kernel, bit for bit."""
    original = table_model(storage, with_zp, block, scale_type, opset)
    skip = ["gather-block-quantized-packed"] if form == "table" else []
    result = onnx_qrewrite.rewrite(original, keep_opset=True, skip=skip)
    blocked = opset >= 21 and scale_type == np.float32 and storage != "uint8-2"
    expected_rule = "gather-block-quantized" if blocked else f"gather-block-quantized-{form}"
    assert result.report.by_rule() == {expected_rule: 1}
    assert {o.domain for o in result.model.opset_import} == {""}
    assert [o.version for o in result.model.opset_import] == [opset]
    if not blocked and form == "table":
        assert op_types(result.model) == ["Gather"]
    if not blocked and form == "packed":  # the table stays packed (bits per value); no float table
        arrays = [numpy_helper.to_array(t) for t in result.model.graph.initializer]
        per_byte = 8 // {"uint8-2": 2, "uint8-8": 8}.get(storage, 4)
        assert any(a.dtype == np.uint8 and a.shape == (40, -(-300 // per_byte)) for a in arrays)
        assert max(a.size for a in arrays if a.dtype.kind == "f") < 40 * 300
    feeds = {"ids": _ids(40)}
    what = f"{storage}, zp {with_zp}, block {block}, {np.dtype(scale_type).name}, opset {opset}, {form}"
    assert_bitwise_equal(run(result.model, feeds)["emb"], run(original, feeds)["emb"], what)


@rule_marker("gather-block-quantized-packed", "positive")
def test_the_packed_table_keeps_a_4_bit_table_at_its_packed_size():
    """The 1000 x 256 4-bit table with float32 scales: the dequantized table is 8x the packed bytes
    (plus the scales); the packed form keeps the packed bytes plus a byte of zero point per block."""
    original = table_model("uint8-4", True, 32, np.float32, 13, shape=(1000, 256))
    packed = onnx_qrewrite.rewrite(original, keep_opset=True)
    table = onnx_qrewrite.rewrite(original, keep_opset=True, skip=["gather-block-quantized-packed"])

    def size(model) -> int:
        return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)

    assert size(table.model) >= 1000 * 256 * 4 and size(packed.model) <= 1000 * (128 + 8) + 1000 * 8 * 4 + 8192
    feeds = {"ids": np.array([[0, 999, -1, 500]], np.int64)}
    assert_bitwise_equal(run(packed.model, feeds)["emb"], run(original, feeds)["emb"], "packed 1000 x 256")


AXES = [((40, 48), 1, 0), ((40, 48), 0, 1), ((6, 5, 48), 1, 2), ((6, 40, 5), 2, 1), ((40, 6, 5), 2, 0)]
AXES += [((5, 40, 6), 1, 0), ((48, 6, 5), 0, 1), ((3, 4, 5, 33), 2, 0)]
# Every axis pair in both forms, with both storages, with and without zero points and with both
# scale types; each of those with each other (pairwise, tests/_pairwise.py; the product was 128).
AXIS_CASES = pairwise(AXES, ("int4", "uint4"), (True, False), (np.float16, np.float32), ("packed", "table"))


def _with_indices_rank(model, rank):
    """``model`` with indices of ``rank`` (recorded) and the output's rank to match."""
    ids = model.graph.input[0].type.tensor_type
    del ids.shape.dim[:]
    for i in range(rank):
        ids.shape.dim.add().dim_param = f"i{i}"
    out = model.graph.output[0].type.tensor_type
    table_rank = len(out.shape.dim) - 1  # the models' indices are 2-D
    del out.shape.dim[:]
    for i in range(table_rank - 1 + rank):
        out.shape.dim.add().dim_param = f"o{i}"
    return model


@rule_marker("gather-block-quantized-packed", "positive")
@rule_marker("gather-block-quantized-table", "positive")
@pytest.mark.parametrize(
    "axes, storage, with_zp, scale_type, form",
    AXIS_CASES,
    ids=[f"{a[0]}-{a[1]}-{a[2]}-{s}-zp{z}-{np.dtype(t).name}-{f}" for a, s, z, t, f in AXIS_CASES],
)
def test_every_axis_pair_the_kernel_takes(axes, storage, with_zp, scale_type, form):
    """Both forms on every axis pair onnxruntime's kernel takes for int4/uint4 (uint8 storage: along
    0, blocks along the last only): the packed table stored with its axes permuted (gathered first,
    blocked last) and each lookup transposed back; the dequantized table gathered where it is.
    Bit for bit with the kernel, the packed table at its packed size."""
    shape, gather_axis, quantize_axis = axes
    original = table_model(storage, with_zp, 16, scale_type, 13, shape, gather_axis, quantize_axis)
    skip = ["gather-block-quantized-packed"] if form == "table" else []
    result = onnx_qrewrite.rewrite(original, keep_opset=True, skip=skip)
    assert result.report.by_rule() == {f"gather-block-quantized-{form}": 1}
    if form == "packed":
        arrays = [numpy_helper.to_array(t) for t in result.model.graph.initializer]
        assert max(a.size for a in arrays if a.dtype.kind == "f") < np.prod(shape)  # no float table
        assert any(a.dtype == np.uint8 and 2 * a.size >= np.prod(shape) for a in arrays)  # the packed one
        moved = gather_axis != 0 or quantize_axis != len(shape) - 1
        assert ("Transpose" in op_types(result.model)) == moved
    size = shape[gather_axis]
    feeds = {"ids": np.array([[0, -1, 2], [1, size - 1, -size]], np.int64)}
    what = f"{storage} zp {with_zp} {shape} gather {gather_axis} blocks {quantize_axis} {form}"
    assert_bitwise_equal(run(result.model, feeds)["emb"], run(original, feeds)["emb"], what)


@rule_marker("gather-block-quantized-packed", "positive")
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_other_axes_with_indices_of_any_rank(rank):
    """The transpose back depends on the indices' rank: a scalar index (the gathered axis dropped),
    a vector, a 3-D block of indices."""
    original = _with_indices_rank(table_model("int4", True, 16, np.float32, 13, (6, 40, 5), 2, 1), rank)
    result = onnx_qrewrite.rewrite(original, keep_opset=True)
    assert result.report.by_rule() == {"gather-block-quantized-packed": 1}
    ids = np.asarray(np.array([[[0, -1], [4, 2]], [[1, 3], [-5, 0]]], np.int64)[(0,) * (3 - rank)])
    assert_bitwise_equal(run(result.model, {"ids": ids})["emb"], run(original, {"ids": ids})["emb"], f"rank {rank}")


@rule_marker("gather-block-quantized-packed", "negative")
def test_other_axes_with_indices_of_unrecorded_rank_take_the_table():
    """Without the indices' rank the packed form cannot transpose back: it says so, and the
    dequantized table (which gathers along the axis as it is) lowers the node."""
    original = table_model("uint4", True, 16, np.float16, 13, (40, 48), 1, 0)
    # The indices reshaped to a shape given at run time: their rank is not recorded.
    graph = original.graph
    graph.input.append(helper.make_tensor_value_info("ids_shape", TensorProto.INT64, [2]))
    graph.node.insert(0, helper.make_node("Reshape", ["ids", "ids_shape"], ["ids_any"]))
    graph.node[1].input[1] = "ids_any"
    result = onnx_qrewrite.rewrite(original, keep_opset=True)
    assert result.report.by_rule() == {"gather-block-quantized-table": 1}
    with pytest.raises(onnx_qrewrite.LoweringError, match="the rank of indices 'ids_any' is not recorded"):
        onnx_qrewrite.rewrite(original, keep_opset=True, skip=["gather-block-quantized-table"])
    feeds = {"ids": np.array([[0, -1], [1, 47]], np.int64), "ids_shape": np.array([2, 2], np.int64)}
    assert_bitwise_equal(run(result.model, feeds)["emb"], run(original, feeds)["emb"], "unrecorded rank")


@rule_marker("gather-block-quantized-packed", "negative")
@rule_marker("gather-block-quantized-table", "negative")
def test_runtime_scales_and_uint8_on_other_axes_are_not_tabled():
    original = table_model("uint4", True, 16, np.float16, 13)
    scales = original.graph.initializer[1]
    original.graph.input.append(helper.make_tensor_value_info("scales", TensorProto.FLOAT16, list(scales.dims)))
    original.graph.initializer.remove(scales)
    with pytest.raises(onnx_qrewrite.LoweringError, match="scales 'scales' are computed at run time"):
        onnx_qrewrite.rewrite(original, keep_opset=True)
    original = table_model("uint8-4", False, 16, np.float32, 13, (40, 48), 1, 0)
    with pytest.raises(onnx_qrewrite.LoweringError, match="uint8 data gathers along 0"):
        onnx_qrewrite.rewrite(original, keep_opset=True)


@rule_marker("gather-block-quantized-table", "positive")
def test_a_block_larger_than_the_table_allocates_nothing_by_it():
    """block_size is the model's (a power of two >= 16, any size: onnxruntime runs 2^40 as one block
    per row): the table form picks each value's scale by index, where it repeated the scales
    block_size times (192 TiB here: exit 5; a smaller huge block filled the memory first)."""
    original = table_model("int4", True, 2**40, np.float16, 13, (40, 48), 1, 0)
    feeds = {"ids": np.array([[0, -1], [1, 47]], np.int64)}
    for form in ("table", "packed"):  # the packed form indexes each value's block alike
        skip = ["gather-block-quantized-packed"] if form == "table" else []
        result = onnx_qrewrite.rewrite(original, keep_opset=True, skip=skip)
        assert result.report.by_rule() == {f"gather-block-quantized-{form}": 1}
        assert_bitwise_equal(run(result.model, feeds)["emb"], run(original, feeds)["emb"], f"block 2^40, {form}")


@rule_marker("gather-block-quantized", "positive")
@pytest.mark.parametrize("storage", ["uint8-4", "int4"])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_one_block_per_row_with_indices_of_any_rank(storage, rank):
    """One block per row: a scalar index's lookup has a 1-element scale, which onnxruntime's
    DequantizeLinear takes as per-tensor and refuses with a block_size ("block_size must be 0 for
    per-tensor quantization"; the second review's finding); it is dequantized per tensor there,
    blocked for other ranks. Bit for bit with the kernel, and the rewrite runs."""
    original = _with_indices_rank(gbq_model(storage, True, 16, hidden=16), rank)
    result = onnx_qrewrite.rewrite(original)
    assert result.report.by_rule() == {"gather-block-quantized": 1}
    ids = np.asarray(np.array([[3, -1, 0], [49, 7, -50]], np.int64)[(0,) * (2 - rank)])
    assert_bitwise_equal(run(result.model, {"ids": ids})["emb"], run(original, {"ids": ids})["emb"], f"rank {rank}")


@rule_marker("gather-block-quantized", "negative")
def test_one_block_per_row_with_indices_of_unrecorded_rank_takes_the_packed_form():
    """Whether a lookup's scale has one element cannot be told without the indices' rank: the
    blocked form says so and the packed form (no DequantizeLinear) lowers the node."""
    original = gbq_model("int4", False, 32, hidden=20)
    graph = original.graph
    graph.input.append(helper.make_tensor_value_info("ids_shape", TensorProto.INT64, [None]))
    graph.node.insert(0, helper.make_node("Reshape", ["ids", "ids_shape"], ["ids_any"]))
    graph.node[1].input[1] = "ids_any"
    result = onnx_qrewrite.rewrite(original)
    assert result.report.by_rule() == {"gather-block-quantized-packed": 1}
    with pytest.raises(onnx_qrewrite.LoweringError, match="one block per row and indices 'ids_any' of unrecorded"):
        onnx_qrewrite.rewrite(original, skip=["gather-block-quantized-packed", "gather-block-quantized-table"])
    for ids in (np.array([5, -2, 0], np.int64), np.array(7, np.int64)):
        feeds = {
            "ids": ids.reshape(-1, 1) if ids.ndim else ids.reshape(1, 1),
            "ids_shape": np.array(ids.shape, np.int64),
        }
        assert_bitwise_equal(run(result.model, feeds)["emb"], run(original, feeds)["emb"], f"indices {ids.shape}")
