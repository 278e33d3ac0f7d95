"""The web page (issue 18) in headless Chromium (Debian's, driven by Playwright) against a
scripted-guest session: a command from the box, its step and diff, Undo by click with the tree
checked on disk, a safeguard denied from its dialog, a barrier's refusal and the forced undo
behind a confirmation, and a reload that shows the history again. Screenshots go to
test-artifacts/ui/ (gitignored). Every wait is Playwright's own (expect / wait_for): no sleeps."""

from __future__ import annotations

import os

import pytest

from .ui_page import EXPECT_TIMEOUT_MS, artifacts_dir, browser_missing, launch_chromium, page_session

missing = browser_missing()
pytestmark = pytest.mark.skipif(missing is not None, reason=missing or "")

if missing is None:
    from playwright.sync_api import expect, sync_playwright

SAFEGUARD_DELETES = 5  # the 5th deletion of one step is held


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = launch_chromium(p)
        expect.set_options(timeout=EXPECT_TIMEOUT_MS)
        yield b
        b.close()


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    (w / "src").mkdir(parents=True)
    (w / "src" / "a.txt").write_text("alpha\nbeta\n")
    (w / "src" / "util.py").write_text("def f():\n    return 1\n")
    (w / "big").mkdir()
    for i in range(8):
        (w / "big" / f"f{i}.txt").write_text(f"file {i}\n")
    (w / "README.md").write_text("# project\n")
    return w


def tree(root) -> dict[str, str | None]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = open(p).read()
    return out


@pytest.fixture
def page_of(browser, work):
    """(server, page) with the page open and connected."""
    with page_session(work, safeguard={"delete_threshold": SAFEGUARD_DELETES, "timeout_seconds": 120}) as server:
        ctx = browser.new_context(viewport={"width": 1400, "height": 900})
        page = ctx.new_page()
        page.goto(server.url)
        expect(page.locator("#connection")).to_have_text("connected")
        try:
            yield server, page
        finally:
            ctx.close()


def shot(page, name: str) -> None:
    page.screenshot(path=os.path.join(artifacts_dir("ui"), f"{name}.png"), full_page=True)


def run_from_box(page, command: str) -> None:
    box = page.get_by_label("Command", exact=True)
    box.fill(command)
    box.press("Enter")


def test_rm_rf_then_diff_then_undo_by_click_restores_the_tree(page_of, work):
    server, page = page_of
    before = tree(work)
    expect(page.get_by_label("Command", exact=True)).to_be_focused()  # typing goes straight to the box
    run_from_box(page, "rm -rf src")
    expect(page.locator("#terminal")).to_contain_text("$ rm -rf src")
    expect(page.locator("#terminal")).to_contain_text("[step 1 recorded")
    assert not (work / "src").exists()

    step = page.locator("#timeline > li").first
    expect(step).to_contain_text("#1 rm -rf src")
    toggle = step.get_by_role("button", name="Step 1: rm -rf src. Show details")
    page.get_by_label("Command", exact=True).focus()
    page.keyboard.press("Tab")  # → Run (Cancel is disabled while nothing runs)
    expect(page.get_by_role("button", name="Run", exact=True)).to_be_focused()
    page.keyboard.press("Tab")  # → the newest step
    expect(toggle).to_be_focused()
    page.keyboard.press("Enter")  # the keyboard opens the step
    expect(toggle).to_have_attribute("aria-expanded", "true")
    diff = step.get_by_label("Diff of src/a.txt")
    expect(diff).to_contain_text("-alpha")
    expect(step.locator(".paths")).to_contain_text("src/util.py")
    expect(step.locator(".change-deleted").first).to_be_visible()
    shot(page, "step-diff")

    step.get_by_role("button", name="Undo step 1").click()
    expect(page.locator("#notices")).to_contain_text("Undone: step(s) 1")
    assert tree(work) == before  # on disk, byte for byte
    expect(page.locator("#timeline-empty")).to_be_visible()
    shot(page, "after-undo")


