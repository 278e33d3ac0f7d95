"""Nightly e2e: ``pytest -m e2e`` cut into shards that run as Ray tasks (issue 19).

    python -m sandbox_sim nightly --out results/ [--shards 8] [--timeout 3600] [--address ray://head:10001] [--require-kvm]

It lives beside ``fanout`` (``sandbox_sim/fanout.py``), whose Ray start/attach it reuses
(:func:`sandbox_sim.fanout.start_or_attach`): both are research/CI commands of the test tree,
not of the product, and ``python -m sandbox_sim --help`` lists them together.

1. **Collect** here: ``pytest --collect-only -q -m e2e PATHS`` (default ``e2e``) in ``--cwd``.
2. **Shard** by file (:func:`shard_by_file`): a file's tests stay together (module fixtures
   such as a booted guest are built once per file), files go heaviest first to the lightest
   shard — a file weighs its test count, or with ``--weights-from DIR`` its seconds in an
   earlier run. Deterministic; every test in exactly one shard; the shards' loads differ by
   at most the heaviest file's weight.
3. **Run** each shard as one Ray task (:func:`run_shard`, one CPU, no retry — a rerun
   would hide a flaky failure; ``--env`` adds to its environment) that starts ``pytest -v``
   in **its own process group** (``start_new_session``) with a hard timeout: on expiry the
   whole group gets ``SIGKILL`` (``killpg``) and the shard is reported as ``timeout`` with
   the last test it started; a group member left after a normal exit (a leaked QEMU) is
   killed too and reported, and so are processes that left the group (their own
   ``setsid``): the Ray worker is their subreaper (``PR_SET_CHILD_SUBREAPER``). Shards still unfinished (unschedulable) at the run's deadline are
   cancelled and reported as timeouts: the run never hangs.
4. **Collect** each shard's JUnit XML and the tail of its output into ``--out``
   (``shard-NN.xml``, ``shard-NN.log``) — the task returns them as data, so the nodes
   need no shared filesystem — plus ``summary.json``; print a table (passed / failed /
   skipped / status per shard). Exit 0 when every shard passed, 1 when any failed, timed
   out or errored, 2 on bad arguments, no Ray, no tests, or ``--require-kvm`` with no KVM node.

**KVM.** A node advertises the custom Ray resource ``kvm`` (1) when the project's KVM probe
(:func:`sandbox.vm.qemu.probe_accel`: ``/dev/kvm`` usable *and* a probe guest boots with
it; ``SANDBOX_ACCEL`` overrides) says so: the local Ray this command starts is given it
from the probe, and a node joining a cluster takes it from
``ray start --resources "$(python -m sandbox_sim nightly --node-resources)"``. When the
cluster has any ``kvm`` resource every shard asks for one (so shards run on KVM hosts only,
one at a time per host); when it has none, shards are scheduled without it and the e2e
tests run under TCG (as here) — unless ``--require-kvm``, which then refuses to start.

Nodes of a remote cluster need the checkout at the same path as ``--cwd`` and a Python
with the project's test dependencies (``sys.executable`` of the worker runs ``pytest``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

from .fanout import _import_ray, start_or_attach

#: shards one run may have (each is a Ray task and two files in --out)
NIGHTLY_SHARDS_MAX = 64
#: shards when --shards is not given
NIGHTLY_SHARDS_DEFAULT = 4
#: a shard's hard timeout when --timeout is not given, and the most it may be set to
NIGHTLY_SHARD_TIMEOUT_S = 3600.0
NIGHTLY_SHARD_TIMEOUT_MAX_S = 6 * 3600.0
#: the collection step (``pytest --collect-only``) is killed after this long
NIGHTLY_COLLECT_TIMEOUT_S = 600.0
#: test ids one run may collect; more is refused (exit 2)
NIGHTLY_TESTS_MAX = 100_000
#: a shard's JUnit XML kept at most; a larger one is not kept and the shard is an error
NIGHTLY_JUNIT_BYTES_MAX = 4 << 20
#: a shard's output (stdout and stderr) kept: its last this many bytes
NIGHTLY_LOG_BYTES_MAX = 256 << 10
#: after a shard's pytest is gone, its output reader is waited for this long at most
NIGHTLY_DRAIN_S = 5.0
#: the whole run's deadline is (shard timeout) x (shards) + this; unfinished shards are then
#: cancelled and reported as timeouts (a shard that cannot be scheduled never hangs the run)
NIGHTLY_SCHEDULE_SLACK_S = 300.0
#: an earlier run's summary.json read by --weights-from at most
NIGHTLY_SUMMARY_BYTES_MAX = 16 << 20
#: rounds of killing the orphans a shard left to its Ray worker (each round: the processes
#: re-parented to it since the shard began; their own children come to it next round)
NIGHTLY_REAP_ROUNDS_MAX = 16
#: the custom Ray resource a KVM host advertises
KVM_RESOURCE = "kvm"

STATUSES = ("passed", "failed", "timeout", "error")


# ---------------------------------------------------------------------------- sharding


def file_of(test_id: str) -> str:
    """The file part of a pytest node id (``e2e/test_x.py::test_y[1]`` -> ``e2e/test_x.py``)."""
    return test_id.split("::", 1)[0]


def shard_by_file(test_ids: list[str], shards: int, seconds: dict[str, float] | None = None) -> list[list[str]]:
    """``test_ids`` cut into at most ``shards`` non-empty shards, a file's tests together and
    in their given order. A file weighs its test count, or with ``seconds`` (a file's time in
    an earlier run, :func:`file_seconds`) that time — a file it does not name weighs its count
    times the known files' mean seconds per test. Files go heaviest first (ties: by name) to
    the lightest shard so far (ties: the one with fewer files, then the lowest index), so the result depends only on the
    files' contents and weights, not on their order, and the heaviest and lightest shard
    differ by at most the heaviest file's weight. ``min(shards, files)`` shards; each id
    occurrence lands in exactly one."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    by_file: dict[str, list[str]] = {}
    for t in test_ids:
        by_file.setdefault(file_of(t), []).append(t)
    weight = _weights(by_file, seconds or {})
    files = sorted(by_file, key=lambda f: (-weight[f], f))
    n = min(shards, len(files))
    out: list[list[str]] = [[] for _ in range(n)]
    loads = [0.0] * n
    counts = [0] * n  # files per shard: among equally loaded shards (weights of 0) the emptier wins
    for f in files:
        i = min(range(n), key=lambda k: (loads[k], counts[k], k))
        out[i].extend(by_file[f])
        loads[i] += weight[f]
        counts[i] += 1
    return out


