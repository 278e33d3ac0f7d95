"""The STDIO API suite of ``sandbox_sim/test_stdio_api.py`` against a real VM guest.

Same tests, same assertions, ``sandbox serve --guest vm``: commands run in a real Linux
guest's shell (``sandbox_sim.api_client.Commands`` spells them for it) over 9P through QEMU's
guestfwd. A few run in the default tier (each boots a guest: about 10 s under TCG);
the rest are marked slow (``./dev test --full``). Tests that never start a session
(protocol framing, schemas, the README) are not repeated here.
"""

from __future__ import annotations

import functools

import pytest

from sandbox_sim import test_stdio_api as base

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NO_GUEST = {"test_hello_negotiates_the_version_and_requests_before_it_are_accepted",
            "test_malformed_input_gets_error_responses_and_never_kills_the_agent",
            "test_every_operation_needs_a_session_except_hello_and_status", "test_every_error_code_is_in_the_readme",
            "test_the_shipped_schema_is_current_and_valid",
            "test_bad_session_configs_are_clear_errors_and_leave_nothing_running",
            "test_the_readme_documents_every_operation_and_event_and_embeds_the_schema",
            "test_random_requests_never_kill_the_agent_and_never_hit_a_bug",
            "test_a_deeply_nested_request_id_or_payload_never_stops_the_agent", "test_an_invalid_request_id_is_never_echoed",
            "test_nesting_is_measured_on_the_text_before_parsing", "test_json_depth_agrees_with_the_parser",
            "test_a_bug_while_handling_a_line_is_answered_internal_and_the_next_line_is_served",
            "test_a_response_that_cannot_be_encoded_still_answers_its_request",
            "test_output_is_valid_utf8_even_when_a_lone_surrogate_is_echoed",
            "test_handlers_get_integral_floats_as_ints_whoever_parsed_the_payload"}
SMOKE = {"test_execute_streams_output_then_step_completed_then_the_response",
         "test_safeguard_holds_the_step_until_confirmed",
         "test_external_edit_creates_a_barrier_that_blocks_rollback_unless_forced",
         "test_in_memory_mounts_and_python_path"}


@pytest.fixture
def guest() -> str:
    return "vm"


def _copy(fn):
    """The same test as a new function object, so marks added here stay here."""
    @functools.wraps(fn)
    def test(*args, **kwargs):
        return fn(*args, **kwargs)

    return test


for _name in dir(base):
    if _name.startswith("test_") and _name not in NO_GUEST:
        _t = _copy(getattr(base, _name))
        globals()[_name] = _t if _name in SMOKE else pytest.mark.slow(_t)

project = base.project
state_home = base.state_home
api = base.api
cmds = base.cmds
