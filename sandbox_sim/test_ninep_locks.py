"""The server's POSIX byte-range lock table (fcntl F_SETLK semantics), on its own."""

from __future__ import annotations

import errno

import pytest

from sandbox.serving.locks import INF, RDLCK, UNLCK, WRLCK, LockTable

A, B = ("c1", "a", 1), ("c1", "b", 2)


def ranges(t: LockTable, file: int = 7):
    return sorted(((r.owner[1], r.type, r.start, r.end) for r in t._files.get(file, ())), key=lambda x: x[2])


def test_read_locks_share_write_locks_exclude():
    t = LockTable()
    assert t.lock(7, A, RDLCK, 0, 10) and t.lock(7, B, RDLCK, 5, 10)
    assert not t.lock(7, B, WRLCK, 0, 1)  # A's read lock covers 0
    assert t.conflict(7, B, WRLCK, 0, 1).owner == A
    assert t.conflict(7, B, RDLCK, 0, 1) is None


def test_own_locks_are_replaced_and_split():
    t = LockTable()
    t.lock(7, A, WRLCK, 0, 100)
    t.lock(7, A, RDLCK, 40, 20)  # converts the middle
    assert ranges(t) == [("a", WRLCK, 0, 40), ("a", RDLCK, 40, 60), ("a", WRLCK, 60, 100)]
    t.lock(7, A, UNLCK, 50, 0)  # unlock to EOF
    assert ranges(t) == [("a", WRLCK, 0, 40), ("a", RDLCK, 40, 50)]
    assert t.lock(7, B, WRLCK, 50, 0)  # free now, to EOF
    assert ranges(t)[-1] == ("b", WRLCK, 50, INF)


def test_unlock_of_nothing_and_invalid_type():
    t = LockTable()
    assert t.lock(7, A, UNLCK, 0, 0) and ranges(t) == []
    with pytest.raises(OSError) as e:
        t.lock(7, A, 9, 0, 1)
    assert e.value.errno == errno.EINVAL


def test_cap_and_drop_owner():
    t = LockTable(locks_max=3)
    for i in range(3):
        assert t.lock(i, A, WRLCK, 0, 1)
    with pytest.raises(OSError) as e:
        t.lock(5, B, WRLCK, 0, 1)
    assert e.value.errno == errno.ENOLCK
    t.drop_owner(lambda owner: owner == A)
    assert t.lock(5, B, WRLCK, 0, 1)
