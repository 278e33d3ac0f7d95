"""Commands run as an unprivileged guest user (issue 13), probed inside a real guest.

A VM session's commands run as `agent` — uid/gid of the working folder's owner, 1000/1000 when
root owns it (as here in CI) — with no supplementary groups, ``no_new_privs`` and
``HOME=/home/agent``; the control port, ``/run/sandbox`` and the shim (root) are out of its
reach; it still works in its share (the server reports the folder owner's files as its own)
and every write stays undoable. ``as_root=True`` gives root back. Two guests boot here.
"""

from __future__ import annotations

import os

import pytest

from sandbox.session.runtime import Folder, Session
from sandbox.vm.guestroot import user_ids as guest_user_ids
from sandbox_sim import oracle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

#: the pid of the guest's shim, found through /proc (cmdline is world-readable); not this shell
SHIM_PID = ('for d in /proc/[0-9]*; do [ "${d#/proc/}" = $$ ] && continue; case "$(tr "\\0" " " < $d/cmdline '
            r'2>/dev/null)" in *python3\ /run/sandbox/shim.py*) echo "${d#/proc/}";; esac; done')


@pytest.fixture(scope="module", autouse=True)
def guest_available(vm_guest):
    """Every test here boots a session VM (conftest.vm_guest skips with the reason otherwise)."""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = tmp_path_factory.mktemp("user") / "project"
    p.mkdir()
    (p / "README.md").write_text("# project\n")
    return p


@pytest.fixture(scope="module")
def session(project):
    with Session([Folder(str(project))]) as s:
        yield s


def run(s: Session, command: str) -> tuple[int, str, str]:
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    r = s.run(command, lambda stream, text: out[stream].append(text))
    return r.exit_code, "".join(out["stdout"]), "".join(out["stderr"])


def test_commands_run_as_the_folder_owner_or_1000(session, project):
    uid, gid = guest_user_ids(str(project))
    code, out, err = run(session, 'id -u; id -g; id -G; id -un; echo "$HOME"; pwd')
    assert code == 0, err
    assert out.split("\n") == [str(uid), str(gid), str(gid), "agent", "/home/agent", "/mnt/working/0", ""]


def test_the_control_port_is_permission_denied(session):
    code, out, err = run(session, "ls -lL /dev/virtio-ports/control; for p in /dev/vport*; do cat $p; done")
    assert code != 0
    assert out.startswith("crw-------") and " root " in out, out
    assert "Permission denied" in err and err.count("Permission denied") == err.count("cat:"), err


def test_run_sandbox_and_the_shim_files_are_root_only(session):
    code, _out, err = run(session, "ls /run/sandbox; cat /run/sandbox/shim.py")
    assert code != 0 and err.count("Permission denied") == 2, err


def test_the_shim_cannot_be_killed_or_traced(session):
    code, pid, err = run(session, SHIM_PID)
    assert code == 0 and pid.strip().isdigit(), (pid, err)
    code, _out, err = run(session, f"kill -9 {pid.strip()}")
    assert code != 0 and "not permitted" in err.lower(), err
    code, out, err = run(session, f"cat /proc/{pid.strip()}/environ; ls /proc/{pid.strip()}/fd")
    assert code != 0 and err.count("Permission denied") == 2, err
    assert run(session, "echo still here")[:2] == (0, "still here\n")


def test_no_way_back_to_root(session):
    """no_new_privs: set-uid programs (sudo, su, mount) do not raise the user; no capabilities."""
    code, out, err = run(session, "grep -E '^(NoNewPrivs|CapEff):' /proc/self/status")
    assert code == 0 and sorted(out.split()) == ["0000000000000000", "1", "CapEff:", "NoNewPrivs:"], (out, err)
    code, out, err = run(session, "for t in sudo su; do command -v $t >/dev/null && $t -c 'id -u' </dev/null; done; "
                                  "mount -t tmpfs none /mnt; touch /etc/x; echo end")
    assert out.splitlines()[-1] == "end" and "0" not in out.splitlines()[:-1], (out, err)
    assert "/etc/x" in err and "Permission denied" in err, err


def test_the_user_works_in_its_share_and_home_and_undo_restores(session, project):
    before = oracle.snapshot_dir(str(project))
    code, out, err = run(session, "echo one > new.txt && echo two >> new.txt && mkdir -p d/e && touch d/e/f "
                                  "&& chmod 600 new.txt && cat new.txt && echo more >> README.md && rm -r d "
                                  "&& echo home > ~/note && cat ~/note")
    assert code == 0, err
    assert out == "one\ntwo\nhome\n"
    assert (project / "new.txt").read_text() == "one\ntwo\n"
    assert (project / "new.txt").stat().st_uid == os.geteuid()  # on the host: the server's files, as always
    session.undo(1)
    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "undo of the guest user's step")


def test_as_root_gives_root(project):
    with Session([Folder(str(project))], as_root=True) as s:
        code, out, err = run(s, "id -u; grep NoNewPrivs /proc/self/status")
        assert code == 0, err
        assert out.split() == ["0", "NoNewPrivs:", "0"]
        assert s.status()["as_root"] is True
