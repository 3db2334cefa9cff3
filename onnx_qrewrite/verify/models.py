"""Both models of a comparison: how each is read, and how each runs.

Read from a file on the fast path, a model is the file's bytes and a wire view of them
(:mod:`onnx_qrewrite.io.wire_model`), and onnx parses it only when a check needs its graph; read
from a ModelProto, or when the fast path cannot give the full path's answer (:class:`NotFast`), it is
parsed up front. As it runs, a model's uint8 x int8 integer ops may be converted
(:mod:`.u8s8_reference`), so :class:`Models` holds each side both ways.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from onnx_qrewrite.errors import InvalidModelError, UsageError
from onnx_qrewrite.progress import stage
from onnx_qrewrite.verify.options import ModelLike, Options
from onnx_qrewrite.verify.session import SessionSettings

if TYPE_CHECKING:
    import onnx

    from onnx_qrewrite.io.wire_model import WireMessage


# --- reading the models: from a file (fast: its bytes and a wire view) or a ModelProto ------------


#: Domains whose ops stock onnxruntime runs: a model importing only these holds no vendor op that
#: would need the reference kernels (a node of an undeclared domain makes onnxruntime refuse it).
_STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})


def _is_proto(model: object) -> bool:
    """Whether ``model`` is an ``onnx.ModelProto`` (without importing onnx: if it is not imported
    yet, nothing can be one)."""
    onnx_module = sys.modules.get("onnx")
    return onnx_module is not None and isinstance(model, onnx_module.ModelProto)


#: Op types (as bytes) of the uint8 x int8 integer ops whose weights verify converts as onnxruntime's
#: session.x64quantprecision does (verify/u8s8_reference.py): their presence needs the parsed model.
_U8S8_OPS = (b"MatMulInteger", b"QLinearMatMul", b"QLinearConv", b"QGemm", b"QAttention", b"DynamicQuantizeMatMul")


def _may_convert(source: Source) -> bool:
    """Whether the model may hold a node whose weights the u8s8 reference converts: one of those
    ops by name in its bytes and an int8 initializer (the weights it converts are int8 constants)."""
    from onnx_qrewrite.io.wire_model import tensors_of

    data = source.data or b""
    if not any(op in data for op in _U8S8_OPS):
        return False
    return source.view is None or any(t.data_type == 3 for t in tensors_of(source.view))  # INT8


class NotFast(Exception):
    """The fast path cannot give this verification's answer as the full path would: run that."""


class Source:
    """One model of the comparison and the label that names it in messages.

    Read by the fast path, it holds the file's bytes (read once) and a wire view of them
    (:mod:`onnx_qrewrite.io.wire_model`): onnxruntime gets the bytes unparsed, and what verify
    reads of the model (inputs, provenance) comes from the view. The ``onnx.ModelProto`` is parsed
    from the same bytes only when something needs the graph itself (bounded rewrites to cut out,
    a difference to localise)."""

    def __init__(
        self,
        label: str,
        *,
        proto: onnx.ModelProto | None = None,
        data: bytes | None = None,
        view: WireMessage | None = None,
        path: Path | None = None,
        file_id: tuple[int, int] = (0, 0),
    ) -> None:
        self.label = label
        self.data = data
        self.view = view
        self._proto = proto
        self._path = path
        self._file_id = file_id

    @property
    def fast(self) -> bool:
        return self.data is not None

    @property
    def proto(self) -> onnx.ModelProto:
        """The parsed model (parsed now from the bytes already read, if it was not yet)."""
        if self._proto is None:
            from onnx_qrewrite.io import model_io

            assert self.data is not None and self._path is not None
            loaded = model_io.open_model_bytes(self.data, self._file_id, self._path, check=False)
            if loaded.external is not None:  # not on the fast path (it refuses external data)
                with loaded.external:
                    loaded.external.load_into(loaded.proto)
            self._proto = loaded.proto
        return self._proto

    @property
    def readable(self) -> Any:
        """What readers of a few fields get: the wire view, else the ModelProto (same spelling)."""
        return self.view if self.view is not None else self.proto

    @property
    def runnable(self) -> onnx.ModelProto | bytes:
        """What onnxruntime gets: the file's bytes, else the ModelProto."""
        return self.data if self.data is not None else self.proto


def load_full(model: ModelLike, side: str) -> Source:
    """The model with its external data in memory, and the label that names it in messages."""
    if _is_proto(model):
        return Source(f"<{side} ModelProto>", proto=model)  # type: ignore[arg-type]
    if not isinstance(model, (str, os.PathLike)):
        raise UsageError(f"{side}: expected a path or an onnx.ModelProto, got {type(model).__name__}")
    from onnx_qrewrite.io import model_io

    path = Path(model)
    loaded = model_io.open_model(path, check=False)  # external data opened and checked, read once
    if loaded.external is not None:
        with loaded.external:
            loaded.external.load_into(loaded.proto)
    return Source(str(path), proto=loaded.proto)


