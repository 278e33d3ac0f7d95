"""Take the README's screenshot of the page: ``python -m sandbox_sim.ui_screenshot [docs/ui.png]``.

A scripted-guest session on a copy of the sample project, an agent's few commands run from the
page's command box, the `rm -rf src` step opened to its diff; headless Chromium (Debian's, via
Playwright) saves the picture. Needs chromium and Playwright (``./dev setup``)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from .ui_page import browser_missing, launch_chromium, page_session

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandbox", "data", "sample-project")
COMMANDS = ["ls src", "write src/notes.md '# notes from the agent'", "rm -rf src"]


def main(out: str) -> int:
    why = browser_missing()
    if why:
        print(f"ui_screenshot: {why}", file=sys.stderr)
        return 1
    from playwright.sync_api import expect, sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("XDG_STATE_HOME", os.path.join(tmp, "state"))
        project = os.path.join(tmp, "project")
        shutil.copytree(SAMPLE, project, symlinks=True)
        with page_session(project) as server, sync_playwright() as p:
            browser = launch_chromium(p)
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(server.url)
            expect(page.locator("#connection")).to_have_text("connected")
            box = page.get_by_label("Command", exact=True)
            for i, command in enumerate(COMMANDS, 1):
                box.fill(command)
                box.press("Enter")
                expect(page.locator("#terminal")).to_contain_text(f"[step {i} recorded")
            step = page.locator("#timeline > li").first
            step.locator(".step-toggle").click()
            expect(step.locator("pre.diff").first).to_be_visible()
            page.screenshot(path=out)
            browser.close()
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/ui.png"))
