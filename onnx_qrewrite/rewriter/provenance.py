"""Where a rewritten node came from: which rule made it, replacing which node.

Three modes (``rewrite(..., provenance=...)``, ``--provenance``):

``compact`` (default)
    The first node of each replacement carries two ``metadata_props`` entries,
    ``onnx_qrewrite.rule`` and ``onnx_qrewrite.origin`` (the replaced node's name); the other nodes
    of that replacement carry none. They are recognisable without it: a replacement's nodes are
    contiguous in the node list (each takes its original's place) and every created name starts
    with ``<prefix>/``, the prefix being the replaced node's name or its first output, whichever is shorter. Two
    metadata strings on every created node were over half of a rewritten model's node bytes.
``full``
    Both entries on every created node (what 0.1.0 wrote).
``none``
    No node metadata; only the JSON report (``--report``) says what replaced what.

The rewritten model records the mode in its own ``metadata_props`` (``onnx_qrewrite.provenance``)
so a reader such as the verifier's localiser knows whether an absent entry means "same rewrite as
the node above" or "not recorded". The JSON report always keeps the full mapping (every created
node name, per rewrite).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = [
    "BOUND_KEY",
    "DEFAULT_MODE",
    "EXACTNESS_KEY",
    "MODES",
    "MODE_KEY",
    "ORIGIN_KEY",
    "RULE_KEY",
    "SUPERSEDED_KEY",
    "attribute_nodes",
    "check_mode",
    "model_mode",
]

RULE_KEY = "onnx_qrewrite.rule"
ORIGIN_KEY = "onnx_qrewrite.origin"
MODE_KEY = "onnx_qrewrite.provenance"
#: On a replacement's first node, beside the rule: the rule's exactness and, when bounded, the
#: bound (written by the Emitter; read by the verifier, which must not import the builders).
EXACTNESS_KEY = "onnx_qrewrite.exactness"
BOUND_KEY = "onnx_qrewrite.bound"
#: On the first node of a later pass's inexact replacement of a node that an earlier bounded
#: replacement made: "<rule>\t<origin>" of that earlier one, whose bound no longer describes the
#: model's nodes (the verifier reports it unchecked instead of checking it, or saying nothing).
SUPERSEDED_KEY = "onnx_qrewrite.supersedes_bound"
MODES = ("compact", "full", "none")
DEFAULT_MODE = "compact"


# Read-only members: protobuf messages and onnx_ir objects both satisfy them (a plain attribute
# would be invariant, and a protobuf repeated field is not assignable as an Iterable).
class _Entry(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def value(self) -> str: ...


class _Node(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def metadata_props(self) -> Iterable[_Entry]: ...


class _Model(Protocol):
    @property
    def metadata_props(self) -> Iterable[_Entry]: ...


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`; a usage error naming the option otherwise."""
    if mode not in MODES:
        from onnx_qrewrite.errors import UsageError

        raise UsageError(f"--provenance {mode}: must be one of {', '.join(MODES)}")
    return mode


def model_mode(model: _Model) -> str | None:
    """The provenance mode a rewritten model was written with (None: not written by a rewrite that
    recorded it; per-node metadata, where present, is then read as ``full``)."""
    for entry in model.metadata_props:
        if entry.key == MODE_KEY:
            return entry.value
    return None


def attribute_nodes(nodes: Iterable[_Node]) -> list[tuple[str, str] | None]:
    """(rule, origin) for each node of one node list, in order; None for a node no rewrite made
    (or whose provenance was not recorded).

    A node with the entries starts a replacement; the nodes after it that carry no entries and
    whose names start with the same ``<prefix>/`` belong to it (compact mode). The prefix is the
    first node's name up to its last ``/``: created names are ``<prefix>/<hint>`` with hints that
    hold no ``/``.
    """
    out: list[tuple[str, str] | None] = []
    current: tuple[str, str] | None = None
    prefix = ""
    for node in nodes:
        meta = {e.key: e.value for e in node.metadata_props if e.key in (RULE_KEY, ORIGIN_KEY)}
        if RULE_KEY in meta:
            current = (meta[RULE_KEY], meta.get(ORIGIN_KEY, ""))
            head, sep, _ = node.name.rpartition("/")
            prefix = head + sep if sep else ""
            out.append(current)
        elif current is not None and prefix and node.name.startswith(prefix):
            out.append(current)
        else:
            current = None
            out.append(None)
    return out
