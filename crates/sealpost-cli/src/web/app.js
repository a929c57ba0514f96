"use strict";
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

// The token: asked once, kept in this tab's sessionStorage (gone when the tab closes, never
// sent by the browser on its own, so another site cannot make the browser use it), and sent
// as `Authorization: Bearer` with every API request.
const TOKEN_KEY = "sealpost.token";
const token = () => sessionStorage.getItem(TOKEN_KEY);

class AuthError extends Error {}

async function getJson(url, opts) {
  opts = opts || {};
  const headers = Object.assign({}, opts.headers || {});
  const t = token();
  if (t) headers["Authorization"] = "Bearer " + t;
  const r = await fetch(url, Object.assign({}, opts, { headers, cache: "no-store", credentials: "omit" }));
  let body;
  try { body = await r.json(); } catch (_) { body = { error: r.status + " " + r.statusText }; }
  const msg = body.error || (r.status + " " + r.statusText);
  if (r.status === 401) {
    signOut("the server refused the token: " + msg);
    throw new AuthError(msg);
  }
  if (!r.ok) throw new Error(msg);
  return body;
}

function showSignIn(msg) {
  clearTimeout(refreshTimer);
  $("content").hidden = true;
  $("logout").hidden = true;
  $("whoami").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = msg || "";
  $("access-token").focus();
}

function signOut(msg) {
  sessionStorage.removeItem(TOKEN_KEY);
  lastQuarantined = null;
  showSignIn(msg);
}

async function start() {
  if (!token()) { showSignIn(""); return; }
  let s;
  try {
    s = await getJson("/api/session");
  } catch (e) {
    if (!(e instanceof AuthError)) showSignIn("cannot reach the server: " + e.message);
    return;
  }
  $("whoami").textContent = "signed in: " + s.name + (s.may_release ? " (operator)" : " (read only)");
  $("release-as").textContent = s.may_release ? "released as " + s.name + " (audited)" :
    (s.releases_enabled ? "a read token cannot release: sign in with an operator token" : "releases are disabled on this server");
  $("login").hidden = true;
  $("logout").hidden = false;
  $("content").hidden = false;
  refresh();
}

$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const t = $("access-token").value.trim();
  $("access-token").value = "";
  if (!t) { $("login-error").textContent = "give a token"; return; }
  sessionStorage.setItem(TOKEN_KEY, t);
  start();
});

$("logout").addEventListener("click", () => signOut(""));

function fmtAge(s) { return Number(s).toFixed(1); }

