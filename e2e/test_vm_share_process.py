"""A real VM session with its folders served by the confined share-server process (issue 13).

``Session(share_servers="process")``: the guest's shares reach a child process that owns the
workspaces and the 9P server, confined by Landlock; the agent keeps the guest and the broker.
``rm -rf`` in the guest, then undo: the tree is byte-exact again (the tree oracle). A SIGKILL
of the child mid-session is reported and the guest stopped; the next start recovers.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from sandbox.session.runtime import Folder, Session, SessionError
from sandbox_sim import oracle

# every test here boots a session VM (conftest.vm_guest skips with the reason otherwise)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("vm_guest")]


@pytest.fixture
def project(sample_project):
    return sample_project


def test_rm_rf_and_undo_exact_through_the_share_process(project, tmp_path):
    before = oracle.snapshot_dir(str(project))
    with Session([Folder(str(project), state_dir=str(tmp_path / "state"))], share_servers="process") as s:
        pid = s.status()["share_server_pid"]
        assert pid and pid != os.getpid()
        r = s.run("rm -rf src && echo oops > README.md")
        assert r.exit_code == 0 and not (project / "src").exists()
        s.undo(1)
        oracle.assert_same(before, oracle.snapshot_dir(str(project)), "undo through the share process")


def test_the_share_process_killed_mid_command_stops_the_session_and_the_next_start_recovers(project, tmp_path):
    before = oracle.snapshot_dir(str(project))
    warned, gone = threading.Event(), threading.Event()

    def on_event(e):
        if e["type"] == "event.warning" and "share server" in e.get("message", ""):
            warned.set()

    s = Session([Folder(str(project), state_dir=str(tmp_path / "state"))], share_servers="process", on_event=on_event)
    s.start()
    outcome = []
    try:
        def run():
            try:
                outcome.append(s.run("rm -rf src && echo gone && sleep 600",
                                     on_output=lambda stream, text: gone.set() if "gone" in text else None))
            except SessionError as e:
                outcome.append(e)

        t = threading.Thread(target=run)
        t.start()
        assert gone.wait(300) and not (project / "src").exists()
        os.kill(s.status()["share_server_pid"], signal.SIGKILL)
        assert warned.wait(60)
        t.join(120)
        assert isinstance(outcome[0], SessionError), outcome
        with pytest.raises(SessionError, match="share server"):
            s.history()
    finally:
        s.stop()
    with Session([Folder(str(project), state_dir=str(tmp_path / "state"))], share_servers="process"):
        pass  # recovery on open: the interrupted step is rolled back
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "recovery after the share process was killed")
