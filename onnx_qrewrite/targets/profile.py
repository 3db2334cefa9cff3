"""Target profiles: what one deployment runtime accepts, read from ``rules/targets/<id>.toml``.

A profile is data, like a rule file: the ops the target runs (by domain, with an opset range and
the tensor types it takes), its quantization constraints, the tensor types it refuses inside the
network, observed exceptions to its published tables, and the ops it runs natively that a rewrite
must keep. Every entry names a ``[[source]]`` (a document and its version, or an observation on a
named runtime version), so each verdict can be traced to where it came from. The loader refuses a
file with an unknown key, a missing source, or an entry that cites no source: exit 2, naming the
file and the key.

Format (every table except ``[target]`` and ``[[source]]`` needs ``source = "<source id>"``)::

    [target]
    id = "tract"                     # the name users type: --target tract
    title = "tract (Sonos), ONNX inference in Rust"
    version = "0.23.9"               # the runtime version the profile holds for
    proof = "runtime"                # how verdicts are checked: runtime | vendor-checker | published-table | spec
    runtime = "tract"                # optional: the `verify --runtime` that runs it here
    extra = "tract"                  # optional: pip extra that installs that runtime

    [[source]]
    id = "registry"
    document = "sonos/tract onnx/src/ops (the op registry)"
    version = "commit 38b383f (v0.23.5-67)"

    [opset]                          # default-domain opsets the target loads
    min = 9
    max = 22
    source = "registry"

    [ir]                             # the highest IR version the target loads (a model declaring
    max = 13                         # more is lowered when it uses nothing newer: lower_ir.py)
    source = "observed"

    [[ops]]                          # ops the target runs; several tables per domain are merged
    domain = ""                      # "" = ai.onnx
    names = ["Add", "Conv"]
    types = ["float32", "int64"]     # optional: element types accepted on its inputs
    note = "..."                     # optional
    source = "registry"

    [[refuse]]                       # exceptions to [[ops]]: a node the target refuses anyway
    domain = ""
    op = "QuantizeLinear"
    when = "computed-scale"          # always | computed-scale | computed-zero-point |
                                     # nonzero-zero-point | quantized-type (with types = [...]) |
                                     # type (any input or output of these types) | per-channel
                                     # (a scale with more than one element: Q/DQ, QLinearConv,
                                     # QLinearMatMul) | input-from (with ops = [...]: its first
                                     # input, or one of `inputs`, is the output of one of these
                                     # standard ops; with through = [...] also through a chain of
                                     # those standard ops, reading it at any of their inputs;
                                     # through_static = { Where = 0 }: through such an op only
                                     # where that input is computed from constants and Shape/Size
                                     # alone, no run-time data) |
                                     # rank-above (with rank = N: one of `inputs` has more than
                                     # N dimensions) | rank-below (with rank = N: one of
                                     # `inputs` has fewer) | computed-input (one of `inputs` is
                                     # computed at run time, not a constant) | outside-chain
                                     # (with chain = [...]: it is not a link of a direct
                                     # producer -> consumer chain of these standard ops) |
                                     # unfused-outputs (with ops = [...]: an output is a graph
                                     # output, or is read by no node or by more than one, or the
                                     # first output's reader is none of these standard ops) |
                                     # read-by (with ops = [...]: one of these standard ops reads
                                     # its first output; with types, only a Q/DQ of those types) |
                                     # folded-quantize-input (two of its inputs are
                                     # QuantizeLinear -> DequantizeLinear pairs: one of a value
                                     # computed at run time, one of a value the runtime folds to
                                     # a constant of more than one element at load time) |
                                     # shape-unrecorded (one of `inputs` has no rank that
                                     # shape inference, --input-shape's recording, a constant or
                                     # the com.microsoft ops before it give: what a converter
                                     # that infers shapes itself may get wrong) |
                                     # shape-not-static (one of `inputs` has no shape, or a
                                     # dimension that is not a fixed number)
    inputs = [0]                     # rank-above / rank-below / computed-input / input-from /
                                     # shape-unrecorded / shape-not-static: the input
                                     # positions looked at (default: the first)
    rank = 2                         # rank-above: the most dimensions the target takes there;
                                     # rank-below: the fewest
    chain = ["Div", "Erf", "Add", "Mul"]   # outside-chain: the only chain the op runs inside
    reason = "y_scale must be a const"
    source = "observed"

    [[differs]]                      # a node the target runs but computes otherwise than
    op = "DynamicQuantizeLinear"     # onnxruntime (observed): not refused (no rule changes what
    when = "always"                  # the runtime does with it), but `inspect --target` names
    reason = "..."                   # each such node left in the rewrite and why; the keys and
    source = "observed"              # conditions of [[refuse]], and when = "exact-ties" (a
                                     # com.microsoft QLinearAdd whose constant scales let the
                                     # exact result fall on k + 1/2 for some operands)

    [quantization]                   # QuantizeLinear / DequantizeLinear (the standard ops)
    types = ["int8", "uint8"]        # quantized element types accepted
    constant_scale = true            # scales must be initializers or Constants
    constant_zero_point = true
    symmetric = false                # zero points must be all zero
    per_channel = true               # 1-D scales along an axis
    blocked = false                  # block_size (opset 21 blocked quantization)
    source = "..."

    [network]
    io_only_types = ["uint8"]        # element types allowed only as graph inputs/outputs
    refused_types = ["bfloat16"]     # element types refused anywhere
    qdq_only_types = ["uint8"]       # element types only on the quantized side of a Q/DQ: refused
                                     # as an input or output of any other op (except `keep` ops)
    source = "..."

    [arithmetic]                     # what the target does with float64 Mul/Add/Sub/Div and Cast:
    float64 = "float32"              # float64 | float32 (computes it as float32) | reduced (less
    source = "observed"              # precise still) | refused (at run time); rules whose exactness
                                     # rests on float64 arithmetic are named for such a target

    [shapes]
    static = true                    # every input dimension must be fixed (--input-shape fixes them)
    source = "..."

    [rewrites]
    keep = ["DynamicQuantizeLinear"] # standard ops the target runs natively: never rewritten for it
    avoid = ["ms-q-decompose"]       # rules whose output the target was seen to run wrongly (or not
                                     # at all) although it runs each of its ops: never used for it
    source = "..."

    [[rewrites.options]]             # options of a catalogue rule for this target only, checked
    rule = "qop-matmul"              # against the rule's builder contract as a rule file's are
    options = { reduction_length = "recorded" }
    why = "the runtime fails on its run-time-K form: ..."  # shown by inspect, targets --long
    source = "..."                   # (--rule-option RULE.KEY=V, the user's, wins over it)

    [[rewrites.form]]                # a named form (rules/forms/<name>.toml) the target may need
    name = "weight-only"
    allow = "approximate"            # the target's consent: the least exact level of the form's
                                     # rules it may use (exact | bounded | approximate); rules
                                     # beyond it are not used. Required: no form runs by default.
    options = { rule-id = { key = "value" } }   # optional: the form's rule options for this target
    form_options = { weights = "float" }        # optional: an option for every rule of the form that
                                                # takes it (as `--form-option weights=float`)
    consent = "user"                 # optional: "profile" (default: this entry is the consent) or
                                     # "user": its approximate rules run only when the user also
                                     # passes --allow-approximate (inspect --target says so)
    why = "NNAPI has no Round: ..."  # what the form gives this target (shown by `targets --long`)
    source = "..."

A form may be listed more than once with different options (e.g. weight-only with its weights
dequantized, then as float initializers): per node the listings are tried in the file's order and
the first that leaves the target nothing to refuse wins. The second and later listings' rules get
the options in their ids (``weight-only-matmul[weights=float]``), so reports tell them apart.

The plan (:mod:`.plan`) chooses per node among leaving it, the catalogue's rules and the rules of
the forms the profile names: a form's rule is used on a node only where it leaves fewer refused
nodes than every more exact choice, so an approximate form runs only where the target needs it,
and the summary and report name it.

This module reads and checks a profile's TOML and finds profiles by id; what a profile is once
read (:class:`TargetProfile` and its records, which this module re-exports) is
:mod:`.profile_records`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.rewriter.contract import closest
from onnx_qrewrite.targets.profile_records import (
    FormRequest,
    OpSupport,
    ProfileRuleOptions,
    Quantization,
    Refusal,
    Source,
    TargetProfile,
    norm_domain,
)

__all__ = [
    "FormRequest",
    "OpSupport",
    "ProfileRuleOptions",
    "Quantization",
    "Refusal",
    "Source",
    "TargetProfile",
    "load_target",
    "load_targets",
    "parse_target",
    "shipped_targets_dir",
]

PROOFS = ("runtime", "vendor-checker", "published-table", "spec")
REFUSE_WHEN = (
    "always",
    "exact-ties",
    "computed-scale",
    "computed-zero-point",
    "nonzero-zero-point",
    "quantized-type",
    "type",
    "per-channel",
    "input-from",
    "rank-above",
    "rank-below",
    "computed-input",
    "outside-chain",
    "unfused-outputs",
    "read-by",
    "folded-quantize-input",
    "shape-unrecorded",
    "shape-not-static",
)
#: Element type names as the profiles spell them (onnx's, lower case; "float32" for FLOAT).
TYPE_NAMES = frozenset(
    {
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int4",
        "uint4",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "bool",
        "string",
        "float8e4m3fn",
        "float8e4m3fnuz",
        "float8e5m2",
        "float8e5m2fnuz",
        "float4e2m1",
        "complex64",
        "complex128",
    }
)

_TOP_KEYS = {
    "target",
    "source",
    "opset",
    "ir",
    "arithmetic",
    "ops",
    "refuse",
    "differs",
    "quantization",
    "network",
    "rewrites",
    "shapes",
}
_SHAPES_KEYS = {"static", "source"}
_TARGET_KEYS = {"id", "title", "version", "proof", "runtime", "extra", "notes"}
_SOURCE_KEYS = {"id", "document", "version", "notes"}
_OPSET_KEYS = {"min", "max", "source", "notes"}
_IR_KEYS = {"max", "source", "notes"}
_ARITHMETIC_KEYS = {"float64", "source", "notes"}
#: What a target does with float64 arithmetic ([arithmetic] float64).
FLOAT64_ARITHMETIC = ("float64", "float32", "reduced", "refused")
_OPS_KEYS = {"domain", "names", "types", "min_opset", "max_opset", "note", "source"}
_REFUSE_KEYS = {
    "domain",
    "op",
    "when",
    "types",
    "ops",
    "through",
    "through_static",
    "inputs",
    "rank",
    "chain",
    "reason",
    "source",
}
_QUANT_KEYS = {
    "types",
    "constant_scale",
    "constant_zero_point",
    "symmetric",
    "per_channel",
    "blocked",
    "source",
    "notes",
}
_NETWORK_KEYS = {"io_only_types", "refused_types", "qdq_only_types", "source", "notes"}
_REWRITES_KEYS = {"keep", "avoid", "form", "options", "source", "notes"}
_RULE_OPTIONS_KEYS = {"rule", "options", "why", "source"}
_FORM_KEYS = {"name", "allow", "options", "form_options", "consent", "why", "source"}
CONSENTS = ("profile", "user")


def _fail(path: str, where: str, message: str) -> UsageError:
    return UsageError(f"{path}: {where}: {message}")


def _check_keys(path: str, where: str, table: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _fail(path, where, "must be a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(path, where, f"unknown key {unknown[0]!r}{closest(unknown[0], sorted(allowed))}")
    return table


def _string(path: str, where: str, table: dict[str, Any], key: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(path, where, f"'{key}' must be a non-empty string")
    return value


def _optional_string(path: str, where: str, table: dict[str, Any], key: str) -> str | None:
    return None if table.get(key) is None else _string(path, where, table, key)


def _int(path: str, where: str, table: dict[str, Any], key: str) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(path, where, f"'{key}' must be an integer")
    return value


def _bool(path: str, where: str, table: dict[str, Any], key: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise _fail(path, where, f"'{key}' must be true or false")
    return value


def _types(path: str, where: str, table: dict[str, Any], key: str) -> frozenset[str] | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(path, where, f"'{key}' must be a list of element type names")
    for name in value:
        if name not in TYPE_NAMES:
            raise _fail(path, where, f"'{key}': unknown element type {name!r}{closest(name, sorted(TYPE_NAMES))}")
    return frozenset(value)


def _cited(path: str, where: str, table: dict[str, Any], sources: Mapping[str, Source]) -> str:
    """Every entry cites a declared source: that is what makes a verdict traceable."""
    source = table.get("source")
    if not isinstance(source, str) or not source:
        raise _fail(path, where, "'source' is missing: every entry must cite a [[source]] id")
    if source not in sources:
        raise _fail(path, where, f"'source' {source!r} is not a [[source]] id (known: {', '.join(sources)})")
    return source


def _check_rule_ids(path: str, where: str, ids: frozenset[str]) -> None:
    """Rule ids a profile names must exist (shipped catalogue or a named form): a typo would
    silently avoid nothing."""
    from onnx_qrewrite.rewriter.catalogue import load_catalogue, shipped_rules_dir

    forms = sorted((shipped_rules_dir() / "forms").glob("*.toml"))
    known = load_catalogue(forms).ids
    for rule_id in sorted(ids):
        if rule_id not in known:
            raise _fail(path, where, f"no rule {rule_id!r}{closest(rule_id, known)}")


def _form(path: str, where: str, item: Any, sources: Mapping[str, Source]) -> FormRequest:
    """One ``[[rewrites.form]]``, checked against the form itself: it exists, the consent leaves
    it at least one rule, and the options are valid for its rules (as ``--option`` would be)."""
    from onnx_qrewrite.rewriter.catalogue import named_form
    from onnx_qrewrite.rewriter.contract import EXACTNESS

    raw = _check_keys(path, where, item, _FORM_KEYS)
    source = _cited(path, where, raw, sources)
    name = _string(path, where, raw, "name")
    allow = _string(path, where, raw, "allow")
    if allow not in EXACTNESS:
        raise _fail(path, where, f"'allow' must be one of {', '.join(EXACTNESS)}, got {allow!r}")
    why = raw.get("why", "")
    if not isinstance(why, str):
        raise _fail(path, where, "'why' must be a string")
    options = raw.get("options", {})
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise _fail(path, where, "'options' must be a table of tables: { rule-id = { key = value } }")
    form_options = raw.get("form_options", {})
    if not isinstance(form_options, dict):
        raise _fail(path, where, "'form_options' must be a table: { key = value }")
    consent = raw.get("consent", "profile")
    if consent not in CONSENTS:
        raise _fail(path, where, f"'consent' must be one of {', '.join(CONSENTS)}, got {consent!r}")
    request = FormRequest(name, allow, source, why, options, form_options, consent)
    try:
        named_form(name)
        rules = request.rules()
    except UsageError as exc:
        raise _fail(path, where, str(exc)) from None
    usable = [r.id for r in rules if EXACTNESS.index(r.exactness) <= EXACTNESS.index(allow)]
    if not usable:
        levels = ", ".join(sorted({r.exactness for r in rules}))
        raise _fail(path, where, f"form {name!r} has no rule at allow = {allow!r} or more exact (its rules: {levels})")
    return request


def _variants(path: str, forms: list[FormRequest]) -> tuple[FormRequest, ...]:
    """A form listed again must differ in its options; its rules are then told apart by them."""
    out: list[FormRequest] = []
    for i, form in enumerate(forms):
        same = [f for f in out if f.name == form.name]
        if not same:
            out.append(form)
            continue
        settings = sorted(
            [(k, v) for k, v in form.form_options.items()]
            + [(f"{rule}.{k}", v) for rule, kv in form.options.items() for k, v in kv.items()]
        )
        variant = ",".join(f"{k}={v}" for k, v in settings)
        for earlier in same:
            if (dict(earlier.form_options), _plain(earlier.options)) == (dict(form.form_options), _plain(form.options)):
                raise _fail(
                    path,
                    f"[[rewrites.form]] #{i + 1}",
                    f"form {form.name!r} is listed twice with the same options: a later listing must differ in "
                    "'options' or 'form_options'",
                )
        out.append(dataclasses.replace(form, variant=variant))
    return tuple(out)


def _plain(options: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: dict(v) for k, v in options.items()}


@functools.lru_cache(maxsize=64)
def _decoded(text: str) -> dict[str, Any]:
    """A profile's TOML, decoded once per text: every ``--target`` plan loads every profile (to
    find one by id), and the decoding was most of that. A text that does not decode raises each
    time; callers get a copy (:func:`parse_target`), so nothing can change the remembered one."""
    return tomllib.loads(text)


def parse_target(text: str, path: str) -> TargetProfile:
    """A profile from TOML text; ``path`` names the file in error messages."""
    try:
        data = copy.deepcopy(_decoded(text))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise UsageError(f"{path}: not a target profile: arrays or tables nested too deeply") from None
    _check_keys(path, "top level", data, _TOP_KEYS)
    target = _check_keys(path, "[target]", data.get("target"), _TARGET_KEYS)
    target_id = _string(path, "[target]", target, "id")
    title = _string(path, "[target]", target, "title")
    version = _string(path, "[target]", target, "version")
    proof = _string(path, "[target]", target, "proof")
    if proof not in PROOFS:
        raise _fail(path, "[target]", f"'proof' must be one of {', '.join(PROOFS)}, got {proof!r}")
    # Each table is checked in this order, so a file with several problems names the same first one.
    sources = _sources(path, data)
    opset = _opset(path, data, sources)
    ir = _ir(path, data, sources)
    arithmetic = _arithmetic(path, data, sources)
    ops = _ops(path, data, sources)
    refusals = tuple(_refusal(path, where, raw, sources) for where, raw in _tables(path, data, "refuse"))
    differences = tuple(_refusal(path, where, raw, sources) for where, raw in _tables(path, data, "differs"))
    quantization = _quantization(path, data, sources)
    network = _network(path, data, sources)
    rewrites = _rewrites(path, data, sources, ops, target_id)
    shapes = _shapes(path, data, sources)
    return TargetProfile(
        id=target_id,
        title=title,
        version=version,
        proof=proof,
        path=path,
        sources=sources,
        ops=ops,
        refusals=refusals,
        differences=differences,
        quantization=quantization,
        **opset,
        **ir,
        **arithmetic,
        **network,
        **rewrites,
        **shapes,
        runtime=_optional_string(path, "[target]", target, "runtime"),
        extra=_optional_string(path, "[target]", target, "extra"),
    )


# One function per table of a profile: each checks its table and returns what TargetProfile keeps
# of it (a table left out keeps TargetProfile's defaults: its functions return no field).


def _tables(path: str, table: Mapping[str, Any], key: str, name: str | None = None) -> list[tuple[str, Any]]:
    """The entries of the array of tables ``key`` of ``table`` (none when absent), each with the
    name messages give it: ``[[name]] #n`` (``name``: the key's full dotted name, default ``key``)."""
    name = name or key
    raw = table.get(key, [])
    if not isinstance(raw, list):
        raise _fail(path, f"[[{name}]]", "must be an array of tables")
    return [(f"[[{name}]] #{i + 1}", item) for i, item in enumerate(raw)]


