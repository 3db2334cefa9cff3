"""The rule catalogue: TOML files that say which op lowers to what, under which dtype and opset.

Rule files are data, never code: they name a builder registered in :mod:`onnx_qrewrite.rewriter.builders`
and give it options. Format (``rules/*.toml``)::

    title = "DynamicQuantizeLinear"                    # optional, for docs/lowerings.md
    about = "Markdown shown above the file's rules"    # optional
    notes = "Markdown shown below them"                # optional

    [[rule]]
    id = "dql-expand"                                  # stable, shown in every report
    summary = "Expand DynamicQuantizeLinear ..."       # one line for `onnx-qrewrite rules`
    doc = "details for docs/lowerings.md"              # optional
    emits = "ReduceMin, ReduceMax, ..., QuantizeLinear"   # ops of the builder's contract
    builder = "dynamic_quantize_linear"
    exactness = "exact"                                # exact | bounded | approximate
    match = [{ domain = "", op = "DynamicQuantizeLinear" }]   # several entries = aliases
    when = { dtypes = ["uint8"], min_opset = 11, max_opset = 26 }   # all optional
    options = { semantics = "onnxruntime" }            # the builder's declared options
    precedes = ["other-rule-id"]                       # optional: tried before those rules
    on_replacements = true                             # optional (exact rules): also lowers the nodes
                                                       # other rules emit (see the engine)

Every rule is checked against its builder's contract (:mod:`onnx_qrewrite.rewriter.contract`) when the
catalogue is built: unknown keys and options, bad values, ops the builder does not emit, output
types the builder does not declare for a matched op (or cannot satisfy with the rule's options),
and an exactness the builder does not deliver are usage errors naming the file, the rule and the
key.
The opset an emitted op needs is not stated here: builders take it from
:mod:`onnx_qrewrite.rewriter.kernel_opsets`.

``match.domain = "*"`` matches any non-standard domain. The engine tries a node's exact rules
first, then its bounded ones (each group in catalogue order); approximate rules only when asked,
and then before the others. A rule is tried before the rules its ``precedes`` names, whatever
their exactness: how a named form's rule file, loaded after the shipped ones, takes over a node
the shipped rules also lower (a bounded form asked for, e.g. "qdq", before the exact default).
The first whose conditions hold and whose builder accepts the node rewrites it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.rewriter.builders import Builder, builder_names, contract_of, get_builder
from onnx_qrewrite.rewriter.contract import ELEMENT_TYPES, EXACTNESS, Contract, closest

__all__ = [
    "Catalogue",
    "OpRef",
    "Rule",
    "checked",
    "load_catalogue",
    "load_rules",
    "named_form",
    "parse_rules",
    "shipped_rules_dir",
    "with_precedence",
]

ANY_DOMAIN = "*"
_STANDARD_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class OpRef:
    """One op a rule matches: domain (``*``: any non-standard one) and op type."""

    domain: str
    op: str

    def matches(self, domain: str, op: str) -> bool:
        if op != self.op:
            return False
        if self.domain == ANY_DOMAIN:
            return domain not in _STANDARD_DOMAINS
        return domain == self.domain or (self.domain in _STANDARD_DOMAINS and domain in _STANDARD_DOMAINS)

    def __str__(self) -> str:
        return f"{self.domain or 'ai.onnx'}::{self.op}" if self.domain != ANY_DOMAIN else f"*::{self.op}"


@dataclass(frozen=True)
class Rule:
    """One rule of the catalogue, as its file states it, checked against its builder's contract."""

    id: str
    summary: str
    emits: str
    builder: str
    match: tuple[OpRef, ...]
    exactness: str = "exact"
    dtypes: frozenset[str] | None = None
    min_opset: int | None = None
    max_opset: int | None = None
    #: The builder's options: validated against its contract, defaults filled in (see
    #: :func:`checked`); ``given_options`` are the ones the rule file (or an override) set.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "<api>"
    given_options: Mapping[str, Any] | None = None
    #: Details for docs/lowerings.md (markdown, optional).
    doc: str = ""
    #: Rule ids this rule is tried before, for the ops both match (ids not in the catalogue: none).
    precedes: tuple[str, ...] = ()
    #: Also tried on the nodes other rewrites create (the engine's later passes), e.g. the
    #: QuantizeLinear a DynamicQuantizeLinear expansion emits, under float emulation. Exact rules
    #: only: the replacement it lowers keeps its own declared exactness and bound.
    on_replacements: bool = False
    #: Option keys set by an override (``--rule-option``, the API's ``options=``) rather than the rule
    #: file: a target profile's options for the rule (``[[rewrites.options]]``) leave them as set.
    overridden: frozenset[str] = frozenset()

    def with_options(self, overrides: Mapping[str, Any]) -> Rule:
        given = {**(self.given_options if self.given_options is not None else self.options), **overrides}
        return dataclasses.replace(
            self, options=MappingProxyType(given), given_options=None, overridden=self.overridden | set(overrides)
        )

    def describe_match(self) -> str:
        return ", ".join(str(m) for m in self.match)

    @property
    def implementation(self) -> Builder:
        """The builder (its module is imported on first use: applying a rule needs it, loading or
        listing the catalogue does not)."""
        builder = get_builder(self.builder)
        assert builder is not None  # checked when the catalogue was built
        return builder

    @property
    def contract(self) -> Contract:
        """The builder's contract, without importing the builder's code."""
        contract = contract_of(self.builder)
        assert contract is not None  # checked when the catalogue was built
        return contract

    @property
    def bound(self) -> str:
        """The bound of a bounded rule, in words (the builder's)."""
        return self.contract.bound if self.exactness != "exact" else ""


