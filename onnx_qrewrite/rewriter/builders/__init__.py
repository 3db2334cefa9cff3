"""Mechanism: how a replacement is built. Policy (which rule uses which builder, for which dtypes
and opsets) lives in the rule files under ``rules/``.

A builder is a small object with a :class:`~onnx_qrewrite.rewriter.contract.Contract` (its options, what
it emits, its outputs, exactness and opset: see :mod:`onnx_qrewrite.rewriter.contract`) and three methods,
in the spirit of onnxscript's rewrite rules:

``quantized_dtype(site)``
    The dtype a rule's ``when.dtypes`` condition is checked against (None: unknown).
``check(site, options) -> Plan``
    ``options`` are the rule's, validated against the contract with defaults filled in.
    Decides whether it can rewrite this node and what it needs (for example a minimum
    default-domain opset). Raises :class:`NoMatch` with a reason when it cannot: the engine then
    tries the next rule and reports the reason if none fits.
``build(site, emit, options, plan)``
    Emits the replacement nodes through an :class:`Emitter`. Must write the original node's output
    names, so nothing downstream changes.

A builder may set ``memo_check = True`` when its ``check`` (and ``quantized_dtype``) read the
graph only through the Site's queries (``inputs``, ``outputs``, ``elem_type``, ``constant``,
``value_shape``, ``producer_op``, ``producer_input``, ``scope_memo``...) and keep no name of the
node in the plan: the engine then decides each node structure once (``_facts.py``), and a check
that reads anything else is simply run for every node, as without it. Such a builder may also set
``template_key_of_structure = True`` when its ``template_key`` reads only the rule's options, the
plan, the scope's default opset and what ``_facts.structure_of`` keys on (op, domain, attributes,
which names are empty or equal): the build then makes the key once per structure and plan
(``apply._template_of``) instead of once per node.

Builders register themselves by name with :func:`register`; rule files refer to that name.
Built-in builders declare their contracts in :mod:`onnx_qrewrite.rewriter.builders.contracts`, which imports
neither onnx nor numpy: the catalogue validates rules against them without importing any builder's
code, and a builder's module is imported the first time :func:`get_builder` asks for it (on first
use, when a rule is applied). :class:`Site`, :class:`Emitter` and :class:`ConstantPool` live in
``_emit`` (they need onnx) and load on first access.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, MODULES
from onnx_qrewrite.rewriter.contract import Contract

if TYPE_CHECKING:
    from onnx_qrewrite.rewriter.builders._emit import ConstantPool, Emitter, Site

__all__ = [
    "Builder",
    "ConstantPool",
    "Emitter",
    "NoMatch",
    "NotApplicable",
    "Plan",
    "Site",
    "builder_names",
    "contract_of",
    "get_builder",
    "register",
]


class NoMatch(Exception):
    """The builder cannot rewrite this node; the message says why (shown as a near miss)."""


class NotApplicable(NoMatch):
    """The rule does not apply here and the node is fine as it is: a standard-domain node that
    every candidate rule declines this way (a named form's rules, e.g. float emulation of
    QuantizeLinear) stays in place without an error or a warning."""


#: Distinct notes tuples, each kept once (see :meth:`Plan.__post_init__`); cleared when this many.
_NOTES_MAX = 4096
_NOTES: dict[tuple[str, ...], tuple[str, ...]] = {}


@dataclass(frozen=True, slots=True)
class Plan:
    """What a builder needs to rewrite one node.

    Slotted, and its notes shared between equal plans: a plan is kept for every matched node
    until its replacement is built (and its notes in the report to the end), and on a 100k-node
    chain 20k plans with a dict each and their own copies of the same two notes were ~10 MB of
    the rewrite's peak memory."""

    #: Lowest default-domain opset the emitted ops need (0: whatever the model has).
    min_opset: int = 0
    #: Free-form notes shown in reports (for example "per-axis, axis=0 (Quark kernel default)").
    notes: tuple[str, ...] = ()
    #: Anything ``check`` worked out that ``build`` reuses.
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Bounded rewrites: the largest absolute difference from the original op allowed at this
    #: node's outputs, in the outputs' units (recorded in the created nodes' metadata; ``verify``
    #: checks it there). None for exact rewrites.
    bound: float | None = None
    #: A bound that grows with the data (float32 accumulation of products of a run-time
    #: activation): ``(value, per_unit)`` adds ``per_unit * max|value|`` to ``bound`` at this node,
    #: ``value`` being a value of the original model (e.g. the float input of a dynamic
    #: quantization). Recorded and checked with ``bound``.
    bound_scale: tuple[str, float] | None = None
    #: Bounded rewrites whose bound varies per element: the name of a formula ``verify`` evaluates
    #: per element of the outputs from the original node and the values it reads
    #: (:mod:`onnx_qrewrite.verify.element_bounds`); recorded in the metadata beside ``bound``
    #: (then the largest value it can take, where that does not depend on the inputs). None:
    #: ``bound`` everywhere.
    bound_formula: str | None = None
    #: The part of ``bound`` (in its units) that only onnxruntime's int16 pair saturation of uint8 x
    #: int8 products can use (x86 CPUs without VNNI, :mod:`onnx_qrewrite.rewriter.u8s8`).
    #: Recorded beside the bound; ``verify`` leaves it out where it measures that this CPU's
    #: kernel does not saturate, so the bound there is the one of the rewrite's own arithmetic.
    bound_u8s8: float = 0.0
    #: The values the replacement reads, when they are not (a subset of) the node's own inputs:
    #: e.g. a pattern anchored at its last node that reads the pattern's float input instead.
    #: None: the node's inputs. Used to decide which ``remove_if_dead`` nodes are dead.
    reads: frozenset[str] | None = None
    #: The rewrite removes the node (emits nothing), which is valid only if nothing reads its
    #: outputs once every other node's rewrite is decided (the neighbours of a multi-node pattern
    #: that its anchor's rewrite no longer reads). The engine decides that after matching the
    #: whole scope; a node something still reads goes on to its next candidate rule.
    remove_if_dead: bool = False

    def __post_init__(self) -> None:
        notes = _NOTES.get(self.notes)
        if notes is None:
            if len(_NOTES) >= _NOTES_MAX:  # notes with per-node values: keep the table small
                _NOTES.clear()
            notes = _NOTES[self.notes] = self.notes
        object.__setattr__(self, "notes", notes)