def _sources(path: str, data: Mapping[str, Any]) -> dict[str, Source]:
    """``[[source]]``: the documents every other entry cites (at least one, ids unique)."""
    raw_sources = data.get("source", [])
    if not isinstance(raw_sources, list) or not raw_sources:
        raise _fail(path, "[[source]]", "at least one [[source]] table is required")
    sources: dict[str, Source] = {}
    for where, item in _tables(path, data, "source"):
        raw = _check_keys(path, where, item, _SOURCE_KEYS)
        sid = _string(path, where, raw, "id")
        if sid in sources:
            raise _fail(path, where, f"source id {sid!r} is defined twice")
        sources[sid] = Source(sid, _string(path, where, raw, "document"), _string(path, where, raw, "version"))
    return sources


def _opset(path: str, data: Mapping[str, Any], sources: Mapping[str, Source]) -> dict[str, Any]:
    """``[opset]``: the model opsets the target runs."""
    if "opset" not in data:
        return {}
    opset = _check_keys(path, "[opset]", data["opset"], _OPSET_KEYS)
    return {
        "opset_source": _cited(path, "[opset]", opset, sources),
        "opset_min": _int(path, "[opset]", opset, "min"),
        "opset_max": _int(path, "[opset]", opset, "max"),
    }


def _ir(path: str, data: Mapping[str, Any], sources: Mapping[str, Source]) -> dict[str, Any]:
    """``[ir]``: the highest IR version the target loads."""
    if "ir" not in data:
        return {}
    ir = _check_keys(path, "[ir]", data["ir"], _IR_KEYS)
    highest = _int(path, "[ir]", ir, "max")
    if highest is None or highest < 1:
        raise _fail(path, "[ir]", "'max' (an IR version >= 1) is required")
    return {"ir_source": _cited(path, "[ir]", ir, sources), "ir_max": highest}


