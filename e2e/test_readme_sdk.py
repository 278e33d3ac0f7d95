"""The README's SDK quick start, run verbatim against a real VM — what an embedder copies.

The block is taken from README.md as it stands (the first ``python`` block under "The SDK"),
written to a file and run with ``HOME`` pointing at a temporary home holding ``~/proj`` (a
Makefile project with a stale ``build/``) and ``~/data``. What it must do: run ``rm -rf build
&& make`` in the guest, print the events, undo the step exactly (the old ``build/`` is back,
byte for byte), and leave ``notes.txt`` written through the file API.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_sim import oracle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
README = Path(__file__).resolve().parent.parent / "README.md"
MAKEFILE = "build/app.txt: src/app.txt\n\tmkdir -p build && cp src/app.txt build/app.txt\n"


def quick_start() -> str:
    text = README.read_text()
    section = text[text.index("## The SDK"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README: no python block under '## The SDK'"
    return m.group(1)


def test_the_quick_start_parses_and_uses_only_the_public_api():
    code = quick_start()
    compile(code, "README-quick-start", "exec")
    import sandbox

    for name in re.findall(r"\bsandbox\.([A-Za-z_]+)", code):
        assert name in sandbox.__all__, f"the quick start uses sandbox.{name}, which is not public"


def test_the_readme_quick_start_runs_in_a_vm(tmp_path, vm_guest):
    if shutil.which("make") is None:
        pytest.skip("make is not installed on the host, so the guest (which uses the host's /usr) has none")
    home = tmp_path / "home"
    proj, data = home / "proj", home / "data"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "app.txt").write_text("fresh\n")
    (proj / "Makefile").write_text(MAKEFILE)
    (proj / "build").mkdir()
    (proj / "build" / "app.txt").write_text("stale\n")
    (proj / "build" / "cache.bin").write_bytes(bytes(range(256)))
    data.mkdir()
    before = oracle.snapshot_dir(str(proj))
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start())
    env = {**os.environ, "HOME": str(home)}
    env.pop("XDG_STATE_HOME", None)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=800,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step_completed" in p.stdout, p.stdout
    assert (proj / "notes.txt").read_bytes() == b"notes\n"
    after = oracle.snapshot_dir(str(proj))
    del after["notes.txt"]
    before.pop(""), after.pop("")  # the root's mtime moved with notes.txt, the API step after the undo
    oracle.assert_same(before, after)  # the make step was undone exactly
