"""Generated values for the inputs that give onnxruntime's attention kernels their lengths.

Random integers cannot feed these: com.microsoft GroupQueryAttention refuses a
total_sequence_length of 0 and reads a seqlens_k that disagrees with the past and present
buffers out of bounds, and MultiHeadAttention's past_sequence_length must leave room for the new
keys in its buffer. Each such input is found in the graph and generated consistent with the
shapes of the sample, from its own random stream of ``--seed`` (deterministic):

GroupQueryAttention(query (B, S, .), past_key (B, Nkv, P, H), seqlens_k, total_sequence_length),
P = 0 without a past: the call is a token step or a subsequent prompt when P > 0 and S = 1 or
B = 1 (total_sequence_length T = P + S, every entry's length ``total_b`` in [S, T]: its past
``total_b - S`` fits the buffer), else a first prompt (T = S, ``total_b`` in [1, S]: padded
entries). ``seqlens_k[b] = total_b - 1``. The first sample has every entry at T (every key
written, so values verify cannot compare where keys are unwritten are compared there); every
other sample has uneven lengths: the first entry at T (T is the longest, as onnxruntime-genai
sets it) and the second below T (a single entry: below T), the rest drawn in the range. Found:

- seqlens_k and total_sequence_length as graph inputs, or reached from one through Cast,
  Identity, Reshape, Squeeze, Unsqueeze or Flatten;
- computed from a 2-D attention mask graph input as onnxruntime-genai's model builder and
  onnxscript's GQA fusion write them: seqlens_k = ReduceSum(mask, axis 1) - 1 and total_sequence_length =
  Shape(mask)[1] (each through the ops above): the mask is generated as each entry's ``total_b``
  ones then zeros, and its second dimension is T unless ``--input-shape`` fixes it (then T is
  that, and the lengths are kept within what the buffers allow).

Not found (those inputs keep the defaults, and a warning names the node): other computations,
and a query whose sequence dimension is not recorded (``onnx.shape_inference`` records it). Not
adjusted: attention_bias and rotary caches, whose shapes must agree with T (give them with
``--input-shape``).

MultiHeadAttention's past_sequence_length (input 8, the past and present sharing a buffer of M
positions, L new keys), a graph input or reached through the ops above: the first sample M - L
(the buffer's end), the others drawn in [0, M - L].

A 1-D key_padding_mask of MultiHeadAttention or mask_index of Attention (a graph input, or through
the ops above) holds key lengths, which the integer default {0, 1} would keep at most one key
long: each entry's length in [1, T], T = past + new keys (all T on the first sample); of 2B values
(Attention) the second B are start positions (0 on the first sample, half the length on the
others); of 3B + 2 (MultiHeadAttention reads the first B) the rest are 0. 2-D and 3-D masks keep
the default {0, 1}: any such mask is valid.

An input named by ``--val-range NAME:[LO,HI]`` keeps that range; a bare ``--val-range`` or
``--int-range`` does not apply to these inputs.

The heads of GroupQueryAttention's past_key/past_value graph inputs (B, Nkv, P, H) admit one
value each, which the kernel checks: a symbolic dimension there (onnxruntime-genai's builder names
the head size ``kv_cache_dim``) is given kv_num_heads, and H = the query's hidden size / num_heads
(of a packed QKV query: / (num_heads + 2·kv_num_heads)), where the query's last dimension is
recorded (:func:`head_dims`); ``--input-shape DIM=N`` or a shape for the whole input wins.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from onnx_qrewrite import _onnx  # verify's console path does not import onnx (tests/test_startup.py)
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.verify.inputs import GenerationOptions, InputSpec, ValueRange, resolve_shape

if TYPE_CHECKING:
    import onnx

__all__ = ["LengthInputs", "head_dims", "length_inputs"]

logger = logging.getLogger(__name__)

#: Ops that pass an integer tensor's values through unchanged, reshaped or retyped.
_PASS_THROUGH = frozenset({"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
#: Seeds the lengths' own generator beside ``--seed`` (the other inputs' draws stay as they were).
_STREAM = 0x6C656E73


@dataclass(frozen=True)
class _Lengths:
    """One attention node's lengths: batch, the longest length T, the range of the others."""

    batch: int
    total: int  # total_sequence_length (MultiHeadAttention: the buffer's room, M - L)
    high: int  # the longest length (T, or less where the buffers allow less)
    low: int
    what: str = dataclasses.field(compare=False)