def _arithmetic(path: str, data: Mapping[str, Any], sources: Mapping[str, Source]) -> dict[str, Any]:
    """``[arithmetic]``: what the target computes float64 arithmetic in."""
    if "arithmetic" not in data:
        return {}
    raw = _check_keys(path, "[arithmetic]", data["arithmetic"], _ARITHMETIC_KEYS)
    value = raw.get("float64")
    if value not in FLOAT64_ARITHMETIC:
        raise _fail(path, "[arithmetic]", f"'float64' must be one of {', '.join(FLOAT64_ARITHMETIC)}, got {value!r}")
    return {"arithmetic_source": _cited(path, "[arithmetic]", raw, sources), "float64": value}


def _ops(
    path: str, data: Mapping[str, Any], sources: Mapping[str, Source]
) -> dict[tuple[str, str], tuple[OpSupport, ...]]:
    """``[[ops]]``: what the target runs, by (domain, op); one table may name several ops."""
    ops: dict[tuple[str, str], list[OpSupport]] = {}
    for where, item in _tables(path, data, "ops"):
        raw = _check_keys(path, where, item, _OPS_KEYS)
        source = _cited(path, where, raw, sources)
        domain = raw.get("domain", "")
        if not isinstance(domain, str):
            raise _fail(path, where, "'domain' must be a string")
        names = raw.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise _fail(path, where, "'names' must be a non-empty list of op names")
        types = _types(path, where, raw, "types")
        note = raw.get("note", "")
        if not isinstance(note, str):
            raise _fail(path, where, "'note' must be a string")
        lo, hi = _int(path, where, raw, "min_opset"), _int(path, where, raw, "max_opset")
        for name in names:
            entry = OpSupport(norm_domain(domain), name, source, types, lo, hi, note)
            ops.setdefault((entry.domain, name), []).append(entry)
    return {k: tuple(v) for k, v in ops.items()}


