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

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

__all__ = [
    "APPROXIMATE",
    "BOUNDED",
    "EXACT",
    "EXACTNESS",
    "REQUIRED",
    "Contract",
    "Option",
    "always",
    "closest",
]

EXACT = "exact"
BOUNDED = "bounded"
APPROXIMATE = "approximate"
#: In order of preference: the engine tries exact rules first, then bounded ones.
EXACTNESS = (EXACT, BOUNDED, APPROXIMATE)


def closest(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or '' when none is close."""
    import difflib  # only a bad rule file needs it: not imported on every start

    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


#: ``Option.default`` of an option every rule must give.
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
class Contract:
    """What a builder promises; see the module docstring."""

    options: tuple[Option, ...]
    #: Default-domain op types the replacements may contain.
    emits: frozenset[str]
    #: Exactness for the (validated, defaulted) options.
    exactness: Callable[[Mapping[str, Any]], str] = _ALWAYS_EXACT
    #: The bound of a bounded form, in words (docs, ``rules --long``, reports).
    bound: str = ""
    #: Outputs of the op it replaces (the pattern rewriter matches that many).
    outputs: int = 1
    #: Output 0 has input 0's shape.
    preserves_shape: bool = False
    #: The default-domain opset the emitted ops need, in words, given a rule's options and dtypes.
    opset: Callable[[Mapping[str, Any], Collection[str] | None], str] = lambda options, dtypes: "any"

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