let lastQuarantined = null;
function renderStatus(s) {
  $("oldest-pending-s").textContent = fmtAge(s.oldest_pending_s);
  $("unknown").textContent = s.unknown;
  $("oldest-unknown-s").textContent = fmtAge(s.oldest_unknown_s);
  $("quarantined").textContent = s.quarantined;
  $("missing-at-broker").textContent = s.missing_at_broker;
  $("missing-at-broker").classList.toggle("bad", s.missing_at_broker > 0);
  const tb = $("states").tBodies[0];
  tb.replaceChildren();
  for (const [name, n] of Object.entries(s.states)) {
    const tr = el("tr");
    tr.appendChild(el("td", name));
    const td = el("td", n, "n");
    td.id = "state-" + name;
    tr.appendChild(td);
    tb.appendChild(tr);
  }
  const stuck = $("stuck");
  stuck.replaceChildren();
  for (const [id, tries, why] of s.stuck_rows) {
    stuck.appendChild(el("p", "cannot leave: " + id + " (" + tries + " tries; last: " + why + ")", "bad"));
  }
  // Delivery sets (R16): counts, and the open sets with each member's route and state.
  const sets = $("sets");
  const ss = s.sets || { total: 0, open: [] };
  sets.hidden = ss.total === 0;
  $("sets-summary").textContent = "delivery sets: " + ss.total + " (" + ss.complete + " complete, " +
    ss.in_progress + " in progress, " + ss.blocked + " blocked)";
  sets.tBodies[0].replaceChildren();
  for (const v of ss.open) {
    const tr = el("tr");
    tr.dataset.eventId = v.event_id;
    tr.appendChild(el("td", v.event_id, "id"));
    tr.appendChild(el("td", v.rule + " (" + v.published + "/" + v.needed + ")"));
    tr.appendChild(el("td", v.status.replace("_", " "), v.status === "blocked" ? "bad" : ""));
    tr.appendChild(el("td", v.members.map((m) => m.route + ": " + (m.state || "removed")).join(", ")));
    sets.tBodies[0].appendChild(tr);
  }
  // Rollouts (R25): each route's alias, the shadows' tallies and their latest divergences.
  const ro = s.rollout || { aliases: [], shadows: [] };
  const rollout = $("rollout");
  rollout.hidden = ro.aliases.length === 0;
  const moving = ro.aliases.filter((a) => a.stage !== "incumbent").length;
  $("rollout-summary").textContent = "rollouts: " + ro.aliases.length + " route(s), " + moving + " under way";
  rollout.tBodies[0].replaceChildren();
  for (const a of ro.aliases) {
    const tr = el("tr");
    tr.dataset.route = a.route;
    tr.appendChild(el("td", a.route));
    tr.appendChild(el("td", a.stage));
    tr.appendChild(el("td", a.generation, "n"));
    tr.appendChild(el("td", a.claims));
    rollout.tBodies[0].appendChild(tr);
  }
  const shadows = $("shadows");
  const divergences = $("divergences");
  shadows.hidden = ro.shadows.length === 0;
  shadows.tBodies[0].replaceChildren();
  divergences.tBodies[0].replaceChildren();
  let examples = 0;
  for (const sh of ro.shadows) {
    const tr = el("tr");
    tr.dataset.shadow = sh.candidate + "@" + sh.route;
    tr.appendChild(el("td", sh.candidate));
    tr.appendChild(el("td", sh.route));
    for (const k of ["compared", "matched", "diverged"]) tr.appendChild(el("td", sh[k], "n"));
    tr.appendChild(el("td", sh.unexplained, sh.unexplained > 0 ? "n bad" : "n"));
    shadows.tBodies[0].appendChild(tr);
    for (const d of sh.examples) {
      const dr = el("tr");
      dr.dataset.eventId = d.event_id;
      dr.appendChild(el("td", sh.candidate));
      dr.appendChild(el("td", d.event_id, "id"));
      dr.appendChild(el("td", d.kind));
      dr.appendChild(el("td", d.incumbent));
      dr.appendChild(el("td", d.candidate));
      dr.appendChild(el("td", d.explanation || "no", d.explanation ? "" : "bad"));
      divergences.tBodies[0].appendChild(dr);
      examples += 1;
    }
  }
  divergences.hidden = examples === 0;
  const cdc = $("cdc-slots");
  const slots = s.cdc || [];
  cdc.hidden = slots.length === 0;
  cdc.tBodies[0].replaceChildren();
  for (const c of slots) {
    const tr = el("tr");
    tr.appendChild(el("td", c.slot));
    tr.appendChild(el("td", c.cluster));
    const state = !c.exists ? "gone (scanning)" : c.wal_status === "lost" ? "lost" : c.active ? "streaming" : "no publisher";
    tr.appendChild(el("td", state, c.exists && c.wal_status !== "lost" && c.active ? "" : "bad"));
    tr.appendChild(el("td", c.unconfirmed_bytes, "n"));
    tr.appendChild(el("td", fmtAge(c.confirmed_age_s), "n"));
    tr.appendChild(el("td", c.window_rows, "n"));
    cdc.tBodies[0].appendChild(tr);
  }
  // Rebuilt only when the rows change, so a button is not replaced under the operator's click.
  const qkey = JSON.stringify(s.quarantined_rows);
  if (qkey === lastQuarantined) return;
  lastQuarantined = qkey;
  const qb = $("quarantined-rows").tBodies[0];
  qb.replaceChildren();
  for (const [id, why] of s.quarantined_rows) {
    const tr = el("tr");
    tr.dataset.eventId = id;
    tr.appendChild(el("td", id, "id"));
    tr.appendChild(el("td", why, "reason"));
    const td = el("td");
    const b = el("button", "release");
    b.className = "release";
    b.addEventListener("click", () => release(id));
    td.appendChild(b);
    tr.appendChild(td);
    qb.appendChild(tr);
  }
  if (s.quarantined_rows.length === 0) {
    const tr = el("tr");
    tr.appendChild(el("td", "none"));
    qb.appendChild(tr);
  }
}

