"""Inside a real guest on the ``image`` guest root (sandbox.vm.imageroot): a Debian root built
by mmdebstrap from the host's apt sources (downloads packages the first time: marked slow),
cached under ~/.cache/sandbox/guest/roots/. The command runs as the guest user on the
image's userland; the host's secrets are absent; the image's own python3/git are used.
"""

from __future__ import annotations

import shutil
import time

import pytest

from sandbox.session.runtime import Folder, Session
from sandbox.vm import imageroot

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]
PACKAGES = ["python3", "git"]


@pytest.fixture(scope="module")
def image_root(vm_guest):
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is not installed (./dev setup installs it)")
    return imageroot.ensure_root(PACKAGES, progress=print)


def test_a_command_runs_in_a_guest_on_an_image_root(image_root, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "hello.txt").write_text("hi\n")
    out: list[str] = []
    t0 = time.monotonic()
    with Session([Folder(str(project))], guest_root="image", guest_packages=PACKAGES) as s:
        print(f"image root: session start {time.monotonic() - t0:.1f} s (boot_s {s.status()['boot_s']})")
        r = s.run("id -un; cat /etc/os-release | grep ^VERSION_CODENAME; git --version; "
                  "python3 -c 'import sys; print(sys.version_info[:2])'; cat hello.txt; "
                  "test -e /etc/shadow && echo SHADOW-PRESENT; grep -c . /etc/passwd; "
                  "grep -q ' /usr ' /proc/mounts && echo usr-mounted; echo made > new.txt",
                  lambda stream, text: out.append(text), cwd=s.guest_path(0))
        assert s.status()["guest_root"] == "image"
    text = "".join(out)
    assert r.exit_code == 0, text
    suite = imageroot.host_sources()[0]["suites"][0]
    assert "agent\n" in text and f"VERSION_CODENAME={suite}" in text and "git version" in text
    assert "hi\n" in text and "usr-mounted" in text
    assert "SHADOW-PRESENT" not in text  # neither the host's nor the image's shadow file
    assert "3\n" in text  # root, agent, nobody: the generated passwd
    assert (project / "new.txt").read_text() == "made\n"
