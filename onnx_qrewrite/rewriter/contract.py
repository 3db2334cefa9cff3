"""The one contract between rules (data, ``rules/*.toml``) and builders (mechanism, ``builders/``).

Every builder declares, in one :class:`Contract`:

- its **options**: name, type, default and allowed values. The catalogue validates every rule's
  options against them when it loads (an unknown key or a bad value is a usage error naming the
  file, the rule and the key, with the closest valid name), and hands builders the options with
  the defaults filled in, so a builder never re-validates or re-states a default;
- what it **emits**: the default-domain op types its replacements may contain (the Emitter refuses
  any other, so the declaration cannot drift from the code; docs and ``rules`` show it);
- the **outputs** of the op it replaces (all written, same names and types) and whether output 0
  has input 0's shape (``preserves_shape``: shape look-ups see through such ops);
- the **element type of each output** of the op it replaces, for given options and matched op, in
  a few words the catalogue checks when it loads and the tests check on every rewrite they make
  (:data:`OUTPUT_TYPE_GRAMMAR`): the replacement writes the same types as the original op;
- its **exactness** for given options (below) and, when bounded, the bound in words;
- the **opset** its emitted ops need, in words for the docs (the number for one node is computed
  by ``check`` from the one table in :mod:`onnx_qrewrite.rewriter.kernel_opsets`).

Exactness levels, each rule declares one and it must be the builder's:

``exact``        bit-exact with onnxruntime's kernel for the original op (the default policy);
``bounded``      differs by at most a stated bound at the node's output; each rewrite's ``Plan``
                 gives the bound for that node (``Plan.bound``), recorded in the created nodes'
                 metadata so ``verify`` checks it at the node's own output;
``approximate``  changes the model's numerics by design; runs only when asked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from onnx_qrewrite._dataclass import dataclass

__all__ = [
    "APPROXIMATE",
    "BOUNDED",
    "ELEMENT_TYPES",
    "EXACT",
    "EXACTNESS",
    "OUTPUT_TYPE_GRAMMAR",
    "REQUIRED",
    "RUN_TIME_K_FORMULA",
    "UNREAD",
    "Contract",
    "Option",
    "always",
    "closest",
    "output_type_problem",
    "resolve_output_type",
]

EXACT = "exact"
BOUNDED = "bounded"
APPROXIMATE = "approximate"
#: In order of preference: the engine tries exact rules first, then bounded ones.
EXACTNESS = (EXACT, BOUNDED, APPROXIMATE)

#: The bound formula (``Plan.bound_formula``, ``run-time-k:<c>``) of a bound that is a function of a
#: reduction length K known only at run time: ``floor(gamma(K + 4)·K·c) + 1`` steps, which ``verify``
#: evaluates at each sample's K (verify/element_bounds.py). Named here, where the report reads it.
RUN_TIME_K_FORMULA = "run-time-k"


def closest(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or '' when none is close."""
    import difflib  # only a bad rule file needs it: not imported on every start

    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


