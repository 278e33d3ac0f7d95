"""The shared Hypothesis example database (``$SANDBOX_HYPOTHESIS_DB``; issue 19).

A failure one run finds is saved to the shared directory (``rw``: the nightly run) and
replayed *first* by another run on another machine (another local database) that only reads
it (``ro``: developers, CI), which never writes there.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .budget import HYPOTHESIS_DB_ENV, HYPOTHESIS_DB_MODE_ENV, example_database


def _listing(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _property(db, seen: list):
    @settings(database=db, max_examples=300, deadline=None)
    @given(st.integers(0, 10**6))
    def prop(x):
        seen.append(x)
        assert x < 1000

    return prop


def test_a_failure_saved_by_the_nightly_run_is_replayed_first_elsewhere(tmp_path):
    shared = tmp_path / "shared"
    nightly = example_database({HYPOTHESIS_DB_ENV: str(shared), HYPOTHESIS_DB_MODE_ENV: "rw"}, local=str(tmp_path / "a"))
    seen: list[int] = []
    with pytest.raises(AssertionError):
        _property(nightly, seen)()
    assert _listing(shared), "the nightly run saved nothing to the shared directory"
    before = _listing(shared)

    elsewhere = example_database({HYPOTHESIS_DB_ENV: str(shared)}, local=str(tmp_path / "b"))  # ro by default
    seen.clear()
    with pytest.raises(AssertionError):
        _property(elsewhere, seen)()
    assert seen[0] == 1000, f"the shared failure was not replayed first: {seen[:5]}"
    assert _listing(shared) == before, "a read-only run wrote to the shared directory"


def test_without_the_variable_hypothesis_keeps_its_default_and_bad_modes_are_refused(tmp_path):
    assert example_database({}) is None
    with pytest.raises(ValueError):
        example_database({HYPOTHESIS_DB_ENV: str(tmp_path), HYPOTHESIS_DB_MODE_ENV: "yes"})
