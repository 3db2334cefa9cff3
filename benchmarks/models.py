"""Generators for the benchmark models: a very long DynamicQuantizeLinear chain and a big LLM-shaped model.

They stress the two ways a rewrite can be slow: many nodes (``make_dql_chain``, 5 nodes a block, built
for 100k blocks in seconds) and big weights (``make_llm``, gigabytes of uint8 weights in one external
data file, written streaming so the generator itself stays under a few hundred MB of memory).

Importable (``from benchmarks.models import make_dql_chain, make_llm``) and runnable::

    python benchmarks/models.py chain --blocks 20000 -o /tmp/chain.onnx
    python benchmarks/models.py llm --layers 32 --weights-gb 4 -o /tmp/llm/model.onnx
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Default-domain opset of both models: ReduceMean still takes `axes` as an attribute at 17.
OPSET = 17
# onnx 1.23's make_model writes IR version 14, which onnxruntime 1.31 refuses (it reads <= 13).
IR_VERSION = 8
PRODUCER = "benchmarks.models"


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER)
    model.ir_version = IR_VERSION
    return model


# ---------------------------------------------------------------------------------------------------
# The DynamicQuantizeLinear chain: many small nodes

CHAIN_WIDTH = 16


def chain_weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The one uint8 [16, 16] weight, its zero point and its scale, shared by every block of the chain.

    The scale is 1 / (spectral radius of W - zero point), so a block maps x to roughly x @ an operator
    of spectral radius 1: values neither explode nor vanish along the chain (in a numpy simulation of
    100k blocks they stayed finite, within a factor ~100 of the input), and the outputs stay
    comparable after a rewrite.
    """
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (CHAIN_WIDTH, CHAIN_WIDTH), dtype=np.uint8)
    w_zp = np.uint8(128)
    centred = w.astype(np.float64) - float(w_zp)
    w_scale = np.float32(1.0 / np.abs(np.linalg.eigvals(centred)).max())
    return w, np.array(w_zp, dtype=np.uint8), np.array(w_scale, dtype=np.float32)


def _chain_block(index: str, x: str, y: str) -> onnx.GraphProto:
    """One block (5 nodes) reading value ``x`` and writing value ``y``, its names prefixed ``blk<index>/``."""
    p = f"blk{index}/"
    block = onnx.GraphProto()
    add = block.node.add
    add(
        op_type="DynamicQuantizeLinear",
        name=p + "DynamicQuantizeLinear",
        input=[x],
        output=[p + "x_q", p + "x_scale", p + "x_zp"],
    )
    add(
        op_type="MatMulInteger",
        name=p + "MatMulInteger",
        input=[p + "x_q", "W_quantized", p + "x_zp", "W_zero_point"],
        output=[p + "acc"],
    )
    add(
        op_type="Cast",
        name=p + "Cast",
        input=[p + "acc"],
        output=[p + "acc_f"],
        attribute=[helper.make_attribute("to", TensorProto.FLOAT)],
    )
    add(op_type="Mul", name=p + "Mul_x_scale", input=[p + "acc_f", p + "x_scale"], output=[p + "y_x"])
    add(op_type="Mul", name=p + "Mul_w_scale", input=[p + "y_x", "W_scale"], output=[y])
    return block


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | 0x80 if n else low)
        if not n:
            return bytes(out)