_RULE_KEYS = (
    "id",
    "summary",
    "doc",
    "emits",
    "builder",
    "exactness",
    "match",
    "when",
    "options",
    "precedes",
    "on_replacements",
)
_WHEN_KEYS = ("dtypes", "min_opset", "max_opset")
#: What ``when.dtypes`` may name: every onnx 1.23 element type as ``graph.dtype_name`` spells it
#: (tests/test_catalogue.py checks the two agree). A name outside it would never match a node.
DTYPE_NAMES = tuple(
    sorted(
        ELEMENT_TYPES
        | {"complex64", "complex128", "float4e2m1", "float6e2m3", "float6e3m2", "float8e8m0", "int2", "uint2", "string"}
    )
)
_FILE_KEYS = ("rule", "title", "about", "notes")
#: Keys rule files used to have, and where their content lives now.
_REMOVED_KEYS = {
    "requires_opset": "the opset an emitted op needs is declared once, in onnx_qrewrite/rewriter/kernel_opsets.py "
    "(builders compute it per node); use 'when.min_opset' to restrict where a rule applies",
}


def _fail(source: str, where: str, message: str) -> UsageError:
    return UsageError(f"{source}: {where}: {message}")


def _unknown_keys(found: Any, valid: Sequence[str], what: str) -> str | None:
    unknown = sorted(set(found) - set(valid))
    if not unknown:
        return None
    key = unknown[0]
    if key in _REMOVED_KEYS:
        return f"{what} {key!r} is no longer accepted: {_REMOVED_KEYS[key]}"
    return f"unknown {what} {key!r}{closest(key, valid)}; valid: {', '.join(valid)}"


def _parse_rule(raw: Any, source: str, index: int) -> Rule:
    where = f"rule #{index + 1}"
    if not isinstance(raw, dict):
        raise _fail(source, where, "each [[rule]] must be a table")
    if isinstance(raw.get("id"), str):
        where = f"rule {raw['id']!r}"
    # In this order, so that a rule with several problems is told the same first one as before.
    _check_fields(raw, source, where)
    match = _parse_match(raw, source, where)
    when, dtypes = _parse_when(raw, source, where)
    options = raw.get("options", {})
    if not isinstance(options, dict):
        raise _fail(source, where, "'options' must be a table")
    precedes, on_replacements = _parse_ordering(raw, source, where)
    return Rule(
        id=raw["id"],
        summary=raw["summary"],
        doc=raw.get("doc", ""),
        emits=raw.get("emits", ""),
        builder=raw["builder"],
        match=tuple(match),
        exactness=raw["exactness"],
        dtypes=frozenset(dtypes) if dtypes is not None else None,
        min_opset=when.get("min_opset"),
        max_opset=when.get("max_opset"),
        options=MappingProxyType(dict(options)),
        source=source,
        precedes=tuple(precedes),
        on_replacements=on_replacements,
    )


