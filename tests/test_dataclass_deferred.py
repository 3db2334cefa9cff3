"""onnx_qrewrite._dataclass.dataclass: the classes dataclasses.dataclass makes, with the generated
methods other than __init__ compiled on first call; they must behave as dataclasses' own."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from onnx_qrewrite import _dataclass
from onnx_qrewrite._dataclass import dataclass

DEFERS = _dataclass._COMPILE is not None  # Python 3.11/3.12; 3.13 has no _create_fn


def _pair(**options):
    """The same class body made by dataclasses.dataclass and by ours."""

    def body():
        class Point:
            x: int
            y: float = 0.5
            tags: tuple[str, ...] = dataclasses.field(default_factory=tuple)

        return Point

    return dataclasses.dataclass(**options)(body()), dataclass(**options)(body())


@pytest.mark.parametrize(
    "options", [{}, {"frozen": True}, {"frozen": True, "slots": True}, {"order": True}, {"eq": False}]
)
def test_behaves_as_dataclasses_own(options):
    plain, ours = _pair(**options)
    described = [[(f.name, f.default, f.default_factory) for f in dataclasses.fields(k)] for k in (ours, plain)]
    assert described[0] == described[1]
    assert str(inspect.signature(ours)) == str(inspect.signature(plain))
    assert ours.__doc__ == plain.__doc__
    a, b, c = ours(1, 2.0, ("t",)), ours(1, 2.0, ("t",)), ours(3)
    pa, pb, pc = plain(1, 2.0, ("t",)), plain(1, 2.0, ("t",)), plain(3)
    assert repr(a) == repr(pa).replace(plain.__qualname__, ours.__qualname__)
    assert (a == b, a == c, a != c, a == 1) == (pa == pb, pa == pc, pa != pc, pa == 1)
    assert (ours.__hash__ is None) == (plain.__hash__ is None)
    if plain.__hash__ is not None and options.get("frozen"):
        assert hash(a) == hash(b) == hash(pa)
    if options.get("order"):
        assert (a < c, c <= a, c > a, a >= b) == (pa < pc, pc <= pa, pc > pa, pa >= pb)
    if options.get("frozen"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.x = 5
        with pytest.raises(dataclasses.FrozenInstanceError):
            del a.y
    else:
        a.x = 5
        assert a.x == 5
    assert dataclasses.astuple(dataclasses.replace(c, x=4)) == (4, 0.5, ())
    assert dataclasses.asdict(c) == dataclasses.asdict(pc)


@pytest.mark.skipif(not DEFERS, reason="Python 3.13+: dataclasses compiles a class's methods in one exec")
def test_methods_are_compiled_on_first_call_and_then_installed():
    _, ours = _pair(frozen=True)
    stand_in = ours.__dict__["__eq__"]
    assert stand_in.__code__.co_filename == _dataclass.__file__  # not compiled yet
    assert ours.__dict__["__init__"].__code__.co_filename == "<string>"  # compiled at once
    assert ours(1) == ours(1)
    real = ours.__dict__["__eq__"]
    assert real is not stand_in and real.__code__.co_filename == "<string>"
    assert real.__qualname__ == f"{ours.__qualname__}.__eq__"
    assert ours(1) != ours(2)  # the installed method, not the stand-in again
    assert ours.__dict__["__eq__"] is real


@pytest.mark.skipif(not DEFERS, reason="Python 3.13+: dataclasses compiles a class's methods in one exec")
def test_subclass_first_call_installs_on_the_class_that_defines_it():
    _, base = _pair(frozen=True)

    class Child(base):
        pass

    assert repr(Child(1)).endswith(".Child(x=1, y=0.5, tags=())")
    assert Child(1) == Child(1) and base(1) != Child(1)  # dataclasses: other.__class__ is self.__class__
    assert "__eq__" not in Child.__dict__
    assert base.__dict__["__eq__"].__code__.co_filename == "<string>"


def test_recursive_repr_as_dataclasses():
    @dataclass
    class Node:
        name: str
        children: list = dataclasses.field(default_factory=list)

    node = Node("a")
    node.children.append(node)
    assert repr(node) == "test_recursive_repr_as_dataclasses.<locals>.Node(name='a', children=[...])"


def test_dataclasses_is_restored_after_a_class_is_made():
    before = getattr(dataclasses, "_create_fn", None)
    _pair(frozen=True)

    @dataclasses.dataclass(frozen=True)
    class Plain:
        x: int

    assert getattr(dataclasses, "_create_fn", None) is before
    assert Plain.__dict__["__eq__"].__code__.co_filename == "<string>"  # dataclasses' own: compiled at once


def test_the_package_makes_its_dataclasses_with_the_deferring_decorator():
    """A class made with dataclasses.dataclass directly would compile its methods at import again."""
    package = Path(_dataclass.__file__).parent
    direct = [str(p.relative_to(package)) for p in package.rglob("*.py") if "@dataclasses.dataclass" in p.read_text()]
    assert direct == []
