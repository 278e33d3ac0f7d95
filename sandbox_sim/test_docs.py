"""The README is a map and the docs hold together (issue 12).

* The README opens with exactly the two set-up commands, ``./dev demo`` and ``./dev test``,
  and ``.ci/run`` runs the second: what a newcomer reads first is what CI runs.
* The README stays a map (at most ``README_LINES_MAX`` lines); the reference lives in
  ``docs/``. The protocol reference and the 9P limits are checked against the code by
  ``test_stdio_api.py`` and ``test_ninep_limits.py``.
* Every relative link in the README, ``docs/*.md`` and ``bench/README.md`` names a file that
  exists (and an anchor, when given, a heading of that file).
* The README's Python blocks parse (top-level ``await`` allowed): an embedder copies them.
"""

from __future__ import annotations

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
README_LINES_MAX = 400

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    text = FENCE.sub("", text)
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_readme_opens_with_the_two_set_up_commands_and_ci_runs_the_second():
    text = read(README)
    lang, block = FENCE.search(text).groups()
    assert text.index("```") < text.index("\n## "), "the commands come before any section"
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert (lang, commands) == ("sh", ["./dev demo", "./dev test"])
    assert "exec ./dev test" in read(os.path.join(ROOT, ".ci", "run"))


def test_the_readme_is_a_map():
    lines = read(README).count("\n")
    assert lines <= README_LINES_MAX, f"README.md has {lines} lines; move reference material to docs/"
    assert "<!-- protocol.schema.json -->" not in read(README), "the schema lives in docs/stdio-api.md"


def test_every_relative_link_resolves():
    files = [README, os.path.join(ROOT, "bench", "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    assert len(files) > 3
    broken = []
    for path in files:
        text = read(path)
        for target in LINK.findall(FENCE.sub("", text)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), name)) if name else path
            if not os.path.exists(dest):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(read(dest)):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_s_python_parses():
    blocks = [body for lang, body in FENCE.findall(read(README)) if lang == "python"]
    assert blocks, "the SDK quick start is a python block"
    for body in blocks:
        compile(body, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