def _chain_model_bytes(n_blocks: int) -> bytes:
    """The serialized chain model, built as bytes: ~10x faster and ~5x leaner than building NodeProtos.

    Even through protobuf's C API, creating 500k NodeProtos, then copying and serializing them, takes
    ~2 s and ~550 MB at 100k blocks. Instead one block is serialized with fixed-width placeholders for
    its index (indices are zero-padded, so every length prefix stays valid), the index is stamped into
    the bytes for each block, and the node bytes are spliced into the model's serialization at the
    place protobuf itself puts them (GraphProto.node is field 1, ModelProto.graph is field 7), so the
    file is byte-identical to what ``SerializeToString`` would write.
    """
    width = len(str(n_blocks))
    idx = lambda i: f"{i:0{width}d}"  # noqa: E731
    value = lambda i: "input" if i == 0 else "output" if i == n_blocks else f"h{idx(i)}"  # noqa: E731
    cur, nxt = "@" * width, "#" * width
    template = _chain_block(cur, f"h{cur}", f"h{nxt}").SerializeToString()
    cur_b, nxt_b = cur.encode(), nxt.encode()
    nodes = b"".join(
        template.replace(cur_b, idx(i).encode()).replace(nxt_b, idx(i + 1).encode())
        if 0 < i < n_blocks - 1
        else _chain_block(idx(i), value(i), value(i + 1)).SerializeToString()
        for i in range(n_blocks)
    )
    w, w_zp, w_scale = chain_weights()
    graph_rest = helper.make_graph(
        [],
        f"dql_chain_{n_blocks}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, CHAIN_WIDTH])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, CHAIN_WIDTH])],
        [
            numpy_helper.from_array(w, "W_quantized"),
            numpy_helper.from_array(w_zp, "W_zero_point"),
            numpy_helper.from_array(w_scale, "W_scale"),
        ],
    ).SerializeToString()
    graph = nodes + graph_rest
    head = onnx.ModelProto(ir_version=IR_VERSION, producer_name=PRODUCER)  # fields 1-2: before the graph
    tail = onnx.ModelProto(opset_import=[helper.make_opsetid("", OPSET)])  # field 8: after it
    graph_tag = b"\x3a"  # field 7, length-delimited
    return head.SerializeToString() + graph_tag + _varint(len(graph)) + graph + tail.SerializeToString()


def make_dql_chain(n_blocks: int, path: str | os.PathLike) -> Path:
    """Write a chain of ``n_blocks`` DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul -> Mul blocks.

    Input ``input`` [1, 16] float, output ``output`` [1, 16] float; every block reads the previous
    block's output and shares one uint8 [16, 16] weight, so the file is almost all NodeProtos.
    Returns the path written.
    """
    if n_blocks < 1:
        raise ValueError("n_blocks must be >= 1")
    path = Path(path)
    path.write_bytes(_chain_model_bytes(n_blocks))
    return path


# ---------------------------------------------------------------------------------------------------
# The LLM-shaped model: few nodes, gigabytes of external weights

_HEAD_DIM = 64
_ALIGN = 4096  # tensor offsets in the data file, as onnx aligns large tensors for mmap
_BLOCK_BYTES = 1 << 20  # the pseudo-random block every weight's bytes are cut from


@dataclass(frozen=True)
class LlmInfo:
    """What make_llm wrote: the sizes actually chosen, for reports and tests."""

    model_path: Path
    data_path: Path
    n_layers: int
    hidden: int
    intermediate: int
    weight_bytes: int
    n_nodes: int


