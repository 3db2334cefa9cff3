"""Decide each distinct node structure once: a rule's check recorded as the facts it read.

A chain of 20k blocks has 20k alike DynamicQuantizeLinear nodes and 20k alike MatMulIntegers: each
rule's check reads the same facts about each of them (operand types, producers' ops, shapes, the
bytes of a zero point) and comes to the same plan. Here a check runs once per structure, on a
:class:`RecordingSite`, which notes every question it asks of the graph and the answer; another node
of the same *head* (rule, op, domain, attributes, and which of its input and output names are
empty or equal) gets that check's outcome when asking the same questions about it gives the same
answers (:meth:`CheckMemo.decide`). The key is therefore what the check read, not a list kept by
hand: a check that starts reading something else records it.

Why this is sound. A check is a function of the answers it gets (the Site's queries, all recorded
here), of the head (the node's op, domain, attributes and name pattern, which it may read without
recording) and of its rule's options. Names are what differs between nodes of one structure, so
the recording hands the check its node's names as :class:`Name` tokens: they can be compared (with
each other and with '') and passed back to the Site's queries, nothing else. Any other use (a name
formatted into a message, concatenated, sorted, compared with a literal) raises
:class:`Unrecorded`, and then nothing is memoised for that head: every node of it is checked as
before. A query's name argument is recorded by its *role* (input k, output k of the node, or the
literal name when it is another node's), and so are names in answers, so equalities between the
names a check sees are part of the key. An outcome is shared only when it holds no :class:`Name`
(a plan that kept a name of its node would be wrong for the next one; integer-matmul plans hold
input positions instead); a declining reason is shared the same way (a reason that names the node
could not have been formatted). Reading the node or scope objects directly (``site.node``,
``site.scope``) raises :class:`Unrecorded` too. Facts the scope shares (:meth:`Site.scope_memo`)
are keyed by their memo key, its names by role: a node whose key is not yet in the scope's memo
is checked as before (which fills it).

Replaying a trace asks the same questions again, so the look-ups a check makes are still paid; what
is saved is the check's own work (its reads' bookkeeping, the notes, the plan objects) and the
memory of one plan per node: every node of a structure shares one plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.builders import NoMatch, Plan
from onnx_qrewrite.rewriter.builders._emit import Site, no_unknown_attributes

if TYPE_CHECKING:
    from onnx_qrewrite.rewriter.catalogue import Rule

__all__ = ["CheckMemo", "Name", "RecordingSite", "Unrecorded", "replay_all", "structure_from", "structure_of"]

T = TypeVar("T")
_MISSING = object()
#: Traces kept per head: structures whose checks take more paths than this are checked as before.
_MAX_TRACES = 8
#: Recordings per head that may fail (a check that reads a name's text, say) before its nodes are
#: all checked as before: each failure costs a second run of the check.
_MAX_FAILURES = 4


class Unrecorded(Exception):
    """The check used something the recording cannot key on (a name's text, the node itself)."""


#: A name's role: ("i", k) input k of the node, ("o", k) output k, ("n", text) any other name.
Role = tuple[str, Any]


class Name:
    """A name as a recorded check sees it: comparable, hashable, true when not empty; no text."""

    __slots__ = ("real", "role")

    def __init__(self, real: str, role: Role):
        self.real = real
        self.role = role

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Name):
            return self.real == other.real
        if other == "":
            return self.real == ""
        if isinstance(other, str):
            raise Unrecorded("a name compared with a literal")
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.real)

    def __bool__(self) -> bool:
        return bool(self.real)

    def _text(self, *_: Any) -> str:
        raise Unrecorded("a name's text was read")

    __str__ = __repr__ = __format__ = _text


def _real(value: Any) -> Any:
    """``value`` with its :class:`Name` tokens replaced by the names (tuples looked into)."""
    if isinstance(value, Name):
        return value.real
    if type(value) is tuple:
        return tuple(_real(v) for v in value)
    return value