function renderFindings(f) {
  $("findings-total").textContent = f.total + " finding(s)" + (f.total > f.findings.length ? ", newest " + f.findings.length + " shown" : "");
  const tb = $("findings").tBodies[0];
  tb.replaceChildren();
  for (const x of f.findings) {
    const tr = el("tr");
    tr.appendChild(el("td", x.kind));
    tr.appendChild(el("td", x.event_id, "id"));
    tr.appendChild(el("td", x.detail));
    tb.appendChild(tr);
  }
}

const SVG = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// Two panels sharing the time axis: latency (p50, p99) above, backlog below.
function renderChart(h) {
  const svg = $("chart");
  svg.replaceChildren();
  const W = 600, L = 52, R = 10, panels = [{ top: 10, h: 120 }, { top: 160, h: 110 }];
  const samples = h.samples;
  $("chart-note").textContent = h.last_error ? "sampler: " + h.last_error :
    samples.length + " samples, every " + (h.sample_ms / 1000) + " s or 5× the last read (" + h.last_took_ms + " ms), at most " + h.samples_max;
  $("chart-note").classList.toggle("error", !!h.last_error);
  if (samples.length === 0) {
    svg.appendChild(svgEl("text", { x: L, y: 60 }, "waiting for the first sample"));
    return;
  }
  const t0 = samples[0].at_ms, t1 = Math.max(samples[samples.length - 1].at_ms, t0 + 1);
  const x = (t) => L + (W - L - R) * (t - t0) / (t1 - t0);
  const series = [
    { panel: 0, key: "latency_ms_p50", color: "#3056d3", id: "line-p50" },
    { panel: 0, key: "latency_ms_p99", color: "#b3261e", id: "line-p99" },
    { panel: 1, key: "backlog", color: "#1e7b34", id: "line-backlog" },
  ];
  const max = [1, 1];
  for (const s of series) for (const p of samples) if (p[s.key] != null) max[s.panel] = Math.max(max[s.panel], p[s.key]);
  panels.forEach((p, i) => {
    svg.appendChild(svgEl("rect", { x: L, y: p.top, width: W - L - R, height: p.h, fill: "none", stroke: "#d8dce4" }));
    svg.appendChild(svgEl("text", { x: L - 4, y: p.top + 10, "text-anchor": "end" }, String(max[i])));
    svg.appendChild(svgEl("text", { x: L - 4, y: p.top + p.h, "text-anchor": "end" }, "0"));
    svg.appendChild(svgEl("text", { x: 2, y: p.top + p.h / 2 }, i === 0 ? "ms" : "rows"));
  });
  for (const s of series) {
    const p = panels[s.panel];
    const pts = samples.filter((q) => q[s.key] != null)
      .map((q) => x(q.at_ms).toFixed(1) + "," + (p.top + p.h - p.h * q[s.key] / max[s.panel]).toFixed(1));
    if (pts.length === 0) continue;
    const line = svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: s.color, "stroke-width": 2, id: s.id });
    svg.appendChild(line);
    if (pts.length === 1) {
      const [cx, cy] = pts[0].split(",");
      svg.appendChild(svgEl("circle", { cx, cy, r: 3, fill: s.color }));
    }
  }
  const span = (t1 - t0) / 1000;
  svg.appendChild(svgEl("text", { x: L, y: 292 }, "-" + span.toFixed(0) + " s"));
  svg.appendChild(svgEl("text", { x: W - R, y: 292, "text-anchor": "end" }, "now"));
}