def llm_sizes(n_layers: int, weights_gb: float, hidden: int | None = None) -> tuple[int, int]:
    """Pick (hidden, intermediate) so the weights of n_layers layers add up to about weights_gb * 1e9 bytes.

    A layer holds q/k/v/o [hidden, hidden] and gate/up [hidden, inter], down [inter, hidden]: 4h^2 + 3hi
    bytes. Both sizes are multiples of 64 (the head size); hidden defaults to the size that makes
    inter ~ 3 * hidden, and inter then absorbs the rounding so the total lands near the target.
    """
    per_layer = weights_gb * 1e9 / n_layers
    if hidden is None:
        hidden = max(_HEAD_DIM, int(math.sqrt(per_layer / 13)) // _HEAD_DIM * _HEAD_DIM)
    if hidden % _HEAD_DIM:
        raise ValueError(f"hidden must be a multiple of {_HEAD_DIM}")
    inter = (per_layer - 4 * hidden * hidden) / (3 * hidden)
    inter = max(_HEAD_DIM, round(inter / _HEAD_DIM) * _HEAD_DIM)
    return hidden, inter


class _ExternalWeightWriter:
    """Streams uint8 weights into one data file and returns TensorProtos that point into it.

    Every tensor's bytes are a rotation of one seeded pseudo-random 1 MiB block, written in 1 MiB
    slices, so memory stays bounded whatever the total size and no two tensors start alike.
    """

    def __init__(self, data_path: Path, seed: int = 0) -> None:
        self.data_path = data_path
        block = np.random.default_rng(seed).integers(0, 256, _BLOCK_BYTES, dtype=np.uint8).tobytes()
        self._twice = memoryview(block + block)  # any rotation of the block is one slice of this
        self._file = open(data_path, "wb")  # noqa: SIM115 - closed by close()
        self._offset = 0
        self._count = 0

    def add(self, name: str, shape: tuple[int, ...]) -> TensorProto:
        pad = -self._offset % _ALIGN
        self._file.write(b"\0" * pad)
        self._offset += pad
        length = math.prod(shape)
        start = (self._count * 7919 * 64) % _BLOCK_BYTES  # a different rotation for every tensor
        left = length
        while left:
            n = min(left, _BLOCK_BYTES)
            self._file.write(self._twice[start : start + n])
            left -= n
        tensor = TensorProto(name=name, data_type=TensorProto.UINT8, dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.data_path.name), ("offset", str(self._offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        self._offset += length
        self._count += 1
        return tensor

    def close(self) -> None:
        self._file.close()


class _LlmGraph:
    """Builds the nodes of the LLM-shaped graph the way onnxruntime's quantize_dynamic lays them out."""

    def __init__(self, weights: _ExternalWeightWriter) -> None:
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def op(self, op_type: str, inputs: list[str], output: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output.replace(".out", ""), **attrs))
        return output

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def dynamic_quantize(self, x: str, prefix: str) -> tuple[str, str, str]:
        outs = [f"{prefix}.x_q", f"{prefix}.x_scale", f"{prefix}.x_zp"]
        self.nodes.append(helper.make_node("DynamicQuantizeLinear", [x], outs, name=f"{prefix}.DynamicQuantizeLinear"))
        return outs[0], outs[1], outs[2]

    def int_linear(self, quantized: tuple[str, str, str], name: str, k: int, n: int) -> str:
        """MatMulInteger with a [k, n] uint8 external weight, then Cast and rescale, as quantize_dynamic does."""
        x_q, x_scale, x_zp = quantized
        w = self.weights.add(f"{name}.weight_quantized", (k, n))
        self.inits.append(w)
        w_zp = self.const(f"{name}.weight_zero_point", np.array(128, dtype=np.uint8))
        # ~unit-variance outputs for unit-variance inputs: uniform uint8 - 128 has std ~74.
        w_scale = self.const(f"{name}.weight_scale", np.array(1.0 / (74.0 * math.sqrt(k)), dtype=np.float32))
        acc = self.op("MatMulInteger", [x_q, w.name, x_zp, w_zp], f"{name}.MatMulInteger.out")
        scale = self.op("Mul", [x_scale, w_scale], f"{name}.scale.out")
        acc_f = self.op("Cast", [acc], f"{name}.Cast.out", to=TensorProto.FLOAT)
        return self.op("Mul", [acc_f, scale], f"{name}.out")

    def rms_norm(self, x: str, name: str, hidden: int) -> str:
        sq = self.op("Mul", [x, x], f"{name}.sq.out")
        mean = self.op("ReduceMean", [sq], f"{name}.mean.out", axes=[-1], keepdims=1)
        eps = self.op("Add", [mean, self.const(f"{name}.eps", np.array(1e-5, dtype=np.float32))], f"{name}.eps.out")
        rms = self.op("Sqrt", [eps], f"{name}.rms.out")
        normed = self.op("Div", [x, rms], f"{name}.div.out")
        gamma = self.const(f"{name}.weight", np.ones(hidden, dtype=np.float32))
        return self.op("Mul", [normed, gamma], f"{name}.out")

    def attention(self, x: str, name: str, hidden: int) -> str:
        """Multi-head self-attention (no mask, no rotary): enough glue to look and run like an LLM."""
        xq = self.dynamic_quantize(x, f"{name}.qkv")
        q, k, v = (self.int_linear(xq, f"{name}.{p}_proj", hidden, hidden) for p in "qkv")
        heads = hidden // _HEAD_DIM
        split = self.const(f"{name}.split_shape", np.array([0, 0, heads, _HEAD_DIM], dtype=np.int64))
        merge = self.const(f"{name}.merge_shape", np.array([0, 0, hidden], dtype=np.int64))

        def to_heads(t: str, perm: list[int]) -> str:
            r = self.op("Reshape", [t, split], f"{t}.heads.out")
            return self.op("Transpose", [r], f"{t}.heads_t.out", perm=perm)

        qh, kt, vh = to_heads(q, [0, 2, 1, 3]), to_heads(k, [0, 2, 3, 1]), to_heads(v, [0, 2, 1, 3])
        scores = self.op("MatMul", [qh, kt], f"{name}.scores.out")
        scaled = self.op(
            "Mul",
            [scores, self.const(f"{name}.inv_sqrt_d", np.array(_HEAD_DIM**-0.5, dtype=np.float32))],
            f"{name}.scaled.out",
        )
        probs = self.op("Softmax", [scaled], f"{name}.probs.out", axis=-1)
        ctx = self.op("MatMul", [probs, vh], f"{name}.ctx.out")
        ctx_t = self.op("Transpose", [ctx], f"{name}.ctx_t.out", perm=[0, 2, 1, 3])
        merged = self.op("Reshape", [ctx_t, merge], f"{name}.merged.out")
        return self.int_linear(self.dynamic_quantize(merged, f"{name}.o"), f"{name}.o_proj", hidden, hidden)

    def mlp(self, x: str, name: str, hidden: int, inter: int) -> str:
        """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
        xq = self.dynamic_quantize(x, f"{name}.gate_up")
        gate = self.int_linear(xq, f"{name}.gate_proj", hidden, inter)
        up = self.int_linear(xq, f"{name}.up_proj", hidden, inter)
        sig = self.op("Sigmoid", [gate], f"{name}.sigmoid.out")
        silu = self.op("Mul", [gate, sig], f"{name}.silu.out")
        act = self.op("Mul", [silu, up], f"{name}.act.out")
        return self.int_linear(self.dynamic_quantize(act, f"{name}.down"), f"{name}.down_proj", inter, hidden)


def make_llm(
    path: str | os.PathLike, n_layers: int = 32, weights_gb: float = 4.0, hidden: int | None = None
) -> LlmInfo:
    """An LLM-shaped model of ``n_layers`` decoder layers whose uint8 weights total ~weights_gb * 1e9 bytes.

    Each layer is RMSNorm -> attention (q/k/v/o MatMulInteger projections) -> residual Add -> RMSNorm ->
    SwiGLU MLP (gate/up/down MatMulInteger) -> residual Add, every MatMulInteger fed by a
    DynamicQuantizeLinear as quantize_dynamic writes it (~65 nodes a layer). Input ``hidden_states``
    [batch, seq, hidden] float, output ``output`` of the same shape. All weights go to ONE data file,
    ``<model file name>.data`` beside the model, written streaming: memory stays bounded.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden, inter = llm_sizes(n_layers, weights_gb, hidden)
    writer = _ExternalWeightWriter(path.with_name(path.name + ".data"))
    g = _LlmGraph(writer)
    try:
        x = "hidden_states"
        for i in range(n_layers):
            p = f"layers.{i}"
            attn = g.attention(g.rms_norm(x, f"{p}.input_norm", hidden), f"{p}.attn", hidden)
            x = g.op("Add", [x, attn], f"{p}.attn_residual.out")
            mlp = g.mlp(g.rms_norm(x, f"{p}.post_attn_norm", hidden), f"{p}.mlp", hidden, inter)
            x = g.op("Add", [x, mlp], f"{p}.mlp_residual.out")
        g.op("Identity", [g.rms_norm(x, "final_norm", hidden)], "output")
    finally:
        writer.close()
    graph = helper.make_graph(
        g.nodes,
        f"llm_{n_layers}x{hidden}",
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "seq", hidden])],
        g.inits,
    )
    # Written directly, not with onnx.save, so nothing tries to load or rewrite the external data.
    path.write_bytes(_model(graph).SerializeToString())
    weight_bytes = n_layers * (4 * hidden * hidden + 3 * hidden * inter)
    return LlmInfo(path, writer.data_path, n_layers, hidden, inter, weight_bytes, len(g.nodes))


# ---------------------------------------------------------------------------------------------------
# Small real-shaped models for inference cost: a BERT-like encoder and a CNN, quantized the way users
# quantize them (onnxruntime.quantization.quantize_dynamic), so the DynamicQuantizeLinear nodes, their
# sharing and their MatMulInteger/ConvInteger consumers are exactly what that tool writes.


class _FloatGraph:
    """Nodes and float initializers of a float model, with readable unique names."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def op(self, op_type: str, inputs: list[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, name: str, shape: tuple[int, ...], std: float) -> str:
        return self.const(name, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def linear(self, x: str, name: str, k: int, n: int) -> str:
        w = self.weight(f"{name}.weight", (k, n), k**-0.5)
        b = self.const(f"{name}.bias", (self.rng.standard_normal(n) * 0.02).astype(np.float32))
        return self.op("Add", [self.op("MatMul", [x, w], f"{name}.matmul"), b], f"{name}.out")

    def layer_norm(self, x: str, name: str, hidden: int) -> str:
        gamma = self.const(f"{name}.weight", np.ones(hidden, np.float32))
        beta = self.const(f"{name}.bias", np.zeros(hidden, np.float32))
        return self.op("LayerNormalization", [x, gamma, beta], f"{name}.out", axis=-1, epsilon=1e-12)

    def gelu(self, x: str, name: str) -> str:
        """GELU written with Erf, as exporters write it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
        scaled = self.op("Div", [x, self.const(f"{name}.sqrt2", np.float32(math.sqrt(2.0)))], f"{name}.div")
        erf = self.op("Erf", [scaled], f"{name}.erf")
        one_plus = self.op("Add", [erf, self.const(f"{name}.one", np.float32(1.0))], f"{name}.add")
        half = self.op("Mul", [x, self.const(f"{name}.half", np.float32(0.5))], f"{name}.half_x")
        return self.op("Mul", [half, one_plus], f"{name}.out")


