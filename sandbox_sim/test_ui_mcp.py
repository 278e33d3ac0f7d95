"""`sandbox mcp --ui` (issue 18): a person watches and steers what an LLM does over MCP. The
page (headless Chromium, Debian's, via Playwright) shows the LLM's execute_command and its
output live, undoes its step by a click (the tree checked on disk), and answers the safeguard
hold the LLM's command raised — the MCP call then reports the denial. No sleeps: Playwright's
waits and thread joins."""

from __future__ import annotations

import os
import threading

import anyio
import pytest

from sandbox.api.mcp.host import OwnSessionHost
from sandbox.api.ui.run import page_for_mcp_host
from sandbox.core.safeguard import SafeguardConfig
from sandbox.session.runtime import Folder, Session

from .test_mcp import connected
from .ui_page import EXPECT_TIMEOUT_MS, artifacts_dir, browser_missing, launch_chromium

missing = browser_missing()
pytestmark = pytest.mark.skipif(missing is not None, reason=missing or "")

if missing is None:
    from playwright.sync_api import expect, sync_playwright

CALL_TIMEOUT_S = 60


@pytest.fixture
def project(tmp_path):
    p = tmp_path / "project"
    (p / "src").mkdir(parents=True)
    (p / "src" / "main.py").write_text("def main():\n    return 1\n")
    (p / "big").mkdir()
    for i in range(6):
        (p / "big" / f"{i}.txt").write_text(f"{i}\n")
    return p


def llm_calls(host, calls: list[tuple[str, dict]], results: list) -> threading.Thread:
    """An MCP client (the LLM) making ``calls`` in order on a thread; their results in ``results``."""
    async def go():
        async with connected(host, close_host=False) as c:
            for name, args in calls:
                results.append(await c.s.call_tool(name, args))

    t = threading.Thread(target=anyio.run, args=(go,), daemon=True)
    t.start()
    return t


def test_the_page_shows_the_llms_command_and_undoes_it_and_answers_its_safeguard(project, tmp_path):
    host = OwnSessionHost(Session([Folder(str(project), state_dir=str(tmp_path / "state"))], guest="scripted",
                                  safeguard=SafeguardConfig(delete_threshold=5)), on_hold="allow")
    page_server = page_for_mcp_host(host, guest="scripted")
    try:
        with sync_playwright() as p:
            browser = launch_chromium(p)
            expect.set_options(timeout=EXPECT_TIMEOUT_MS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(page_server.url)
            expect(page.locator("#connection")).to_have_text("connected")
            expect(page.locator("#status")).to_contain_text("scripted")  # the page adopted the booted session

            results: list = []
            llm = llm_calls(host, [("execute_command", {"command": "echo the llm was here; rm -r src"})], results)
            terminal = page.locator("#terminal")
            expect(terminal).to_contain_text("$ echo the llm was here; rm -r src   (the LLM, over MCP)")
            expect(terminal).to_contain_text("the llm was here\n")
            step = page.locator("#timeline > li").first
            expect(step).to_contain_text("#1 echo the llm was here; rm -r src")
            llm.join(CALL_TIMEOUT_S)
            assert not llm.is_alive() and not results[0].is_error
            assert not (project / "src").exists()
            page.screenshot(path=os.path.join(artifacts_dir("ui"), "mcp-command.png"), full_page=True)
            step.get_by_role("button", name="Step 1: echo the llm was here; rm -r src. Show details").click()
            step.get_by_role("button", name="Undo step 1").click()
            expect(page.locator("#notices")).to_contain_text("Undone: step(s) 1")
            assert (project / "src" / "main.py").read_text() == "def main():\n    return 1\n"

            # the LLM's next command is held: the page answers (on_hold=allow would have let it through)
            results.clear()
            llm = llm_calls(host, [("execute_command", {"command": "rm -r big"})], results)
            dialog = page.get_by_role("dialog", name="Safeguard: a step is held")
            expect(dialog).to_be_visible()
            dialog.get_by_role("button", name="Deny: roll the step back").click()
            expect(dialog).to_be_hidden()
            llm.join(CALL_TIMEOUT_S)
            assert not llm.is_alive()
            out = results[0].structured_content  # the denied step was rolled back: it failed, changed nothing
            assert out["exit_code"] != 0 and "0 deleted" in results[0].content[0].text, results[0].content[0].text
            assert sorted(os.listdir(project / "big")) == [f"{i}.txt" for i in range(6)]
            browser.close()
    finally:
        host.stop()
        page_server.stop()