def _refusal(path: str, where: str, item: Any, sources: Mapping[str, Source]) -> Refusal:
    """One ``[[refuse]]``: an op the target refuses in a given situation (``when``), with the
    settings that situation needs and no others."""
    raw = _check_keys(path, where, item, _REFUSE_KEYS)
    source = _cited(path, where, raw, sources)
    when = _string(path, where, raw, "when")
    if when not in REFUSE_WHEN:
        raise _fail(path, where, f"'when' must be one of {', '.join(REFUSE_WHEN)}, got {when!r}")
    types = _types(path, where, raw, "types") or frozenset()
    if when in ("quantized-type", "type") and not types:
        raise _fail(path, where, f"'when = \"{when}\"' needs 'types'")
    after_ops = raw.get("ops", [])
    if not isinstance(after_ops, list) or not all(isinstance(o, str) and o for o in after_ops):
        raise _fail(path, where, "'ops' must be a list of op names")
    if (when in ("input-from", "unfused-outputs", "read-by")) != bool(after_ops):
        raise _fail(path, where, "'ops' goes with 'when' input-from, unfused-outputs or read-by, and they need them")
    positions = raw.get("inputs", [0])
    if (
        not isinstance(positions, list)
        or not positions
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in positions)
    ):
        raise _fail(path, where, "'inputs' must be a non-empty list of input positions (0, 1, ...)")
    looks_at = ("rank-above", "rank-below", "computed-input", "input-from", "shape-unrecorded", "shape-not-static")
    if "inputs" in raw and when not in looks_at:
        raise _fail(path, where, f"'inputs' goes with 'when' {', '.join(looks_at[:-1])} or {looks_at[-1]}")
    rank = _int(path, where, raw, "rank")
    if (when in ("rank-above", "rank-below")) != (rank is not None) or (rank is not None and rank < 0):
        raise _fail(path, where, "'rank' (a number >= 0) goes with 'when' rank-above or rank-below, and they need one")
    chain = raw.get("chain", [])
    if not isinstance(chain, list) or not all(isinstance(o, str) and o for o in chain):
        raise _fail(path, where, "'chain' must be a list of op names")
    through = raw.get("through", [])
    if not isinstance(through, list) or not all(isinstance(o, str) and o for o in through):
        raise _fail(path, where, "'through' must be a list of op names")
    if through and when != "input-from":
        raise _fail(path, where, "'through' goes with 'when = \"input-from\"'")
    through_static = _through_static(path, where, raw, through)
    op = _string(path, where, raw, "op")
    if (when == "outside-chain") != bool(chain) or (chain and op not in chain):
        raise _fail(path, where, "'chain' goes with 'when = \"outside-chain\"', needs ops, and must name 'op'")
    return Refusal(
        norm_domain(str(raw.get("domain", ""))),
        op,
        when,
        _string(path, where, raw, "reason"),
        source,
        types,
        frozenset(after_ops),
        tuple(positions),
        rank,
        tuple(chain),
        frozenset(through),
        through_static,
    )


