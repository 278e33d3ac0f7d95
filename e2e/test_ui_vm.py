"""The web page (issue 18) over a real VM session: `rm -rf src` typed into the page's command
box runs in Debian's kernel under QEMU; the step appears, its diff opens, and Undo by click
restores the tree exactly on disk (the tree oracle). Headless Chromium (Debian's, via
Playwright); skipped with the reason without QEMU, the guest image, chromium or Playwright."""

from __future__ import annotations

import os
import shutil

import pytest

from sandbox.api.agent import Agent
from sandbox.api.ui.hub import Hub
from sandbox.api.ui.run import PageServer
from sandbox_sim import oracle
from sandbox_sim.ui_page import artifacts_dir, browser_missing, launch_chromium

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
missing = browser_missing()
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandbox", "data", "sample-project")
#: a command under TCG takes seconds; the page waits for it at most this long (a condition wait)
VM_EXPECT_TIMEOUT_MS = 180_000


@pytest.mark.skipif(missing is not None, reason=missing or "")
def test_rm_rf_in_a_vm_then_undo_by_click_restores_the_tree(tmp_path, vm_guest):
    from playwright.sync_api import expect, sync_playwright

    project = tmp_path / "project"
    shutil.copytree(SAMPLE, project, symlinks=True)
    before = oracle.snapshot_dir(str(project))
    hub = Hub()
    agent = Agent(hub.publish, guest="vm")
    agent.handle("session.start", {"working_directories": [{"path": str(project)}]}, "start")
    server = PageServer(agent, hub)
    server.start_thread()
    try:
        with sync_playwright() as p:
            browser = launch_chromium(p)
            expect.set_options(timeout=VM_EXPECT_TIMEOUT_MS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(server.url)
            expect(page.locator("#connection")).to_have_text("connected")
            expect(page.locator("#status")).to_contain_text("vm")
            box = page.get_by_label("Command", exact=True)
            box.fill("rm -rf src && ls")
            box.press("Enter")
            expect(page.locator("#terminal")).to_contain_text("[step 1 recorded")
            assert not (project / "src").exists()
            step = page.locator("#timeline > li").first
            step.get_by_role("button", name="Step 1: rm -rf src && ls. Show details").click()
            expect(step.locator(".paths")).to_contain_text("src")
            page.screenshot(path=os.path.join(artifacts_dir("ui"), "vm-step.png"), full_page=True)
            step.get_by_role("button", name="Undo step 1").click()
            expect(page.locator("#notices")).to_contain_text("Undone: step(s) 1")
            assert oracle.snapshot_dir(str(project)) == before
            browser.close()
    finally:
        server.stop()
        agent.shutdown()
