// The sandbox page: a STDIO API client over a WebSocket (docs/ui.md). No build step, no dependencies.
"use strict";

const TERMINAL_CHARS_MAX = 1 << 20;   // characters kept in the terminal (older ones are cut first)
const NOTICES_MAX = 20;               // notices shown (the oldest goes first)
const RETRY_MS_MAX = 5000;            // reconnection back-off ceiling
const $ = (id) => document.getElementById(id);

let ws = null, nextId = 1, retryMs = 250;
const pending = new Map();            // request_id -> {resolve}
let folder = 0, steps = [], folders = [];
const expanded = new Set();           // step ids whose details are open
const holds = new Map();              // safeguard_id -> {payload, deadline}
let shownHold = null, countdownTimer = null, forceStep = null;
let termChars = 0;                    // characters in the terminal now

// ------------------------------------------------------------------ connection

function connect() {
  setConnection("connecting", "connecting…");
  ws = new WebSocket(`${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/ws`);
  ws.onopen = () => { retryMs = 250; setConnection("open", "connected"); };
  ws.onmessage = (e) => { let m; try { m = JSON.parse(e.data); } catch { return; } onMessage(m, false); };
  ws.onclose = (e) => {
    for (const p of pending.values()) p.resolve({status: "error", error: {code: "ui.disconnected", message: "the connection closed"}});
    pending.clear();
    setConnection("closed", `disconnected${e.reason ? ": " + e.reason : ""} — reconnecting`);
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, RETRY_MS_MAX);
  };
}

function setConnection(state, text) { const c = $("connection"); c.dataset.state = state; c.textContent = text; }

function request(type, payload = {}) {
  return new Promise((resolve) => {
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      resolve({status: "error", error: {code: "ui.disconnected", message: "not connected"}});
      return;
    }
    const id = `ui-${nextId++}`;
    pending.set(id, {resolve});
    ws.send(JSON.stringify({type, request_id: id, payload}));
  });
}

function onMessage(m, replay) {
  const p = m.payload || {};
  switch (m.type) {
    case "response": {
      const w = pending.get(m.request_id);
      if (w) { pending.delete(m.request_id); w.resolve(m); }
      return;
    }
    case "ui.welcome":
      $("terminal").textContent = ""; termChars = 0;
      if (p.dropped) term(`[${p.dropped} earlier events were dropped from the page's backlog]\n`, "cmd");
      for (const ev of p.backlog || []) onMessage(ev, true);
      refresh();
      return;
    case "ui.command":
      term(`$ ${p.command}${p.client === "mcp" ? "   (the LLM, over MCP)" : ""}\n`, "cmd");
      if (!replay) refreshStatus();
      return;
    case "ui.session":
      if (!replay) refresh();
      return;
    case "ui.output":
    case "event.terminal_output":
    case "event.agent_output":
      term(p.data, p.stream === "stderr" ? "stderr" : "");
      return;
    case "event.step_completed":
      term(`[step ${p.step_id} recorded: exit code ${p.exit_code ?? "–"}, ${p.paths_count ?? (p.affected_paths || []).length} path(s)` +
           `${p.outcome && p.outcome !== "completed" ? ", " + p.outcome : ""}]\n`, "cmd");
      if (!replay) { refreshHistory(); refreshStatus(); }
      return;
    case "event.safeguard_triggered":
      if (!replay) { addHold(p); refreshStatus(); }
      return;
    case "event.external_modification":
      notice("info", `Changed outside the sandbox: ${listPaths(p.paths)}` +
             (p.barrier_id != null ? ` — barrier #${p.barrier_id}: undoing an older step will ask before overwriting these edits.` : "."));
      if (!replay) refreshHistory();
      return;
    case "event.recovery":
      notice("warning", `Recovery: ${p.message || "a crashed step was rolled back"} (${p.paths_restored} path(s) restored).`);
      return;
    case "event.warning":
    case "event.error":
      notice(m.type === "event.error" ? "error" : "warning", p.message);
      return;
    case "event.undo_version_mismatch":
      notice("error", p.message);
      return;
  }
}

// ------------------------------------------------------------------ terminal and notices

function term(text, cls) {
  const t = $("terminal");
  const atEnd = t.scrollTop + t.clientHeight >= t.scrollHeight - 4;
  const span = document.createElement("span");
  if (cls) span.className = cls;
  span.textContent = text;
  t.appendChild(span);
  termChars += text.length;
  while (termChars > TERMINAL_CHARS_MAX && t.firstChild) { termChars -= t.firstChild.textContent.length; t.removeChild(t.firstChild); }
  if (atEnd) t.scrollTop = t.scrollHeight;
}