def _through_static(path: str, where: str, raw: Mapping[str, Any], through: list[str]) -> tuple[tuple[str, int], ...]:
    """``through_static``: ops of ``through`` (to input positions) looked through only where that
    input is computed from constants and shapes alone (a runtime that folds it folds the op away)."""
    table = raw.get("through_static", {})
    if not isinstance(table, Mapping) or not all(
        op in through and isinstance(i, int) and not isinstance(i, bool) and i >= 0 for op, i in table.items()
    ):
        raise _fail(path, where, "'through_static' maps ops of 'through' to an input position (0, 1, ...)")
    return tuple(sorted(table.items()))


def _quantization(path: str, data: Mapping[str, Any], sources: Mapping[str, Source]) -> Quantization | None:
    """``[quantization]``: the quantized forms the target runs."""
    if "quantization" not in data:
        return None
    raw = _check_keys(path, "[quantization]", data["quantization"], _QUANT_KEYS)
    return Quantization(
        source=_cited(path, "[quantization]", raw, sources),
        types=_types(path, "[quantization]", raw, "types"),
        constant_scale=_bool(path, "[quantization]", raw, "constant_scale", False),
        constant_zero_point=_bool(path, "[quantization]", raw, "constant_zero_point", False),
        symmetric=_bool(path, "[quantization]", raw, "symmetric", False),
        per_channel=_bool(path, "[quantization]", raw, "per_channel", True),
        blocked=_bool(path, "[quantization]", raw, "blocked", True),
    )