def _weights(by_file: dict[str, list[str]], seconds: dict[str, float]) -> dict[str, float]:
    known = {f: max(0.0, float(seconds[f])) for f in by_file if f in seconds}
    if not known:
        return {f: float(len(ids)) for f, ids in by_file.items()}
    per_test = sum(known.values()) / sum(len(by_file[f]) for f in known)
    return {f: known.get(f, len(ids) * per_test) for f, ids in by_file.items()}


def file_seconds(test_ids: list[str], xml_bytes: bytes) -> dict[str, float]:
    """Seconds per test file in a JUnit file, for ``test_ids``' files: a test case belongs to
    the file whose dotted path (``e2e/test_x.py`` -> ``e2e.test_x``) is, or is the longest
    prefix of, its ``classname``; cases of no such file are left out."""
    dotted = {f[:-3].replace("/", ".") if f.endswith(".py") else f.replace("/", "."): f
              for f in {file_of(t) for t in test_ids}}
    out: dict[str, float] = {}
    for case in ET.fromstring(xml_bytes).iter("testcase"):
        cls = case.get("classname", "")
        match = max((d for d in dotted if cls == d or cls.startswith(d + ".")), key=len, default=None)
        if match is not None:
            f = dotted[match]
            out[f] = round(out.get(f, 0.0) + float(case.get("time", 0) or 0), 3)
    return out


def seconds_from(out_dir: str) -> dict[str, float]:
    """The per-file seconds of an earlier run's ``summary.json`` in ``out_dir`` (``ValueError``
    when it is missing, larger than ``NIGHTLY_SUMMARY_BYTES_MAX`` or not a summary)."""
    path = os.path.join(out_dir, "summary.json")
    try:
        size = os.path.getsize(path)
        if size > NIGHTLY_SUMMARY_BYTES_MAX:
            raise ValueError(f"{path}: {size} bytes, at most {NIGHTLY_SUMMARY_BYTES_MAX} (NIGHTLY_SUMMARY_BYTES_MAX)")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        out: dict[str, float] = {}
        for shard in data["shards"]:
            for name, secs in (shard.get("file_seconds") or {}).items():
                out[str(name)] = float(secs)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a nightly summary ({type(e).__name__}: {e})") from None
    return out