def _check_fields(raw: dict[str, Any], source: str, where: str) -> None:
    """The rule's keys are known, its texts are strings, its builder exists, its exactness is one
    of :data:`EXACTNESS`."""
    problem = _unknown_keys(raw, _RULE_KEYS, "key")
    if problem:
        raise _fail(source, where, problem)
    for key in ("id", "summary", "builder"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise _fail(source, where, f"'{key}' must be a non-empty string")
    for key in ("doc", "emits"):
        if not isinstance(raw.get(key, ""), str):
            raise _fail(source, where, f"'{key}' must be a string")
    if contract_of(raw["builder"]) is None:
        names = builder_names()
        raise _fail(
            source,
            where,
            f"unknown builder {raw['builder']!r}{closest(raw['builder'], names)}; known: {', '.join(names)}",
        )
    if not isinstance(raw.get("exactness"), str) or raw["exactness"] not in EXACTNESS:
        raise _fail(
            source,
            where,
            f"'exactness' must be one of {', '.join(EXACTNESS)}"
            + (f", not {raw['exactness']!r}" if "exactness" in raw else " (missing)")
            + (closest(raw["exactness"], EXACTNESS) if isinstance(raw.get("exactness"), str) else ""),
        )


def _parse_match(raw: dict[str, Any], source: str, where: str) -> list[OpRef]:
    """``match``: one ``{domain, op}`` table or a non-empty list of them."""
    match_raw = raw.get("match")
    if isinstance(match_raw, dict):
        match_raw = [match_raw]
    if not isinstance(match_raw, list) or not match_raw:
        raise _fail(source, where, "'match' must be a table or a non-empty list of {domain, op} tables")
    match = []
    for m in match_raw:
        problem = _unknown_keys(m, ("domain", "op"), "key in 'match':") if isinstance(m, dict) else None
        if problem:
            raise _fail(source, where, problem)
        if not isinstance(m, dict) or not isinstance(m.get("op"), str):
            raise _fail(source, where, "each 'match' entry needs 'op' (string) and optional 'domain'")
        domain = m.get("domain", "")
        if not isinstance(domain, str):
            raise _fail(source, where, "'match.domain' must be a string")
        match.append(OpRef(domain, m["op"]))
    return match


def _parse_when(raw: dict[str, Any], source: str, where: str) -> tuple[dict[str, Any], list[str] | None]:
    """``when``: the table (known keys only) and its dtype list (None: any dtype)."""
    when = raw.get("when", {})
    if not isinstance(when, dict):
        raise _fail(source, where, f"'when' must be a table of {', '.join(_WHEN_KEYS)}")
    problem = _unknown_keys(when, _WHEN_KEYS, "key in 'when':")
    if problem:
        raise _fail(source, where, problem)
    dtypes = when.get("dtypes")
    if dtypes is not None and (not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes)):
        raise _fail(source, where, "'when.dtypes' must be a list of dtype names")
    for name in dtypes or ():
        if name not in DTYPE_NAMES:
            raise _fail(source, where, f"'when.dtypes': unknown dtype {name!r}{closest(name, DTYPE_NAMES)}")
    for key in ("min_opset", "max_opset"):
        if key in when and (not isinstance(when[key], int) or isinstance(when[key], bool)):
            raise _fail(source, where, f"'when.{key}' must be an integer")
    return when, dtypes


def _parse_ordering(raw: dict[str, Any], source: str, where: str) -> tuple[list[str], bool]:
    """``precedes`` (rule ids) and ``on_replacements`` (exact rules only)."""
    precedes = raw.get("precedes", [])
    if not isinstance(precedes, list) or not all(isinstance(r, str) and r for r in precedes):
        raise _fail(source, where, "'precedes' must be a list of rule ids")
    on_replacements = raw.get("on_replacements", False)
    if not isinstance(on_replacements, bool):
        raise _fail(source, where, "'on_replacements' must be true or false")
    if on_replacements and raw["exactness"] != "exact":
        raise _fail(
            source,
            where,
            "'on_replacements' needs an exact rule: a lowered replacement keeps the exactness and bound "
            "its first rule declared",
        )
    return precedes, on_replacements