def _quantize_dynamic(float_model: onnx.ModelProto, path: Path) -> Path:
    """Quantize with onnxruntime's own tool (imported here: only these generators need it)."""
    import tempfile

    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float.onnx"
        onnx.save(float_model, src)
        quantize_dynamic(src, path, weight_type=QuantType.QUInt8)
    model = onnx.load(path)
    model.ir_version = IR_VERSION
    model.producer_name = PRODUCER
    onnx.save(model, path)
    return path


def make_bert(
    path: str | os.PathLike,
    n_layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    intermediate: int = 512,
    vocab: int = 1024,
    max_seq: int = 128,
    seed: int = 0,
) -> Path:
    """A BERT-like encoder (bert-tiny sized by default), dynamically quantized by onnxruntime:
    :func:`float_bert`, where every weight MatMul becomes DynamicQuantizeLinear -> MatMulInteger as
    quantize_dynamic writes it."""
    return _quantize_dynamic(float_bert(n_layers, hidden, heads, intermediate, vocab, max_seq, seed), Path(path))


def float_bert(
    n_layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    intermediate: int = 512,
    vocab: int = 1024,
    max_seq: int = 128,
    seed: int = 0,
) -> onnx.ModelProto:
    """The float BERT-like encoder the quantizers start from (benchmarks/target_models.py gives it
    to several of them).

    Word + position embeddings (Gather), LayerNormalization, per layer multi-head self-attention
    (MatMul/Add projections, scaled MatMul, Softmax) and a GELU (Erf) feed-forward block, each with a
    residual Add and LayerNormalization. Input ``input_ids`` int64 [batch, seq] (seq <= max_seq),
    output ``last_hidden_state`` float [batch, seq, hidden].
    """
    g = _FloatGraph(seed)
    head_dim = hidden // heads
    words = g.weight("embeddings.word", (vocab, hidden), 0.02)
    positions = g.weight("embeddings.position", (max_seq, hidden), 0.02)
    shape = g.op("Shape", ["input_ids"], "embeddings.shape")
    seq = g.op("Gather", [shape, g.const("embeddings.one_index", np.array([1], np.int64))], "embeddings.seq_len")
    zero = g.const("embeddings.zero_index", np.array([0], np.int64))
    pos = g.op("Slice", [positions, zero, seq, zero], "embeddings.position_slice")
    emb = g.op("Add", [g.op("Gather", [words, "input_ids"], "embeddings.word_lookup"), pos], "embeddings.sum")
    x = g.layer_norm(emb, "embeddings.norm", hidden)
    split = g.const("attention.split_shape", np.array([0, 0, heads, head_dim], np.int64))
    merge = g.const("attention.merge_shape", np.array([0, 0, hidden], np.int64))
    for i in range(n_layers):
        p = f"layer.{i}"

        def to_heads(t: str, perm: list[int], p: str = p) -> str:
            return g.op("Transpose", [g.op("Reshape", [t, split], f"{t}.heads")], f"{t}.heads_t", perm=perm)

        q = to_heads(g.linear(x, f"{p}.attention.query", hidden, hidden), [0, 2, 1, 3])
        k = to_heads(g.linear(x, f"{p}.attention.key", hidden, hidden), [0, 2, 3, 1])
        v = to_heads(g.linear(x, f"{p}.attention.value", hidden, hidden), [0, 2, 1, 3])
        scores = g.op("MatMul", [q, k], f"{p}.attention.scores")
        scaled = g.op(
            "Div", [scores, g.const(f"{p}.attention.sqrt_d", np.float32(math.sqrt(head_dim)))], f"{p}.attention.scaled"
        )
        probs = g.op("Softmax", [scaled], f"{p}.attention.probs", axis=-1)
        ctx = g.op("MatMul", [probs, v], f"{p}.attention.context")
        ctx = g.op(
            "Reshape",
            [g.op("Transpose", [ctx], f"{p}.attention.context_t", perm=[0, 2, 1, 3]), merge],
            f"{p}.attention.merged",
        )
        attn = g.linear(ctx, f"{p}.attention.output", hidden, hidden)
        x = g.layer_norm(g.op("Add", [x, attn], f"{p}.attention.residual"), f"{p}.attention.norm", hidden)
        up = g.gelu(g.linear(x, f"{p}.intermediate", hidden, intermediate), f"{p}.intermediate.gelu")
        down = g.linear(up, f"{p}.output", intermediate, hidden)
        x = g.layer_norm(g.op("Add", [x, down], f"{p}.output.residual"), f"{p}.output.norm", hidden)
    g.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="last_hidden_state"))
    graph = helper.make_graph(
        g.nodes,
        f"bert_{n_layers}x{hidden}",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden])],
        g.inits,
    )
    return _model(graph)