function notice(kind, text) {
  const ul = $("notices"), li = document.createElement("li");
  li.className = kind;
  const span = document.createElement("span"); span.textContent = text;
  const close = document.createElement("button");
  close.type = "button"; close.textContent = "Dismiss"; close.setAttribute("aria-label", "Dismiss this notice");
  close.onclick = () => li.remove();
  li.append(span, close);
  ul.prepend(li);
  while (ul.children.length > NOTICES_MAX) ul.lastElementChild.remove();
}

function listPaths(paths, n = 5) {
  const ps = (paths || []).map((p) => p === "" ? "." : p);
  return ps.slice(0, n).join(", ") + (ps.length > n ? ` and ${ps.length - n} more` : "");
}

// ------------------------------------------------------------------ status

async function refresh() { await refreshHistory(); await refreshStatus(); }

async function refreshStatus() {
  const r = await request("session.status");
  if (r.status !== "ok") return;
  const s = r.payload;
  folders = (s.folders || []).filter((f) => f.access === "read_write");
  const sel = $("folder");
  $("folder-choice").hidden = folders.length < 2;
  if (sel.options.length !== folders.length) {
    sel.textContent = "";
    for (const f of folders) sel.add(new Option(`${f.index}: ${f.path}`, String(f.index)));
    sel.value = String(folder);
  }
  const running = s.running;
  $("cancel").disabled = !running;
  const shown = (s.folders || []).find((f) => f.index === folder);
  const store = shown && shown.undo_store;
  const undoText = store ? `${steps.length} of ${store.max_step_count} step(s), ${fmtBytes(store.size_bytes)} of ${fmtBytes(store.max_log_size_bytes)}`
    : `${steps.length} step(s)`;
  const rows = [["State", s.state + (running ? ` (${running.client}: ${running.command})` : "")],
    ["Guest", s.guest || "–"], ["Accelerator", s.accel || "–"], ["Network", s.network || "–"],
    ["View", s.view ? s.view + (s.read_only ? " (read-only)" : "") : "–"],
    ["Folders", (s.folders || []).map((f) => `${f.path} → ${f.guest_path}${f.access === "read_only" ? " (ro)" : ""}`).join("; ")],
    ["Undo store", undoText]];
  const dl = $("status"); dl.textContent = "";
  for (const [k, v] of rows) {
    const d = document.createElement("div"), dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k; dd.textContent = v; d.append(dt, dd); dl.append(d);
  }
  const live = new Set();
  for (const h of s.pending_safeguards || []) { live.add(h.safeguard_id); if (!holds.has(h.safeguard_id)) addHold(h); }
  for (const id of [...holds.keys()]) if (!live.has(id)) dropHold(id);
}

