"""The local guest (``sandbox run --local``, ``guest="local"``): host commands on a FUSE mount.

Real commands (``sh``, ``rm``, ``stat``) run on this host against a real FUSE mount of the
folder at its own path, made in the guest's private mount namespace and served by our
dispatcher; the folder is compared with its snapshot from before
(:mod:`sandbox_sim.oracle`: kinds, modes, mtimes, bytes, xattrs, owners) after ``undo``.
Fast (well under a second per session) and in the default tier where it can run: skipped,
saying why, without /dev/fuse or nsenter, or where the private namespace or the FUSE mount
cannot be made (no privilege, e.g. a container without CAP_SYS_ADMIN).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

import sandbox
from sandbox.core.safeguard import SafeguardConfig
from sandbox.local.guest import LocalGuest, LocalGuestError, check_usable
from sandbox.session.runtime import Folder, Session
from sandbox_sim import oracle
from sandbox_sim.api_client import ApiClient

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_S = 60


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


@pytest.fixture(scope="module")
def usable(tmp_path_factory):
    """Skip (saying why) where the local guest cannot run; probe it once with a real session."""
    try:
        check_usable()
    except LocalGuestError as e:
        pytest.skip(str(e))
    d = tmp_path_factory.mktemp("probe")
    try:
        with Session([Folder(str(d))], guest="local", state_dirs=[str(d) + ".state"]):
            pass
    except LocalGuestError as e:
        pytest.skip(f"the local guest cannot mount here: {e}")


@pytest.fixture
def project(tmp_path, usable):
    p = tmp_path / "project"
    (p / "src" / "pkg").mkdir(parents=True)
    (p / "src" / "main.py").write_text("print('hi')\n")
    (p / "src" / "pkg" / "data.bin").write_bytes(bytes(range(256)) * 40)
    os.chmod(p / "src" / "main.py", 0o755)
    os.symlink("src/main.py", p / "link")
    (p / "big").mkdir()
    for i in range(10):
        (p / "big" / f"f{i}").write_text(f"{i}\n")
    return str(p)


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=WAIT_S, **kw)


def _pids_in(ns: str) -> set[int]:
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns:
                    out.add(int(name))
            except OSError:
                pass
    return out


# ---------------------------------------------------------------------------- the command line


def test_run_local_then_undo_restores_the_tree_exactly(project, tmp_path):
    state = str(tmp_path / "state")
    before = oracle.snapshot_dir(project)
    script = ('awk -v p="$PWD" \'$5 == p && / - fuse\\.sandbox /\' /proc/self/mountinfo | wc -l; stat -f -c %T "$PWD"; '
              'rm -rf src && echo gone; echo new > added; exit 7')
    r = _cli("run", "--local", "--workdir", project, "--state-dir", state, "--", "sh", "-c", script)
    assert r.returncode == 7, r.stderr  # the command's exit code
    lines = r.stdout.split()
    assert lines[0] == "1", r.stdout  # the command saw the FUSE mount at the folder's own path …
    assert lines[1].startswith("fuse"), r.stdout  # … and its cwd is on it
    assert lines[2] == "gone" and "sandbox undo --workdir" in r.stderr
    assert not os.path.exists(os.path.join(project, "src"))
    assert project not in _mount_points()  # the host's own namespace never saw the mount
    u = _cli("undo", "--workdir", project, "--state-dir", state)
    assert u.returncode == 0, u.stdout + u.stderr
    oracle.assert_same(before, oracle.snapshot_dir(project))


def test_run_local_help_says_undo_not_isolation(usable):
    r = _cli("run", "--help")
    assert r.returncode == 0
    assert "--local" in r.stdout and "UNDO, NOT ISOLATION" in r.stdout and "private mount namespace" in r.stdout


# ---------------------------------------------------------------------------- the SDK


def test_sdk_local_guest_runs_undoes_exactly_and_reports_events(project, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "keep.txt").write_text("keep\n")
    before = oracle.snapshot_dir(project)

    async def main():
        events = []
        async with sandbox.Sandbox(volumes=[sandbox.Volume(project, state_dir=str(tmp_path / "st")), (str(ro), None, "ro")],
                                   guest="local", on_event=events.append) as sb:
            r2 = await sb.run(f"touch {ro}/nope", on_output=None)
            assert r2.exit_code != 0 and "Read-only file system" in r2.stderr  # read-only volumes mount read-only
            r = await sb.run("rm -rf src big && rm link && touch new.txt")
            assert r.exit_code == 0 and r.step_id is not None, r
            assert project not in _mount_points() and str(ro) not in _mount_points()
            status = await sb.status()
            assert status["guest"] == "local"
            await sb.undo(1)
        # every event is delivered by the time the sandbox has stopped
        steps = [e for e in events if e["type"] == "step_completed" and e["step_id"] == r.step_id]
        assert len(steps) == 1 and "new.txt" in steps[0]["affected_paths"]
        assert any(e["type"] == "rollback" and e["step_ids"] == [r.step_id] for e in events)

    asyncio.run(main())
    oracle.assert_same(before, oracle.snapshot_dir(project))


def test_after_stop_no_process_and_no_mount_remains(project, tmp_path):
    s = Session([Folder(project)], guest="local", state_dirs=[str(tmp_path / "st")])
    with s:
        guest = s._s.guest
        assert isinstance(guest, LocalGuest)
        # a daemon that escapes the command's process group and session, holding no pipe
        r = s.run("setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo started")
        assert r.exit_code == 0
        init = guest.init_pid
        ns = os.readlink(f"/proc/{init}/ns/pid")
        assert len(_pids_in(ns)) >= 2  # init and the daemon
        holder = guest._holder
    assert holder.poll() is not None
    assert _pids_in(ns) == set()  # the kernel killed what was left in the namespace with its init
    assert project not in _mount_points()


# ---------------------------------------------------------------------------- cancel and safeguards


def test_cancel_of_a_running_command(project, tmp_path):
    cancel = threading.Event()

    def on_output(stream: str, text: str) -> None:
        if "started" in text:
            cancel.set()

    with Session([Folder(project)], guest="local", state_dirs=[str(tmp_path / "st")]) as s:
        r = s.run("echo started; exec sleep 1000", on_output, cancel=cancel)
        assert r.cancelled and r.signal == 15 and r.exit_code == 128 + 15, r
        assert s.run("echo again").exit_code == 0  # the guest goes on


@pytest.mark.parametrize("action", ["allow", "deny"])
def test_a_safeguard_hold_blocks_the_command_mid_syscall(project, tmp_path, action):
    before = oracle.snapshot_dir(project)
    seen: list[dict] = []

    def decide(hold):
        # the command is blocked inside its unlink(2): nothing after rm has run, some files remain
        seen.append({"after": os.path.exists(os.path.join(project, "after")),
                     "left": len(os.listdir(os.path.join(project, "big")))})
        return action

    with Session([Folder(project)], guest="local", state_dirs=[str(tmp_path / "st")], decide=decide,
                 safeguard=SafeguardConfig(delete_threshold=3)) as s:
        r = s.run("rm -rf big && echo done > after")
        assert s.status()["guest"] == "local"
    assert len(seen) == 1 and not seen[0]["after"] and seen[0]["left"] > 0, seen
    if action == "allow":
        assert r.exit_code == 0 and not os.path.exists(os.path.join(project, "big"))
        assert os.path.exists(os.path.join(project, "after"))
    else:  # a deny rolls the step back; the program saw an error and stopped
        assert r.exit_code != 0
        oracle.assert_same(before, oracle.snapshot_dir(project))


# ---------------------------------------------------------------------------- STDIO


@pytest.mark.parametrize("how", ["serve --guest local", "session.start guest local"])
def test_stdio_session_start_with_the_local_guest(project, tmp_path, how):
    c = ApiClient(guest="local" if how.startswith("serve") else "scripted", env={"XDG_STATE_HOME": str(tmp_path / "xdg")})
    try:
        before = oracle.snapshot_dir(project)
        payload = {"working_directories": [{"path": project}]} | ({} if how.startswith("serve") else {"guest": "local"})
        started = c.ok("session.start", payload, timeout_s=WAIT_S)
        assert started["guest"] == "local" and started["folders"][0]["guest_path"] == os.path.realpath(project)
        r = c.ok("agent.execute", {"command": "rm -rf src && echo gone"})
        assert r["exit_code"] == 0
        assert not os.path.exists(os.path.join(project, "src"))
        c.ok("undo.rollback", {"count": 1})
        oracle.assert_same(before, oracle.snapshot_dir(project))
        c.ok("session.stop")
    finally:
        if c.proc.poll() is None:
            c.close()
    c.check()


def test_the_next_command_sees_an_undo_at_once(project, tmp_path):
    """The kernel caches dentries and attributes for a second; an undo tells it to forget them."""
    with Session([Folder(project)], guest="local", state_dirs=[str(tmp_path / "st")]) as s:
        assert s.run("cat src/main.py >/dev/null && printf x > src/main.py && echo new > fresh && ls fresh").exit_code == 0
        s.undo(1)
        out: list[str] = []
        r = s.run("cat src/main.py; ls fresh", lambda stream, text: out.append(text))
        assert r.exit_code != 0  # fresh is gone
        assert "print('hi')\n" in "".join(out)  # the whole restored file, not its cached size of 1
        events = open(s._s.guest.undo_events.path).read()
        assert '"fresh"' in events or "/fresh" in events  # $SANDBOX_UNDO_EVENTS names what was undone


def test_the_mount_caches_long_and_is_told_of_host_edits(project, tmp_path):
    """The session watches the folder for the local guest: its mount is coherent (60 s
    timeouts, pages kept), and a change made beside it — a chmod, a same-size rewrite —
    is invalidated in the kernel, so the next command sees it at once."""
    with Session([Folder(project)], guest="local", state_dirs=[str(tmp_path / "st")]) as s:
        guest = s._s.guest
        (m,) = guest._mounts
        assert m.server.dispatcher.coherent
        out: list[str] = []
        assert s.run("stat -c %a src/main.py; cat src/main.py", lambda stream, text: out.append(text)).exit_code == 0
        main = os.path.join(project, "src", "main.py")
        assert "".join(out).split("\n")[:2] == [f"{os.stat(main).st_mode & 0o777:o}", "print('hi')"], out
        since = m.server.notifier.mark()
        os.chmod(main, 0o600)
        with open(main, "w") as f:
            f.write("print('HO')\n")  # the same size: only an invalidation can show it
        assert m.server.notifier.wait_flushed("src/main.py", WAIT_S, since), "no invalidation was written"
        out.clear()
        assert s.run("stat -c %a src/main.py; cat src/main.py", lambda stream, text: out.append(text)).exit_code == 0
        assert "".join(out).split("\n")[:2] == ["600", "print('HO')"], out


def test_commands_see_a_proc_of_their_own_pid_namespace(project, tmp_path):
    """init mounts a /proc of the guest's PID namespace: pid 1 is the holder's init, and the
    agent's own process is not in it (the host's /proc would show both)."""
    with Session([Folder(project)], guest="local", state_dirs=[str(tmp_path / "st")]) as s:
        if not s._s.guest.private_proc:  # root may always mount it in its own namespaces
            assert os.geteuid() != 0, "no private /proc, as root"
            pytest.skip("the kernel refused a private /proc here (masked /proc in a user namespace?)")
        out: list[str] = []
        r = s.run(f"tr '\\0' ' ' < /proc/1/cmdline; echo; cat /proc/{os.getpid()}/cmdline 2>/dev/null | wc -c; "
                  "echo $$", lambda stream, text: out.append(text))
    assert r.exit_code == 0, out
    lines = "".join(out).splitlines()
    assert "holder.py" in lines[0], lines
    assert lines[1].strip() == "0" or os.getpid() < 50, lines  # the agent is not there (unless its pid is tiny)
    assert int(lines[2]) < 50, lines  # the command's shell has a pid of the new namespace


# ---------------------------------------------------------------------------- unprivileged


NOBODY = 65534


def _python_for_nobody() -> str | None:
    """An interpreter of this version that an unprivileged user can run, and that can start
    itself again (the holder): ours may be under /root."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", cand, "-c",
                                "import subprocess, sys; subprocess.run([sys.executable, '-c', ''], check=True); "
                                "print(sys.version_info[:2])"], capture_output=True, text=True, timeout=WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip() == str(sys.version_info[:2]):
            return cand
    return None