// The next refresh starts 2 s after this one began, or 5 times its duration if longer: on a
// large outbox the status read scans, and an open tab must not keep a backend busy.
let refreshTimer = null;
async function refresh() {
  clearTimeout(refreshTimer);
  const began = performance.now();
  try {
    const [s, h, f] = await Promise.all([getJson("/api/status"), getJson("/api/history"), getJson("/api/findings")]);
    renderStatus(s);
    renderChart(h);
    renderFindings(f);
    $("load-error").textContent = "";
    $("updated").textContent = new Date().toLocaleTimeString();
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (e) {
    if (e instanceof AuthError) return;
    $("load-error").textContent = "cannot load the status: " + e.message;
  }
  const took = performance.now() - began;
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, Math.max(2000, 5 * took) - took);
}

async function release(id) {
  const out = $("release-result");
  out.className = "";
  out.textContent = "releasing " + id + " ...";
  try {
    const r = await getJson("/api/release", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ event_id: id, reason: $("reason").value }),
    });
    out.className = "ok";
    out.textContent = "released " + r.released + " row(s) of " + r.event_id + " to PENDING (audited: " + r.audit + ")";
  } catch (e) {
    if (e instanceof AuthError) return;
    out.className = "error";
    out.textContent = "release refused: " + e.message;
  }
  await refresh();
}

function chainItem(list, label, text) {
  const li = el("li");
  li.appendChild(el("b", label + ": "));
  li.appendChild(document.createTextNode(text));
  list.appendChild(li);
}

function renderTrace(t) {
  const out = $("trace-out");
  out.replaceChildren();
  if (!t.found) {
    out.appendChild(el("p", t.query + ": no envelope found (never committed, or a wrong id)", "error"));
    return;
  }
  if (t.truncated) out.appendChild(el("p", "showing the first " + t.events.length + " events only", "meta"));
  for (const e of t.events) {
    const div = el("div", undefined, "trace-event");
    div.dataset.eventId = e.event_id;
    div.appendChild(el("h3", e.event_id + " member " + e.member + ": " + e.state));
    const ol = el("ol", undefined, "chain");
    const env = e.envelope;
    chainItem(ol, "committed", "txid " + env.creating_txid + ", " + env.event_type + " " + env.aggregate);
    chainItem(ol, "envelope", "generation " + env.generation + ", destination " + env.destination + ", payload " + env.payload_digest);
    for (const a of e.attempts) chainItem(ol, "attempt", "#" + a.attempt_id + " gen " + a.attempt_generation + " claim gen " + a.claim_generation + " owner " + a.owner + ": " + a.status);
    if (e.broker_position) chainItem(ol, "broker", e.broker_position.stream + "#" + e.broker_position.sequence + " (primary attempt #" + e.broker_position.primary_attempt_id + ")");
    else chainItem(ol, "broker", "no accepted receipt yet");
    for (const r of e.receipts) chainItem(ol, "receipt", r.kind + " via " + r.source + " attempt #" + r.attempt_id + " at " + r.stream + "#" + r.sequence);
    if (e.consumers.length === 0) chainItem(ol, "consumers", "none yet");
    for (const c of e.consumers) chainItem(ol, "consumer", c.consumer + " receipt #" + c.receipt_id + " from " + c.stream + "#" + c.sequence);
    for (const q of e.quarantine) chainItem(ol, "quarantine", q.reason + ": " + q.detail);
    for (const a of e.audit) chainItem(ol, "audit", a.what + ": " + a.detail);
    div.appendChild(ol);
    out.appendChild(div);
  }
}

$("trace-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const key = $("trace-key").value.trim();
  const out = $("trace-out");
  try {
    renderTrace(await getJson("/api/trace?key=" + encodeURIComponent(key)));
  } catch (e) {
    if (e instanceof AuthError) return;
    out.replaceChildren(el("p", "trace failed: " + e.message, "error"));
  }
});

start();