@dataclass(frozen=True)
class _Feed:
    """A graph input and how its value follows from the node's lengths."""

    name: str
    form: str  # "seqlens" (total_b - 1), "total" (T), "mask" (total_b ones, then zeros), "past", "keys"
    lengths: _Lengths
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LengthInputs:
    """The inputs generated from attention lengths: their shapes (a mask's T), ranges (for the
    report) and values, sample by sample (:meth:`feeds`)."""

    feeds_of: tuple[_Feed, ...]
    seed: int

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {f.name: f.shape for f in self.feeds_of}

    @property
    def ranges(self) -> dict[str, ValueRange]:
        ranges = {}
        for f in self.feeds_of:
            lo, hi = (0, 1) if f.form == "mask" else (f.lengths.low, f.lengths.high)
            lo, hi = (f.lengths.total, f.lengths.total) if f.form == "total" else (lo, hi)
            shift = 1 if f.form == "seqlens" else 0
            ranges[f.name] = ValueRange(lo - shift, hi - shift, f"{_WHY[f.form]} of {f.lengths.what}")
        return ranges

    def feeds(self, index: int) -> dict[str, np.ndarray]:
        """The values of sample ``index`` (0: every length T; else uneven)."""
        rng = np.random.default_rng([self.seed, _STREAM, index])
        drawn: dict[_Lengths, np.ndarray] = {}
        out = {}
        for f in self.feeds_of:
            if f.lengths not in drawn:
                drawn[f.lengths] = _draw(f.lengths, index, rng)
            out[f.name] = _value(f, drawn[f.lengths], index)
        return out


_WHY = {
    "seqlens": "seqlens_k (each entry's length - 1)",
    "total": "total_sequence_length",
    "mask": "attention mask (each entry's length in ones, then zeros)",
    "past": "past_sequence_length (room for the new keys in the buffer)",
    "keys": "key lengths (1-D mask)",
}


def _draw(lengths: _Lengths, index: int, rng: np.random.Generator) -> np.ndarray:
    """Each entry's length: all T on sample 0; else uneven (see the module docstring)."""
    top, low = lengths.high, lengths.low
    values = np.full(lengths.batch, top, np.int64)
    if index == 0 or low >= top:
        return values
    values[:] = rng.integers(low, top, size=lengths.batch, endpoint=True)
    first_short = 1 if lengths.batch > 1 else 0
    values[0] = top if lengths.batch > 1 else values[0]
    values[first_short] = rng.integers(low, top - 1, endpoint=True)
    return values


def _value(feed: _Feed, lengths: np.ndarray, index: int) -> np.ndarray:
    if feed.form == "keys":
        rest = feed.shape[0] - lengths.size  # 2B: start positions; 3B + 2: not read
        starts = lengths // 2 if index and rest == lengths.size else np.zeros(rest, np.int64)
        return np.concatenate([lengths, starts]).astype(feed.dtype)
    if feed.form == "total":
        return np.full(feed.shape, feed.lengths.total, feed.dtype)
    if feed.form == "past":
        return np.full(feed.shape, lengths[0], feed.dtype)
    if feed.form == "seqlens":
        return (lengths - 1).reshape(feed.shape).astype(feed.dtype)
    return (np.arange(feed.shape[1]) < lengths[:, None]).astype(feed.dtype)