def test_unprivileged_in_a_user_namespace(usable, tmp_path):
    """Not root: the holder makes a user namespace (uid mapped to itself) and mounts FUSE there.
    This machine's /dev/fuse may be root's only, so the test runs in a private mount namespace
    of its own where a 0666 node of the same device covers /dev/fuse (the host is untouched)."""
    import shutil
    import sysconfig
    import tempfile

    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("needs root (to become an unprivileged user) and setpriv/unshare")
    python = _python_for_nobody()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that an unprivileged user can run")
    base = tempfile.mkdtemp(prefix="sandbox-local-unpriv-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        proj = os.path.join(base, "proj")
        os.makedirs(os.path.join(proj, "src"))
        with open(os.path.join(proj, "src", "a.txt"), "w") as f:
            f.write("a\n")
        for d, dirs, files in os.walk(base):
            for n in [d] + [os.path.join(d, x) for x in dirs + files]:
                os.lchown(n, NOBODY, NOBODY)
        before = oracle.snapshot_dir(proj)
        path = os.pathsep.join([REPO, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        as_nobody = (f"HOME={base} XDG_STATE_HOME={base}/xdg PYTHONPATH={path} "
                     f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups {python} -m sandbox")
        script = (f"mknod -m 666 {base}/fuse c 10 229 && mount --bind {base}/fuse /dev/fuse && "
                  f"{as_nobody} run --local --workdir {proj} -- sh -c 'id -u; stat -f -c %T .; rm -rf src' && "
                  f"{as_nobody} undo --workdir {proj}")
        r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=WAIT_S)
        if "Permission denied" in r.stderr and "sandbox" not in r.stdout:
            pytest.skip(f"the unprivileged user cannot read this checkout or its packages: {r.stderr[-300:]}")
        if "cannot make the private mount namespace" in r.stderr or "cannot mount" in r.stderr:
            pytest.skip(f"the kernel does not allow FUSE in a user namespace here: {r.stderr[-300:]}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.split()[:2] == [str(NOBODY), "fuseblk"], r.stdout
        oracle.assert_same(before, oracle.snapshot_dir(proj))
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- mounts and docs


def test_in_memory_and_live_mounts_at_existing_directories(project, tmp_path):
    tools, live = tmp_path / "tools", tmp_path / "live"
    tools.mkdir()
    live.mkdir()

    async def main():
        async with sandbox.Sandbox(volumes=[sandbox.Volume(project, state_dir=str(tmp_path / "st"))], guest="local",
                                   mounts={str(tools): {"hello.sh": b"echo hi from memory\n"}}) as sb:
            r = await sb.run(f"sh {tools}/hello.sh")
            assert r.stdout == "hi from memory\n", r
            await sb.mount(str(live), {"x.txt": b"live\n"})
            assert (await sb.run(f"cat {live}/x.txt")).stdout == "live\n"
            await sb.unmount(str(live))
            assert (await sb.run(f"ls {live}")).stdout == ""  # the host's empty directory again
        with pytest.raises(Exception, match="existing directories"):
            async with sandbox.Sandbox(volumes=[sandbox.Volume(project, state_dir=str(tmp_path / "st"))], guest="local",
                                       mounts={str(tmp_path / "absent"): {"a": b""}}):
                pass

    asyncio.run(main())
    assert not os.listdir(tools) and not os.listdir(live)  # nothing was written to the host


def test_docs_quote_the_local_guest_limits():
    import re

    from sandbox.local import guest, holder

    doc = open(os.path.join(REPO, "docs", "fuse.md")).read()
    section = doc[doc.index("## Local guest"):]
    rows = dict(re.findall(r"\| `([A-Z_]+)` = ([\d,.]+)", section))
    expected = {name: getattr(guest, name, getattr(holder, name, None)) for name in rows}
    assert set(rows) == {"COMMANDS_RUNNING_MAX", "READ_CHUNK_BYTES_MAX", "CANCEL_GRACE_S", "HOLDER_REPLY_TIMEOUT_S",
                         "STOP_TIMEOUT_S", "MESSAGE_BYTES_MAX", "UNDO_NOTIFY_WAIT_S"}
    for name, text in rows.items():
        assert float(text.replace(",", "")) == expected[name], name


def test_mcp_local_runs_on_the_mount_and_undoes_exactly(project, tmp_path):
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    before = oracle.snapshot_dir(project)

    async def go():
        params = StdioServerParameters(command=sys.executable, args=[
            "-m", "sandbox", "mcp", "--local", "--workdir", project, "--state-dir", str(tmp_path / "st")], cwd=REPO)
        with open(tmp_path / "stderr", "w") as err:
            async with stdio_client(params, errlog=err) as (r, w):
                async with ClientSession(r, w) as cs:
                    await cs.initialize()
                    x = await cs.call_tool("execute_command", {"command": 'stat -f -c %T "$PWD"; rm -rf src'})
                    assert not x.is_error and "fuse" in x.content[0].text, x
                    assert not os.path.exists(os.path.join(project, "src"))
                    assert not (await cs.call_tool("undo", {})).is_error

    asyncio.run(go())
    oracle.assert_same(before, oracle.snapshot_dir(project))


# ---------------------------------------------------------------------------- lifetime and errors


def _started(pid: int) -> int | None:
    """When the live process ``pid`` started (``/proc/PID/stat`` field 22, clock ticks after
    boot), or None: gone or a zombie. With the pid it names one process: the kernel hands a
    freed pid out again (``pid_max`` is 32,768 on these machines, and the test suite starts
    thousands), and a process that starts under a remembered pid is another one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _alive(proc: tuple[int, int | None]) -> bool:
    """Is ``(pid, start)`` (:func:`_started`) still that running process?"""
    pid, start = proc
    return start is not None and _started(pid) == start


def _descendants(root: int) -> set[int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        todo += list(kids - out)
        out |= kids
    return out


def test_everything_dies_with_a_sigkilled_agent(project, tmp_path):
    """QEMU-style lifetime: SIGKILL of `sandbox run --local` mid-command leaves nothing running —
    not the holder, not init, not the command, not a daemon it started — and no mount."""
    import time

    p = subprocess.Popen([sys.executable, "-m", "sandbox", "run", "--local", "--workdir", project, "--state-dir",
                          str(tmp_path / "st"), "--", "setsid sleep 1001 </dev/null >/dev/null 2>&1 & echo started; "
                          "exec sleep 1000"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout.readline() == "started\n"
        tree = _descendants(p.pid)
        assert len(tree) >= 4, tree  # holder, init, nsenter, the command (and the daemon, in init's namespace)
        ours = os.readlink("/proc/self/ns/pid")
        spaces = {os.readlink(f"/proc/{pid}/ns/pid") for pid in tree} - {ours}
        assert len(spaces) == 1  # init's
        members = _pids_in(spaces.pop())
        assert len(members) >= 3, members  # init, the command, the daemon
        procs = {(pid, _started(pid)) for pid in tree | members}  # a helper already gone is None: not alive
        p.kill()
        p.wait()
        deadline = time.monotonic() + WAIT_S  # a condition wait: the kernel delivers the death signals
        while any(_alive(proc) for proc in procs) and time.monotonic() < deadline:
            os.sched_yield()
        assert not [proc for proc in procs if _alive(proc)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert project not in _mount_points()


def test_an_unprivileged_user_without_dev_fuse_gets_a_clear_error(usable, tmp_path):
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to become an unprivileged user")
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        pytest.skip("/dev/fuse is open to every user here: the unprivileged path works instead")
    python = _python_for_nobody()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that an unprivileged user can run")
    import shutil
    import sysconfig

    base = tempfile.mkdtemp(prefix="sandbox-local-nofuse-", dir="/tmp")
    try:
        os.chmod(base, 0o777)
        os.mkdir(os.path.join(base, "proj"))
        os.chown(os.path.join(base, "proj"), NOBODY, NOBODY)
        path = os.pathsep.join([REPO, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, "-m",
                            "sandbox", "run", "--local", "--workdir", os.path.join(base, "proj"), "--", "true"], capture_output=True,
                           text=True, timeout=WAIT_S, env={**os.environ, "HOME": base, "XDG_STATE_HOME": base,
                                                             "PYTHONPATH": path})
        assert r.returncode == 1, r.stdout + r.stderr
        assert "cannot open /dev/fuse" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("network", ["disabled", "open"])
def test_network_disabled_is_a_private_network_namespace(project, tmp_path, network):
    with Session([Folder(project)], guest="local", network=network, state_dirs=[str(tmp_path / "st")]) as s:
        out: list[str] = []
        r = s.run("readlink /proc/self/ns/net; cat /proc/net/dev", lambda stream, text: out.append(text))
        loopback = s.run(f"{sys.executable} -c 'import socket; s = socket.create_server((\"127.0.0.1\", 0)); "
                         "socket.create_connection(s.getsockname())'")
    assert r.exit_code == 0 and loopback.exit_code == 0  # loopback is up in a private namespace too
    lines = "".join(out).splitlines()
    interfaces = {line.split(":")[0].strip() for line in lines[3:]}
    if network == "disabled":
        assert lines[0] != os.readlink("/proc/self/ns/net") and interfaces == {"lo"}
    else:
        assert lines[0] == os.readlink("/proc/self/ns/net")