def _network(path: str, data: Mapping[str, Any], sources: Mapping[str, Source]) -> dict[str, Any]:
    """``[network]``: element types the target takes only at the model's edges, or refuses."""
    if "network" not in data:
        return {}
    raw = _check_keys(path, "[network]", data["network"], _NETWORK_KEYS)
    return {
        "network_source": _cited(path, "[network]", raw, sources),
        "io_only_types": _types(path, "[network]", raw, "io_only_types") or frozenset(),
        "refused_types": _types(path, "[network]", raw, "refused_types") or frozenset(),
        "qdq_only_types": _types(path, "[network]", raw, "qdq_only_types") or frozenset(),
    }


def _shapes(path: str, data: Mapping[str, Any], sources: Mapping[str, Source]) -> dict[str, Any]:
    """``[shapes]``: whether the target needs every input dimension fixed."""
    if "shapes" not in data:
        return {}
    raw = _check_keys(path, "[shapes]", data["shapes"], _SHAPES_KEYS)
    return {
        "shapes_source": _cited(path, "[shapes]", raw, sources),
        "static_shapes": _bool(path, "[shapes]", raw, "static", False),
    }


def _rewrites(
    path: str,
    data: Mapping[str, Any],
    sources: Mapping[str, Source],
    ops: Mapping[tuple[str, str], Any],
    target_id: str,
) -> dict[str, Any]:
    """``[rewrites]``: ops to keep, rules to avoid and the named forms the target asks for. A kept
    op must be a standard op the profile's own tables list: a misspelt name would silently keep
    nothing, and the planner would rewrite what the target runs natively."""
    if "rewrites" not in data:
        return {}
    raw = _check_keys(path, "[rewrites]", data["rewrites"], _REWRITES_KEYS)
    rewrites_source = None
    if set(raw) - {"form", "options"}:  # each [[rewrites.form]] / [[rewrites.options]] cites its own source
        rewrites_source = _cited(path, "[rewrites]", raw, sources)
    for key in ("keep", "avoid"):
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise _fail(path, "[rewrites]", f"'{key}' must be a list of names")
    for op in sorted(set(raw.get("keep", []))):
        if ("", op) not in ops:
            listed = sorted(name for domain, name in ops if domain == "")
            raise _fail(path, "[rewrites] keep", f"{op!r} is not a standard op the profile lists{closest(op, listed)}")
    avoid = frozenset(raw.get("avoid", []))
    if avoid:
        _check_rule_ids(path, "[rewrites] avoid", avoid)
    forms = [_form(path, where, item, sources) for where, item in _tables(path, raw, "form", "rewrites.form")]
    return {
        "rewrites_source": rewrites_source,
        "keep": frozenset(raw.get("keep", [])),
        "avoid": avoid,
        "forms": _variants(path, forms),
        "rule_options": _rule_options(path, raw, sources, avoid, target_id),
    }


