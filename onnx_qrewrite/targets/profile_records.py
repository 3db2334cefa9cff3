"""What a target profile is once read: :class:`TargetProfile` and the records it is made of (its
sources, the ops it runs, its refusals, quantization constraints, the forms and rule options it
asks for), with the questions the checks and the plan ask of it.

A module of its own, apart from reading and checking a profile's TOML (:mod:`.profile`, which
documents the format and re-exports these names): the checks (:mod:`.check`) and the planner use
the records, and only loading a profile needs the parser.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from onnx_qrewrite._dataclass import dataclass

__all__ = [
    "FormRequest",
    "OpSupport",
    "ProfileRuleOptions",
    "Quantization",
    "Refusal",
    "Source",
    "TargetProfile",
]


@dataclass(frozen=True)
class Source:
    id: str
    document: str
    version: str


@dataclass(frozen=True)
class OpSupport:
    """The target runs ``domain::op`` (at model opsets ``min_opset..max_opset``, on ``types``)."""

    domain: str
    op: str
    source: str
    types: frozenset[str] | None = None
    min_opset: int | None = None
    max_opset: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Refusal:
    """A node the target refuses although an ``[[ops]]`` table lists its op."""

    domain: str
    op: str
    when: str
    reason: str
    source: str
    types: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset()  # "input-from": the producers it applies after; else: its readers
    inputs: tuple[int, ...] = (0,)  # "rank-above" / "computed-input" / "input-from": the inputs looked at
    rank: int | None = None  # when = "rank-above": the most dimensions taken; "rank-below": the fewest
    chain: tuple[str, ...] = ()  # when = "outside-chain": the chain the op runs only inside
    through: frozenset[str] = frozenset()  # "input-from": ops between the producer and the op it looks through
    # "input-from": (op of ``through``, input) looked through only where that input has no run-time data
    through_static: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Quantization:
    source: str
    types: frozenset[str] | None = None
    constant_scale: bool = False
    constant_zero_point: bool = False
    symmetric: bool = False
    per_channel: bool = True
    blocked: bool = True


@dataclass(frozen=True)
class FormRequest:
    """A named form (``rules/forms/<name>.toml``) the target may need, and its consent: rules of
    the form less exact than ``allow`` are not used for the target."""

    name: str
    allow: str
    source: str
    why: str = ""
    options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    #: Options for every rule of the form that takes them (``--form-option``).
    form_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: "profile": this entry is the consent; "user": approximate rules also need --allow-approximate.
    consent: str = "profile"
    #: "" for a form's first listing; for later ones, what sets them apart ("weights=float"): the
    #: suffix of their rules' ids.
    variant: str = ""

    def rules(self) -> Any:
        """The form's rules with this listing's options (a Catalogue), ids suffixed by the variant."""
        import dataclasses as dc

        from onnx_qrewrite.rewriter.catalogue import Catalogue, load_catalogue, named_form

        rules = load_catalogue([named_form(self.name)], include_shipped=False)
        for key, value in self.form_options.items():
            rules = rules.with_option(key, value)
        if self.options:
            rules = rules.with_options(self.options)
        if self.variant:
            rules = Catalogue(dc.replace(r, id=f"{r.id}[{self.variant}]") for r in rules)
        return rules


@dataclass(frozen=True)
class ProfileRuleOptions:
    """Options of one catalogue rule for this target (``[[rewrites.options]]``): the rule still
    applies, with these options, e.g. qop-matmul declining where its reduction length is not
    recorded on a target that runs the run-time bound's output wrongly."""

    rule: str
    options: Mapping[str, Any]
    source: str
    why: str = ""

    def words(self) -> str:
        """The options as a rule file spells them: ``reduction_length = 'recorded'``."""
        return ", ".join(f"{key} = {value!r}" for key, value in self.options.items())


@dataclass(frozen=True)
class TargetProfile:
    id: str
    title: str
    version: str
    proof: str
    path: str
    sources: Mapping[str, Source]
    ops: Mapping[tuple[str, str], tuple[OpSupport, ...]]
    refusals: tuple[Refusal, ...] = ()
    #: ``[[differs]]``: nodes the target runs but computes otherwise than onnxruntime (observed),
    #: in the form of a refusal: inspect --target names each such node left in the rewrite.
    differences: tuple[Refusal, ...] = ()
    opset_min: int | None = None
    opset_max: int | None = None
    opset_source: str | None = None
    ir_max: int | None = None
    ir_source: str | None = None
    float64: str | None = None  # [arithmetic] float64: one of FLOAT64_ARITHMETIC; None: not established
    arithmetic_source: str | None = None
    quantization: Quantization | None = None
    io_only_types: frozenset[str] = frozenset()
    refused_types: frozenset[str] = frozenset()
    qdq_only_types: frozenset[str] = frozenset()
    network_source: str | None = None
    keep: frozenset[str] = frozenset()
    forms: tuple[FormRequest, ...] = ()
    avoid: frozenset[str] = frozenset()
    #: Options of catalogue rules for this target (``[[rewrites.options]]``), in the file's order.
    rule_options: tuple[ProfileRuleOptions, ...] = ()
    rewrites_source: str | None = None
    runtime: str | None = None
    extra: str | None = None
    static_shapes: bool = False
    shapes_source: str | None = None

    def support(self, domain: str, op: str) -> tuple[OpSupport, ...]:
        """Every table that lists ``domain::op`` (``ai.onnx`` spelled as "")."""
        return self.ops.get((norm_domain(domain), op), ())

    def cite(self, source_id: str | None) -> str:
        """How a verdict names its source: ``[target/source-id]`` (``targets --long`` expands it)."""
        return f"[{self.id}/{source_id}]" if source_id else ""

    def float64_loss(self) -> str | None:
        """What becomes of float64 arithmetic on the target, in words, when it is not float64
        (None: it is, or nothing is established)."""
        said = {
            "float32": "computes float64 as float32",
            "reduced": "computes float64 in reduced precision",
            "refused": "refuses float64 arithmetic",
        }.get(self.float64 or "")
        return f"{self.id} {said} {self.cite(self.arithmetic_source)}" if said else None

    def source_text(self, source_id: str) -> str:
        s = self.sources[source_id]
        return f"{s.document} ({s.version})"


def norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain
