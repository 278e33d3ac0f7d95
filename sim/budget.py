"""Test budgets: the default run fits CI (fast tier under ~10 minutes on 2 cores); the
full run (``./dev test --full`` or ``SANDBOX_TEST_FULL=1``) explores much more."""

import os

FULL = os.environ.get("SANDBOX_TEST_FULL") == "1"


def scale(default: int, full: int) -> int:
    return full if FULL else default
