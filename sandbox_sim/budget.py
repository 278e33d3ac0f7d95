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


#: a directory shared between runs and machines as Hypothesis's example database (the
#: failing and interesting examples each run found are replayed first by the next)
HYPOTHESIS_DB_ENV = "SANDBOX_HYPOTHESIS_DB"
#: ``ro`` (the default: read the shared examples, never write them — developers, CI) or ``rw``
#: (also save there — the nightly run that explores)
HYPOTHESIS_DB_MODE_ENV = "SANDBOX_HYPOTHESIS_DB_MODE"


def example_database(env=os.environ, local: str = ".hypothesis/examples"):
    """The example database the tests use: None (Hypothesis's own default, ``local``) unless
    ``$SANDBOX_HYPOTHESIS_DB`` names a shared directory; then ``local`` and that directory
    together (``MultiplexedDatabase``: examples are read from both, saved to ``local`` and —
    in ``rw`` mode only — to the shared one). ``ValueError`` for another mode."""
    shared = env.get(HYPOTHESIS_DB_ENV)
    if not shared:
        return None
    from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase, ReadOnlyDatabase

    mode = env.get(HYPOTHESIS_DB_MODE_ENV, "ro")
    if mode not in ("ro", "rw"):
        raise ValueError(f"{HYPOTHESIS_DB_MODE_ENV} must be ro or rw, not {mode!r}")
    shared_db = DirectoryBasedExampleDatabase(shared)
    return MultiplexedDatabase(DirectoryBasedExampleDatabase(local), shared_db if mode == "rw" else ReadOnlyDatabase(shared_db))