def _rule_options(
    path: str, raw: Mapping[str, Any], sources: Mapping[str, Source], avoid: frozenset[str], target_id: str
) -> tuple[ProfileRuleOptions, ...]:
    """``[[rewrites.options]]``: each names a rule of the shipped catalogue once, and its options
    are checked against that rule's builder contract exactly as a rule file's are (unknown key,
    wrong type, a value not allowed, an exactness the options no longer deliver), so a typo fails
    when the profile loads, not silently at planning time."""
    entries = _tables(path, raw, "options", "rewrites.options")
    if not entries:
        return ()
    from onnx_qrewrite.rewriter.catalogue import load_catalogue

    shipped = load_catalogue()
    out: list[ProfileRuleOptions] = []
    for where, item in entries:
        named = f"target {target_id!r}, {where}"
        if isinstance(item, dict) and isinstance(item.get("rule"), str):
            named = f"{named} (rule {item['rule']!r})"  # every message names the rule, when there is one
        entry = _rule_option(path, named, item, sources)
        _check_rule_options(path, named, shipped, entry.rule, entry.options, avoid)
        if any(o.rule == entry.rule for o in out):
            raise _fail(path, named, f"rule {entry.rule!r} is given options twice: merge them into one entry")
        out.append(entry)
    return tuple(out)


