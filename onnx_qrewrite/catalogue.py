"""The rule catalogue: TOML files that say which op lowers to what, under which dtype and opset.

Rule files are data, never code: they name a builder registered in :mod:`onnx_qrewrite.builders`
and give it options. Format (``rules/*.toml``)::

    [[rule]]
    id = "dql-expand"                                  # stable, shown in every report
    summary = "Expand DynamicQuantizeLinear ..."       # one line for `onnx-qrewrite rules`
    emits = "ReduceMin, ReduceMax, ..., QuantizeLinear"
    builder = "dynamic_quantize_linear"
    match = [{ domain = "", op = "DynamicQuantizeLinear" }]   # several entries = aliases
    when = { dtypes = ["uint8"], min_opset = 11, max_opset = 26 }   # all optional
    requires_opset = { int16 = 21, uint16 = 21 }       # optional: per dtype, "*" for any
    options = { semantics = "onnxruntime" }            # passed to the builder

``match.domain = "*"`` matches any non-standard domain. Rules are tried in catalogue order; the
first whose conditions hold and whose builder accepts the node rewrites it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from onnx_qrewrite.builders import builder_names, get_builder
from onnx_qrewrite.errors import UsageError

__all__ = ["Catalogue", "OpRef", "Rule", "load_catalogue", "parse_rules", "shipped_rules_dir"]

ANY_DOMAIN = "*"
_STANDARD_DOMAINS = ("", "ai.onnx")


@dataclasses.dataclass(frozen=True)
class OpRef:
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


@dataclasses.dataclass(frozen=True)
class Rule:
    id: str
    summary: str
    emits: str
    builder: str
    match: tuple[OpRef, ...]
    dtypes: frozenset[str] | None = None
    min_opset: int | None = None
    max_opset: int | None = None
    requires_opset: Mapping[str, int] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "<api>"

    def opset_needed_for(self, dtype: str | None) -> int:
        if dtype is not None and dtype in self.requires_opset:
            return self.requires_opset[dtype]
        return self.requires_opset.get("*", 0)

    def with_options(self, overrides: Mapping[str, Any]) -> Rule:
        return dataclasses.replace(self, options=MappingProxyType({**self.options, **overrides}))

    def describe_match(self) -> str:
        return ", ".join(str(m) for m in self.match)


_RULE_KEYS = {"id", "summary", "emits", "builder", "match", "when", "requires_opset", "options"}
_WHEN_KEYS = {"dtypes", "min_opset", "max_opset"}


def _fail(source: str, where: str, message: str) -> UsageError:
    return UsageError(f"{source}: {where}: {message}")


def _parse_rule(raw: Any, source: str, index: int) -> Rule:
    where = f"rule #{index + 1}"
    if not isinstance(raw, dict):
        raise _fail(source, where, "each [[rule]] must be a table")
    if isinstance(raw.get("id"), str):
        where = f"rule {raw['id']!r}"
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise _fail(source, where, f"unknown key(s) {', '.join(sorted(unknown))}")
    for key in ("id", "summary", "builder"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise _fail(source, where, f"'{key}' must be a non-empty string")
    if get_builder(raw["builder"]) is None:
        raise _fail(source, where, f"unknown builder {raw['builder']!r} (known: {', '.join(builder_names())})")
    match_raw = raw.get("match")
    if isinstance(match_raw, dict):
        match_raw = [match_raw]
    if not isinstance(match_raw, list) or not match_raw:
        raise _fail(source, where, "'match' must be a table or a non-empty list of {domain, op} tables")
    match = []
    for m in match_raw:
        if not isinstance(m, dict) or set(m) - {"domain", "op"} or not isinstance(m.get("op"), str):
            raise _fail(source, where, "each 'match' entry needs 'op' (string) and optional 'domain'")
        domain = m.get("domain", "")
        if not isinstance(domain, str):
            raise _fail(source, where, "'match.domain' must be a string")
        match.append(OpRef(domain, m["op"]))
    when = raw.get("when", {})
    if not isinstance(when, dict) or set(when) - _WHEN_KEYS:
        raise _fail(source, where, f"'when' may only hold {', '.join(sorted(_WHEN_KEYS))}")
    dtypes = when.get("dtypes")
    if dtypes is not None and (not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes)):
        raise _fail(source, where, "'when.dtypes' must be a list of dtype names")
    for key in ("min_opset", "max_opset"):
        if key in when and (not isinstance(when[key], int) or isinstance(when[key], bool)):
            raise _fail(source, where, f"'when.{key}' must be an integer")
    requires = raw.get("requires_opset", {})
    if not isinstance(requires, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in requires.values()
    ):
        raise _fail(source, where, "'requires_opset' must map dtype names (or '*') to integers")
    options = raw.get("options", {})
    if not isinstance(options, dict):
        raise _fail(source, where, "'options' must be a table")
    return Rule(
        id=raw["id"],
        summary=raw["summary"],
        emits=str(raw.get("emits", "")),
        builder=raw["builder"],
        match=tuple(match),
        dtypes=frozenset(dtypes) if dtypes is not None else None,
        min_opset=when.get("min_opset"),
        max_opset=when.get("max_opset"),
        requires_opset=MappingProxyType(dict(requires)),
        options=MappingProxyType(dict(options)),
        source=source,
    )


def parse_rules(text: str, source: str) -> list[Rule]:
    """Rules from TOML text; ``source`` names the file in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{source}: not valid TOML: {exc}") from None
    unknown = set(data) - {"rule"}
    if unknown:
        raise UsageError(f"{source}: unknown top-level key(s) {', '.join(sorted(unknown))}; expected [[rule]] tables")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise UsageError(f"{source}: 'rule' must be an array of tables ([[rule]])")
    return [_parse_rule(r, source, i) for i, r in enumerate(raw_rules)]


