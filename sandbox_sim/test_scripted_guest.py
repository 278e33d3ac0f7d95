"""The scripted guest against the real 9P server, providers and undo core.

Each test boots a :class:`~sandbox.scripted.guest.ScriptedGuest` on a real server (a
working folder through the undo core under attach name "0", a read-only host directory
under "1", an in-memory tree under "m0") and checks what its scripts did to the host
folders, the exit codes and the output. Waits are on futures and events, never sleeps.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass, field

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.mounts import Provider, memory_tree
from sandbox.guest.control import LIVE_MOUNTS_MAX
from sandbox.ninep.server import NinePServer, ServerConfig, ServerThread
from sandbox_sim import oracle
from sandbox.scripted.guest import (
    GuestError,
    GuestMount,
    ScriptedGuest,
    ScriptSyntaxError,
    parse_script,
)

pytestmark = pytest.mark.timeout(60)
W0, W1, TOOLS = "/mnt/working/0", "/mnt/working/1", "/mnt/tools"
WAIT_S = 20.0


@dataclass
class Result:
    exit_code: int
    signal: int | None
    out: str
    err: str
    step_id: int | None


@dataclass
class Rig:
    tmp: object
    work: str
    ro: str
    ws: Workspace
    st: ServerThread
    guest: ScriptedGuest
    sock: str
    next_id: int = 1
    chunks: list = field(default_factory=list)

    def start(self, script: str, cwd: str = W0, env: dict | None = None, on_output=None):
        """Start a script; returns the Execution and its output chunks (appended as they come)."""
        chunks: list[tuple[str, str]] = []

        def out(stream, text):
            chunks.append((stream, text))
            if on_output is not None:
                on_output(stream, text)

        exec_id, self.next_id = self.next_id, self.next_id + 1
        ex = self.st.run(self.guest.exec(exec_id, script, cwd, env or {}, out))
        return ex, chunks

    def wait(self, ex, timeout_s: float = WAIT_S) -> dict:
        return self.st.run(asyncio.wait_for(asyncio.shield(ex.completed), timeout_s), timeout_s + 5)

    def run(self, script: str, cwd: str = W0, env: dict | None = None, step: bool = True) -> Result:
        """One script as one step of the working folder (as the session runs a command)."""
        step_id = self.ws.begin_step(script) if step else None
        code = 1
        try:
            ex, chunks = self.start(script, cwd, env)
            done = self.wait(ex)
            code = done["exit_code"]
        finally:
            if step_id is not None:
                self.ws.complete_step(step_id, code)
                self.ws.close_active()
        return Result(done["exit_code"], done["signal"],
                      "".join(t for s, t in chunks if s == "stdout"), "".join(t for s, t in chunks if s == "stderr"),
                      step_id)

    def host(self, rel: str) -> str:
        return os.path.join(self.work, rel)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def make_rig(tmp_path, *, safeguard: SafeguardConfig | None = None, decide=None, extra_exports=None,
             extra_mounts=(), ro_mount_read_only: bool = True):
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_bytes(b"hello\n")
    (work / "sub").mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "readme").write_bytes(b"read only\n")
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"), safeguard=safeguard)
    exports = {"0": Provider.intercepted(ws), "1": Provider.read_only_dir(str(ro)),
               "m0": memory_tree({"bin/tool": b"#!/bin/sh\necho tool\n", "README": b"tools\n"})}
    exports.update(extra_exports or {})
    sockdir = tempfile.mkdtemp(prefix="sg-")  # unix socket paths are short; tmp_path may be long
    sock = os.path.join(sockdir, "9p.sock")
    st = ServerThread(NinePServer(exports, ServerConfig(), decide=decide), unix_path=sock).__enter__()
    guest = ScriptedGuest()
    mounts = [GuestMount("0", W0, False), GuestMount("1", W1, ro_mount_read_only), GuestMount("m0", TOOLS, True),
              *extra_mounts]
    guest.boot(socket_path=sock, mounts=mounts, loop=st.loop, timeout_s=10)
    return Rig(tmp_path, str(work), str(ro), ws, st, guest, sock), sockdir


@pytest.fixture
def rig_factory(tmp_path):
    made = []

    def factory(**kwargs):
        r, sockdir = make_rig(tmp_path, **kwargs)
        made.append((r, sockdir))
        return r

    yield factory
    for r, sockdir in made:
        r.guest.stop()
        r.st.__exit__(None, None, None)
        r.ws.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
def rig(rig_factory):
    return rig_factory()


# ---------------------------------------------------------------------------- file commands


def test_file_commands_change_the_host_folder(rig):
    r = rig.run("""
        write a.txt "one\\ntwo\\n"
        append a.txt "three\\n"
        append new.txt fresh
        cat a.txt hello.txt
        mkdir -p deep/er/est
        mkdir plain
        write deep/er/est/f x
        touch t1 hello.txt
        cp a.txt plain/copy.txt
        cp a.txt plain                 # into the directory
        mv new.txt plain/moved.txt
        chmod 600 a.txt
        chmod +x plain/copy.txt
        ln -s a.txt link
        ln a.txt hard
        truncate -s 3 hello.txt
        truncate -s 1K sized
        setfattr -n user.tag -v v1 a.txt
        setfattr -n user.hex -v 0x6869 a.txt
        gen many 7 5
        stat a.txt sub link
        ls
        ls -a plain many
    """)
    assert (r.exit_code, r.err) == (0, ""), r
    h = rig.host
    assert read(h("a.txt")) == b"one\ntwo\nthree\n"
    assert r.out.startswith("one\ntwo\nthree\nhello\n")
    assert not os.path.exists(h("new.txt"))
    assert read(h("plain/moved.txt")) == b"fresh"
    assert os.path.isdir(h("deep/er/est")) and read(h("deep/er/est/f")) == b"x"
    assert os.path.getsize(h("t1")) == 0
    assert read(h("plain/copy.txt")) == b"one\ntwo\nthree\n"
    assert read(h("plain/a.txt")) == b"one\ntwo\nthree\n"
    assert stat.S_IMODE(os.stat(h("a.txt")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(h("plain/copy.txt")).st_mode) == 0o755  # 0644 + x for all (umask 022)
    assert os.readlink(h("link")) == "a.txt"
    assert os.stat(h("hard")).st_ino == os.stat(h("a.txt")).st_ino
    assert read(h("hello.txt")) == b"hel"
    assert os.path.getsize(h("sized")) == 1024
    assert os.getxattr(h("a.txt"), "user.tag") == b"v1" and os.getxattr(h("a.txt"), "user.hex") == b"hi"
    assert sorted(os.listdir(h("many"))) == [f"f{i:05d}" for i in range(7)]
    assert read(h("many/f00003")) == b"f0000"
    assert "reg 0600 14\ndir 0755 " in r.out and "\nlnk 0777 5\n" in r.out
    listing = r.out.split("lnk 0777 5\n", 1)[1]
    assert listing.startswith("a.txt\ndeep\nhard\nhello.txt\nlink\nmany\nplain\nsized\nsub\nt1\n")
    assert "plain:\na.txt\ncopy.txt\nmoved.txt\nmany:\nf00000\n" in listing


def test_removal_commands(rig):
    os.makedirs(rig.host("tree/a/b"))
    for p in ("tree/x", "tree/a/y", "tree/a/b/z", "lone", "victim"):
        with open(rig.host(p), "wb"):
            pass
    os.mkdir(rig.host("empty"))
    os.setxattr(rig.host("victim"), "user.gone", b"1")
    r = rig.run("rm -r tree; rm lone; rmdir empty; rm -f missing also-missing; rm -rf nothing; "
                "setfattr -x user.gone victim")
    assert (r.exit_code, r.err) == (0, ""), r
    assert sorted(os.listdir(rig.work)) == ["hello.txt", "sub", "victim"]
    assert os.listxattr(rig.host("victim")) == []
    r = rig.run("rm sub")
    assert r.exit_code == 1 and r.err == "rm: sub: Is a directory\n"
    r = rig.run("rm -r gone")
    assert r.exit_code == 1 and r.err == "rm: gone: No such file or directory\n"
    assert os.path.isdir(rig.host("sub"))


def test_a_command_is_one_undoable_step(rig):
    os.makedirs(rig.host("old/inner"))
    with open(rig.host("old/inner/f"), "wb") as f:
        f.write(b"old contents")
    before = oracle.snapshot_dir(rig.work)
    r = rig.run("write hello.txt changed; mkdir -p n/m; gen n/m 5; rm -r old; mv hello.txt sub/h; "
                "chmod 700 sub; ln -s sub/h s; setfattr -n user.k -v v sub/h; truncate -s 2 sub/h; touch sub")
    assert r.exit_code == 0, r
    assert oracle.diff(before, oracle.snapshot_dir(rig.work))  # it changed something
    hist = rig.ws.history()
    assert hist[0]["id"] == r.step_id and hist[0]["exit_code"] == 0
    assert rig.ws.rollback(1)["step_ids"] == [r.step_id]
    oracle.assert_same(before, oracle.snapshot_dir(rig.work), "the folder after undoing the script")
    rig.st.run(rig.guest.rollback_notify(r.step_id))
    assert rig.guest.rollbacks == [r.step_id]


# ---------------------------------------------------------------------------- read-only shares


def test_read_only_mount_refuses_writes_in_the_guest(rig_factory):
    rig = rig_factory(extra_mounts=[GuestMount("0", "/mnt/ro-view", True)])  # a writable export, mounted ro
    before = oracle.snapshot_dir(rig.work)
    for script in ("write /mnt/ro-view/new x", "rm /mnt/ro-view/hello.txt", "touch /mnt/ro-view/hello.txt",
                   "gen /mnt/ro-view/g 1", "truncate -s 0 /mnt/ro-view/hello.txt", "ln -s a /mnt/ro-view/l"):
        r = rig.run(script)
        assert (r.exit_code, r.err.split(": ")[-1]) == (1, os.strerror(errno.EROFS) + "\n"), (script, r)
    oracle.assert_same(before, oracle.snapshot_dir(rig.work))
    r = rig.run("cat /mnt/ro-view/hello.txt")
    assert (r.exit_code, r.out) == (0, "hello\n")
    r = rig.run(f"cat {W1}/readme; ls {W1}")
    assert (r.exit_code, r.out) == (0, "read only\nreadme\n")
    for script in (f"write {W1}/new x", f"rm {W1}/readme", f"mkdir {W1}/d", f"touch {W1}/readme",
                   f"mv {W0}/hello.txt {W1}/h", f"chmod 600 {W1}/readme"):
        r = rig.run(script + "; write after x")
        assert r.exit_code == 1, script
        assert r.err.endswith(f": {os.strerror(errno.EROFS)}\n"), (script, r.err)
        assert not os.path.exists(rig.host("after"))
    assert sorted(os.listdir(rig.ro)) == ["readme"] and os.path.exists(rig.host("hello.txt"))


def test_read_only_export_refuses_writes_on_the_server(rig_factory):
    rig = rig_factory(ro_mount_read_only=False)  # the guest would write: the server must refuse
    for script in (f"write {W1}/new x", f"rm {W1}/readme", f"mkdir {W1}/d", f"setfattr -n user.a -v b {W1}/readme"):
        r = rig.run(script)
        assert (r.exit_code, r.err.split(": ")[-1]) == (1, os.strerror(errno.EROFS) + "\n"), (script, r)
    assert sorted(os.listdir(rig.ro)) == ["readme"]
    assert read(os.path.join(rig.ro, "readme")) == b"read only\n"


def test_memory_mount_is_readable_not_writable(rig_factory):
    rig = rig_factory(extra_mounts=[GuestMount("m0", "/mnt/tools-rw", False)])  # also as a writable mount
    r = rig.run(f"cat {TOOLS}/bin/tool {TOOLS}/README; ls {TOOLS}; stat {TOOLS}/bin")
    assert r.exit_code == 0, r
    assert r.out.startswith("#!/bin/sh\necho tool\ntools\nREADME\nbin\ndir 0755 ")
    for target in (TOOLS, "/mnt/tools-rw"):
        r = rig.run(f"write {target}/new x")
        assert r.exit_code == 1 and r.err == f"write: {target}/new: {os.strerror(errno.EROFS)}\n"
    r = rig.run("ls /mnt/tools-rw")
    assert r.out == "README\nbin\n"


# ---------------------------------------------------------------------------- paths


def test_relative_paths_and_cwd(rig):
    r = rig.run("write x 1; write ./sub/../sub/y 2; cd sub; write z 3; write ../w 4; pwd; "
                f"cd ..; cd {W0}/sub/..; pwd; write {W0}/sub/../sub/v 5", cwd=W0)
    assert (r.exit_code, r.err) == (0, ""), r
    assert r.out == f"{W0}/sub\n{W0}\n"
    got = {p: read(rig.host(p)) for p in ("x", "sub/y", "sub/z", "w", "sub/v")}
    assert got == {"x": b"1", "sub/y": b"2", "sub/z": b"3", "w": b"4", "sub/v": b"5"}
    r = rig.run("write q 6", cwd=f"{W0}/sub")
    assert r.exit_code == 0 and read(rig.host("sub/q")) == b"6"
    r = rig.run("cat ../readme", cwd=f"{W1}/nonexistent")  # lexical: the cwd need not exist
    assert (r.exit_code, r.out) == (0, "read only\n")


def test_a_path_outside_every_share_fails(rig):
    for path, cwd in (("/etc/passwd", W0), ("/mnt/working/10/x", W0), ("../../x", W0), ("/mnt/working", W0),
                      ("x", "/")):
        r = rig.run(f"write {path} data; write after x", cwd=cwd)
        assert (r.exit_code, r.err) == (1, f"write: {path}: not in a shared folder\n"), (path, r)
        assert not os.path.exists(rig.host("after"))


def test_longest_prefix_with_nested_shares(rig_factory, tmp_path):
    nested = tmp_path / "nested"
    nested.mkdir()
    ten = tmp_path / "ten"
    ten.mkdir()
    rig = rig_factory(extra_exports={"n": Provider.read_only_dir(str(nested)), "10": Provider.read_only_dir(str(ten))},
                      extra_mounts=[GuestMount("n", f"{W0}/sub", False), GuestMount("10", "/mnt/working/10", False)])
    (nested / "inner").write_bytes(b"nested share\n")
    (ten / "t").write_bytes(b"ten\n")
    r = rig.run(f"cat {W0}/sub/inner; cat /mnt/working/10/t; ls {W0}; write {W0}/subway x")
    assert (r.exit_code, r.err) == (0, ""), r
    assert r.out == "nested share\nten\nhello.txt\nsub\n"  # "sub" is the parent's mount-point directory
    assert read(rig.host("subway")) == b"x"
    r = rig.run(f"write {W0}/sub/inner2 x")  # the nested share is a read-only export
    assert r.exit_code == 1 and os.strerror(errno.EROFS) in r.err
    assert os.listdir(rig.host("sub")) == [] and sorted(os.listdir(nested)) == ["inner"]
    r = rig.run(f"mv {W0}/hello.txt {W0}/sub/h")  # across shares: copy, then remove — refused by the export
    assert r.exit_code == 1 and os.path.exists(rig.host("hello.txt"))


def test_mv_across_shares_copies_a_file_and_refuses_a_directory(rig_factory, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    ws2 = Workspace.open(str(other), state_dir=str(tmp_path / "state2"))
    try:
        rig = rig_factory(extra_exports={"2": Provider.intercepted(ws2)},
                          extra_mounts=[GuestMount("2", "/mnt/working/2", False)])
        os.chmod(rig.host("hello.txt"), 0o640)
        mtime = os.stat(rig.host("hello.txt")).st_mtime_ns
        r = rig.run("mv hello.txt /mnt/working/2/; ln -s target /mnt/working/2/l; mv /mnt/working/2/l l2")
        assert (r.exit_code, r.err) == (0, ""), r
        assert not os.path.exists(rig.host("hello.txt"))
        moved = other / "hello.txt"
        assert moved.read_bytes() == b"hello\n" and stat.S_IMODE(moved.stat().st_mode) == 0o640
        assert moved.stat().st_mtime_ns == mtime
        assert os.readlink(rig.host("l2")) == "target" and not os.path.lexists(other / "l")
        r = rig.run("mv sub /mnt/working/2/sub")
        assert r.exit_code == 1 and r.err == f"mv: sub: {os.strerror(errno.EXDEV)}\n"
        r = rig.run("ln /mnt/working/2/hello.txt h")
        assert r.exit_code == 1 and os.strerror(errno.EXDEV) in r.err
        assert os.path.isdir(rig.host("sub"))
    finally:
        ws2.close()


# ---------------------------------------------------------------------------- the language


def test_expansion_and_quoting_results(rig):
    env = {"PYTHONPATH": "/opt/lib:/mnt/tools/py", "SPACED": "a  b", "Q": "it's \"q\" \\n", "D": "$HOME"}
    r = rig.run('echo $PYTHONPATH\n'
                'echo "${PYTHONPATH}/x" \'$PYTHONPATH\' \\$PYTHONPATH\n'
                'write "$SPACED" $SPACED    # one word each\n'
                'echo "[$UNSET]" x$UNSET.y $D\n'
                'echo "a;b" \'c#d\' e#f; echo second # comment with \'quotes\' and ; semicolons\n'
                'echo "$Q"; echo $Q\n'
                'echo multi\\\nline\n', env=env)
    assert (r.exit_code, r.err) == (0, ""), r
    assert r.out.splitlines() == [
        "/opt/lib:/mnt/tools/py",
        "/opt/lib:/mnt/tools/py/x $PYTHONPATH $PYTHONPATH",
        "[] x.y $HOME",
        "a;b c#d e#f",
        "second",
        "it's \"q\" \\n",
        "it's \"q\" \\n",
        "multiline",
    ]
    assert read(rig.host("a  b")) == b"a  b"


def test_parse_script_rejects_shell_syntax_it_does_not_have():
    assert parse_script("a 'x|y' \"<>\" \\*; b", {}) == [(1, ["a", "x|y", "<>", "*"]), (1, ["b"])]
    for bad in ("ls | wc", "a && b", "echo > f", "rm *", "echo $(pwd)", "echo ${A", "echo 'open", "(a)"):
        with pytest.raises(ScriptSyntaxError):
            parse_script(bad, {})


def test_a_syntax_error_runs_nothing(rig):
    r = rig.run("write first x\necho 'unterminated")
    assert r.exit_code == 2 and r.err.startswith("sh: line 2: syntax error:"), r
    assert not os.path.exists(rig.host("first"))


@pytest.mark.parametrize("script, code, err", [
    ("exit 3; write after x", 3, ""),
    ("true; false; write after x", 1, ""),
    ("frobnicate; write after x", 127, "sh: frobnicate: not found\n"),
    ("cat missing; write after x", 1, "cat: missing: No such file or directory\n"),
    ("rm -z x; write after x", 2, "rm: usage: invalid option -- 'z'\n"),
    ("cat hello.txt missing sub; write after x", 1,
     "cat: missing: No such file or directory\ncat: sub: Is a directory\n"),
])
def test_exit_codes_and_errors_stop_the_script(rig, script, code, err):
    r = rig.run(script)
    assert (r.exit_code, r.signal, r.err) == (code, None, err), r
    assert not os.path.exists(rig.host("after"))


def test_output_is_streamed_and_cancel_wakes_wait(rig):
    got_first = threading.Event()
    ex, chunks = rig.start("echo before; wait; write after x",
                           on_output=lambda s, t: got_first.set() if t == "before\n" else None)
    assert got_first.wait(WAIT_S)  # the echo's output arrived while the script still runs
    assert not ex.completed.done()
    with pytest.raises(RuntimeError, match="already running"):
        rig.st.run(rig.guest.exec(99, "true", W0, {}, None))
    rig.st.run(rig.guest.cancel(ex.id))
    done = rig.wait(ex)
    assert (done["exit_code"], done["signal"]) == (143, 15)
    assert chunks == [("stdout", "before\n")] and not os.path.exists(rig.host("after"))
    r = rig.run("echo again")  # the guest takes the next command
    assert (r.exit_code, r.out) == (0, "again\n")
    assert any("cancel" in line for line in rig.guest.tail(50))


# ---------------------------------------------------------------------------- safeguard holds


class Decider:
    """The server's decide callback: reports the hold, then waits for the test's answer."""

    def __init__(self):
        self.asked = threading.Event()
        self.holds = []
        self._answer: asyncio.Future | None = None
        self._loop = None

    async def __call__(self, hold):
        self._loop = asyncio.get_running_loop()
        self._answer = self._loop.create_future()
        self.holds.append(hold)
        self.asked.set()
        return await self._answer

    def answer(self, action: str) -> None:
        self._loop.call_soon_threadsafe(self._answer.set_result, action)


@pytest.mark.parametrize("action", ["deny", "allow"])
def test_a_safeguard_hold_blocks_the_script_until_decided(rig_factory, action):
    decider = Decider()
    rig = rig_factory(safeguard=SafeguardConfig(delete_threshold=5, timeout_s=60), decide=decider)
    os.mkdir(rig.host("many"))
    for i in range(20):
        with open(rig.host(f"many/f{i:05d}"), "wb") as f:
            f.write(b"%d" % i)
    before = oracle.snapshot_dir(rig.work)
    step_id = rig.ws.begin_step("rm -r many")
    ex, chunks = rig.start("rm -r many; echo done")
    assert decider.asked.wait(WAIT_S)
    hold = decider.holds[0]
    assert (hold.kind, hold.count) == ("delete", 5)
    assert len(os.listdir(rig.host("many"))) == 16  # four deleted; the fifth is held, unanswered
    assert not ex.completed.done()
    decider.answer(action)
    done = rig.wait(ex)
    rig.ws.complete_step(step_id, done["exit_code"])
    rig.ws.close_active()
    out = "".join(t for s, t in chunks if s == "stdout")
    err = "".join(t for s, t in chunks if s == "stderr")
    if action == "deny":
        assert (done["exit_code"], out, err) == (1, "", f"rm: many: {os.strerror(errno.EIO)}\n")
        oracle.assert_same(before, oracle.snapshot_dir(rig.work), "the folder after a denied hold")
        assert rig.ws.history()[0]["outcome"] == "denied"
    else:
        assert (done["exit_code"], out, err) == (0, "done\n", "")
        assert not os.path.exists(rig.host("many"))
    assert len(decider.holds) == 1


def test_a_cancel_during_a_hold_takes_effect_when_the_reply_returns(rig_factory):
    decider = Decider()
    rig = rig_factory(safeguard=SafeguardConfig(delete_threshold=3, timeout_s=60), decide=decider)
    rig.run("gen many 6")
    step_id = rig.ws.begin_step("rm -r many")
    ex, _chunks = rig.start("rm -r many; write after x")
    assert decider.asked.wait(WAIT_S)
    rig.st.run(rig.guest.cancel(ex.id))  # the worker is blocked in the held unlink: nothing happens yet
    assert not ex.completed.done()
    decider.answer("allow")
    done = rig.wait(ex)
    rig.ws.complete_step(step_id, done["exit_code"])
    assert (done["exit_code"], done["signal"]) == (143, 15)
    assert not os.path.exists(rig.host("many"))  # the held command finished: allowed
    assert not os.path.exists(rig.host("after"))  # the next one never started


def test_stop_while_a_script_is_blocked_on_a_held_reply(rig_factory):
    decider = Decider()  # never answered
    rig = rig_factory(safeguard=SafeguardConfig(delete_threshold=2, timeout_s=60), decide=decider)
    rig.run("gen many 6")
    step_id = rig.ws.begin_step("rm -r many")
    ex, _chunks = rig.start("rm -r many; write after x")
    assert decider.asked.wait(WAIT_S)
    stopped = threading.Event()
    t = threading.Thread(target=lambda: (rig.guest.stop(), stopped.set()), daemon=True)
    t.start()
    assert stopped.wait(WAIT_S), "stop() hung on a held reply"
    done = rig.wait(ex)
    assert (done["exit_code"], done["signal"]) == (143, 15)
    assert not rig.guest.alive() and rig.st.run(rig.guest.vm_status()) == "stopped"
    rig.guest.stop()  # idempotent
    with pytest.raises(RuntimeError):
        rig.st.run(rig.guest.exec(50, "true", W0, {}, None))
    assert not os.path.exists(rig.host("after"))
    rig.ws.complete_step(step_id, 143)


# ---------------------------------------------------------------------------- lifecycle


def test_lifecycle_and_status(rig):
    g = rig.guest
    assert (g.accel, g.alive(), rig.st.run(g.vm_status()), rig.st.run(g.pause())) == ("none", True, "running", False)
    assert "scripted guest" in g.accel_reason and g.boot_s is not None and g.boot_s >= 0
    rig.st.run(g.resume())
    assert any(line.startswith("boot: attached '0' at /mnt/working/0 (rw)") for line in g.tail(10))
    r = rig.run("echo hi", step=False)
    assert r.out == "hi\n" and len(g.tail(3)) == 3 and g.tail(0) == []
    with pytest.raises(RuntimeError):
        g.boot(socket_path=rig.sock, mounts=[], loop=rig.st.loop)
    g.stop()
    assert not g.alive()


def test_boot_failure_leaves_nothing_open(rig):
    g = ScriptedGuest()
    with pytest.raises(OSError):
        g.boot(socket_path=rig.sock, mounts=[GuestMount("0", W0, False), GuestMount("nope", "/x", False)],
               loop=rig.st.loop, timeout_s=5)
    assert not g.alive()
    for mounts in ([GuestMount("0", "relative", False)], [GuestMount("0", "/a", False), GuestMount("1", "/a/", True)]):
        g = ScriptedGuest()
        with pytest.raises(ValueError):
            g.boot(socket_path=rig.sock, mounts=mounts, loop=rig.st.loop)
        assert not g.alive()
        g.stop()


# ---------------------------------------------------------------------------- live mounts


def test_a_live_mount_is_visible_at_once_then_gone_after_unmount(rig):
    add = {"hello.txt": b"live\n", "sub/x": b"x\n"}
    rig.st.call(lambda: rig.st.server.add_export("l0", memory_tree(add)))
    assert rig.run("cat /mnt/live/hello.txt", step=False).err == "cat: /mnt/live/hello.txt: not in a shared folder\n"
    rig.st.run(rig.guest.mount(GuestMount("l0", "/mnt/live", True)))
    r = rig.run("cat /mnt/live/hello.txt; ls /mnt/live/sub", step=False)
    assert (r.exit_code, r.out) == (0, "live\nx\n"), r
    r = rig.run("write /mnt/live/new x", step=False)
    assert r.err == f"write: /mnt/live/new: {os.strerror(errno.EROFS)}\n"
    with pytest.raises(GuestError, match="already mounted"):
        rig.st.run(rig.guest.mount(GuestMount("l0", "/mnt/live", True)))
    rig.st.run(rig.guest.unmount("/mnt/live"))
    assert rig.run("cat /mnt/live/hello.txt", step=False).exit_code == 1
    with pytest.raises(GuestError, match="no live mount"):
        rig.st.run(rig.guest.unmount("/mnt/live"))
    with pytest.raises(GuestError, match="no live mount"):
        rig.st.run(rig.guest.unmount(TOOLS))  # a boot share is not a live mount


def test_live_mounts_are_bounded_and_a_refused_attach_is_a_guest_error(rig):
    for k in range(LIVE_MOUNTS_MAX):
        rig.st.run(rig.guest.mount(GuestMount("m0", f"/mnt/l{k}", True)))
    with pytest.raises(GuestError, match="LIVE_MOUNTS_MAX"):
        rig.st.run(rig.guest.mount(GuestMount("m0", "/mnt/one-more", True)))
    rig.st.run(rig.guest.unmount("/mnt/l0"))
    with pytest.raises(GuestError, match="cannot mount 'nosuch'"):
        rig.st.run(rig.guest.mount(GuestMount("nosuch", "/mnt/l0", True)))
    with pytest.raises(ValueError):
        rig.st.run(rig.guest.mount(GuestMount("m0", "/mnt/../x", True)))
    rig.st.run(rig.guest.mount(GuestMount("m0", "/mnt/l0", True)))
    assert rig.run("cat /mnt/l0/README /mnt/l3/README", step=False).out == "tools\ntools\n"