def _rule_option(path: str, where: str, item: Any, sources: Mapping[str, Source]) -> ProfileRuleOptions:
    """One ``[[rewrites.options]]`` entry's keys and their types."""
    entry = _check_keys(path, where, item, _RULE_OPTIONS_KEYS)
    rule_id = _string(path, where, entry, "rule")
    source = _cited(path, where, entry, sources)
    options = entry.get("options")
    if not isinstance(options, dict) or not options:
        raise _fail(path, where, "'options' must be a non-empty table: { key = value }")
    why = entry.get("why", "")
    if not isinstance(why, str):
        raise _fail(path, where, "'why' must be a string")
    return ProfileRuleOptions(rule_id, dict(options), source, why)


def _check_rule_options(
    path: str, where: str, shipped: Any, rule_id: str, options: Mapping[str, Any], avoid: frozenset[str]
) -> None:
    """The rule exists in the shipped catalogue (a form's rules take their options in their
    ``[[rewrites.form]]``), is not avoided, and takes ``options`` (its contract says so)."""
    from onnx_qrewrite.rewriter.catalogue import load_catalogue, shipped_rules_dir

    if rule_id not in shipped.ids:
        forms = sorted((shipped_rules_dir() / "forms").glob("*.toml"))
        form = next((f.stem for f in forms if rule_id in load_catalogue([f], include_shipped=False).ids), None)
        if form is not None:
            raise _fail(path, where, f"{rule_id!r} is a rule of form {form!r}: set it in that form's options")
        raise _fail(path, where, f"no rule {rule_id!r} in the catalogue{closest(rule_id, shipped.ids)}")
    if rule_id in avoid:
        raise _fail(path, where, f"rule {rule_id!r} is in [rewrites] avoid: it is never used for this target")
    try:
        shipped.select(only=[rule_id]).with_options({rule_id: options})
    except UsageError as exc:
        why = str(exc).split(f"options for rule {rule_id!r} (overridden): ", 1)[-1]
        raise _fail(path, where, why) from None


def shipped_targets_dir() -> Path:
    """``targets/`` of the shipped rule catalogue (inside the wheel, or ``rules/`` in a checkout)."""
    from onnx_qrewrite.rewriter.catalogue import shipped_rules_dir

    return shipped_rules_dir() / "targets"


def _read(path: Path) -> TargetProfile:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: target file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read target file: {exc}") from None
    profile = parse_target(text, str(path))
    if profile.id != path.stem:
        raise UsageError(f"{path}: [target] id {profile.id!r} must match the file name {path.stem!r}")
    return profile


def load_targets(directory: str | Path | None = None) -> dict[str, TargetProfile]:
    """Every profile in ``directory`` (default: the shipped ones), by id, in file-name order."""
    folder = Path(directory) if directory is not None else shipped_targets_dir()
    return {p.id: p for p in (_read(path) for path in sorted(folder.glob("*.toml")))}


def load_target(name: str, directory: str | Path | None = None) -> TargetProfile:
    """One profile by id (``--target NAME``), or a path to a ``.toml`` profile of the user's."""
    if name.endswith(".toml"):
        return _read(Path(name))
    targets = load_targets(directory)
    if name not in targets:
        raise UsageError(f"--target: unknown target {name!r}{closest(name, targets)}; known: {', '.join(targets)}")
    return targets[name]