def checked(rule: Rule) -> Rule:
    """``rule`` validated against its builder's contract, with the builder's option defaults filled
    in. Idempotent. Raises :class:`UsageError` naming the file, the rule and the key."""
    if rule.given_options is not None:
        return rule
    where = f"rule {rule.id!r}"
    contract = contract_of(rule.builder)
    if contract is None:
        names = builder_names()
        raise _fail(
            rule.source,
            where,
            f"unknown builder {rule.builder!r}{closest(rule.builder, names)}; known: {', '.join(names)}",
        )
    resolved, problems = contract.resolve(rule.options)
    if problems:
        key, why = problems[0]
        raise _fail(rule.source, where, f"option {key!r} ({rule.builder}): {why}")
    for op in (o.strip() for o in rule.emits.split(",")):
        if op and op not in contract.emits:
            raise _fail(
                rule.source,
                where,
                f"'emits' names {op!r}{closest(op, contract.emits)}, which builder {rule.builder} does not emit "
                f"(its contract: {', '.join(sorted(contract.emits))})",
            )
    for matched in dict.fromkeys(ref.op for ref in rule.match):
        unsatisfied = contract.output_types_problem(resolved, matched)
        if unsatisfied:
            raise _fail(rule.source, where, f"output types ({rule.builder}): {unsatisfied}")
    delivered = contract.exactness(resolved)
    if rule.exactness != delivered:
        raise _fail(
            rule.source,
            where,
            f"'exactness' is {rule.exactness!r} but builder {rule.builder} with these options is {delivered!r}",
        )
    return dataclasses.replace(
        rule, options=MappingProxyType(resolved), given_options=MappingProxyType(dict(rule.options))
    )


def parse_rules(text: str, source: str, *, cache: bool = False) -> list[Rule]:
    """Rules from TOML text; ``source`` names the file in error messages. ``cache``: the TOML's
    values may come from, and go to, :mod:`~onnx_qrewrite.rewriter.rule_cache` (the shipped
    files: the rules are the same either way, checked the same way).

    Remembered per text and source: one ``rewrite --target openvino`` of the sample MLP parsed 81
    rule files, 17 distinct (each target profile checks its rule ids against the named forms, each
    plan loads the catalogue again), and decoding their TOML was most of planning a small model for
    every target (tests/_target_helpers.py: 4.9 s of CPU, 1.9 s remembered). A parse depends only
    on the text, the source and the contract of each rule's builder, so a remembered one is used
    while those contracts are the same objects (a builder registered or its contract replaced
    since: parsed again). Rules are immutable; a file with a problem is never remembered."""
    key = (text, source)
    remembered = _PARSED.get(key)
    if remembered is not None and all(contract_of(r.builder) is c for r, c in remembered):
        return [r for r, _ in remembered]
    rules = _parse_rules(text, source, cache)
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[key] = [(r, contract_of(r.builder)) for r in rules]
    return rules


#: parse_rules' memory: (text, source) -> each rule with the contract it was checked against.
_PARSED: dict[tuple[str, str], list[tuple[Rule, Contract | None]]] = {}
_PARSED_MAX = 256  # distinct rule files: the shipped ones are about 30


def _parse_rules(text: str, source: str, cache: bool) -> list[Rule]:
    data = _toml(text, source, cache)
    problem = _unknown_keys(data, _FILE_KEYS, "top-level key")
    if problem:
        raise UsageError(f"{source}: {problem}")
    for key in ("title", "about", "notes"):
        if key in data and not isinstance(data[key], str):
            raise UsageError(f"{source}: {key!r} must be a string")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise UsageError(f"{source}: 'rule' must be an array of tables ([[rule]])")
    return [checked(_parse_rule(r, source, i)) for i, r in enumerate(raw_rules)]


def _toml(text: str, source: str, cache: bool) -> dict[str, Any]:
    """``tomllib.loads(text)``, from the rule cache when ``cache`` and it holds this very text
    (imported only when parsing: the cache spares ``inspect`` both, see rule_cache.py)."""
    from onnx_qrewrite.rewriter import rule_cache

    data = rule_cache.load(text) if cache else None
    if data is not None:
        return data
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise UsageError(f"{source}: not a rule file: arrays or tables nested too deeply") from None
    if cache:
        rule_cache.store(text, data)
    return data