#: ``Option.default`` of an option every rule must give.
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Option:
    """One option a builder takes from its rules."""

    name: str
    type: type
    default: Any = REQUIRED
    #: The only values accepted (None: any value of ``type``).
    allowed: tuple[Any, ...] | None = None
    doc: str = ""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable, or None."""
        if self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.type)
        if not ok:
            return f"must be {_TYPE_NAMES.get(self.type, self.type.__name__)}, not {value!r}"
        if self.allowed is not None and value not in self.allowed:
            hint = closest(value, [str(a) for a in self.allowed]) if isinstance(value, str) else ""
            return f"{value!r} is not one of {', '.join(repr(a) for a in self.allowed)}{hint}"
        return None


def always(level: str) -> Callable[[Mapping[str, Any]], str]:
    """An exactness that does not depend on the options."""
    return lambda options: level


_ALWAYS_EXACT = always(EXACT)


#: ONNX element type names, as rule files, reports and output-type declarations spell them.
ELEMENT_TYPES = frozenset(
    {
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "bool",
        "uint4",
        "int4",
        "float8e4m3fn",
        "float8e4m3fnuz",
        "float8e5m2",
        "float8e5m2fnuz",
    }
)

#: An output's declared type for outputs the replacement removes: a rule with this type rewrites a
#: node only when nothing reads its outputs (a pattern's dead parts), so it promises no type.
#: A declaration of ``(UNREAD,)`` alone covers every output of the op.
UNREAD = "unread"

OUTPUT_TYPE_GRAMMAR = """\
An output's element type, one string per output of the replaced op:

    unread                         the rewrite removes the output (nothing reads it); alone,
                                   every output of the op (a pattern's dead parts)
    ALTERNATIVE [else ALTERNATIVE]...
    ALTERNATIVE = SOURCE [if input N]
    SOURCE      = an element type (float32, uint8, ...) | input N (that input's element type)
                | attribute NAME (the node's attribute, an ONNX data type, e.g. Cast's 'to')
                | option NAME (the rule's option, an element type name)

The first alternative that applies gives the type: one reading an absent input or attribute, or
conditioned on an absent input, does not apply. E.g. QuantizeLinear's 'attribute output_dtype else
input 2 else uint8'.
"""


@dataclass(frozen=True)
class _Alternative:
    """One alternative of a declared output type (``A else B``): where the type comes from."""

    kind: str  # "type", "input", "attribute" or "option"
    value: str | int
    if_input: int | None


def _parse_output_type(spec: str) -> list[_Alternative] | str:
    """The alternatives of a declared output type, or why ``spec`` is not one."""
    alternatives = []
    for text in spec.split(" else "):
        words = text.split()
        condition = None
        if len(words) >= 3 and words[-3:-1] == ["if", "input"]:
            if not words[-1].isdigit():
                return f"{text!r}: 'if input' needs an input index"
            condition, words = int(words[-1]), words[:-3]
        if len(words) == 1 and words[0] in ELEMENT_TYPES:
            alternatives.append(_Alternative("type", words[0], condition))
        elif len(words) == 2 and words[0] == "input" and words[1].isdigit():
            alternatives.append(_Alternative("input", int(words[1]), condition))
        elif len(words) == 2 and words[0] in ("attribute", "option") and words[1].isidentifier():
            alternatives.append(_Alternative(words[0], words[1], condition))
        else:
            hint = closest(text, sorted(ELEMENT_TYPES)) if len(words) == 1 else ""
            return f"{text!r} is not an element type, 'input N', 'attribute NAME' or 'option NAME'{hint}"
    return alternatives


def output_type_problem(spec: Any, options: Mapping[str, Any]) -> str | None:
    """Why ``spec`` cannot be satisfied with the rule's (validated, defaulted) ``options``, or None."""
    if not isinstance(spec, str):
        return f"{spec!r} is not a string"
    if spec == UNREAD:
        return None
    parsed = _parse_output_type(spec)
    if isinstance(parsed, str):
        return parsed
    for alt in parsed:
        if alt.kind != "option":
            continue
        name = str(alt.value)
        if name not in options:
            return f"'option {name}': the builder has no such option{closest(name, options)}"
        if options[name] not in ELEMENT_TYPES:
            return f"'option {name}' is {options[name]!r}, not an element type"
    return None


def resolve_output_type(
    spec: str,
    options: Mapping[str, Any],
    input_type: Callable[[int], str | None],
    attribute_type: Callable[[str], str | None],
) -> str | None:
    """The element type ``spec`` declares for one node: ``input_type(i)`` is its input i's type
    (None: absent or unknown), ``attribute_type(name)`` its attribute's (None: absent). None when
    no alternative applies, or for :data:`UNREAD`."""
    parsed = [] if spec == UNREAD else _parse_output_type(spec)
    assert not isinstance(parsed, str), parsed  # checked when the catalogue loaded
    for alt in parsed:
        if alt.if_input is not None and input_type(alt.if_input) is None:
            continue
        if alt.kind == "type":
            return str(alt.value)
        found = {
            "input": lambda v: input_type(int(v)),
            "attribute": lambda v: attribute_type(str(v)),
            "option": lambda v: str(options[v]),
        }[alt.kind](alt.value)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Contract:
    """What a builder promises; see the module docstring."""

    options: tuple[Option, ...]
    #: Default-domain op types the replacements may contain.
    emits: frozenset[str]
    #: Exactness for the (validated, defaulted) options.
    exactness: Callable[[Mapping[str, Any]], str] = _ALWAYS_EXACT
    #: The bound of a bounded form, in words (docs, ``rules --long``, reports).
    bound: str = ""
    #: Outputs the op it replaces always has. The onnxscript rule set matches nodes with this many up
    #: to as many as ``output_types`` declares (optional outputs: one pattern per count).
    outputs: int = 1
    #: Output 0 has input 0's shape.
    preserves_shape: bool = False
    #: The element type of each output of the replaced op (:data:`OUTPUT_TYPE_GRAMMAR`), given a
    #: rule's options and the op it matches; None for an op the builder does not replace. At least
    #: ``outputs`` entries (an op may have optional outputs the builder declines when they are read).
    output_types: Callable[[Mapping[str, Any], str], tuple[str, ...] | None] | None = None
    #: The default-domain opset the emitted ops need, in words, given a rule's options and dtypes.
    opset: Callable[[Mapping[str, Any], Collection[str] | None], str] = lambda options, dtypes: "any"

    def output_types_problem(self, options: Mapping[str, Any], op: str) -> str | None:
        """Why the declared output types of ``op`` cannot be satisfied with a rule's (validated,
        defaulted) ``options``, or None (checked for every rule when the catalogue loads)."""
        if self.output_types is None:
            return "the builder declares no output types"
        declared = self.output_types(options, op)
        if declared is None:
            return f"the builder declares no output types for {op} (it does not replace that op)"
        if len(declared) < self.outputs:
            return f"{len(declared)} output type(s) declared for {op}, which has {self.outputs} outputs"
        for i, spec in enumerate(declared):
            why = output_type_problem(spec, options)
            if why:
                return f"output {i} of {op}: {why}"
        return None

    def option_names(self) -> list[str]:
        return [o.name for o in self.options]

    def resolve(self, given: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
        """Options with defaults filled in, and every (key, problem) found."""
        by_name = {o.name: o for o in self.options}
        problems = []
        for key, value in given.items():
            declared = by_name.get(key)
            if declared is None:
                known = ", ".join(self.option_names()) or "none"
                problems.append((key, f"unknown option{closest(key, by_name)}; this builder takes: {known}"))
                continue
            why = declared.problem(value)
            if why:
                problems.append((key, why))
        for o in self.options:
            if o.default is REQUIRED and o.name not in given:
                allowed = f" ({', '.join(repr(a) for a in o.allowed)})" if o.allowed else ""
                problems.append((o.name, f"required option missing{allowed}"))
        resolved = {o.name: given.get(o.name, o.default) for o in self.options}
        return resolved, problems