def load_fast(model: ModelLike, side: str) -> Source:
    """The model file's bytes and a wire view of them; :class:`NotFast` unless the bytes can go
    to onnxruntime as they are (a file, no external data, a model the view reads)."""
    if not isinstance(model, (str, os.PathLike)):
        raise NotFast(f"{side}: not a path")
    from onnx_qrewrite.io.model_file import read_once
    from onnx_qrewrite.io.wire_model import WireError, read_model, tensors_of

    path = Path(model)
    data, file_id = read_once(path)  # the same checks and messages as the full path's read
    try:
        view = read_model(data)
        if view.ir_version == 0 or not view.HasField("graph"):
            raise NotFast(f"{side}: no IR version or graph")  # the full path says what is wrong
        # Every external tensor names its file under the key "location": bytes without that
        # string cannot make onnxruntime read another file (a tensor marked external without
        # one makes it refuse the model, and the full path then reports it).
        if b"location" in data and any(t.data_location == 1 for t in tensors_of(view)):
            raise NotFast(f"{side}: external data")
    except WireError as exc:
        raise NotFast(f"{side}: {exc}") from None
    return Source(str(path), data=data, view=view, path=path, file_id=file_id)


def _vendor_free(view: WireMessage) -> bool:
    """Whether the model can hold no vendor op the reference kernels would run: it imports only
    standard domains and has no local function."""
    return not view.functions and all(o.domain in _STANDARD_DOMAINS for o in view.opset_import)


def provenance_key_absent(source: Source, key: str) -> bool:
    """Whether no node of the model can carry the metadata entry ``key``: its bytes do not hold the
    key's string at all (an exact test, and a search in C instead of a walk over every node)."""
    return source.data is not None and key.encode() not in source.data


class Models(NamedTuple):
    """Both models as read (what the report names and the checks read) and as they run (the
    uint8 x int8 integer ops of either side may run converted, see :func:`_as_run`)."""

    original: Source
    rewritten: Source
    reference: Source  # the original as it runs
    rewritten_run: Source  # the rewritten model as it runs
    vendor_nodes: int
    u8s8_nodes: int
    reference_kernels: bool  # the original's vendor nodes run on the numpy reference kernels


def load_models(original: ModelLike, rewritten: ModelLike, options: Options, *, fast: bool) -> Models:
    """Read both models (``fast``: their bytes, see :func:`load_fast`) and decide how each runs."""
    with stage(options.progress, "loading models"):
        load = load_fast if fast else load_full
        original_src = load(original, "original")
        rewritten_src = load(rewritten, "rewritten")
    vendor_nodes = _count_vendor_nodes(original_src, options.session, fast=fast)
    reference_kernels = options.session.custom_op_library is None and vendor_nodes > 0
    if fast and any(_may_convert(src) for src in (original_src, rewritten_src)):
        raise NotFast("the models may hold uint8 x int8 integer ops with int8 weights")
    reference, rewritten_run, u8s8_nodes = original_src, rewritten_src, 0
    if not fast:
        reference, rewritten_run, u8s8_nodes = _as_run(original_src, rewritten_src, options.runtime)
    return Models(original_src, rewritten_src, reference, rewritten_run, vendor_nodes, u8s8_nodes, reference_kernels)


def _count_vendor_nodes(source: Source, session: SessionSettings, *, fast: bool) -> int:
    """How many of the original's nodes are vendor ops (that the reference kernels run unless the
    vendor's library is given). The fast path only serves models that can hold none."""
    if fast:
        if not _vendor_free(source.view):  # type: ignore[arg-type]
            raise NotFast("the original may hold vendor ops")
        return 0
    from onnx_qrewrite.verify.reference_ops import find_vendor_nodes

    try:
        return len(find_vendor_nodes(source.proto))
    except InvalidModelError as exc:
        if session.custom_op_library is None:
            raise InvalidModelError(f"{source.label}: {exc}") from None
        return 0


def _as_run(original: Source, rewritten: Source, runtime: str) -> tuple[Source, Source, int]:
    """The original and the rewritten model as they run, and how many of the original's nodes changed.

    uint8 x int8 integer ops run as onnxruntime's session.x64quantprecision runs them, on both
    sides (.u8s8_reference): the outputs are compared with the ONNX definition, and each bounded
    replacement of such a node is checked against the default, saturating kernel at its node
    (check_bounds, on the models as they are). Another runtime runs the rewritten model as it is."""
    from onnx_qrewrite.verify.u8s8_reference import without_saturation

    reference, u8s8_nodes = without_saturation(original.proto)
    reference_src = Source(original.label, proto=reference) if u8s8_nodes else original
    rewritten_run = rewritten
    if runtime == "onnxruntime":
        as_run, changed = without_saturation(rewritten.proto)
        rewritten_run = Source(rewritten.label, proto=as_run) if changed else rewritten
    return reference_src, rewritten_run, u8s8_nodes