def with_precedence(rules: list[Rule]) -> list[Rule]:
    """``rules`` in catalogue order, but each rule with ``precedes`` moved just before the first of
    the rules it names (stable otherwise)."""
    out = list(rules)
    for rule in rules:
        if not rule.precedes:
            continue
        first = next((i for i, r in enumerate(out) if r.id in rule.precedes), None)
        here = out.index(rule)
        if first is not None and first < here:
            out.insert(first, out.pop(here))
    return out


#: Quantization ops no shipped rule lowers (yet), so that ``inspect`` lists them too. Ops a rule
#: matches are found through the catalogue and must not be listed here (a test keeps it so).
OTHER_QUANT_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "MatMulBnb4",
    }
)


def is_quantization_op(op_type: str) -> bool:
    """Whether ``op_type`` names a quantization op (by name: a quantize/dequantize, a ``QLinear*``
    op, or :data:`OTHER_QUANT_OPS`). One definition for ``inspect``, which lists such nodes, and
    the engine, which reports such a node of a non-standard domain that no rule names as
    unlowered rather than leave it in the output unsaid (:func:`is_unnamed_vendor_quant_op`)."""
    return op_type in OTHER_QUANT_OPS or "quant" in op_type.lower() or op_type.startswith("QLinear")


def is_unnamed_vendor_quant_op(domain: str, op_type: str) -> bool:
    """A quantization op of a vendor domain (com.microsoft's channels_last QLinearConv, say): the
    point of a rewrite is a model without it, so when no rule names it, it is reported as
    unlowered (exit code 4, or a warning with ``--allow-unlowered``), as a node every rule declines.
    Standard-domain ops (QuantizeLinear...) run everywhere and stay quietly."""
    return domain not in ("", "ai.onnx") and is_quantization_op(op_type)


def shipped_rules_dir() -> Path:
    """The catalogue that ships with the tool: inside the wheel, or ``rules/`` in a checkout."""
    package_dir = Path(__file__).resolve().parents[1]
    for candidate in (package_dir / "_rules", package_dir.parent / "rules"):
        if candidate.is_dir():
            return candidate
    raise UsageError(f"the shipped rule catalogue is missing (looked in {package_dir / '_rules'})")


class Catalogue:
    """An ordered, validated set of rules, indexed by op for fast matching."""

    def __init__(self, rules: Iterable[Rule]):
        self.rules: tuple[Rule, ...] = tuple(checked(r) for r in rules)
        seen: dict[str, str] = {}
        for rule in self.rules:
            if rule.id in seen:
                raise UsageError(f"{rule.source}: rule {rule.id!r} is already defined in {seen[rule.id]}")
            seen[rule.id] = rule.source
        self._by_op: dict[str, list[Rule]] = {}
        for rule in self.rules:
            for ref in rule.match:
                self._by_op.setdefault(ref.op, []).append(rule)
        for op, listed in self._by_op.items():
            if any(r.precedes for r in listed):
                self._by_op[op] = with_precedence(listed)

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.rules]

    @functools.cached_property
    def same_shape_ops(self) -> frozenset[str]:
        """Ops matched by rules whose builder declares that output 0 has input 0's shape."""
        return frozenset(ref.op for rule in self.rules if rule.contract.preserves_shape for ref in rule.match)

    def matched_ops(self) -> set[tuple[str, str]]:
        """Every (domain, op) some rule matches (domain "*" for any non-standard one)."""
        return {(ref.domain, ref.op) for rule in self.rules for ref in rule.match}

    def candidates(self, domain: str, op: str) -> list[Rule]:
        """Rules whose ``match`` names this op, in catalogue order (deduplicated)."""
        out = []
        for rule in self._by_op.get(op, ()):
            if rule not in out and any(ref.matches(domain, op) for ref in rule.match):
                out.append(rule)
        return out

    def select(self, only: Sequence[str] | None = None, skip: Sequence[str] | None = None) -> Catalogue:
        known = set(self.ids)
        for option, ids in (("--only", only), ("--skip", skip)):
            for rule_id in ids or ():
                if rule_id not in known:
                    raise UsageError(
                        f"{option}: no rule {rule_id!r}{closest(rule_id, self.ids)} (see `onnx-qrewrite rules`)"
                    )
        rules = [r for r in self.rules if (not only or r.id in only) and r.id not in set(skip or ())]
        return Catalogue(rules)

    def with_options(self, overrides: Mapping[str, Mapping[str, Any]]) -> Catalogue:
        """Override rule options: ``{rule_id: {key: value}}``."""
        known = self.ids
        for rule_id in overrides:
            if rule_id not in known:
                raise UsageError(
                    f"option for unknown rule {rule_id!r}{closest(rule_id, known)} (see `onnx-qrewrite rules`)"
                )
        out = []
        for rule in self.rules:
            if rule.id not in overrides:
                out.append(rule)
                continue
            try:
                out.append(checked(rule.with_options(overrides[rule.id])))
            except UsageError as exc:
                why = str(exc).split(f"rule {rule.id!r}: ", 1)[-1]
                raise UsageError(f"options for rule {rule.id!r} (overridden): {why}") from None
        return Catalogue(out)

    def with_option(self, key: str, value: Any) -> Catalogue:
        """Set option ``key`` on every rule whose builder takes it, e.g. a named form's
        ``with_option("weights", "float")`` (``--form-option``). A key no rule takes, or a bad
        value, is a usage error naming the closest valid key."""
        takers = {r.id: {key: value} for r in self.rules if key in r.contract.option_names()}
        if not takers:
            known = sorted({o for r in self.rules for o in r.contract.option_names()})
            raise UsageError(
                f"no rule takes option {key!r}{closest(key, known)}; options: {', '.join(known) or 'none'}"
            )
        return self.with_options(takers)