class Builder(Protocol):
    """What the engine calls to rewrite one node (its three methods: see this module's docstring);
    instances register with :func:`register`."""

    name: str
    contract: Contract

    def quantized_dtype(self, site: Site) -> str | None:
        """The dtype a rule's ``when.dtypes`` condition is checked against (None: unknown)."""

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        """Whether this node can be rewritten and what that needs; raises :class:`NoMatch` with a reason if not."""

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        """Emit the replacement, writing the original node's output names so nothing downstream changes."""


_REGISTRY: dict[str, Builder] = {}


def register(builder: Builder) -> Builder:
    """Make ``builder`` available to rule files under its ``name``; returns it (usable as a decorator)."""
    _REGISTRY[builder.name] = builder
    return builder


def get_builder(name: str) -> Builder | None:
    """The builder registered as ``name`` (a built-in one is imported on first use), or None."""
    builder = _REGISTRY.get(name)
    if builder is None and name in MODULES:
        importlib.import_module(f"{__name__}.{MODULES[name]}")  # registers it
        builder = _REGISTRY.get(name)
    if builder is None:
        _import_undeclared()
        builder = _REGISTRY.get(name)
    return builder


def contract_of(name: str) -> Contract | None:
    """The contract of the builder called ``name``, without importing a built-in builder's code
    (:mod:`.contracts`); None when no builder has that name."""
    builder = _REGISTRY.get(name)
    if builder is not None:
        return builder.contract
    if name not in CONTRACTS:
        _import_undeclared()
        builder = _REGISTRY.get(name)
        return builder.contract if builder is not None else None
    return CONTRACTS[name]


def builder_names() -> list[str]:
    """Names of every builder, built-in or registered, sorted: what a rule file's ``builder`` may say."""
    _import_undeclared()
    return sorted(set(_REGISTRY) | set(MODULES))


@functools.cache
def _import_undeclared() -> None:
    """Import the modules under ``builders/`` that :mod:`.contracts` does not name, once: a builder
    added without its declaration there still works (``tests/test_contract.py`` asks for the
    declaration, which keeps its code out of catalogue loading)."""
    import pkgutil

    declared = set(MODULES.values())
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name != "contracts" and info.name not in declared:
            importlib.import_module(f"{__name__}.{info.name}")


#: Names defined in ``_emit`` (they need onnx and numpy), loaded on first access (PEP 562).
_LAZY = frozenset({"ConstantPool", "Emitter", "Site"})


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from onnx_qrewrite.rewriter.builders import _emit

    value = getattr(_emit, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
