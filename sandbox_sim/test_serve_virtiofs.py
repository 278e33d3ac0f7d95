"""``sandbox serve-virtiofs`` as a process: a real vhost-user socket, the test-side
front-end and guest rings of ``test_virtiofs_device.py``, SIGTERM. What the guest writes
lands in ambient steps that ``sandbox history`` lists and ``sandbox undo`` undoes exactly;
``--read-only`` refuses writes (EROFS); bad usage exits 2; a file at the socket path is
not replaced (exit 1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox_sim import oracle
from sandbox_sim.test_fuse_codec import ref_request
from sandbox_sim.test_fuse_dispatcher import H
from sandbox_sim.test_virtiofs_device import FrontEnd, Guest, fuse_reply, init, open_flags

pytestmark = pytest.mark.timeout(120)


def sandbox_cmd(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")}


def start(*args: str, env) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "serve-virtiofs", *args], stderr=subprocess.PIPE,
                         text=True, env=env, stdin=subprocess.DEVNULL)
    line = p.stderr.readline()  # blocks until the server announces itself (or dies)
    assert "serving" in line, line + p.stderr.read()
    return p


def mkdir_over_virtiofs(sock: str, name: bytes) -> int:
    guest = Guest()
    fe = FrontEnd(sock, guest)
    try:
        fe.handshake()
        init(fe, guest)
        head, at = guest.submit(1, ref_request(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, name)), 16 + 128)
        ((used_head, n),) = fe.kick_and_wait(1)
        assert used_head == head and n in (16, 144)  # an error, or an entry
        err, _, _ = fuse_reply(guest, at, n)
        return err
    finally:
        fe.close()
        os.close(guest.fd)


def test_writes_are_undoable_after_the_server_stops(tmp_path, env):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_bytes(b"precious\n")
    before = oracle.snapshot_dir(str(work))
    sock = str(tmp_path / "vfs.sock")
    p = start("--root", str(work), "--socket", sock, env=env)
    try:
        assert oracle.snapshot_dir(str(work)) == before
        assert mkdir_over_virtiofs(sock, b"made-by-guest") == 0
        assert (work / "made-by-guest").is_dir()
        assert sandbox_cmd("undo", "--workdir", str(work), env=env).returncode == 5  # locked while serving
    finally:
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert not os.path.exists(sock)
    hist = sandbox_cmd("history", "--workdir", str(work), env=env)
    assert hist.returncode == 0, hist.stderr
    undo = sandbox_cmd("undo", "--workdir", str(work), env=env)
    assert undo.returncode == 0, undo.stderr
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "undo after serve-virtiofs")


def test_read_only_refuses_writes(tmp_path, env):
    work = tmp_path / "work"
    work.mkdir()
    sock = str(tmp_path / "vfs.sock")
    p = start("--root", str(work), "--socket", sock, "--read-only", env=env)
    try:
        assert mkdir_over_virtiofs(sock, b"nope") == -30  # -EROFS
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    assert p.returncode == 0
    assert os.listdir(work) == [] and not os.path.exists(tmp_path / "xdg")


def open_flags_over_virtiofs(sock: str, name: bytes, flags: int) -> int:
    """The ``open_flags`` the device answers an OPEN of ``name`` (in the root) with ``flags``."""
    guest = Guest()
    fe = FrontEnd(sock, guest)
    try:
        fe.handshake()
        init(fe, guest)
        return open_flags(fe, guest, name, flags)
    finally:
        fe.close()
        os.close(guest.fd)


@pytest.mark.parametrize("mode", [None, "write-only", "all"])
def test_direct_io_all_opens_every_file_direct(tmp_path, env, mode):
    """``--direct-io all``: a reading open is ``FOPEN_DIRECT_IO`` (virtiofsd ``cache=none``'s
    trade); the default (``write-only``) keeps it cached; the mode is in the ready line."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "data").write_bytes(b"x" * 100)
    sock = str(tmp_path / "vfs.sock")
    p = subprocess.Popen([sys.executable, "-m", "sandbox", "serve-virtiofs", "--root", str(work), "--socket", sock,
                          *(["--direct-io", mode] if mode else [])],
                         stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
    try:
        line = p.stderr.readline()
        assert f"direct I/O: {mode or 'write-only'}" in line, line + p.stderr.read()
        direct = open_flags_over_virtiofs(sock, b"data", os.O_RDONLY) & abi.FOPEN_DIRECT_IO
        assert bool(direct) == (mode == "all")
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    assert p.returncode == 0
    r = sandbox_cmd("serve-virtiofs", "--root", str(work), "--socket", sock, "--direct-io", "reads", env=env)
    assert r.returncode == 2 and "--direct-io" in r.stderr, r


def test_bad_usage_and_a_file_at_the_socket_path(tmp_path, env):
    r = sandbox_cmd("serve-virtiofs", "--root", "/nonexistent-dir", "--socket", str(tmp_path / "s"), env=env)
    assert r.returncode == 2 and "not a directory" in r.stderr, r
    victim = tmp_path / "not-a-socket"
    victim.write_bytes(b"data")
    work = tmp_path / "w"
    work.mkdir()
    r = sandbox_cmd("serve-virtiofs", "--root", str(work), "--socket", str(victim), env=env)
    assert r.returncode == 1 and "not a socket" in r.stderr, r
    assert victim.read_bytes() == b"data"


def test_sigkill_of_the_server_mid_session_recovers_exactly(tmp_path, env):
    """The server is SIGKILLed after the guest's writes (its ambient step still open): the
    next open recovers (today: the interrupted step is rolled back), and undoing whatever
    history then lists gives the tree before."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_bytes(b"precious\n")
    before = oracle.snapshot_dir(str(work))
    sock = str(tmp_path / "vfs.sock")
    p = start("--root", str(work), "--socket", sock, env=env)
    try:
        assert mkdir_over_virtiofs(sock, b"made-by-guest") == 0
        assert (work / "made-by-guest").is_dir()
    finally:
        p.kill()
        p.communicate(timeout=60)
    hist = sandbox_cmd("history", "--workdir", str(work), "--json", env=env)
    assert hist.returncode == 0, hist.stderr
    steps = json.loads(hist.stdout)
    steps = steps["steps"] if isinstance(steps, dict) else steps
    if steps:
        undo = sandbox_cmd("undo", "--workdir", str(work), "-n", str(len(steps)), env=env)
        assert undo.returncode == 0, undo.stderr
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "recovery after SIGKILL of serve-virtiofs")


def test_sigterm_while_qemu_is_connected_stops_cleanly(tmp_path, env):
    work = tmp_path / "work"
    work.mkdir()
    sock = str(tmp_path / "vfs.sock")
    p = start("--root", str(work), "--socket", sock, env=env)
    guest = Guest()
    fe = FrontEnd(sock, guest)
    try:
        fe.handshake()
        init(fe, guest)
        head, at = guest.submit(1, ref_request(m.Mkdir(H(abi.Opcode.MKDIR), 0o755, 0o022, b"d")), 16 + 128)
        assert fe.kick_and_wait(1) == [(head, 144)]
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=60)
        assert fe.sock.recv(1) == b""  # the server closed the vhost-user connection
    finally:
        fe.close()
        os.close(guest.fd)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert sandbox_cmd("undo", "--workdir", str(work), env=env).returncode == 0
    assert os.listdir(work) == []