def shipped_rules_dir() -> Path:
    """The catalogue that ships with the tool: inside the wheel, or ``rules/`` in a checkout."""
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "_rules", package_dir.parent / "rules"):
        if candidate.is_dir():
            return candidate
    raise UsageError(f"the shipped rule catalogue is missing (looked in {package_dir / '_rules'})")


class Catalogue:
    """An ordered, validated set of rules, indexed by op for fast matching."""

    def __init__(self, rules: Iterable[Rule]):
        self.rules: tuple[Rule, ...] = tuple(rules)
        seen: dict[str, str] = {}
        for rule in self.rules:
            if rule.id in seen:
                raise UsageError(f"{rule.source}: rule {rule.id!r} is already defined in {seen[rule.id]}")
            seen[rule.id] = rule.source
        self._by_op: dict[str, list[Rule]] = {}
        for rule in self.rules:
            for ref in rule.match:
                self._by_op.setdefault(ref.op, []).append(rule)

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.rules]

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
                    raise UsageError(f"{option}: no rule {rule_id!r} (see `onnx-qrewrite rules`)")
        rules = [r for r in self.rules if (not only or r.id in only) and r.id not in set(skip or ())]
        return Catalogue(rules)

    def with_options(self, overrides: Mapping[str, Mapping[str, Any]]) -> Catalogue:
        """Override rule options: ``{rule_id: {key: value}}``."""
        known = set(self.ids)
        for rule_id in overrides:
            if rule_id not in known:
                raise UsageError(f"option for unknown rule {rule_id!r} (see `onnx-qrewrite rules`)")
        return Catalogue(r.with_options(overrides[r.id]) if r.id in overrides else r for r in self.rules)


def load_catalogue(paths: Iterable[str | Path] = (), *, include_shipped: bool = True) -> Catalogue:
    """Shipped rules (sorted by file name) followed by the user's files, in the order given."""
    files: list[Path] = []
    if include_shipped:
        files.extend(sorted(shipped_rules_dir().glob("*.toml")))
    rules: list[Rule] = []
    for path in files + [Path(p) for p in paths]:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"{path}: rule file not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: cannot read rule file: {exc}") from None
        rules.extend(parse_rules(text, str(path)))
    return Catalogue(rules)