# ---------------------------------------------------------------------------- one shard


class _Tail:
    """The last ``limit`` bytes of a stream, and how many came in all."""

    def __init__(self, limit: int):
        self.limit, self.total, self.buf = limit, 0, bytearray()

    def drain(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):
            self.total += len(chunk)
            self.buf += chunk
            if len(self.buf) > self.limit:
                del self.buf[: len(self.buf) - self.limit]

    def text(self) -> str:
        head = f"[first {self.total - len(self.buf)} byte(s) of output dropped: NIGHTLY_LOG_BYTES_MAX]\n" \
            if self.total > len(self.buf) else ""
        return head + self.buf.decode("utf-8", "replace")


def _kill_group(pgid: int) -> bool:
    """SIGKILL every process of group ``pgid``; whether any was left to kill."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def junit_counts(xml_bytes: bytes) -> dict[str, int]:
    """tests/passed/failed/errors/skipped summed over a JUnit file's test suites."""
    root = ET.fromstring(xml_bytes)
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    c = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    for s in suites:
        c["tests"] += int(s.get("tests", 0))
        c["failed"] += int(s.get("failures", 0))
        c["errors"] += int(s.get("errors", 0))
        c["skipped"] += int(s.get("skipped", 0))
    c["passed"] = c["tests"] - c["failed"] - c["errors"] - c["skipped"]
    return c


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (``prctl``): a process that
    leaves the shard's group and session (``setsid``) and outlives its parent comes back to
    this process instead of init, so :func:`reap_orphans` can still kill it."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (from ``/proc/*/stat``)."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(name))
    return out


def reap_orphans(before: set[int]) -> int:
    """SIGKILL and reap every child of this process not in ``before`` (the orphans a shard
    left to this subreaper), for at most ``NIGHTLY_REAP_ROUNDS_MAX`` rounds; how many."""
    killed = 0
    for _ in range(NIGHTLY_REAP_ROUNDS_MAX):
        orphans = children(os.getpid()) - before
        if not orphans:
            break
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                continue
            killed += 1
    return killed


def run_shard(index: int, test_ids: list[str], cwd: str, timeout_s: float, pytest_args: list[str] = (),
              env: dict[str, str] | None = None, reap: bool = False) -> dict:
    """Run one shard's tests with ``pytest`` in ``cwd`` (this process's environment plus
    ``env``), in a process group of its own, killed whole (``SIGKILL``) after ``timeout_s``.
    Returns plain data: ``status`` (one of :data:`STATUSES`), ``returncode``, the JUnit
    ``counts`` (None without a usable file), ``junit`` (its text, at most
    ``NIGHTLY_JUNIT_BYTES_MAX`` bytes, else None), ``file_seconds``, ``log`` (the output's last
    ``NIGHTLY_LOG_BYTES_MAX`` bytes), ``strays_killed`` (group members left after pytest
    exited, killed), ``seconds``, ``host`` and a ``reason`` for anything not passed. With
    ``reap`` (the Ray task: a worker process of its own) this process becomes a subreaper
    and the processes that left the group are killed too (``orphans_killed``)."""
    res = {"index": index, "tests": len(test_ids), "host": os.uname().nodename, "status": "error",
           "returncode": None, "counts": None, "junit": None, "log": "", "strays_killed": False, "reason": "",
           "seconds": 0.0, "file_seconds": {}, "orphans_killed": 0}
    t0 = time.monotonic()
    before = children(os.getpid()) if reap and become_subreaper() else None
    with tempfile.TemporaryDirectory(prefix="sandbox-nightly-") as tmp:
        junit = os.path.join(tmp, "junit.xml")
        ids = os.path.join(tmp, "tests.txt")
        with open(ids, "w", encoding="utf-8") as f:
            f.write("".join(t + "\n" for t in test_ids))
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--rootdir", cwd,
               f"--junitxml={junit}", "-o", f"junit_suite_name=shard-{index:02d}", *pytest_args, f"@{ids}"]
        tail = _Tail(NIGHTLY_LOG_BYTES_MAX)
        proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        reader = threading.Thread(target=tail.drain, args=(proc.stdout,), daemon=True, name=f"nightly-shard-{index}")
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # the timeout, or this task cancelled: nothing of the shard outlives it
            strays = _kill_group(proc.pid)
            proc.wait()
            if before is not None:
                res["orphans_killed"] = reap_orphans(before)
        reader.join(NIGHTLY_DRAIN_S)
        res["seconds"] = round(time.monotonic() - t0, 3)
        res["returncode"] = proc.returncode
        res["log"] = tail.text()
        if timed_out:
            last = last_started(tail.text(), test_ids)
            res["status"], res["reason"] = "timeout", (f"killed (SIGKILL to its process group) after {timeout_s:g} s"
                                                       + (f", in or after {last}" if last else ""))
            return res
        res["strays_killed"] = strays
        size = os.path.getsize(junit) if os.path.exists(junit) else None
        if size is None:
            res["reason"] = f"pytest exited {proc.returncode} without a JUnit file"
            return res
        if size > NIGHTLY_JUNIT_BYTES_MAX:
            res["reason"] = f"JUnit file of {size} bytes not kept (NIGHTLY_JUNIT_BYTES_MAX = {NIGHTLY_JUNIT_BYTES_MAX})"
            return res
        with open(junit, "rb") as f:
            data = f.read()
        try:
            res["counts"] = junit_counts(data)
            res["file_seconds"] = file_seconds(test_ids, data)
        except (ET.ParseError, ValueError) as e:
            res["reason"] = f"unreadable JUnit file: {e}"
            return res
        res["junit"] = data.decode("utf-8", "replace")
    if proc.returncode == 0:
        res["status"] = "passed"
    elif proc.returncode == 1:
        res["status"], res["reason"] = "failed", "tests failed"
    else:
        res["reason"] = f"pytest exited {proc.returncode}"
    if (strays or res["orphans_killed"]) and res["status"] == "passed":
        res["reason"] = "processes left in its group after pytest exited were killed" if strays else \
            f"{res['orphans_killed']} process(es) that left its group were killed"
    return res


