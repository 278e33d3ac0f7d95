"""``sandbox.frozen.fast_init``: the cheaper ``__init__`` changes nothing else a frozen,
slotted dataclass does — and the hot per-request classes that use it behave as before."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from sandbox.frozen import fast_init
from sandbox.fuse import messages as m
from sandbox.hostfs import Attr


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    x: int
    y: int
    z: int = 7


@dataclasses.dataclass(frozen=True, slots=True)
class Base:
    a: int


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class Derived(Base):
    b: str = "b"


def test_the_fast_init_stores_every_field_positionally_by_keyword_and_by_default():
    assert (Point(1, 2).x, Point(1, 2).y, Point(1, 2).z) == (1, 2, 7)
    assert Point(y=2, x=1, z=3) == Point(1, 2, 3)
    assert Derived(1) == Derived(a=1, b="b") and Derived(1, "c").b == "c"
    with pytest.raises(TypeError):
        Point(1)  # a field without a default is still required
    with pytest.raises(TypeError):
        Point(1, 2, 3, 4)
    with pytest.raises(TypeError):
        Point(1, 2, w=3)


def test_the_class_stays_frozen_hashable_comparable_and_replaceable():
    p = Point(1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 5  # type: ignore[misc]
    assert hash(p) == hash(Point(1, 2, 7)) and p != Point(1, 2, 8)
    assert repr(p) == "Point(x=1, y=2, z=7)"
    assert dataclasses.replace(p, y=9) == Point(1, 9, 7)
    assert [f.name for f in dataclasses.fields(Derived)] == ["a", "b"]
    assert pickle.loads(pickle.dumps(Point(3, 4))) == Point(3, 4)


def test_what_plain_stores_would_skip_is_refused_at_decoration():
    with pytest.raises(TypeError, match="frozen dataclasses with slots"):
        fast_init(dataclasses.dataclass(frozen=True)(type("NoSlots", (), {"__annotations__": {"a": int}})))
    with pytest.raises(TypeError, match="frozen dataclasses with slots"):
        fast_init(dataclasses.dataclass(slots=True)(type("NotFrozen", (), {"__annotations__": {"a": int}})))

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithPost:
        a: int

        def __post_init__(self):
            pass

    with pytest.raises(TypeError, match="__post_init__"):
        fast_init(WithPost)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithFactory:
        a: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="plain positional"):
        fast_init(WithFactory)

    @dataclasses.dataclass(frozen=True, slots=True)
    class KwOnly:
        a: int = dataclasses.field(kw_only=True)

    with pytest.raises(TypeError, match="plain positional"):
        fast_init(KwOnly)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: dataclasses.InitVar[int] = 0

    with pytest.raises(TypeError, match="InitVar"):
        fast_init(WithInitVar)


def test_the_hot_per_request_classes_use_it_and_keep_their_values():
    for cls in (m.InHeader, m.Getattr, m.Unlink, m.Forget, m.FuseAttr, m.AttrOut, m.EntryOut, Attr):
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
        assert "_set0" in cls.__init__.__code__.co_names, cls  # the member-descriptor stores
    h = m.InHeader(40, 3, 9, 1, 0, 0, 42)
    g = m.Getattr(h, 0, 0)
    assert (g.header.unique, g.getattr_flags, g.fh) == (9, 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.fh = 3  # type: ignore[misc]
    a = Attr("reg", 0o100000, 0o644, 1, 1, 0, 0, 0, 4096, 8, 1, 2, 3, 4)
    assert a.dev == 0 and dataclasses.replace(a, mode=0o600).mode == 0o600
