"""``dataclass``: :func:`dataclasses.dataclass`, with the methods it generates other than
``__init__`` compiled when first called instead of when the class is created.

Why: on Python 3.11 and 3.12, ``dataclasses`` writes each method it generates (``__repr__``,
``__eq__``, ``__hash__``, a frozen class's ``__setattr__`` and ``__delattr__``, the order
methods) as source text and compiles it with ``exec`` when the class is created, at every import
of its module: the byte-code cache does not hold them. Parsing and compiling that text was about
a tenth of the instructions of an ``inspect`` of a small model (issue 13, docs/performance.md),
and most of these methods are never called in a command: nothing compares or prints an
``EngineOptions``.

How: the class is made by :func:`dataclasses.dataclass` itself, with the same arguments. Only the
function ``dataclasses`` compiles each method with (``dataclasses._create_fn``) is replaced while
it runs, by one that returns, for a method other than ``__init__``, a stand-in: on its first call
the stand-in has the original function compile the method from the same text, names and
namespace, puts it in the class in its own place (a later call runs the method directly) and
calls it. So each method is the one ``dataclasses`` would have made, made later.
``__init__`` is compiled at once: the class's signature and the docstring ``dataclasses`` writes
for a class without one are read from it, and nearly every class is instantiated anyway.

Python 3.13 compiles all of a class's methods in one ``exec`` and has no ``_create_fn``: there
this is :func:`dataclasses.dataclass` unchanged. While a class is being made here, a
dataclass another thread makes at the same moment gets stand-ins too, which behave the same.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform

__all__ = ["dataclass"]

_T = TypeVar("_T")

#: The function ``dataclasses`` compiles a generated method with (None where it has none).
_COMPILE: Callable[..., Any] | None = getattr(dataclasses, "_create_fn", None)
_LOCK = threading.RLock()


def _deferred(name: str, *args: Any, **kwargs: Any) -> Any:
    """``dataclasses._create_fn``'s stand-in: ``__init__`` compiled now, any other method on its
    first call (the same arguments then, see the module docstring)."""
    assert _COMPILE is not None
    compile_now = _COMPILE
    if name == "__init__":
        return compile_now(name, *args, **kwargs)
    compiled: list[Callable[..., Any]] = []

    def method(self: Any, *rest: Any, **named: Any) -> Any:
        if not compiled:
            real = compile_now(name, *args, **kwargs)
            real.__qualname__ = method.__qualname__  # dataclasses named the stand-in for the class
            compiled.append(real)
            for klass in type(self).__mro__:
                if klass.__dict__.get(name) is method:
                    setattr(klass, name, real)
                    break
        return compiled[0](self, *rest, **named)

    method.__name__ = name
    return method


@dataclass_transform(field_specifiers=(dataclasses.field, dataclasses.Field))
def dataclass(
    cls: type[_T] | None = None,
    /,
    *,
    init: bool = True,
    repr: bool = True,
    eq: bool = True,
    order: bool = False,
    unsafe_hash: bool = False,
    frozen: bool = False,
    match_args: bool = True,
    kw_only: bool = False,
    slots: bool = False,
) -> Any:
    """:func:`dataclasses.dataclass` with the same parameters (``weakref_slot`` aside), its
    methods other than ``__init__`` compiled on first call (module docstring)."""
    options = {
        "init": init,
        "repr": repr,
        "eq": eq,
        "order": order,
        "unsafe_hash": unsafe_hash,
        "frozen": frozen,
        "match_args": match_args,
        "kw_only": kw_only,
        "slots": slots,
    }

    def make(klass: type[_T]) -> type[_T]:
        if _COMPILE is None:
            return dataclasses.dataclass(**options)(klass)
        with _LOCK:
            previous = dataclasses._create_fn  # type: ignore[attr-defined]
            dataclasses._create_fn = _deferred  # type: ignore[attr-defined]
            try:
                return dataclasses.dataclass(**options)(klass)
            finally:
                dataclasses._create_fn = previous  # type: ignore[attr-defined]

    return make if cls is None else make(cls)