def last_started(log: str, test_ids: list[str]) -> str | None:
    """The last of ``test_ids`` whose line pytest ``-v`` printed (it prints a test's id as the
    test starts, its outcome when it ends): for a killed shard, the test it hung in or after."""
    wanted = set(test_ids)
    for line in reversed(log.splitlines()):
        first = line.split(" ", 1)[0]
        if first in wanted:
            return first
    return None


# ---------------------------------------------------------------------------- KVM probe


def probe_kvm() -> tuple[bool, str]:
    """Whether this host runs guests under KVM, by the project's probe (``SANDBOX_ACCEL``
    decides without probing; an unusable ``/dev/kvm`` needs no guest image), and why."""
    from sandbox.vm import image as vm_image
    from sandbox.vm import qemu

    try:
        choice = qemu.probe_accel(vm_image.guest_image)
    except (qemu.QemuError, vm_image.ImageError, OSError, ValueError) as e:
        return False, f"KVM probe failed: {e}"
    return choice.accel == "kvm", choice.reason


def node_resources() -> tuple[dict[str, float], str]:
    """The custom Ray resources of this host (``{"kvm": 1}`` or none), and the probe's reason."""
    kvm, why = probe_kvm()
    return ({KVM_RESOURCE: 1.0} if kvm else {}), why


# ---------------------------------------------------------------------------- the command