def named_form(name: str) -> Path:
    """The rule file of a named form (``rules/forms/<name>.toml``): rewrites the default catalogue
    does not make, e.g. "float-emulation" for targets without Q/DQ kernels, "weight-only" (its
    option ``weights``: ``load_catalogue([named_form("weight-only")]).with_option("weights",
    "float")``). Add it to the catalogue like any user rule file (``load_catalogue([...])``,
    ``--form NAME``, ``--rules``)."""
    forms = shipped_rules_dir() / "forms"
    path = forms / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in forms.glob("*.toml"))
        raise UsageError(f"no form named {name!r}{closest(name, known)}; known: {', '.join(known) or 'none'}")
    return path


def load_catalogue(paths: Iterable[str | os.PathLike[str]] = (), *, include_shipped: bool = True) -> Catalogue:
    """Shipped rules (sorted by file name) followed by the user's files, in the order given.
    The shipped files' TOML (named forms included) is read through the rule cache."""
    files: list[Path] = []
    if include_shipped:
        files.extend(sorted(shipped_rules_dir().glob("*.toml")))
    shipped = _shipped_or_none()
    rules: list[Rule] = []
    for path in files + [Path(p) for p in paths]:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"{path}: rule file not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: cannot read rule file: {exc}") from None
        rules.extend(parse_rules(text, str(path), cache=shipped is not None and path.is_relative_to(shipped)))
    if include_shipped:
        _check_precedes(rules)
    return Catalogue(rules)


def _check_precedes(rules: Sequence[Rule]) -> None:
    """Every rule a ``precedes`` names is in the catalogue (with the shipped rules loaded, a name
    that is not is a misspelling, which would silently order nothing)."""
    ids = [r.id for r in rules]
    for rule in rules:
        for other in rule.precedes:
            if other not in ids:
                raise _fail(
                    rule.source, f"rule {rule.id!r}", f"'precedes' names no rule {other!r}{closest(other, ids)}"
                )


def _shipped_or_none() -> Path | None:
    try:
        return shipped_rules_dir()
    except UsageError:  # user rule files only: they load without it
        return None


def load_rules(
    paths: Iterable[str | os.PathLike[str]] = (),
    *,
    only: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    include_shipped: bool = True,
) -> Catalogue:
    """The shipped catalogue plus ``paths``, selected with ``only``/``skip``, options overridden.

    Here, not in ``api``, so the command line reads rules without importing the engine."""
    catalogue = load_catalogue(paths, include_shipped=include_shipped)
    catalogue = catalogue.select(only, skip)
    if options:
        catalogue = catalogue.with_options(options)
    return catalogue