function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${u[i]}`;
}

// ------------------------------------------------------------------ timeline

async function refreshHistory() {
  const r = await request("undo.history", {directory: folder});
  if (r.status !== "ok") { steps = []; renderTimeline(r.error && r.error.message); return; }
  steps = r.payload.steps || [];
  renderTimeline();
}

// The list is rebuilt on every refresh; the element the keyboard was on (a step's toggle, its
// Undo button, a diff) is focused again in the new list, found by its step and its classes.
function renderTimeline(problem) {
  const ol = $("timeline");
  const was = ol.contains(document.activeElement) ? document.activeElement : null;
  const wasStep = was && was.closest("li[data-step-id]");
  const selector = was && [was.tagName.toLowerCase(), ...was.classList].map((c, i) => i ? "." + CSS.escape(c) : c).join("");
  ol.textContent = "";
  $("timeline-empty").hidden = steps.length > 0;
  if (problem) $("timeline-empty").textContent = problem;
  steps.forEach((st, index) => ol.append(stepItem(st, index)));
  if (wasStep) {
    const li = ol.querySelector(`li[data-step-id="${CSS.escape(wasStep.dataset.stepId)}"]`);
    const again = li && (li.querySelector(selector) || li.querySelector(".step-toggle"));
    if (again) again.focus();
  }
}

function mark(text, bad) { const s = document.createElement("span"); s.className = "mark" + (bad ? " bad" : ""); s.textContent = text; return s; }

function stepItem(st, index) {
  const li = document.createElement("li");
  li.dataset.stepId = st.id;
  const body = document.createElement("div");
  body.className = "step-body"; body.id = `step-${st.id}-body`;
  const toggle = document.createElement("button");
  toggle.type = "button"; toggle.className = "step-toggle";
  toggle.setAttribute("aria-controls", body.id);
  toggle.setAttribute("aria-label", `Step ${st.id}: ${st.command || st.type}. Show details`);
  const title = document.createElement("code"); title.textContent = `#${st.id} ${st.command || st.type}`;
  toggle.append(title);
  if (st.type !== "command") toggle.append(mark(st.type));
  if (st.exit_code != null) toggle.append(mark(`exit ${st.exit_code}`, st.exit_code !== 0));
  if (st.started_ns) toggle.append(mark(new Date(st.started_ns / 1e6).toLocaleTimeString()));
  toggle.append(mark(`${(st.paths || []).length} path(s)`));
  if (st.barriers && st.barriers.length) toggle.append(mark(`${st.barriers.length} barrier(s)`, true));
  if (st.unprotected) toggle.append(mark("unprotected", true));
  if (st.outcome && st.outcome !== "completed") toggle.append(mark(st.outcome, true));
  if (st.corrupt) toggle.append(mark("corrupt", true));
  const open = expanded.has(st.id);
  toggle.setAttribute("aria-expanded", String(open));
  body.hidden = !open;
  toggle.onclick = () => {
    const now = body.hidden;
    body.hidden = !now; toggle.setAttribute("aria-expanded", String(now));
    if (now) { expanded.add(st.id); loadDiff(st, body.querySelector(".diff")); } else expanded.delete(st.id);
  };

  const meta = document.createElement("p"); meta.className = "step-meta";
  const when = st.started_ns ? new Date(st.started_ns / 1e6).toLocaleString() : "–";
  const dur = st.ended_ns && st.started_ns ? ` (${((st.ended_ns - st.started_ns) / 1e9).toFixed(2)} s)` : "";
  meta.textContent = `${st.type}, started ${when}${dur}, exit code ${st.exit_code ?? "–"}, ${fmtBytes(st.size_bytes || 0)} of undo data` +
    (st.barriers && st.barriers.length ? `; edited outside since: ${st.barriers.map((b) => listPaths(b.paths)).join("; ")}` : "");
  const undo = document.createElement("button");
  undo.type = "button"; undo.className = "undo"; undo.textContent = "Undo to here";
  undo.setAttribute("aria-label", index ? `Undo step ${st.id} and the ${index} newer step(s)` : `Undo step ${st.id}`);
  undo.onclick = () => undoTo(st, index + 1, false);
  const refusal = document.createElement("div"); refusal.className = "undo-refusal"; refusal.setAttribute("role", "alert");
  const diff = document.createElement("div"); diff.className = "diff"; diff.setAttribute("aria-live", "polite");
  body.append(meta, undo, refusal, diff);
  li.append(toggle, body);
  if (open) loadDiff(st, diff);
  return li;
}

async function loadDiff(st, box) {
  box.textContent = "loading the diff…";
  const r = await request("undo.diff", {directory: folder, step_id: st.id});
  box.textContent = "";
  if (r.status !== "ok") { box.textContent = `no diff: ${r.error.message}`; return; }
  const d = r.payload;
  if (d.approximate) box.append(para("Something this step left was changed since: the diff may be incomplete."));
  const ul = document.createElement("ul"); ul.className = "paths";
  for (const e of d.paths) {
    const li = document.createElement("li");
    const head = document.createElement("div");
    const ch = document.createElement("strong"); ch.className = `change-${e.change}`; ch.textContent = e.change;
    const path = document.createElement("code"); path.textContent = e.path;
    head.append(ch, " ", path, ` — ${e.summary}`);
    li.append(head);
    if (e.diff) {
      const pre = document.createElement("pre"); pre.className = "diff";
      pre.setAttribute("aria-label", `Diff of ${e.path}`); pre.tabIndex = 0;
      for (const line of e.diff.split("\n")) {
        const s = document.createElement("span");
        s.className = line.startsWith("@@") ? "hunk" : line.startsWith("+") && !line.startsWith("+++") ? "add"
          : line.startsWith("-") && !line.startsWith("---") ? "del" : "";
        s.textContent = line + "\n"; pre.append(s);
      }
      li.append(pre);
      if (e.diff_truncated) li.append(para("(diff truncated)"));
    }
    ul.append(li);
  }
  box.append(ul);
  if (d.paths_truncated) box.append(para(`${d.paths.length} of ${d.paths_total} paths shown.`));
  if (!d.paths.length) box.append(para("No paths changed."));
}

function para(text) { const p = document.createElement("p"); p.textContent = text; return p; }