def collect(cwd: str, marker: str, paths: list[str], pytest_args: list[str]) -> list[str]:
    """The ids of the tests ``pytest -m marker PATHS`` would run (``ValueError`` with pytest's
    output when collection fails, times out or finds more than ``NIGHTLY_TESTS_MAX``)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", cwd,
           "-m", marker, *pytest_args, *paths]
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=NIGHTLY_COLLECT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"collection did not finish within {NIGHTLY_COLLECT_TIMEOUT_S:g} s") from None
    if p.returncode not in (0, 5):  # 5: nothing collected
        raise ValueError(f"collection failed (pytest exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    ids = parse_collected(p.stdout)
    if len(ids) > NIGHTLY_TESTS_MAX:
        raise ValueError(f"{len(ids)} tests collected, at most {NIGHTLY_TESTS_MAX} (NIGHTLY_TESTS_MAX)")
    return ids


def parse_collected(stdout: str) -> list[str]:
    """The node ids ``pytest --collect-only -q`` printed: its lines up to the first blank one
    (what follows — the warnings summary, the count — may name tests too, and is not a list)."""
    ids = []
    for ln in stdout.splitlines():
        if not ln.strip():
            break
        if "::" in ln and not ln.startswith(" "):
            ids.append(ln)
    return ids


def _task_failure(index: int, tests: int, why: str) -> dict:
    return {"index": index, "tests": tests, "host": "?", "status": "error", "returncode": None, "counts": None,
            "junit": None, "log": "", "strays_killed": False, "reason": why, "seconds": 0.0, "file_seconds": {},
            "resources": {}, "orphans_killed": 0}


def cmd_nightly(args) -> int:
    if args.node_resources:
        resources, why = node_resources()
        print(f"# {why}", file=sys.stderr)
        print(json.dumps(resources))
        return 0
    if not 1 <= args.shards <= NIGHTLY_SHARDS_MAX:
        print(f"--shards must be 1..{NIGHTLY_SHARDS_MAX} (NIGHTLY_SHARDS_MAX), not {args.shards}", file=sys.stderr)
        return 2
    if not 0 < args.timeout <= NIGHTLY_SHARD_TIMEOUT_MAX_S:
        print(f"--timeout must be in (0, {NIGHTLY_SHARD_TIMEOUT_MAX_S:g}] s (NIGHTLY_SHARD_TIMEOUT_MAX_S)", file=sys.stderr)
        return 2
    if not args.out and not args.plan:
        print("--out DIR is required (an absent or empty directory for the JUnit files and the summary)", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out or ".")
    if not args.plan and os.path.isdir(out) and os.listdir(out):
        print(f"--out {out}: not empty (each run gets its own directory)", file=sys.stderr)
        return 2
    cwd = os.path.abspath(args.cwd)
    ray = None if args.plan else _import_ray()
    if ray is None and not args.plan:
        print("nightly needs Ray: pip install 'sandbox[cluster]' (or ./dev setup, which installs it)", file=sys.stderr)
        return 2
    pytest_args = list(args.pytest_arg or [])
    env = {}
    for item in args.env or []:
        name, eq, value = item.partition("=")
        if not eq or not name:
            print(f"--env {item!r}: must be NAME=VALUE", file=sys.stderr)
            return 2
        env[name] = value
    try:
        tests = collect(cwd, args.marker, args.paths or ["e2e"], pytest_args)
    except ValueError as e:
        print(f"nightly: {e}", file=sys.stderr)
        return 2
    if not tests:
        print(f"nightly: no test marked {args.marker!r} under {args.paths or ['e2e']} (in {cwd})", file=sys.stderr)
        return 2
    try:
        seconds = seconds_from(args.weights_from) if args.weights_from else None
    except ValueError as e:
        print(f"nightly: --weights-from: {e}", file=sys.stderr)
        return 2
    shards = shard_by_file(tests, args.shards, seconds)
    if args.plan:
        for i, shard in enumerate(shards):
            files = sorted({file_of(t) for t in shard})
            print(f"shard {i:02d}: {len(shard)} test(s) in {len(files)} file(s): {' '.join(files)}")
        return 0
    resources, why = ({}, "") if args.address else node_resources()
    if args.require_kvm and not args.address and not resources:
        print(f"nightly: --require-kvm, but no node of the local Ray would advertise {KVM_RESOURCE!r}: {why}",
              file=sys.stderr)
        return 2
    started = start_or_attach(ray, args.address, args.num_cpus, args.ship_code, resources)
    try:
        kvm_nodes = ray.cluster_resources().get(KVM_RESOURCE, 0)
        where = args.address or "a local Ray" + (f" ({why})" if why else "")
        if args.require_kvm and not kvm_nodes:
            print(f"nightly: --require-kvm, but no node of {where} advertises the {KVM_RESOURCE!r} resource",
                  file=sys.stderr)
            return 2
        print(f"nightly: {len(tests)} test(s) marked {args.marker!r} in {len(shards)} shard(s) on {where}; "
              + (f"each shard takes one {KVM_RESOURCE!r} resource ({kvm_nodes:g} in the cluster)" if kvm_nodes
                 else f"no {KVM_RESOURCE!r} resource in the cluster: shards run without it (TCG)")
              + f"; hard timeout {args.timeout:g} s per shard", flush=True)
        results = _run(ray, shards, cwd, args.timeout, pytest_args, env, kvm_nodes > 0)
    finally:
        if started:
            ray.shutdown()
    return write_results(out, shards, results)


def _run(ray, shards: list[list[str]], cwd: str, timeout_s: float, pytest_args: list[str], env: dict[str, str],
         kvm: bool) -> list[dict]:
    opts = {"num_cpus": 1, "max_retries": 0}
    if kvm:
        opts["resources"] = {KVM_RESOURCE: 1}
    remote = ray.remote(**opts)(_shard_task)
    refs = {remote.remote(i, s, cwd, timeout_s, pytest_args, env): i for i, s in enumerate(shards)}
    deadline = time.monotonic() + timeout_s * len(shards) + NIGHTLY_SCHEDULE_SLACK_S
    results: dict[int, dict] = {}
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            for ref, i in refs.items():
                ray.cancel(ref)  # not force: a running shard still kills its group
                r = _task_failure(i, len(shards[i]), "not finished by the run's deadline (shard timeout x shards + "
                                  "NIGHTLY_SCHEDULE_SLACK_S): cancelled")
                r["status"] = "timeout"
                results[i] = r
            break
        for ref in ready:
            i = refs.pop(ref)
            try:
                results[i] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the task itself failed (node lost, ...): that shard is an error
                results[i] = _task_failure(i, len(shards[i]), f"task failed: {type(e).__name__}: "
                                           + (str(e).strip().splitlines() or [""])[-1])
            r = results[i]
            print(f"  shard {i:02d}: {r['status']} ({r['seconds']:.1f} s on {r['host']})", flush=True)
    return [results[i] for i in range(len(shards))]


def _shard_task(*args) -> dict:
    """:func:`run_shard` as a Ray task, its result naming the resources Ray gave it."""
    import ray

    res = run_shard(*args, reap=True)
    res["resources"] = {k: v for k, v in ray.get_runtime_context().get_assigned_resources().items()
                        if not k.startswith("node:")}
    return res


def summary_lines(shards: list[list[str]], results: list[dict]) -> list[str]:
    """The printed table: one row per shard, then the totals."""
    lines = [f"{'shard':<6}{'status':<9}{'passed':>7}{'failed':>7}{'skipped':>8}{'tests':>6}{'seconds':>9}  host / files / reason"]
    tot = {"passed": 0, "failed": 0, "skipped": 0}
    for i, r in enumerate(results):
        c = r["counts"] or {}
        failed = c.get("failed", 0) + c.get("errors", 0) if c else None
        for k, v in (("passed", c.get("passed")), ("failed", failed), ("skipped", c.get("skipped"))):
            tot[k] += v or 0
        files = sorted({file_of(t) for t in shards[i]})
        cell = [("-" if v is None else str(v)) for v in (c.get("passed"), failed, c.get("skipped"))]
        lines.append(f"{i:02d}    {r['status']:<9}{cell[0]:>7}{cell[1]:>7}{cell[2]:>8}{r['tests']:>6}{r['seconds']:>9.1f}  "
                     f"{r['host']} / {' '.join(files)}" + (f" / {r['reason']}" if r["reason"] else ""))
    by = {s: sum(1 for r in results if r["status"] == s) for s in STATUSES}
    lines.append(f"total: {tot['passed']} passed, {tot['failed']} failed, {tot['skipped']} skipped; shards: "
                 f"{by['passed']} passed, {by['failed']} failed, {by['timeout']} timed out, {by['error']} error(s)")
    return lines


def write_results(out: str, shards: list[list[str]], results: list[dict]) -> int:
    """``shard-NN.xml`` (when the shard left one), ``shard-NN.log``, ``summary.json`` and the
    printed table; the exit code (0: every shard passed, else 1)."""
    os.makedirs(out, exist_ok=True)
    for i, r in enumerate(results):
        if r["junit"] is not None:
            with open(os.path.join(out, f"shard-{i:02d}.xml"), "w", encoding="utf-8") as f:
                f.write(r["junit"])
        with open(os.path.join(out, f"shard-{i:02d}.log"), "w", encoding="utf-8") as f:
            f.write(r["log"])
    summary = [{k: v for k, v in r.items() if k not in ("junit", "log")} | {"test_ids": shards[i]}
               for i, r in enumerate(results)]
    ok = all(r["status"] == "passed" for r in results)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"ok": ok, "shards": summary}, f, indent=1)
    lines = summary_lines(shards, results)
    for ln in lines:
        print(ln)
    print(f"JUnit XML, logs and summary.json in {out}")
    return 0 if ok else 1
