#!/usr/bin/env python3
"""Benchmark: the sandbox undo core vs. git as an "undo" for one agent step.

Run ``python bench/undo_vs_git.py --help`` for what it measures. This is a script that
prints numbers; it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

try:
    import sandbox
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import sandbox

DESCRIPTION = """\
Compare the cost of making one agent step undoable with the sandbox undo core
(sandbox.Workspace) against doing the same with git, on a synthetic tree on a real disk.

What is built (not timed): a deterministic tree (fixed --seed) of --files files, about
--mb MB in total, in nested directories: many small text-like compressible files
(200 B - 8 KB), some medium files (32 - 512 KB, text-like or half random) and a few large
files of random bytes (1 - 4 MB). Each repeat copies it afresh to three folders:
A (sandbox), B (git: `git init` + `git add -A` + `git commit` of the initial tree, as
setup) and C (baseline). `os.sync()` runs before every timed section, so write-back of
the setup does not land in it; caches are warm; neither side fsyncs (git runs at its
default core.fsync; gc.auto=0 so no auto-gc lands in a timing; global/system git config
is ignored).

The change (identical on all three): rewrite ~20% of the files (new content, same paths,
similar sizes) and delete ~10% of the files, interleaved, chosen per size class.

What is timed (time.perf_counter, median over --repeat fresh copies):
  baseline   the plain mutations alone on C: open(..., "wb").write / os.unlink
             (no undo, no git) - the floor both sides add their overhead to.
  change     sandbox: the whole `with ws.step(...)` block on A, the mutations made
             through ws.fs.write_file / ws.fs.unlink (so preimage capture, journal and
             the step's close are included).
             git: the same plain mutations on B + `git add -A` + `git commit -q`.
  rollback   sandbox: ws.rollback(1) after that step.
             git: `git checkout -- .` + `git clean -fdq` of the same change made again
             on B *uncommitted* (B is first put back with an untimed
             `git reset --hard HEAD~1`; `reset --hard HEAD~1` itself is not what is
             compared, since an agent's step is not a commit).
Also reported: the undo store's size on disk after the step vs. the .git directory's
(after the initial commit, after the change commit, and the growth between), and a
one-off setup line (Workspace.open vs. git init+add+commit of the initial tree), which
is not part of the comparison.

Verification (not timed): after the change, A and B must hold exactly the expected
tree; after the rollback they must be byte-identical to the original (same set of paths,
files and directories, and the same content hash for every file). OK/FAIL is printed.

The tree lives in a fresh temporary directory under --dir (default /var/tmp); a warning
is printed if that is tmpfs/ramfs. It is deleted at the end unless --keep.
"""

KB = 1024
MB = 1024 * 1024

SMALL = (200, 8 * KB)
MEDIUM = (32 * KB, 512 * KB)
LARGE = (1 * MB, 4 * MB)
CORPUS_BYTES = MEDIUM[1] * 2 + 16 * KB

REWRITE_FRACTION = 0.20
DELETE_FRACTION = 0.10

GIT = ["git", "-c", "core.fsmonitor=false", "-c", "user.name=undo-bench", "-c", "user.email=undo-bench@example.invalid",
       "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false", "-c", "gc.auto=0", "-c", "init.defaultBranch=main",
       "-c", "advice.detachedHead=false"]


def git_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    return env


GIT_ENV = git_env()


def git(cwd: str, *args: str) -> str:
    r = subprocess.run(GIT + list(args), cwd=cwd, env=GIT_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed ({r.returncode}): {r.stderr.decode(errors='replace').strip()}")
    return r.stdout.decode(errors="replace")


# ---------------------------------------------------------------------- the tree


@dataclass
class FileSpec:
    path: str  # relative, "/"-separated
    cls: str  # small | medium | large
    size: int
    index: int


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def make_corpus(seed: int) -> bytes:
    """About 1 MB of code-like text from a small vocabulary: compresses roughly 3-4x."""
    rng = random.Random(f"corpus:{seed}")
    letters = "abcdefghijklmnopqrstuvwxyz_"
    vocab = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(400)]
    vocab += ["def", "return", "if", "else", "for", "in", "=", "==", "(", ")", "{", "}", "[", "]", ",", ":", "+", "-",
              "self", "None", "True", "0", "1", "42", "#", "import", "class", "const", "let", "fn"]
    lines, total = [], 0
    while total < CORPUS_BYTES:
        line = "    " * rng.randint(0, 3) + " ".join(rng.choices(vocab, k=rng.randint(2, 12)))
        lines.append(line)
        total += len(line) + 1
    return ("\n".join(lines) + "\n").encode()


def plan_tree(n_files: int, target_bytes: int, seed: int) -> tuple[list[str], list[FileSpec]]:
    """Directories (parents first) and file specs: deterministic for (n_files, target_bytes, seed)."""
    rng = random.Random(f"plan:{seed}:{n_files}:{target_bytes}")
    avg_small = (SMALL[1] - SMALL[0]) / math.log(SMALL[1] / SMALL[0])
    avg_medium = (MEDIUM[1] - MEDIUM[0]) / math.log(MEDIUM[1] / MEDIUM[0])
    avg_large = sum(LARGE) / 2
    rest = target_bytes - n_files * avg_small  # what medium and large files must bring
    n_large = round(rest * 0.4 / avg_large) if rest > 0 else 0
    if n_large == 0 and rest >= 2 * LARGE[0]:
        n_large = 1
    n_medium = max(n_files // 100, round((rest - n_large * avg_large) / avg_medium)) if rest > 0 else 0
    n_large = min(n_large, n_files // 10)
    n_medium = min(n_medium, n_files // 4)
    n_small = n_files - n_medium - n_large

    sizes = {"small": [log_uniform(rng, *SMALL) for _ in range(n_small)],
             "medium": [log_uniform(rng, *MEDIUM) for _ in range(n_medium)],
             "large": [rng.randint(*LARGE) for _ in range(n_large)]}
    # nudge medium, then large, then small sizes so the total comes close to the target,
    # never leaving a class's size range
    for cls, (lo, hi) in (("medium", MEDIUM), ("large", LARGE), ("small", SMALL)):
        gap = target_bytes - sum(sum(v) for v in sizes.values())
        cur = sum(sizes[cls])
        if cur and gap:
            factor = max(0.01, (cur + gap) / cur)
            sizes[cls] = [min(hi, max(lo, int(s * factor))) for s in sizes[cls]]

    dir_words = ["src", "lib", "pkg", "core", "util", "test", "docs", "build", "data", "api", "net", "ui", "db", "io"]
    dirs = [""]
    can_nest = [""]  # directories less than 5 deep
    for i in range(max(3, n_files // 20)):
        parent = rng.choice(can_nest)
        name = f"{rng.choice(dir_words)}{i}"
        d = f"{parent}/{name}" if parent else name
        dirs.append(d)
        if d.count("/") < 4:
            can_nest.append(d)

    exts = {"small": ["py", "txt", "md", "json", "c", "h", "rs", "toml", "js"], "medium": ["dat", "csv", "log"], "large": ["bin"]}
    order = [(cls, s) for cls in ("small", "medium", "large") for s in sizes[cls]]
    rng.shuffle(order)
    specs = []
    for i, (cls, size) in enumerate(order):
        d = rng.choice(dirs)
        name = f"f{i:05d}.{rng.choice(exts[cls])}"
        specs.append(FileSpec(f"{d}/{name}" if d else name, cls, size, i))
    return dirs[1:], specs


def content(spec: FileSpec, rev: int, seed: int, corpus: bytes) -> bytes:
    """The bytes of ``spec`` at revision ``rev`` (0: original, 1: rewritten)."""
    rng = random.Random(f"content:{seed}:{spec.path}:{rev}")
    size = spec.size
    if rev:
        lo, hi = {"small": SMALL, "medium": MEDIUM, "large": LARGE}[spec.cls]
        size = min(hi, max(min(lo, size), int(size * rng.uniform(0.75, 1.25))))
    header = f"# {spec.path} rev {rev} seed {seed}\n".encode()
    if spec.cls == "large":
        return rng.randbytes(size)
    if spec.cls == "medium" and spec.index % 2:
        half = size // 2
        return rng.randbytes(half) + text_slice(rng, corpus, size - half)
    if size <= len(header):
        return header[:size]
    return header + text_slice(rng, corpus, size - len(header))


def text_slice(rng: random.Random, corpus: bytes, n: int) -> bytes:
    start = rng.randrange(0, len(corpus) - n)
    return corpus[start:start + n]


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def write_tree(root: str, dirs: list[str], specs: list[FileSpec], seed: int, corpus: bytes) -> dict[str, str]:
    """Create the original tree; returns {path: hash} of every file."""
    for d in dirs:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    manifest = {}
    for s in specs:
        data = content(s, 0, seed, corpus)
        with open(os.path.join(root, s.path), "wb") as f:
            f.write(data)
        manifest[s.path] = digest(data)
    return manifest


@dataclass
class Change:
    ops: list[tuple]  # ("w", path, data) | ("d", path)
    rewritten: int = 0
    rewritten_old_bytes: int = 0
    rewritten_new_bytes: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    expected: dict = field(default_factory=dict)  # {path: hash} of the files after the change


def plan_change(specs: list[FileSpec], manifest: dict[str, str], seed: int, corpus: bytes) -> Change:
    """~20% rewritten, ~10% deleted, per size class, disjoint, interleaved (deterministic)."""
    rng = random.Random(f"change:{seed}")
    ops: list[tuple] = []
    ch = Change(ops)
    expected = dict(manifest)
    for cls in ("small", "medium", "large"):
        group = [s for s in specs if s.cls == cls]
        rng.shuffle(group)
        n_rw = round(len(group) * REWRITE_FRACTION)
        n_del = round(len(group) * DELETE_FRACTION)
        for s in group[:n_rw]:
            data = content(s, 1, seed, corpus)
            ops.append(("w", s.path, data))
            expected[s.path] = digest(data)
            ch.rewritten += 1
            ch.rewritten_old_bytes += s.size
            ch.rewritten_new_bytes += len(data)
        for s in group[n_rw:n_rw + n_del]:
            ops.append(("d", s.path))
            del expected[s.path]
            ch.deleted += 1
            ch.deleted_bytes += s.size
    rng.shuffle(ops)
    ch.expected = expected
    return ch


def apply_plain(root: str, change: Change) -> None:
    for op in change.ops:
        p = os.path.join(root, op[1])
        if op[0] == "w":
            with open(p, "wb") as f:
                f.write(op[2])
        else:
            os.unlink(p)


def apply_sandbox(fs, change: Change) -> None:
    for op in change.ops:
        if op[0] == "w":
            fs.write_file(op[1], op[2])
        else:
            fs.unlink(op[1])


# ---------------------------------------------------------------------- checks and sizes


def scan(root: str) -> tuple[set[str], dict[str, str]]:
    """(directories, {file: hash}) under root, .git at the top excluded; anything else is reported as a file."""
    dirs, files = set(), {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel.replace(os.sep, "/")
        if rel == "":
            dirnames[:] = [d for d in dirnames if d != ".git"]
        for d in dirnames:
            dirs.add(f"{rel}/{d}" if rel else d)
        for name in filenames:
            p = f"{rel}/{name}" if rel else name
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full):
                files[p] = "not-a-regular-file"
                continue
            h = hashlib.blake2b(digest_size=16)
            with open(full, "rb") as f:
                while chunk := f.read(MB):
                    h.update(chunk)
            files[p] = h.hexdigest()
    return dirs, files


def compare(root: str, dirs: set[str], files: dict[str, str]) -> str | None:
    """None if root holds exactly these directories and files (by content hash), else what differs."""
    got_dirs, got_files = scan(root)
    problems = []
    if got_dirs != dirs:
        problems.append(f"dirs missing {sorted(dirs - got_dirs)[:3]} extra {sorted(got_dirs - dirs)[:3]}")
    missing = sorted(set(files) - set(got_files))
    extra = sorted(set(got_files) - set(files))
    differ = sorted(p for p in set(files) & set(got_files) if files[p] != got_files[p])
    if missing:
        problems.append(f"{len(missing)} file(s) missing, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} unexpected file(s), e.g. {extra[:3]}")
    if differ:
        problems.append(f"{len(differ)} file(s) with other content, e.g. {differ[:3]}")
    return "; ".join(problems) or None


def du(path: str) -> tuple[int, int]:
    """(bytes allocated on disk, apparent bytes) of everything under path (hard links once)."""
    seen, disk, apparent = set(), 0, 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            disk += st.st_blocks * 512
            apparent += st.st_size
    st = os.lstat(path)
    return disk + st.st_blocks * 512, apparent + st.st_size


def fs_type(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding path, from /proc/mounts."""
    real = os.path.realpath(path)
    best = ("/", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2])
    except OSError:
        pass
    return best


def copy_tree(src: str, dst: str) -> None:
    shutil.copytree(src, dst, symlinks=True)  # copy2: mtimes kept, so git's index is not racy after add


def mb(n: float) -> str:
    if abs(n) < MB:
        return f"{n / KB:.0f} KB"
    return f"{n / MB:.1f} MB"


# ---------------------------------------------------------------------- one repeat


def timed(fn) -> float:
    os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_sandbox(master: str, base: str, change: Change, dirs: set[str], original: dict[str, str], r: dict) -> None:
    work, state = os.path.join(base, "A"), os.path.join(base, "A-undo-store")
    copy_tree(master, work)
    ws = None
    try:
        os.sync()
        t0 = time.perf_counter()
        ws = sandbox.Workspace.open(work, state_dir=state)
        r["sb_setup"] = time.perf_counter() - t0

        def step():
            with ws.step("bench: rewrite 20%, delete 10%"):
                apply_sandbox(ws.fs, change)
        r["sb_change"] = timed(step)
        r["sb_change_check"] = compare(work, dirs, change.expected)
        r["sb_store"] = du(state)
        hist = ws.history()
        r["sb_step_size"] = hist[0]["size_bytes"] if hist else None
        r["sb_rollback"] = timed(lambda: ws.rollback(1))
        r["sb_rollback_check"] = compare(work, dirs, original)
    except Exception:
        r["sb_error"] = traceback.format_exc()
    finally:
        if ws is not None:
            try:
                ws.close()
            except Exception:
                r.setdefault("sb_error", traceback.format_exc())


def run_git(master: str, base: str, change: Change, dirs: set[str], original: dict[str, str], r: dict) -> None:
    work = os.path.join(base, "B")
    copy_tree(master, work)
    try:
        def setup():
            git(work, "init", "-q")
            git(work, "add", "-A")
            git(work, "commit", "-q", "-m", "initial tree")
        r["git_setup"] = timed(setup)
        r["git_size_initial"] = du(os.path.join(work, ".git"))

        os.sync()
        t0 = time.perf_counter()
        apply_plain(work, change)
        t1 = time.perf_counter()
        git(work, "add", "-A")
        git(work, "commit", "-q", "-m", "bench: rewrite 20%, delete 10%")
        t2 = time.perf_counter()
        r["git_change"], r["git_mutations"], r["git_commit"] = t2 - t0, t1 - t0, t2 - t1
        check = compare(work, dirs, change.expected)
        if check is None and git(work, "status", "--porcelain").strip():
            check = "git status not clean after the commit"
        r["git_change_check"] = check
        r["git_size_after"] = du(os.path.join(work, ".git"))

        # rollback: the same change, uncommitted, undone by checkout + clean
        git(work, "reset", "-q", "--hard", "HEAD~1")
        apply_plain(work, change)

        def rollback():
            git(work, "checkout", "-q", "--", ".")
            git(work, "clean", "-fdq")
        r["git_rollback"] = timed(rollback)
        r["git_rollback_check"] = compare(work, dirs, original)
    except Exception:
        r["git_error"] = traceback.format_exc()


def run_baseline(master: str, base: str, change: Change, r: dict) -> None:
    work = os.path.join(base, "C")
    copy_tree(master, work)
    r["baseline"] = timed(lambda: apply_plain(work, change))


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="undo_vs_git.py", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=None, help="number of files in the tree (default 5000; 300 with --quick)")
    p.add_argument("--mb", type=float, default=None, help="approximate total size in MB (default 50; 3 with --quick)")
    p.add_argument("--repeat", type=int, default=3, help="fresh-copy repeats; medians are reported (default 3)")
    p.add_argument("--quick", action="store_true", help="tiny run (300 files, 3 MB) that finishes in seconds")
    p.add_argument("--dir", default="/var/tmp",
                   help="parent directory for the temporary tree; must be a real disk, not tmpfs (default /var/tmp)")
    p.add_argument("--seed", type=int, default=1234, help="RNG seed for the tree and the change (default 1234)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    a = p.parse_args(argv)
    if a.files is None:
        a.files = 300 if a.quick else 5000
    if a.mb is None:
        a.mb = 3.0 if a.quick else 50.0
    if a.files < 10 or a.mb <= 0 or a.repeat < 1:
        p.error("--files must be >= 10, --mb > 0, --repeat >= 1")
    return a


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if shutil.which("git") is None:
        print("error: git is not on PATH", file=sys.stderr)
        return 2
    if not os.path.isdir(a.dir):
        print(f"error: --dir {a.dir!r} is not a directory", file=sys.stderr)
        return 2
    mnt, fstype = fs_type(a.dir)
    if fstype in ("tmpfs", "ramfs", "devtmpfs"):
        print(f"WARNING: {a.dir} is on {fstype} ({mnt}): this measures memory, not a real disk; "
              "pass --dir on a disk-backed filesystem", file=sys.stderr)
    target = int(a.mb * MB)
    free = shutil.disk_usage(a.dir).free
    if free < target * 6:
        print(f"WARNING: only {mb(free)} free under {a.dir}; about {mb(target * 6)} may be needed", file=sys.stderr)

    git_version = subprocess.run(["git", "--version"], stdout=subprocess.PIPE, text=True).stdout.strip()
    top = tempfile.mkdtemp(prefix="undo_vs_git.", dir=a.dir)
    rc = 0
    try:
        corpus = make_corpus(a.seed)
        dir_list, specs = plan_tree(a.files, target, a.seed)
        master = os.path.join(top, "master")
        os.mkdir(master)
        t0 = time.perf_counter()
        original = write_tree(master, dir_list, specs, a.seed, corpus)
        build_s = time.perf_counter() - t0
        dirs = set(dir_list)
        change = plan_change(specs, original, a.seed, corpus)
        total = sum(s.size for s in specs)
        counts = {c: sum(1 for s in specs if s.cls == c) for c in ("small", "medium", "large")}
        print(f"undo_vs_git: sandbox {sandbox.__version__} vs {git_version}, Python {sys.version.split()[0]}")
        print(f"tree: {len(specs)} files ({counts['small']} small, {counts['medium']} medium, {counts['large']} large), "
              f"{mb(total)}, {len(dirs)} directories; seed {a.seed}; built in {build_s:.1f} s")
        print(f"where: {top} ({fstype} on {mnt})")
        print(f"change: rewrite {change.rewritten} files ({mb(change.rewritten_old_bytes)} -> {mb(change.rewritten_new_bytes)}), "
              f"delete {change.deleted} files ({mb(change.deleted_bytes)}), {len(change.ops)} operations interleaved")
        print()

        results = []
        for i in range(a.repeat):
            base = os.path.join(top, f"run{i + 1}")
            os.mkdir(base)
            r: dict = {}
            order = [run_sandbox, run_git] if i % 2 == 0 else [run_git, run_sandbox]
            for fn in order:
                fn(master, base, change, dirs, original, r)
            run_baseline(master, base, change, r)
            results.append(r)
            print(f"repeat {i + 1}/{a.repeat} ({'sandbox first' if i % 2 == 0 else 'git first'}): "
                  f"baseline {fmt(r.get('baseline'))} s | change: sandbox {fmt(r.get('sb_change'))} s, git {fmt(r.get('git_change'))} s | "
                  f"rollback: sandbox {fmt(r.get('sb_rollback'))} s, git {fmt(r.get('git_rollback'))} s", flush=True)
            for key in ("sb_error", "git_error"):
                if key in r:
                    print(f"  {key.split('_')[0]} ERROR:\n" + indent(r[key]), flush=True)
            if not a.keep:
                remove(base)

        rc = report(results, change, a.repeat)
    finally:
        if a.keep:
            print(f"\nkept: {top}")
        else:
            remove(top)
    return rc


def fmt(v: float | None, width: int = 0) -> str:
    s = "n/a" if v is None else f"{v:.3f}"
    return s.rjust(width) if width else s


def ratio(x: float | None, y: float | None) -> str:
    if x is None or y is None or y <= 0:
        return "n/a"
    return f"{x / y:.2f}"


def indent(text: str) -> str:
    return "".join("    " + line + "\n" for line in text.rstrip().splitlines())


def report(results: list[dict], change: Change, repeat: int) -> int:
    keys = ("baseline", "sb_setup", "sb_change", "sb_rollback", "git_setup", "git_change", "git_mutations", "git_commit", "git_rollback")
    m = {k: median([r.get(k) for r in results]) for k in keys}

    def spread(k):
        v = [r[k] for r in results if r.get(k) is not None]
        return f"{min(v):.3f}-{max(v):.3f}" if v else "n/a"

    def over(x, b):
        return None if x is None or b is None else x - b

    rows = [
        ("change (mutations + undo capture | + add+commit)", m["sb_change"], m["git_change"]),
        ("  overhead over the baseline", over(m["sb_change"], m["baseline"]), over(m["git_change"], m["baseline"])),
        ("rollback (rollback(1) | checkout -- . + clean)", m["sb_rollback"], m["git_rollback"]),
    ]
    w = 52
    print()
    print(f"medians of {repeat} repeat(s), seconds (time.perf_counter)")
    print(f"baseline: the same mutations, plain Python, no undo, no git: {fmt(m['baseline'])} s "
          f"(git side's own mutation phase: {fmt(m['git_mutations'])} s, its add+commit: {fmt(m['git_commit'])} s)")
    print()
    print(f"{'operation':<{w}} {'sandbox s':>10} {'git s':>10} {'sandbox/git':>12}")
    print("-" * (w + 35))
    for name, s, g in rows:
        print(f"{name:<{w}} {fmt(s, 10)} {fmt(g, 10)} {ratio(s, g):>12}")
    print("-" * (w + 35))
    if repeat > 1:
        print(f"{'  min-max over the repeats: baseline':<{w}} {spread('baseline'):>22}")
        for name, ks, kg in (("  min-max: change", "sb_change", "git_change"), ("  min-max: rollback", "sb_rollback", "git_rollback")):
            print(f"{name:<{w}} {spread(ks):>11} {spread(kg):>11}")
        print("-" * (w + 35))
    b = m["baseline"]
    print(f"{'change as a multiple of the baseline':<{w}} {ratio(m['sb_change'], b) + 'x':>10} {ratio(m['git_change'], b) + 'x':>10}")
    print(f"{'setup, not compared (Workspace.open | init+add+commit)':<{w}} {fmt(m['sb_setup'], 10)} {fmt(m['git_setup'], 10)}")

    def size_med(key, idx):
        return median([r[key][idx] if r.get(key) else None for r in results])

    store_d, store_a = size_med("sb_store", 0), size_med("sb_store", 1)
    gi_d, gi_a = size_med("git_size_initial", 0), size_med("git_size_initial", 1)
    ga_d, ga_a = size_med("git_size_after", 0), size_med("git_size_after", 1)
    step_size = median([r.get("sb_step_size") for r in results])

    def smb(v):
        return "n/a" if v is None else mb(v)

    print()
    print(f"{'storage (on disk / apparent)':<{w}} {'sandbox':>16} {'git':>22}")
    print(f"{'undo store after the step | .git after the change':<{w}} {smb(store_d) + ' / ' + smb(store_a):>16} "
          f"{smb(ga_d) + ' / ' + smb(ga_a):>22}")
    print(f"{'  .git after the initial commit (setup)':<{w}} {'':>16} {smb(gi_d) + ' / ' + smb(gi_a):>22}")
    growth_d = None if ga_d is None or gi_d is None else ga_d - gi_d
    growth_a = None if ga_a is None or gi_a is None else ga_a - gi_a
    print(f"{'  .git growth from the change commit':<{w}} {'':>16} {smb(growth_d) + ' / ' + smb(growth_a):>22}")
    print(f"{'  step size_bytes as the undo log accounts it':<{w}} {smb(step_size):>16}")
    print(f"  (the change rewrote {mb(change.rewritten_old_bytes)} of old content and deleted {mb(change.deleted_bytes)}: "
          f"{mb(change.rewritten_old_bytes + change.deleted_bytes)} of preimages)")

    print()
    print("verification (every repeat)")
    ok = True
    for label, key, what in (("sandbox", "sb_change_check", "tree after the step is the expected one"),
                             ("sandbox", "sb_rollback_check", "rollback(1) restored the original tree"),
                             ("git", "git_change_check", "tree after the commit is the expected one"),
                             ("git", "git_rollback_check", "checkout+clean restored the original tree")):
        bad = []
        for i, r in enumerate(results):
            err = r.get(("sb" if label == "sandbox" else "git") + "_error")
            if key not in r:
                bad.append(f"repeat {i + 1}: not measured ({err.strip().splitlines()[-1] if err else 'no result'})")
            elif r[key] is not None:
                bad.append(f"repeat {i + 1}: {r[key]}")
        ok &= not bad
        print(f"  {label:<8} {what:<45} {'OK' if not bad else 'FAIL'}")
        for line in bad:
            print(f"      {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