async function undoTo(st, count, force) {
  const li = document.querySelector(`#timeline li[data-step-id="${st.id}"]`);
  const refusal = li && li.querySelector(".undo-refusal");
  if (refusal) refusal.textContent = "";
  const r = await request("undo.rollback", {directory: folder, count, force});
  if (r.status === "ok") {
    const p = r.payload;
    notice("info", `Undone: step(s) ${p.step_ids.join(", ")} — ${p.paths_restored} path(s) restored${p.forced ? " (forced over external edits)" : ""}.`);
    expanded.delete(st.id);
    await refresh();
    return;
  }
  const e = r.error;
  if (!refusal) { notice("error", e.message); return; }
  if (e.code === "undo.barrier") {
    const paths = (e.data && e.data.paths) || [];
    refusal.append(para(`Refused: ${paths.length ? listPaths(paths) + " were" : "files were"} changed outside the sandbox after this step. ` +
      "Undoing it would overwrite those edits."));
    const f = document.createElement("button");
    f.type = "button"; f.className = "danger force"; f.textContent = "Undo anyway…";
    f.setAttribute("aria-label", `Undo step ${st.id} anyway, overwriting the external edits`);
    f.onclick = () => askForce(st, count, paths);
    refusal.append(f);
    f.focus();
  } else {
    refusal.append(para(`Undo failed: ${e.message}`));
  }
}

function askForce(st, count, paths) {
  forceStep = {st, count};
  $("force-message").textContent = `Undoing step ${st.id}${count > 1 ? ` and ${count - 1} newer step(s)` : ""} will overwrite ` +
    `what was changed outside the sandbox${paths.length ? ": " + listPaths(paths) : ""}. This cannot be undone.`;
  $("force").showModal();
  $("force-keep").focus();
}

// ------------------------------------------------------------------ safeguards

function addHold(p) {
  if (holds.has(p.safeguard_id)) return;
  holds.set(p.safeguard_id, {payload: p, deadline: p.timeout_seconds ? Date.now() + p.timeout_seconds * 1000 : null});
  showNextHold();
}

function dropHold(id) {
  holds.delete(id);
  if (shownHold === id) { shownHold = null; $("safeguard").close(); showNextHold(); }
}

function showNextHold() {
  if (shownHold || !holds.size) return;
  const [id, h] = holds.entries().next().value;
  shownHold = id;
  const p = h.payload;
  $("safeguard-message").textContent = p.message;
  $("safeguard-kind").textContent = p.kind;
  $("safeguard-count").textContent = String(p.count);
  $("safeguard-step").textContent = String(p.step_id);
  const ul = $("safeguard-paths"); ul.textContent = "";
  for (const sp of p.sample_paths || []) { const li = document.createElement("li"); const c = document.createElement("code"); c.textContent = sp; li.append(c); ul.append(li); }
  tick();
  clearInterval(countdownTimer);
  countdownTimer = setInterval(tick, 250);
  $("safeguard").showModal();
  $("safeguard-deny").focus();
}

function tick() {
  const h = holds.get(shownHold);
  if (!h) { clearInterval(countdownTimer); return; }
  if (h.deadline == null) { $("safeguard-countdown").textContent = "No timeout: the step waits for your answer."; return; }
  const left = Math.max(0, Math.ceil((h.deadline - Date.now()) / 1000));
  $("safeguard-countdown").textContent = left ? `Denied automatically in ${left} s.` : "Timed out: denied.";
  if (!left) { clearInterval(countdownTimer); setTimeout(refreshStatus, 500); }
}

async function answerHold(action) {
  const id = shownHold;
  if (!id) return;
  const r = await request("safeguard.confirm", {safeguard_id: id, action});
  if (r.status !== "ok") notice("warning", `The safeguard was already decided: ${r.error.message}`);
  else notice("info", action === "deny" ? `Denied: step ${holds.get(id)?.payload.step_id ?? ""} is rolled back.` : "Allowed: the step goes on.");
  clearInterval(countdownTimer);
  dropHold(id);
}

// ------------------------------------------------------------------ wiring

document.addEventListener("DOMContentLoaded", () => {
  $("command-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = $("command-input"), command = input.value.trim();
    if (!command) return;
    input.value = "";
    $("run").disabled = true;
    $("cancel").disabled = false;
    const r = await request("agent.execute", {command});
    $("run").disabled = false;
    if (r.status !== "ok") term(`[${r.error.code}: ${r.error.message}]\n`, "stderr");
    else if (r.payload.cancelled) term("[cancelled]\n", "stderr");
    refreshStatus();
    input.focus();
  });
  $("cancel").addEventListener("click", () => request("agent.cancel"));
  $("folder").addEventListener("change", (e) => { folder = Number(e.target.value); expanded.clear(); refreshHistory(); });
  $("safeguard-allow").addEventListener("click", () => answerHold("allow"));
  $("safeguard-deny").addEventListener("click", () => answerHold("deny"));
  $("safeguard").addEventListener("cancel", (e) => e.preventDefault());  // Escape does not decide a hold
  $("force-keep").addEventListener("click", () => { forceStep = null; $("force").close(); });
  $("force-confirm").addEventListener("click", () => {
    const f = forceStep; forceStep = null; $("force").close();
    if (f) undoTo(f.st, f.count, true);
  });
  connect();
  $("command-input").focus();
});
