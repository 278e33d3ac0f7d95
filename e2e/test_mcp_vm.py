"""`sandbox mcp` against a real VM, driven by the official MCP SDK's client over stdio.

The same client as the fast tier's ``sandbox_sim/test_mcp.py``, but the guest is Debian's
kernel under QEMU running real programs: ``execute_command "rm -rf src"`` then ``undo``,
``write_file`` then ``undo``, and an ``rm -rf`` held by the safeguard, put to the user by
elicitation and denied — each must leave the tree byte-exact as before (the tree oracle). One VM boot for the whole suite (about 10 s under TCG); skipped with the reason
where QEMU or the guest image cannot be had.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import anyio
import mcp_types as types
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from sandbox_sim import oracle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandbox", "data", "sample-project")
SANDBOX = os.path.join(os.path.dirname(sys.executable), "sandbox")


@pytest.fixture(scope="module", autouse=True)
def guest_available(vm_guest):
    """Every test here boots a session VM (conftest.vm_guest skips with the reason otherwise)."""


def test_rm_rf_write_file_and_a_denied_safeguard_through_mcp_are_undone_exactly(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(SAMPLE, project, symlinks=True)
    state = str(tmp_path / "state")

    async def go():
        before = oracle.snapshot_dir(str(project))
        params = StdioServerParameters(command=SANDBOX, args=["mcp", "--workdir", str(project), "--state-dir", state,
                                                               "--delete-threshold", "10"])
        asked = []

        async def deny(ctx, params):  # the user, asked through the client
            asked.append(params.message)
            return types.ElicitResult(action="accept", content={"decision": "deny"})

        boot_messages = []

        async def progress(p, total, msg):
            boot_messages.append(msg)

        with open(tmp_path / "stderr", "w") as err:
            async with stdio_client(params, errlog=err) as (r, w):
                async with ClientSession(r, w, elicitation_callback=deny) as c:
                    await c.initialize()
                    assert len((await c.list_tools()).tools) == 8  # answered while the VM boots
                    x = await c.call_tool("execute_command", {"command": "rm -rf src && ls"}, progress_callback=progress)
                    assert not x.is_error, x.content[0].text
                    sc = x.structured_content
                    assert sc["exit_code"] == 0 and isinstance(sc["step_id"], int), sc
                    assert not (project / "src").exists() and sc["changes"]["paths_total"] > 0
                    u = await c.call_tool("undo", {})
                    assert not u.is_error, u.content[0].text
                    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after undoing rm -rf src")

                    w_ = await c.call_tool("write_file", {"path": "README.md", "content": "overwritten\n"})
                    assert not w_.is_error, w_.content[0].text
                    seen = await c.call_tool("execute_command", {"command": "cat README.md"})
                    assert seen.structured_content["stdout"] == "overwritten\n"  # the guest sees the API write
                    await c.call_tool("undo", {"count": 2})  # the cat's (empty) step, then the write
                    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after undoing write_file")

                    gen = await c.call_tool("execute_command", {"command": "mkdir out && for i in $(seq 30); do "
                                                                "echo $i > out/f$i; done"})
                    assert gen.structured_content["exit_code"] == 0 and len(os.listdir(project / "out")) == 30
                    held = (await c.call_tool("execute_command", {"command": "rm -rf out"})).structured_content
                    assert len(asked) == 1 and "out" in asked[0]  # the 10th deletion was held and put to the user
                    assert [d["action"] for d in held["safeguards"]] == ["deny"] and held["exit_code"] != 0
                    assert len(os.listdir(project / "out")) == 30  # denied: rolled back
                    await c.call_tool("undo", {"count": 2})  # the denied step, then the one that made out/
                    oracle.assert_same(before, oracle.snapshot_dir(str(project)), "after the denied rm -rf")
        logs = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines()]
        assert any(entry["message"] == "session stopped" for entry in logs)

    anyio.run(go)