def make_cnn(
    path: str | os.PathLike, channels: tuple[int, ...] = (16, 32, 64), classes: int = 10, seed: int = 0
) -> Path:
    """A small CNN (:func:`float_cnn`) dynamically quantized by onnxruntime: every Conv becomes
    DynamicQuantizeLinear -> ConvInteger."""
    return _quantize_dynamic(float_cnn(channels, classes, seed), Path(path))


def float_cnn(channels: tuple[int, ...] = (16, 32, 64), classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """A small float CNN (3x3 Conv + Relu stages, the later ones strided, global pooling, a linear
    head). Input ``pixels`` float [batch, 3, height, width], output ``logits`` float [batch, classes]."""
    g = _FloatGraph(seed)
    x, c_in = "pixels", 3
    for i, c_out in enumerate(channels):
        w = g.weight(f"conv{i}.weight", (c_out, c_in, 3, 3), (9 * c_in) ** -0.5)
        b = g.const(f"conv{i}.bias", np.zeros(c_out, np.float32))
        stride = 1 if i == 0 else 2
        conv = g.op("Conv", [x, w, b], f"conv{i}.out", pads=[1, 1, 1, 1], strides=[stride, stride])
        x, c_in = g.op("Relu", [conv], f"conv{i}.relu"), c_out
    pooled = g.op("GlobalAveragePool", [x], "pool.out")
    flat = g.op("Flatten", [pooled], "flatten.out", axis=1)
    logits = g.linear(flat, "head", c_in, classes)
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
    graph = helper.make_graph(
        g.nodes,
        "cnn_" + "_".join(map(str, channels)),
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        g.inits,
    )
    return _model(graph)


# ---------------------------------------------------------------------------------------------------
# LLM-sized weight-only 4-bit layers: what verify's per-element MatMulNBits bound is timed on


def make_nbits(
    path: str | os.PathLike, k: int = 2048, n: int = 2048, layers: int = 1, tokens: int = 8, seed: int = 0
) -> Path:
    """``layers`` chained com.microsoft MatMulNBits nodes (K = N, 4 bits, blocks of 32, uint8 zero
    points), as onnxruntime's MatMulNBits quantizer writes them for an LLM's projections. Input
    ``A`` float [1, tokens, k], output the last layer's [1, tokens, n]. Opset 21, IR 10."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "A"
    for i in range(layers):
        width = k if i == 0 else n
        block, blocks = 32, -(-width // 32)
        q = rng.integers(0, 16, (n, blocks, block)).astype(np.uint8)
        zp = rng.integers(0, 16, (n, blocks + blocks % 2)).astype(np.uint8)
        inits += [
            numpy_helper.from_array(q[..., 0::2] | (q[..., 1::2] << 4), f"layer{i}.B"),  # low nibble first
            numpy_helper.from_array(rng.uniform(1e-3, 0.1, (n, blocks)).astype(np.float32), f"layer{i}.scales"),
            numpy_helper.from_array((zp[:, 0::2] | (zp[:, 1::2] << 4)).reshape(-1), f"layer{i}.zero_points"),
        ]
        inputs = [x, f"layer{i}.B", f"layer{i}.scales", f"layer{i}.zero_points"]
        x = f"layer{i}.out"
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                inputs,
                [x],
                name=f"layer{i}",
                domain="com.microsoft",
                K=width,
                N=n,
                bits=4,
                block_size=32,
            )
        )
    graph = helper.make_graph(
        nodes,
        f"nbits_{layers}x{k}x{n}",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, tokens, k])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, tokens, n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name=PRODUCER, ir_version=10)
    onnx.save(model, path)
    return Path(path)


# ---------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate benchmark models.")
    sub = parser.add_subparsers(dest="kind", required=True)
    chain = sub.add_parser("chain", help="a chain of DynamicQuantizeLinear -> MatMulInteger blocks")
    chain.add_argument("--blocks", type=int, default=20_000)
    chain.add_argument("-o", "--output", type=Path, required=True)
    llm = sub.add_parser("llm", help="an LLM-shaped model with big external uint8 weights")
    llm.add_argument("--layers", type=int, default=32)
    llm.add_argument("--weights-gb", type=float, default=4.0, help="total weight bytes / 1e9")
    llm.add_argument("--hidden", type=int, default=None, help="hidden size (multiple of 64); default: from the size")
    llm.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    if args.kind == "chain":
        args.output.parent.mkdir(parents=True, exist_ok=True)
        make_dql_chain(args.blocks, args.output)
        print(
            f"{args.output}: {args.blocks} blocks, {5 * args.blocks} nodes, "
            f"{args.output.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.2f} s"
        )
    else:
        info = make_llm(args.output, args.layers, args.weights_gb, args.hidden)
        print(
            f"{info.model_path}: {info.n_layers} layers, hidden {info.hidden}, intermediate {info.intermediate}, "
            f"{info.n_nodes} nodes, weights {info.weight_bytes / 1e9:.3f} GB in {info.data_path.name}, "
            f"{time.perf_counter() - start:.2f} s"
        )


if __name__ == "__main__":
    main()