def test_keyboard_focus_in_the_timeline_survives_its_refresh(page_of, work):
    """The timeline is rebuilt on every history refresh (each step's events, an undo, another
    client's command): the element a keyboard user is on — a step's toggle, its Undo button —
    is focused again in the rebuilt list, not lost to the page."""
    server, page = page_of
    run_from_box(page, "echo one > one.txt")
    expect(page.locator("#terminal")).to_contain_text("[step 1 recorded")
    step = page.locator('#timeline > li[data-step-id="1"]')
    toggle = step.get_by_role("button", name="Step 1: echo one > one.txt. Show details")
    toggle.focus()
    expect(toggle).to_be_focused()
    page.evaluate("refreshHistory()")  # what a step event or another client's command does
    expect(toggle).to_be_focused()
    page.keyboard.press("Enter")  # still the keyboard's: it opens the step
    expect(toggle).to_have_attribute("aria-expanded", "true")
    undo = step.get_by_role("button", name="Undo step 1")
    undo.focus()
    page.evaluate("refreshHistory()")
    expect(undo).to_be_focused()


def test_a_safeguard_dialog_deny_rolls_the_step_back(page_of, work):
    server, page = page_of
    before = tree(work)
    run_from_box(page, "rm -rf big")
    dialog = page.get_by_role("dialog", name="Safeguard: a step is held")
    expect(dialog).to_be_visible()
    expect(dialog.locator("#safeguard-kind")).to_have_text("delete")
    expect(dialog.locator("#safeguard-count")).to_have_text(str(SAFEGUARD_DELETES))
    expect(dialog.locator("#safeguard-paths")).to_contain_text("big/")
    expect(dialog.locator("#safeguard-countdown")).to_contain_text("Denied automatically in")
    expect(dialog.get_by_role("button", name="Deny: roll the step back")).to_be_focused()
    shot(page, "safeguard")
    dialog.get_by_role("button", name="Deny: roll the step back").click()
    expect(dialog).to_be_hidden()
    expect(page.locator("#notices")).to_contain_text("Denied")
    expect(page.locator("#terminal")).to_contain_text("[step 1 recorded")
    expect(page.get_by_role("button", name="Run", exact=True)).to_be_enabled()  # the command has ended
    assert tree(work) == before


def test_a_barrier_refusal_is_explained_and_a_forced_undo_needs_confirming(page_of, work):
    server, page = page_of
    run_from_box(page, "write notes.txt from-the-agent")
    expect(page.locator("#timeline > li").first).to_contain_text("#1 write notes.txt")
    (work / "notes.txt").write_text("edited by hand\n")  # outside the sandbox: the watcher records a barrier
    expect(page.locator("#notices")).to_contain_text("Changed outside the sandbox: notes.txt")
    step = page.locator("#timeline > li").first
    step.get_by_role("button", name="Step 1: write notes.txt from-the-agent. Show details").click()
    step.get_by_role("button", name="Undo step 1").click()
    refusal = step.locator(".undo-refusal")
    expect(refusal).to_contain_text("Refused: notes.txt were changed outside the sandbox")
    assert (work / "notes.txt").read_text() == "edited by hand\n"  # nothing was overwritten
    shot(page, "barrier-refusal")
    refusal.get_by_role("button", name="Undo step 1 anyway, overwriting the external edits").click()
    confirm = page.get_by_role("dialog", name="Undo anyway?")
    expect(confirm).to_be_visible()
    expect(confirm.get_by_role("button", name="Keep the external edits")).to_be_focused()  # the safe default
    confirm.get_by_role("button", name="Undo anyway (overwrite them)").click()
    expect(page.locator("#notices")).to_contain_text("forced over external edits")
    assert not (work / "notes.txt").exists()


def test_after_a_reload_the_page_shows_the_history_again(page_of, work):
    server, page = page_of
    run_from_box(page, "echo before the reload")
    expect(page.locator("#terminal")).to_contain_text("[step 1 recorded")
    run_from_box(page, "write x.txt hello")
    expect(page.locator("#terminal")).to_contain_text("[step 2 recorded")
    page.reload()
    expect(page.locator("#connection")).to_have_text("connected")
    expect(page.locator("#terminal")).to_contain_text("$ echo before the reload")
    expect(page.locator("#terminal")).to_contain_text("before the reload\n")
    expect(page.locator("#timeline > li")).to_have_count(2)
    expect(page.locator("#timeline > li").first).to_contain_text("#2 write x.txt hello")  # newest first
    expect(page.locator("#status")).to_contain_text("scripted")
    limits = server.agent.session.workspaces[0].limits  # the store's use against its limits
    expect(page.locator("#status")).to_contain_text(f"2 of {limits.max_step_count} step(s)")
    expect(page.locator("#status")).to_contain_text("of 1.0 GiB" if limits.max_log_size_bytes == 1 << 30 else " of ")
    shot(page, "after-reload")
