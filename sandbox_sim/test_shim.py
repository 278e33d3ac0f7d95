"""The guest shim (sandbox/guest/shim.py) as a black box: the real file runs as a subprocess on
one end of a socketpair (``--fd``) and the tests speak JSON Lines to it.

Nothing of the shim is imported or mocked (only the protocol's constants, from
sandbox/guest/control.py, which the shim imports too); every assertion is on bytes on the wire or on
processes in /proc. No sleeps: every wait is a socket timeout, a pidfd poll or
``Popen.wait(timeout=...)``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import tty
from pathlib import Path

import pytest

from sandbox.guest import control as proto

pytestmark = pytest.mark.timeout(60)

SHIM = Path(__file__).resolve().parent.parent / "sandbox" / "guest" / "shim.py"
RECV_TIMEOUT_S = 20.0
EXIT_TIMEOUT_S = 15.0


class ShimProcess:
    """A running shim and the host end of its control socket."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.sock, theirs = socket.socketpair()
        self._log = open(tmp_path / "shim.log", "wb")  # noqa: SIM115 — closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, str(SHIM), "--fd", str(theirs.fileno()), *args],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
        )
        theirs.close()
        self.sock.settimeout(RECV_TIMEOUT_S)
        self._buf = bytearray()
        ready = self.recv()
        assert ready == {"type": "ready", "version": proto.PROTOCOL_VERSION, "pid": self.proc.pid}

    def send(self, obj) -> None:
        self.send_raw(json.dumps(obj).encode() + b"\n")

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> dict:
        while (newline := self._buf.find(b"\n")) < 0:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "shim closed the control channel"
            self._buf += chunk
        line = bytes(self._buf[:newline])
        del self._buf[: newline + 1]
        return json.loads(line)

    def exec(self, cid: int, command: str, **fields) -> None:
        self.send({"type": "exec", "id": cid, "command": command, **fields})

    def collect(self, *ids: int) -> dict[int, list[dict]]:
        """Every message for ``ids`` until each has completed; nothing else may arrive."""
        got: dict[int, list[dict]] = {cid: [] for cid in ids}
        pending = set(ids)
        while pending:
            msg = self.recv()
            assert msg.get("id") in pending, msg
            got[msg["id"]].append(msg)
            if msg["type"] == "step_completed":
                pending.discard(msg["id"])
        return got

    def run(self, cid: int, command: str, **fields) -> list[dict]:
        self.exec(cid, command, **fields)
        return self.collect(cid)[cid]

    def close(self) -> int:
        self.sock.close()
        try:
            return self.proc.wait(timeout=EXIT_TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()


@pytest.fixture
def shim(tmp_path):
    s = ShimProcess(tmp_path)
    yield s
    assert s.close() == 0


def text_of(messages: list[dict], stream: str) -> str:
    return "".join(m["data"] for m in messages if m["type"] == "output" and m["stream"] == stream)


def assert_step_shape(messages: list[dict]) -> dict:
    """started first, completed last, only output between; returns the completion."""
    assert messages[0]["type"] == "step_started"
    assert messages[-1]["type"] == "step_completed"
    assert all(m["type"] == "output" for m in messages[1:-1]), messages
    return messages[-1]


def assert_exited(fd: int) -> None:
    """A pidfd becomes readable when its process has exited (zombie or reaped)."""
    readable, _, _ = select.select([fd], [], [], EXIT_TIMEOUT_S)
    assert readable, "process still alive"
    os.close(fd)


# ---------------------------------------------------------------- exec basics


def test_echo_started_output_completed_in_order(shim):
    messages = shim.run(1, "echo hello")
    assert messages == [
        {"type": "step_started", "id": 1},
        {"type": "output", "id": 1, "stream": "stdout", "data": "hello\n"},
        {"type": "step_completed", "id": 1, "exit_code": 0},
    ]


def test_stderr_stream(shim):
    messages = shim.run(2, "echo out; echo err >&2")
    assert assert_step_shape(messages)["exit_code"] == 0
    assert text_of(messages, "stdout") == "out\n"
    assert text_of(messages, "stderr") == "err\n"


def test_exit_code(shim):
    done = assert_step_shape(shim.run(3, "exit 3"))
    assert done == {"type": "step_completed", "id": 3, "exit_code": 3}


def test_signal_death_reports_128_plus_signal(shim):
    done = assert_step_shape(shim.run(4, "kill -9 $$"))
    assert done == {"type": "step_completed", "id": 4, "exit_code": 137, "signal": 9}


def test_env_and_cwd_honoured(shim, tmp_path):
    messages = shim.run(5, 'echo "$GREETING"; pwd', env={"GREETING": "hi there"}, cwd=str(tmp_path))
    assert assert_step_shape(messages)["exit_code"] == 0
    assert text_of(messages, "stdout") == f"hi there\n{tmp_path}\n"


def test_default_cwd_is_root_and_stdin_is_devnull(shim):
    messages = shim.run(6, "pwd; cat; echo done")
    assert text_of(messages, "stdout") == "/\ndone\n"


def test_missing_cwd_gives_started_stderr_127(shim, tmp_path):
    messages = shim.run(7, "echo never", cwd=str(tmp_path / "missing"))
    done = assert_step_shape(messages)
    assert done == {"type": "step_completed", "id": 7, "exit_code": 127}
    assert "missing" in text_of(messages, "stderr")
    assert text_of(messages, "stdout") == ""


# ---------------------------------------------------------------- output streaming


def test_large_output_complete_and_in_order(shim):
    messages = shim.run(8, "seq 1 700000")  # ~4.9 MB
    assert assert_step_shape(messages)["exit_code"] == 0
    assert all(len(m["data"].encode()) <= 64 * 1024 for m in messages[1:-1])
    assert len(messages) > 3
    assert text_of(messages, "stdout") == "".join(f"{i}\n" for i in range(1, 700001))


def test_output_complete_when_host_reads_slowly(tmp_path):
    """20 MB through a small socket buffer: the shim's out-queue fills and pauses the
    child's pipe; nothing is lost and a ping is still answered in between."""
    shim = ShimProcess(tmp_path)
    shim.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    shim.exec(1, "head -c 20000000 /dev/zero | tr '\\0' x")
    shim.send({"type": "ping", "id": "mid"})
    total_chars, pong_seen = 0, False
    while True:
        msg = shim.recv()
        if msg["type"] == "pong":
            pong_seen = True
            continue
        assert msg["id"] == 1
        if msg["type"] == "output":
            assert set(msg["data"]) == {"x"}
            total_chars += len(msg["data"])
        elif msg["type"] == "step_completed":
            assert msg["exit_code"] == 0
            break
    assert total_chars == 20_000_000 and pong_seen
    assert shim.close() == 0


def test_head_c_five_megabytes(shim):
    messages = shim.run(9, "head -c 5000000 /dev/zero | tr '\\0' x")
    assert text_of(messages, "stdout") == "x" * 5_000_000


def test_utf8_multibyte_split_across_chunks(shim):
    # 3-byte characters: 64 KiB reads cannot all end on a character boundary.
    messages = shim.run(10, "yes '€€€€' | head -c 1300000")
    text = text_of(messages, "stdout")
    assert text == ("€€€€\n" * 100000)
    assert len([m for m in messages if m["type"] == "output"]) > 1
    # And a character split by the writer itself, across two writes.
    messages = shim.run(11, "printf '\\342\\202'; sleep 0.1; printf '\\254\\n'")
    assert text_of(messages, "stdout") == "€\n"


def test_undecodable_bytes_become_replacement_char(shim):
    messages = shim.run(12, "printf 'a\\377b\\342\\202'")
    assert text_of(messages, "stdout") == "a\ufffdb\ufffd"


def test_concurrent_commands_each_stream_ordered(shim, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # 1 cannot finish before 2 has run: it blocks on the fifo that 2 writes.
    env = {"F": str(fifo)}
    shim.exec(1, 'for i in $(seq 2000); do echo a$i; done; cat "$F"; for i in $(seq 2001 4000); do echo a$i; done', env=env)
    shim.exec(2, 'for i in $(seq 4000); do echo b$i; done; echo go > "$F"', env=env)
    got = shim.collect(1, 2)
    for cid in (1, 2):
        assert assert_step_shape(got[cid])["exit_code"] == 0
    a = [f"a{i}\n" for i in range(1, 2001)] + ["go\n"] + [f"a{i}\n" for i in range(2001, 4001)]
    assert text_of(got[1], "stdout") == "".join(a)
    assert text_of(got[2], "stdout") == "".join(f"b{i}\n" for i in range(1, 4001))


def test_too_many_concurrent_commands(shim):
    for cid in range(64):
        shim.exec(cid, "exec sleep 1000")
    for cid in range(64):
        assert shim.recv() == {"type": "step_started", "id": cid}
    shim.exec(64, "echo no")
    err = shim.recv()
    assert err["type"] == "error" and err["id"] == 64
    shim.send({"type": "cancel", "id": 0})
    assert shim.collect(0)[0][-1]["exit_code"] == 143
    assert assert_step_shape(shim.run(64, "echo yes"))["exit_code"] == 0
    # the other 63 are killed when the host goes away (fixture teardown)


# ---------------------------------------------------------------- cancel


def start_with_pids(shim, cid: int, command: str) -> tuple[list[dict], int, int]:
    """Run ``command`` (which first prints "$$ $!") until its pid line arrives."""
    shim.exec(cid, command)
    messages = [shim.recv(), shim.recv()]
    assert messages[0] == {"type": "step_started", "id": cid}
    assert messages[1]["type"] == "output" and messages[1]["data"].endswith("\n"), messages
    shell_pid, child_pid = map(int, messages[1]["data"].split())
    return messages, shell_pid, child_pid


def test_cancel_plain_sleep(shim):
    shim.exec(20, "sleep 1000")
    assert shim.recv() == {"type": "step_started", "id": 20}
    shim.send({"type": "cancel", "id": 20})
    assert shim.collect(20)[20] == [{"type": "step_completed", "id": 20, "exit_code": 143, "signal": 15}]


def test_cancel_kills_whole_process_group(shim):
    _, shell_pid, child_pid = start_with_pids(shim, 21, "sleep 1000 & echo $$ $!; wait")
    fds = [os.pidfd_open(shell_pid), os.pidfd_open(child_pid)]
    shim.send({"type": "cancel", "id": 21})
    done = shim.collect(21)[21][-1]
    assert done == {"type": "step_completed", "id": 21, "exit_code": 143, "signal": 15}
    for fd in fds:
        assert_exited(fd)


def test_cancel_escalates_to_sigkill_after_grace(tmp_path):
    grace_s = 0.3
    shim = ShimProcess(tmp_path, "--kill-grace-s", str(grace_s))
    _, shell_pid, child_pid = start_with_pids(shim, 22, "trap '' TERM; sleep 1000 & echo $$ $!; wait")
    fds = [os.pidfd_open(shell_pid), os.pidfd_open(child_pid)]
    sent_at = time.monotonic()
    shim.send({"type": "cancel", "id": 22})
    done = shim.collect(22)[22][-1]
    assert time.monotonic() - sent_at >= grace_s
    assert done == {"type": "step_completed", "id": 22, "exit_code": 137, "signal": 9}
    for fd in fds:
        assert_exited(fd)
    assert shim.close() == 0


def test_cancel_unknown_id_is_an_error(shim):
    shim.send({"type": "cancel", "id": 999})
    err = shim.recv()
    assert err["type"] == "error" and err["id"] == 999 and "999" in err["message"]
    assert assert_step_shape(shim.run(1, "true"))["exit_code"] == 0


# ---------------------------------------------------------------- bad input


BAD_LINES = {
    "malformed json": (b'{"type": "exec", "id": 1,', None),
    "array": (b'[1, 2, 3]', None),
    "string": (b'"exec"', None),
    "unknown type": (b'{"type": "launch", "id": 5}', 5),
    "missing type": (b'{"id": 5}', 5),
    "missing id": (b'{"type": "exec", "command": "echo x"}', None),
    "bool id": (b'{"type": "exec", "id": true, "command": "echo x"}', None),
    "float id": (b'{"type": "exec", "id": 1.5, "command": "echo x"}', None),
    "huge id": (b'{"type": "exec", "id": 99999999999999999999999, "command": "echo x"}', None),
    "missing command": (b'{"type": "exec", "id": 6}', 6),
    "non-string command": (b'{"type": "exec", "id": 6, "command": ["ls"]}', 6),
    "bad env value": (b'{"type": "exec", "id": 7, "command": "true", "env": {"A": 1}}', 7),
    "env not object": (b'{"type": "exec", "id": 7, "command": "true", "env": ["A=1"]}', 7),
    "env key with =": (b'{"type": "exec", "id": 7, "command": "true", "env": {"A=B": "1"}}', 7),
    "bad cwd": (b'{"type": "exec", "id": 8, "command": "true", "cwd": 3}', 8),
    "NUL in command": (b'{"type": "exec", "id": 8, "command": "echo \\u0000"}', 8),
    "NaN": (b'{"type": "ping", "id": NaN}', None),
    "invalid utf-8": (b'{"type": "ping", "id": "\xff"}', None),
    "deep nesting": (b"[" * 200000 + b"]" * 200000, None),
    "bad step_id": (b'{"type": "rollback_notify", "step_id": "x"}', None),
    "cancel missing id": (b'{"type": "cancel"}', None),
}


@pytest.mark.parametrize("line,err_id", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_bad_input_is_an_error_and_the_shim_keeps_working(shim, line, err_id):
    shim.send_raw(line + b"\n")
    err = shim.recv()
    assert err["type"] == "error" and err["id"] == err_id, err
    assert isinstance(err["message"], str) and err["message"]
    assert assert_step_shape(shim.run(100, "echo ok"))["exit_code"] == 0


def test_blank_lines_are_ignored(shim):
    shim.send_raw(b"\n  \r\n")
    shim.send({"type": "ping", "id": "x"})
    assert shim.recv() == {"type": "pong", "id": "x"}


def test_oversized_line_reported_once_then_normal(tmp_path):
    shim = ShimProcess(tmp_path, "--line-max-bytes", "1024")
    shim.send_raw(b'{"type": "ping", "id": "' + b"x" * 3000)
    shim.send_raw(b"y" * 3000)  # still the same line, arriving later
    shim.send_raw(b'"}\n')
    shim.send({"type": "ping", "id": 1})
    err = shim.recv()
    assert err["type"] == "error" and err["id"] is None and "1024" in err["message"]
    assert shim.recv() == {"type": "pong", "id": 1}
    # A complete oversized line in one piece, then lines just under the limit.
    shim.send_raw(b"z" * 2000 + b"\n")
    assert shim.recv()["type"] == "error"
    shim.send({"type": "ping", "id": "p" * 900})
    assert shim.recv() == {"type": "pong", "id": "p" * 900}
    assert assert_step_shape(shim.run(1, "echo ok"))["exit_code"] == 0
    assert shim.close() == 0


def test_duplicate_running_id_is_an_error(shim):
    shim.exec(30, "exec sleep 1000")
    assert shim.recv() == {"type": "step_started", "id": 30}
    shim.exec(30, "echo again")
    err = shim.recv()
    assert err["type"] == "error" and err["id"] == 30
    shim.send({"type": "cancel", "id": 30})
    assert shim.collect(30)[30][-1]["exit_code"] == 143
    # the id is free again once completed
    assert assert_step_shape(shim.run(30, "echo again"))["exit_code"] == 0


# ---------------------------------------------------------------- other messages


def test_ping_pong(shim):
    for ping_id in (1, "abc", None, {"nested": [1, 2]}):
        shim.send({"type": "ping", "id": ping_id})
        assert shim.recv() == {"type": "pong", "id": ping_id}


def test_rollback_notify_is_acknowledged(shim):
    shim.send({"type": "rollback_notify", "step_id": 42})
    assert shim.recv() == {"type": "rollback_noted", "step_id": 42}


# ---------------------------------------------------------------- end of input


def test_eof_on_fd_exits_zero_and_kills_commands(tmp_path):
    shim = ShimProcess(tmp_path)
    _, shell_pid, child_pid = start_with_pids(shim, 40, "sleep 1000 & echo $$ $!; wait")
    shim.exec(41, "exec sleep 1000")
    assert shim.recv() == {"type": "step_started", "id": 41}
    fds = [os.pidfd_open(shell_pid), os.pidfd_open(child_pid)]
    assert shim.close() == 0
    for fd in fds:
        assert_exited(fd)


def test_sigterm_exits_zero(shim):
    shim.exec(1, "exec sleep 1000")
    assert shim.recv() == {"type": "step_started", "id": 1}
    shim.proc.send_signal(signal.SIGTERM)
    assert shim.proc.wait(timeout=EXIT_TIMEOUT_S) == 0


def test_port_mode_on_a_pty(tmp_path):
    """``--port`` opens a character device by path; a raw pty stands in for virtio-serial."""
    master, slave = os.openpty()
    tty.setraw(slave)
    with open(tmp_path / "shim.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(SHIM), "--port", os.ttyname(slave)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    buf = bytearray()

    def recv() -> dict:
        nonlocal buf
        while (newline := buf.find(b"\n")) < 0:
            readable, _, _ = select.select([master], [], [], RECV_TIMEOUT_S)
            assert readable, "no message from shim"
            buf += os.read(master, 65536)
        line = bytes(buf[:newline])
        del buf[: newline + 1]
        return json.loads(line)

    try:
        assert recv() == {"type": "ready", "version": proto.PROTOCOL_VERSION, "pid": proc.pid}
        os.write(master, b'{"type":"ping","id":7}\n{"type":"exec","id":1,"command":"echo pty"}\n')
        assert recv() == {"type": "pong", "id": 7}
        assert [recv() for _ in range(3)] == [
            {"type": "step_started", "id": 1},
            {"type": "output", "id": 1, "stream": "stdout", "data": "pty\n"},
            {"type": "step_completed", "id": 1, "exit_code": 0},
        ]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


# ---------------------------------------------------------------- live mounts


def _mounted(target: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(target) for line in f)


def _mount_msg(cid, where, **over):
    msg = {"type": "mount", "id": cid, "port": proto.live_mount_ports()[0], "aname": "l0",
           "target": str(where), "read_only": True}
    msg.update(over)
    return msg


BAD_MOUNTS = {
    "share port": {"port": proto.NINEP_PORT},
    "port as string": {"port": str(proto.live_mount_ports()[0])},
    "aname with comma": {"aname": "l0,trans=virtio"},
    "aname with space": {"aname": "l 0"},
    "empty aname": {"aname": ""},
    "relative target": {"target": "mnt/x"},
    "root target": {"target": "/"},
    "dotdot target": {"target": "/mnt/../etc"},
    "double slash": {"target": "/mnt//x"},
    "newline target": {"target": "/mnt/x\nro"},
    "read_only as int": {"read_only": 1},
    "msize too small": {"msize": 100},
    # -- virtio-fs (issue 17): a hot-plugged device's tag
    "tag with comma": {"tag": "sandbox-l0,dax"},
    "tag too long": {"tag": "t" * 37},
    "tag as int": {"tag": 7},
}


@pytest.mark.parametrize("override", BAD_MOUNTS.values(), ids=BAD_MOUNTS.keys())
def test_bad_mount_fails_with_its_id_and_the_shim_keeps_working(shim, tmp_path, override):
    shim.send(_mount_msg(70, tmp_path / "m", **override))
    reply = shim.recv()
    assert reply["type"] == "mount_failed" and reply["id"] == 70, reply
    assert reply["message"].startswith("mount:"), reply
    assert not (tmp_path / "m").exists()
    assert assert_step_shape(shim.run(100, "echo ok"))["exit_code"] == 0


def test_mount_without_a_valid_id_is_an_error(shim, tmp_path):
    shim.send(_mount_msg("x", tmp_path / "m"))
    assert shim.recv()["type"] == "error"
    shim.send({"type": "unmount", "id": None, "target": str(tmp_path)})
    err = shim.recv()
    assert err["type"] == "error" and err["id"] is None


def test_unmount_of_what_is_not_mounted_fails(shim, tmp_path):
    shim.send({"type": "unmount", "id": 71, "target": str(tmp_path)})
    reply = shim.recv()
    assert reply["type"] == "unmount_failed" and reply["id"] == 71 and reply["target"] == str(tmp_path)
    assert reply["message"].startswith(f"unmount {tmp_path}: ")


def test_unmount_removes_a_real_mount(shim, tmp_path):
    """The forked helper really calls umount2 (a tmpfs stands in for a 9P share)."""
    target = tmp_path / "mnt"
    target.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(target)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        assert _mounted(target)
        shim.send({"type": "unmount", "id": 72, "target": str(target)})
        assert shim.recv() == {"type": "unmounted", "id": 72, "target": str(target)}
        assert not _mounted(target)
    finally:
        if _mounted(target):
            subprocess.run(["umount", "-l", str(target)], check=False)


def test_mount_makes_the_mount_point_and_reports_the_kernel_error(shim, tmp_path):
    """Where the kernel has no 9p filesystem the mount fails with ENODEV — after the shim
    made the missing directories; the real mount is exercised in e2e/test_guest_mounts.py."""
    with open("/proc/filesystems") as f:
        if any(line.split()[-1] == "9p" for line in f if line.strip()):
            pytest.skip("this kernel has 9p: the mount would try to reach the guest's 9P address")
    target = tmp_path / "a" / "b"
    shim.send(_mount_msg(73, target))
    reply = shim.recv()
    assert reply["type"] == "mount_failed" and reply["id"] == 73 and reply["target"] == str(target), reply
    assert os.strerror(19) in reply["message"] or os.strerror(1) in reply["message"], reply
    assert target.is_dir()
    assert assert_step_shape(shim.run(100, "echo ok"))["exit_code"] == 0


# ---------------------------------------------------------------- the guest user (issue 13)

AGENT_UID = AGENT_GID = 4242  # no such user on the host: nothing here can grant it anything


def _as_root_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root (the shim runs as root in the guest)")


@pytest.fixture
def agent_shim(tmp_path):
    """A shim (running as root) told to run commands as AGENT_UID:AGENT_GID."""
    _as_root_or_skip()
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, AGENT_UID, AGENT_GID)
    os.chmod(tmp_path, 0o755)
    s = ShimProcess(tmp_path, "--user", f"{AGENT_UID}:{AGENT_GID}", "--home", str(home))
    yield s
    assert s.close() == 0


def test_user_runs_commands_with_its_ids_and_no_supplementary_groups(agent_shim, tmp_path):
    messages = agent_shim.run(200, 'id -u; id -g; id -G; echo "$HOME $USER $LOGNAME"')
    assert assert_step_shape(messages)["exit_code"] == 0
    assert text_of(messages, "stdout") == f"{AGENT_UID}\n{AGENT_GID}\n{AGENT_GID}\n{tmp_path / 'home'} agent agent\n"


def test_user_commands_have_no_new_privileges(agent_shim):
    """no_new_privs: a set-uid binary (sudo, su) cannot raise the user back to root."""
    messages = agent_shim.run(201, "grep -E '^(NoNewPrivs|CapEff|CapPrm):' /proc/self/status")
    assert assert_step_shape(messages)["exit_code"] == 0
    fields = dict(line.split(":\t") for line in text_of(messages, "stdout").splitlines())
    assert fields == {"NoNewPrivs": "1", "CapPrm": "0000000000000000", "CapEff": "0000000000000000"}


def test_user_cannot_signal_the_shim(agent_shim):
    messages = agent_shim.run(202, f"kill -9 {agent_shim.proc.pid}")
    assert assert_step_shape(messages)["exit_code"] != 0
    assert "not permitted" in text_of(messages, "stderr").lower()
    assert agent_shim.proc.poll() is None
    assert assert_step_shape(agent_shim.run(203, "echo alive"))["exit_code"] == 0


def test_user_command_inherits_no_shim_descriptor(agent_shim):
    """Only stdin/stdout/stderr reach the command: the control fd and the wake-up pipe are CLOEXEC."""
    messages = agent_shim.run(204, "ls /proc/self/fd")
    assert assert_step_shape(messages)["exit_code"] == 0
    # ls itself holds one descriptor open on the directory it lists
    assert len(text_of(messages, "stdout").split()) == 4, text_of(messages, "stdout")


def test_user_cannot_read_a_root_only_file(agent_shim, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    messages = agent_shim.run(205, f"cat {secret}")
    assert assert_step_shape(messages)["exit_code"] != 0
    assert "Permission denied" in text_of(messages, "stderr")


def test_cancel_reaches_the_users_process_group(agent_shim):
    agent_shim.exec(206, "sleep 60")
    assert agent_shim.recv() == {"type": "step_started", "id": 206}
    agent_shim.send({"type": "cancel", "id": 206})
    done = agent_shim.collect(206)[206][-1]
    assert done["type"] == "step_completed" and done.get("signal") == signal.SIGTERM, done


def test_without_user_commands_run_as_the_shims_user(shim):
    messages = shim.run(207, "id -u")
    assert text_of(messages, "stdout") == f"{os.geteuid()}\n"


@pytest.mark.parametrize("bad", ["0:0", "1000", "a:b", "-1:5", "1000:", "4294967295:1"])
def test_bad_user_is_a_usage_error(tmp_path, bad):
    p = subprocess.run([sys.executable, str(SHIM), "--fd", "0", "--user", bad],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=EXIT_TIMEOUT_S)
    assert p.returncode == 2 and b"--user" in p.stderr, p.stderr
