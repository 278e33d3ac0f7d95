"""Test budgets: the default run fits CI (fast tier under ~10 minutes on 2 cores); the
full run (``./dev test --full`` or ``SANDBOX_TEST_FULL=1``) explores much more."""

import os

FULL = os.environ.get("SANDBOX_TEST_FULL") == "1"


def scale(default: int, full: int) -> int:
    return full if FULL else default


def model_case(machine, examples: int, steps: int, full_steps: int | None = None):
    """The pytest TestCase of a Hypothesis state machine with this project's budget:
    ``examples`` machines of ``steps`` rules each by default, ten times the examples (and
    more steps) in the full run; no deadline (real disks and sockets vary)."""
    from hypothesis import HealthCheck, settings

    case = machine.TestCase
    case.settings = settings(max_examples=scale(examples, examples * 10), stateful_step_count=scale(steps, full_steps or int(steps * 1.6)),
                             deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    return case