class _Graph:
    """The main graph's producers, constants and inputs, for walking back from a node's input."""

    def __init__(self, model: onnx.ModelProto, specs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]]):
        self.producer = {o: n for n in model.graph.node for o in n.output if o}
        self.constants = {t.name: t for t in model.graph.initializer}
        self.specs = {s.name: s for s in specs}
        self.shapes = shapes
        self.symbols = {
            d: n
            for s in specs
            for d, n in zip(s.dims or (), shapes.get(s.name, ()), strict=False)
            if isinstance(d, str)
        }
        self.recorded = {
            v.name: v.type.tensor_type.shape
            for v in [*model.graph.value_info, *model.graph.output]
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
        }

    def back(self, name: str) -> str:
        """``name`` walked back through :data:`_PASS_THROUGH` to the value they start from."""
        while (node := self.producer.get(name)) is not None and node.domain in ("", "ai.onnx"):
            if node.op_type not in _PASS_THROUGH:
                break
            name = node.input[0]
        return name

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.constants:
            return _onnx.numpy_helper.to_array(self.constants[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return next((_onnx.numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), None)
        return None

    def dims(self, name: str) -> tuple[int, ...] | None:
        """The sample's shape of ``name``: a graph input's as generated, else as recorded with its
        symbols at the inputs' values; None when a dimension is not known."""
        if name in self.shapes:
            return self.shapes[name]
        shape = self.recorded.get(name)
        if shape is None:
            return None
        dims = []
        for d in shape.dim:
            value = d.dim_value if d.HasField("dim_value") else self.symbols.get(d.dim_param)
            if not value:
                return None
            dims.append(value)
        return tuple(dims)

    def op(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _mask_of_seqlens(graph: _Graph, name: str) -> str | None:
    """The 2-D mask input of ``seqlens_k = ReduceSum(mask, axis 1) - 1`` (through :data:`_PASS_THROUGH`)."""
    sub = graph.op(graph.back(name), "Sub")
    one = graph.constant(sub.input[1]) if sub is not None else None
    if sub is None or one is None or one.size != 1 or one.reshape(-1)[0] != 1:
        return None
    reduce = graph.op(graph.back(sub.input[0]), "ReduceSum")
    if reduce is None:
        return None
    axes = graph.constant(reduce.input[1]) if len(reduce.input) > 1 and reduce.input[1] else None
    if axes is None:
        axes = next((np.array(a.ints) for a in reduce.attribute if a.name == "axes"), None)
    mask = graph.back(reduce.input[0])
    if axes is None or axes.reshape(-1).tolist() not in ([1], [-1]) or len(graph.shapes.get(mask, ())) != 2:
        return None
    return mask


def _mask_of_total(graph: _Graph, name: str) -> str | None:
    """The input whose dimension 1 is ``total_sequence_length = Shape(mask)[1]`` (through :data:`_PASS_THROUGH`)."""
    gather = graph.op(graph.back(name), "Gather")
    at = graph.constant(gather.input[1]) if gather is not None else None
    shape = graph.op(gather.input[0], "Shape") if gather is not None else None
    if at is None or shape is None or at.size != 1 or at.reshape(-1)[0] != 1 or len(shape.attribute):
        return None
    mask = graph.back(shape.input[0])
    return mask if len(graph.shapes.get(mask, ())) == 2 else None


def _fixed_width(graph: _Graph, mask: str, options: GenerationOptions) -> bool:
    """Whether the mask's dimension 1 is fixed: declared, or given by ``--input-shape``."""
    declared = (graph.specs[mask].dims or (None, None))[1]
    return mask in options.shapes or (isinstance(declared, int) and declared > 0) or declared in options.dims


def _gqa_lengths(graph: _Graph, node: onnx.NodeProto, width: int | None) -> _Lengths | str:
    """The node's lengths, T fixed at ``width`` when given (a mask's fixed width), or why none."""
    query = graph.dims(node.input[0])
    if query is None or len(query) != 3:
        return f"the shape of its query {node.input[0]!r} is not recorded"
    batch, seq = query[0], query[1]
    past = 0
    if len(node.input) > 3 and node.input[3]:
        past_dims = graph.dims(node.input[3])
        if past_dims is None or len(past_dims) != 4:
            return f"the shape of its past_key {node.input[3]!r} is not recorded"
        past = past_dims[2]
    what = f"GroupQueryAttention {node.name or node.output[0]!r}"
    steps = past > 0 and (seq == 1 or batch == 1)  # a token step or a subsequent prompt
    total = width if width is not None else past + seq if steps else seq
    if width is None and past > 0 and not steps and seq > past:
        # A batched prompt after a past: onnxruntime's kernel reads T = S <= P as a static cache and
        # refuses T = S > P (review 5 R7); nothing it runs fits these shapes.
        raise UsageError(
            f"--input-shape: {what} would get a batch of {batch} prompts of {seq} tokens after {past} past "
            "positions, which onnxruntime runs only as a first prompt (no past) or within a static cache "
            "(sequence <= past): choose shapes it runs, or pass --inputs"
        )
    if total == seq:
        return _Lengths(batch, total, total, 1, what)  # a first prompt: padded entries down to 1
    if (seq == 1 or batch == 1) and seq < total:
        return _Lengths(batch, total, min(total, past + seq), seq, what)
    return f"a total_sequence_length of {total} fits neither a first prompt nor a step of {seq} queries"


def _gqa_feeds(graph: _Graph, node: onnx.NodeProto, options: GenerationOptions) -> list[_Feed] | str:
    """The inputs of a GroupQueryAttention node's seqlens_k and total_sequence_length, or why none."""
    if len(node.input) < 7 or not node.input[5] or not node.input[6]:
        return "it has no seqlens_k or total_sequence_length"
    seqlens, total = graph.back(node.input[5]), graph.back(node.input[6])
    masks = [m for m in (_mask_of_seqlens(graph, node.input[5]), _mask_of_total(graph, node.input[6])) if m]
    if len(set(masks)) > 1:
        return "its seqlens_k and total_sequence_length come from different masks"
    mask = masks[0] if masks else None
    if mask is None and not (seqlens in graph.shapes and total in graph.shapes):
        return "its seqlens_k or total_sequence_length is computed otherwise than from a mask or an input"
    width = graph.shapes[mask][1] if mask and _fixed_width(graph, mask, options) else None
    lengths = _gqa_lengths(graph, node, width)
    if isinstance(lengths, str):
        return lengths
    feeds = []
    if mask is not None:
        shape = (graph.shapes[mask][0], lengths.total)
        if shape[0] != lengths.batch:
            return f"its mask {mask!r} has {shape[0]} entries for a batch of {lengths.batch}"
        feeds.append(_Feed(mask, "mask", lengths, graph.specs[mask].dtype, shape))
    for name, form, size in ((seqlens, "seqlens", lengths.batch), (total, "total", 1)):
        if name in graph.shapes and name != mask:
            if int(np.prod(graph.shapes[name])) != size:
                return f"its input {name!r} has shape {list(graph.shapes[name])}, not {size} value(s)"
            feeds.append(_Feed(name, form, lengths, graph.specs[name].dtype, graph.shapes[name]))
    return feeds


def _mha_feeds(graph: _Graph, node: onnx.NodeProto) -> list[_Feed] | str:
    """MultiHeadAttention's past_sequence_length input (input 8), or why none."""
    length = graph.back(node.input[8])
    if length not in graph.shapes:
        return "its past_sequence_length is computed"
    past = graph.dims(node.input[6]) if len(node.input) > 6 and node.input[6] else None
    key = graph.dims(node.input[1]) if node.input[1] else None
    if past is None or key is None or len(past) != 4 or len(key) != 3:
        return "the shapes of its past_key and 3-D key are not recorded"
    room = past[2] - key[1]
    if room < 0:
        return f"its buffer of {past[2]} positions has no room for {key[1]} new keys"
    what = f"MultiHeadAttention {node.name or node.output[0]!r}"
    lengths = _Lengths(1, room, room, 0, what)
    return [_Feed(length, "past", lengths, graph.specs[length].dtype, graph.shapes[length])]


def _key_lengths(graph: _Graph, node: onnx.NodeProto) -> list[_Feed] | str | None:
    """A 1-D key_padding_mask (MultiHeadAttention) or mask_index (Attention) input as key lengths,
    or why not (None: the node has no 1-D mask)."""
    index = 4 if node.op_type == "MultiHeadAttention" else 3
    mask = graph.back(node.input[index]) if len(node.input) > index and node.input[index] else ""
    if len(graph.shapes.get(mask, ())) != 1:
        return None
    query = graph.dims(node.input[0])
    if node.op_type == "MultiHeadAttention":
        key = graph.dims(node.input[1]) if node.input[1] else None
        past = graph.dims(node.input[6]) if len(node.input) > 6 and node.input[6] else ()
        new = key[-2] if key is not None and len(key) == 4 else key[1] if key is not None and len(key) == 3 else None
        before = past[2] if past and len(past) == 4 and not (len(node.input) > 8 and node.input[8]) else 0
    else:
        past = graph.dims(node.input[4]) if len(node.input) > 4 and node.input[4] else ()
        new = query[1] if query is not None and len(query) == 3 else None
        before = past[3] if past and len(past) == 5 else 0
    if query is None or new is None or past is None:
        return "the shapes of its query and keys are not recorded"
    size, batch = graph.shapes[mask][0], query[0]
    if size not in (batch, 2 * batch, 3 * batch + 2):
        return f"its 1-D mask {mask!r} has {size} values for a batch of {batch}"
    what = f"{node.op_type} {node.name or node.output[0]!r}"
    lengths = _Lengths(batch, before + new, before + new, 1, what)
    return [_Feed(mask, "keys", lengths, graph.specs[mask].dtype, graph.shapes[mask])]


def _node_feeds(graph: _Graph, node: onnx.NodeProto, options: GenerationOptions) -> list[list[_Feed] | str]:
    """The length inputs of one com.microsoft node, or why not, for each kind it has."""
    if node.op_type == "GroupQueryAttention":
        return [_gqa_feeds(graph, node, options)]
    found: list[list[_Feed] | str] = []
    keys = _key_lengths(graph, node) if node.op_type in ("MultiHeadAttention", "Attention") else None
    if keys is not None:
        found.append(keys)
    if node.op_type == "MultiHeadAttention" and len(node.input) > 8 and node.input[8]:
        found.append(_mha_feeds(graph, node))
    return found


def length_inputs(
    model: onnx.ModelProto, specs: Sequence[InputSpec], options: GenerationOptions
) -> LengthInputs | None:
    """The attention length inputs of ``model`` and how to generate them (None: it has none).

    A node whose lengths cannot be found is logged (its inputs keep the default ranges); inputs
    named by ``--val-range NAME:`` are left to that range."""
    shapes = {}
    for spec in specs:
        if spec.dims is not None or spec.name in options.shapes:
            shapes[spec.name] = resolve_shape(spec, options.shapes, options.dims)
    graph = _Graph(model, specs, shapes)
    found: dict[str, _Feed] = {}
    for node in model.graph.node:
        for feeds in _node_feeds(graph, node, options) if node.domain == "com.microsoft" else ():
            if isinstance(feeds, str):
                logger.warning(
                    "verify: %s %r: %s; its length inputs are generated as other inputs (pass --inputs if it fails)",
                    node.op_type,
                    node.name or node.output[0],
                    feeds,
                )
                continue
            for feed in feeds:
                if feed.name not in options.value_ranges:
                    found.setdefault(feed.name, feed)
    return LengthInputs(tuple(found.values()), options.seed) if found else None


def _hidden_size(model: onnx.ModelProto, name: str) -> int | None:
    """The last dimension of the 3-D value ``name`` where the model records it as a number."""
    graph = model.graph
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.name == name and value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            dims = value.type.tensor_type.shape.dim
            return dims[2].dim_value if len(dims) == 3 and dims[2].HasField("dim_value") else None
    return None


def _heads(model: onnx.ModelProto, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(kv_num_heads, head size) of a GroupQueryAttention node with a past, from its query."""
    if node.op_type != "GroupQueryAttention" or len(node.input) < 5:
        return None
    attrs = {a.name: a.i for a in node.attribute}
    heads, kv_heads = attrs.get("num_heads", 0), attrs.get("kv_num_heads", 0)
    split = heads + 2 * kv_heads if not node.input[1] else heads  # packed QKV: query (B, S, (N + 2·Nkv)·H)
    hidden = _hidden_size(model, node.input[0])
    if not hidden or split <= 0 or hidden % split:
        return None
    return kv_heads, hidden // split


def head_dims(model: onnx.ModelProto, specs: Sequence[InputSpec], options: GenerationOptions) -> dict[str, int]:
    """The symbolic dimensions of GroupQueryAttention past_key/past_value graph inputs that one value fits
    (their heads and head size: the module docstring), unless ``options`` gives them; a symbol
    two nodes would give different values is left out (and named in a warning)."""
    by_name = {s.name: s for s in specs}
    found: dict[str, int] = {}
    clashing: set[str] = set()
    for node in model.graph.node:
        heads = _heads(model, node) if node.domain == "com.microsoft" else None
        if heads is None:
            continue
        kv_heads, size = heads
        for index in (3, 4):
            spec = by_name.get(node.input[index]) if len(node.input) > index else None
            if spec is None or spec.name in options.shapes or spec.dims is None or len(spec.dims) != 4:
                continue
            for dim, value in ((spec.dims[1], kv_heads), (spec.dims[3], size)):
                if not isinstance(dim, str) or dim in options.dims or value <= 0:
                    continue
                if found.setdefault(dim, value) != value:
                    clashing.add(dim)
    for dim in sorted(clashing):
        logger.warning(
            "verify: attention inputs need different values of dimension %r; give it with --input-shape", dim
        )
        del found[dim]
    return found