def _holds_name(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds a :class:`Name` or anything this cannot look into (then it may)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.ndarray, np.generic)):
        return False
    if isinstance(value, Name) or depth > 8:
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return any(_holds_name(v, depth + 1) for v in value)
    if isinstance(value, (dict, MappingProxyType)):
        return any(_holds_name(k, depth + 1) or _holds_name(v, depth + 1) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_name(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    return True


def _answer_key(value: Any, roles: Mapping[str, Role]) -> Hashable:
    """A comparable form of a query's answer: names by role (``roles``: the node's names),
    arrays by dtype, shape and bytes, dataclasses by their fields."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        if isinstance(value, str) and value:
            return ("name", roles.get(value, ("n", value)))
        return (type(value), value)
    if isinstance(value, float):
        return (float, value.hex())
    if isinstance(value, Name):
        return ("name", roles.get(value.real, ("n", value.real)))
    if isinstance(value, tuple):
        return (tuple, *(_answer_key(v, roles) for v in value))
    if isinstance(value, (np.ndarray, np.generic)):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), *(_answer_key(getattr(value, f.name), roles) for f in dataclasses.fields(value)))
    raise Unrecorded(f"an answer of type {type(value).__name__}")


def _roles(inputs: tuple[str, ...], outputs: tuple[str, ...]) -> dict[str, Role]:
    """Each of the node's names and its role (its first place: inputs, then outputs)."""
    roles: dict[str, Role] = {}
    for kind, names in (("i", inputs), ("o", outputs)):
        for k, name in enumerate(names):
            if name and name not in roles:
                roles[name] = (kind, k)
    return roles


@dataclass(frozen=True, slots=True)
class _Slot:
    """A name in a recorded argument, by role."""

    role: Role


def _template(value: Any) -> Any:
    """A query's argument as recorded: its names as :class:`_Slot` roles."""
    if isinstance(value, Name):
        return _Slot(value.role)
    if type(value) is tuple:
        return tuple(_template(v) for v in value)
    if isinstance(value, str) and value:
        return _Slot(("n", value))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise Unrecorded(f"an argument of type {type(value).__name__}")


def _compiled(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[tuple[int, bool, int], ...]]:
    """A flat tuple of arguments as recorded: the tuple with other nodes' names in place, and
    where the node's own names go (position, an output?, index), so that binding it for another
    node is a few list stores (a nested tuple is refused: no check passes one)."""
    template = _template(args)
    base: list[Any] = []
    slots: list[tuple[int, bool, int]] = []
    for position, value in enumerate(template):
        if type(value) is tuple:
            raise Unrecorded("a nested tuple as a query's argument")
        if not isinstance(value, _Slot):
            base.append(value)
            continue
        kind, k = value.role
        if kind != "n":
            slots.append((position, kind == "o", k))
        base.append(k if kind == "n" else None)
    return tuple(base), tuple(slots)


#: How a replayed answer is compared with the recorded one: plain equality (types, shapes and
#: producers' ops: numbers and op names, never a value's name), by role (a name), or through
#: :func:`_answer_key` (arrays, a scope's facts).
_EQUAL, _NAME, _KEY = 0, 1, 2
#: The arguments of a question about one of the node's own names and nothing else (most of them:
#: an input's type, shape or producer): its replay calls the query with that name, not a tuple
#: bound slot by slot. Compared by identity; equal to what :func:`_compiled` gives such a question.
_ONE_NAME: tuple[Any, ...] = (None,)
#: Each query's mode; ``scope_memo`` is looked up in the scope's memo (never computed on replay).
_MODES = {
    "elem_type": _EQUAL,
    "value_type": _EQUAL,
    "value_shape": _EQUAL,
    "producer_op": _EQUAL,
    "producer_input": _NAME,
    "constant": _KEY,
    "scope_memo": _KEY,
}


class RecordingSite(Site):
    """A :class:`Site` whose queries are recorded (see the module docstring); for one check."""

    __slots__ = ("_depth", "_entries", "_real_site", "_roles", "_seen")

    def __init__(self, real: Site):  # not Site.__init__: nothing is read from the node here
        self._real_site = real
        self._memo = None
        self.same_shape_ops = real.same_shape_ops
        self._roles = _roles(real.inputs, real.outputs)
        self.inputs = tuple(Name(n, self._roles[n]) if n else "" for n in real.inputs)  # type: ignore[misc]
        self.outputs = tuple(Name(n, self._roles[n]) if n else "" for n in real.outputs)  # type: ignore[misc]
        #: Each distinct question once, in order (see :class:`_Trace`).
        self._entries: list[_Entry] = []
        self._seen: set[tuple[Any, ...]] = set()
        self._depth = 0  # > 0: inside a scope fact's computation, which the fact's key stands for

    # The node and scope objects are not handed out: reads of them would not be recorded.
    @property
    def node(self) -> Any:  # type: ignore[override]
        raise Unrecorded("the check read the node itself")

    @property
    def scope(self) -> Any:  # type: ignore[override]
        raise Unrecorded("the check read the scope itself")

    @property
    def label(self) -> str:
        raise Unrecorded("the check read the node's name")

    # Part of the head (the same for every node of a structure): read as they are.
    @property
    def op_type(self) -> str:
        return self._real_site.op_type

    @property
    def default_opset(self) -> int:
        return self._real_site.default_opset

    def attribute(self, name: str, default: Any = None) -> Any:
        return self._real_site.attribute(name, default)

    def has_attribute(self, name: str) -> bool:
        return self._real_site.has_attribute(name)

    def no_unknown_attributes(self, known: Collection[str]) -> None:
        no_unknown_attributes(self._real_site.node, known)

    # The queries: asked of the real site, recorded.
    def _ask(self, query: str, *args: Any) -> Any:
        method = getattr(Site, query)
        answer = method(self._real_site, *_real(args))
        if self._depth == 0:
            self._note(query, method, args, answer)
        return answer

    def _note(self, query: str, method: Any, args: tuple[Any, ...], answer: Any) -> None:
        base, slots = _compiled(args)
        if (query, base, slots) not in self._seen:
            self._seen.add((query, base, slots))
            mode = _MODES[query]
            key = answer if mode == _EQUAL else _answer_key(answer, self._roles)
            if method is not None and base == (None,) and len(slots) == 1:
                base = _ONE_NAME  # marks the replay's fast path (_Trace.replays)
            self._entries.append((method, base, slots, mode, key, answer))

    def elem_type(self, value: str) -> int | None:
        return self._ask("elem_type", value) if value else None

    def value_type(self, value: str) -> int | None:
        return self._ask("value_type", value) if value else None

    def constant(self, value: str) -> np.ndarray | None:
        return self._ask("constant", value) if value else None

    def value_shape(self, value: str) -> tuple[int | None, ...] | None:
        return self._ask("value_shape", value)

    def producer_op(self, value: str) -> tuple[str, str] | None:
        return self._ask("producer_op", value) if value else None

    def producer_input(self, value: str, i: int) -> str:
        real = self._ask("producer_input", value, i)
        return Name(real, self._roles.get(real, ("n", real))) if real else ""  # type: ignore[return-value]

    def constant_slabs(self, value: str, max_bytes: int | None = None) -> Any:
        if self._depth == 0:
            raise Unrecorded("weights read as slabs outside a scope fact")
        return self._real_site.constant_slabs(_real(value), max_bytes)

    def scope_memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The scope's fact under ``key``: recorded by its key (and value), not by what computing
        it reads; computed here (and kept for the scope) only when the scope has none yet."""
        real_key = _real(key)
        memo = self._real_site.scope._memo
        found = memo.get(real_key, _MISSING)
        if found is _MISSING:
            self._depth += 1
            try:
                found = compute()
            except Exception as why:  # its reads were not recorded: a decline here cannot be keyed
                raise Unrecorded("a scope fact's computation failed") from why
            finally:
                self._depth -= 1
            if not _holds_name(found):
                memo[real_key] = found
        if self._depth == 0:
            if type(key) is not tuple:
                raise Unrecorded("a scope fact's key is not a tuple")
            self._note("scope_memo", None, key, found)
        return found


def structure_of(site: Site) -> Hashable:
    """What every node of one structure has in common that a check may read without recording:
    the op, domain and attributes (as bytes), and which of its names are empty or equal."""
    node = site.node
    return structure_from(node.domain, node.op_type, node.attribute, site.inputs, site.outputs)


def structure_from(
    domain: str, op_type: str, attrs: Sequence[Any], inputs: tuple[str, ...], outputs: tuple[str, ...]
) -> Hashable:
    """:func:`structure_of` from the node's parts (``attrs``: its attribute field), for a
    caller that has read them already."""
    names = inputs + outputs
    if "" in names or len(set(names)) != len(names):
        pattern: tuple[int, ...] = tuple(names.index(n) if n else -1 for n in names)
    else:
        pattern = ()
    attributes = tuple([a.SerializeToString() for a in attrs]) if attrs else ()
    return (domain, op_type, attributes, len(inputs), len(outputs), pattern)


#: A recorded question: the Site's method (None: the scope's memo, the arguments being its key),
#: its arguments (:func:`_compiled`), how answers compare (``_MODES``), the answer's key and the
#: answer itself (an answer that is the same object needs no comparing: a scope's fact).
_Entry = tuple[Any, tuple[Any, ...], tuple[tuple[int, bool, int], ...], int, Hashable, Any]


@dataclass(slots=True)
class _Trace:
    """One recorded check of a head: its questions and their answers, and the outcome.

    A node replays at most one of its head's traces: the check is deterministic, so two traces
    follow the same questions up to the first one whose answers differ, which no node answers
    both ways. Their order is only how soon the one a node replays is found."""

    entries: list[_Entry]
    plan: Plan | None
    declined: NoMatch | None

    def replays(self, site: Site, roles: dict[str, Role] | None) -> tuple[bool, dict[str, Role] | None]:
        """Whether asking ``site`` this trace's questions gives its answers (and the node's
        roles, if they were needed)."""
        inputs, outputs = site.inputs, site.outputs
        for method, args, slots, mode, key, answer in self.entries:
            if args is _ONE_NAME:  # the commonest question: about one of the node's own names
                ((_, output, k),) = slots
                found = method(site, outputs[k] if output else inputs[k])
                if found is answer:
                    continue
                if mode == _EQUAL:
                    if found != answer:
                        return False, roles
                    continue
                if roles is None:
                    roles = _roles(inputs, outputs)
                if _answer_key(found, roles) != key:
                    return False, roles
                continue
            if slots:
                bound = list(args)
                for position, output, k in slots:
                    bound[position] = outputs[k] if output else inputs[k]
                asked = tuple(bound)
            else:
                asked = args
            if method is None:
                found = site.scope._memo.get(asked, _MISSING)
                if found is _MISSING:
                    return False, roles
            else:
                found = method(site, *asked)
            if found is answer:
                continue
            if mode == _EQUAL:
                if found != answer:
                    return False, roles
                continue
            if roles is None:
                roles = _roles(inputs, outputs)
            if _answer_key(found, roles) != key:
                return False, roles
        return True, roles


class CheckMemo:
    """The recorded checks of one scope's nodes (see the module docstring)."""

    __slots__ = ("_failures", "_heads", "_site", "_structure", "_structures")

    def __init__(self) -> None:
        self._heads: dict[Hashable, list[_Trace]] = {}
        #: Per head, the recordings that failed (from _MAX_FAILURES on, its nodes are checked as before).
        self._failures: dict[Hashable, int] = {}
        #: The last site asked about and its structure (:func:`structure_of`): a node's candidate
        #: rules are tried one after the other.
        self._site: Site | None = None
        self._structure: Hashable = None
        #: Each distinct structure once: a match keeps its node's (:meth:`structure_of_site`),
        #: and 40k equal tuples would be ~6 MB where one shared object is 8 bytes a match.
        self._structures: dict[Hashable, Hashable] = {}

    def structure_of_site(self, site: Site) -> Hashable:
        """The structure (:func:`structure_of`, one shared object per distinct structure) of the
        node :meth:`decide` was last asked about, if that is ``site``; else None."""
        return self._structure if self._site is site else None

    def decide(self, rule: Rule, site: Site, check: Callable[[Site], Plan]) -> Plan:
        """``check(site)`` (the rule's dtype condition and its builder's check), or the outcome of
        an equal recorded check of a node of the same structure."""
        if self._site is not site:
            structure = structure_of(site)
            self._site, self._structure = site, self._structures.setdefault(structure, structure)
        head = (rule.id, self._structure)
        if self._failures.get(head, 0) >= _MAX_FAILURES:
            return check(site)
        traces = self._heads.setdefault(head, [])
        roles = None
        for position, trace in enumerate(traces):
            replayed, roles = trace.replays(site, roles)
            if replayed:
                if position:  # at most one trace replays (see _Trace): the last one to, first
                    traces.insert(0, traces.pop(position))
                if trace.plan is not None:
                    return trace.plan
                assert trace.declined is not None
                raise type(trace.declined)(*trace.declined.args)
        if len(traces) >= _MAX_TRACES:
            return check(site)
        recording = RecordingSite(site)
        try:
            plan = check(recording)
        except NoMatch as why:
            if all(type(a) is str for a in why.args):
                traces.append(_Trace(recording._entries, None, why))
                raise type(why)(*why.args) from None
            return self._failed(head, site, check)
        except Exception:  # noqa: BLE001 - any other failure: the check run as before says what it is
            return self._failed(head, site, check)
        if _holds_name(plan):
            return self._failed(head, site, check)
        traces.append(_Trace(recording._entries, plan, None))
        return plan

    def shared_structure(self, structure: Hashable) -> Hashable:
        """The one object kept for ``structure`` (:func:`structure_of`; see ``_structures``)."""
        return self._structures.setdefault(structure, structure)

    def traces_for(self, rule: Rule, structure: Hashable) -> list[_Trace] | None:
        """The recorded checks of ``rule`` on nodes of ``structure`` (a shared one), for
        :func:`replay_all`; None when its nodes are checked as before (too many failed recordings:
        :meth:`decide` then runs the check itself)."""
        head = (rule.id, structure)
        if self._failures.get(head, 0) >= _MAX_FAILURES:
            return None
        return self._heads.get(head, [])

    def _failed(self, head: Hashable, site: Site, check: Callable[[Site], Plan]) -> Plan:
        """A recording that cannot be kept: counted against its head, and the check run as before."""
        self._failures[head] = self._failures.get(head, 0) + 1
        return check(site)


#: Answers to one recorded question about many nodes: the Site's method (a function of
#: :class:`Site`) and one name per node, or None when there is no bulk form for that method.
BulkAsk = Callable[[Any, list[str]], "list[Any] | None"]


def replay_all(
    traces: list[_Trace],
    inputs: list[tuple[str, ...]],
    outputs: list[tuple[str, ...]],
    site: Site,
    ask: BulkAsk,
) -> list[_Trace | None]:
    """For nodes of one structure (their names: ``inputs[j]``, ``outputs[j]``), the trace of
    ``traces`` each one replays (None: none does), as :meth:`_Trace.replays` would find node by
    node, but asking each recorded question of all the nodes still in the running at once (one
    comprehension, or ``ask``'s bulk form of the query: a search of the producer index for all
    their names together). ``site``: any Site of their scope, which the questions are asked
    through (they read its scope and ``same_shape_ops``, never its node). What a question raises
    is raised (the caller then decides the nodes one by one, which raise it in node order)."""
    found: list[_Trace | None] = [None] * len(inputs)
    left = list(range(len(inputs)))
    for trace in traces:
        live = left
        for method, args, slots, mode, key, answer in trace.entries:
            if not live:
                break
            answers = _answers(method, args, slots, live, inputs, outputs, site, ask)
            if mode == _EQUAL:
                live = [j for j, got in zip(live, answers, strict=True) if got is answer or got == answer]
            else:
                live = [
                    j
                    for j, got in zip(live, answers, strict=True)
                    if got is answer or (got is not _MISSING and _answer_key(got, _roles(inputs[j], outputs[j])) == key)
                ]
        for j in live:
            found[j] = trace
        if live:
            taken = set(live)
            left = [j for j in left if j not in taken]
        if not left:
            break
    return found


def _answers(
    method: Any,
    args: tuple[Any, ...],
    slots: tuple[tuple[int, bool, int], ...],
    live: list[int],
    inputs: list[tuple[str, ...]],
    outputs: list[tuple[str, ...]],
    site: Site,
    ask: BulkAsk,
) -> list[Any]:
    """One recorded question asked of each node ``live`` names (by its names): see :func:`replay_all`."""
    if args is _ONE_NAME:
        ((_, output, k),) = slots
        of = outputs if output else inputs
        names = [of[j][k] for j in live]
        got = ask(method, names)
        return got if got is not None else [method(site, name) for name in names]
    asked: list[tuple[Any, ...]] = []
    for j in live:
        ins, outs = inputs[j], outputs[j]
        bound = list(args)
        for position, output, k in slots:
            bound[position] = outs[k] if output else ins[k]
        asked.append(tuple(bound))
    if method is None:
        memo = site.scope._memo
        return [memo.get(a, _MISSING) for a in asked]
    return [method(site, *a) for a in asked]
