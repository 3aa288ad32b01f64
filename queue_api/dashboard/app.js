// Backfill's dashboard: plain JS, no build step. It holds the tenant's API key only in this
// tab (sessionStorage) and calls the JSON API with it, so the server keeps no session and the
// page sees exactly what that tenant's key may see.
"use strict";

const STATES = ["succeeded", "failed", "expired", "cancelled", "running", "reserved",
  "preempted", "deferred", "queued"];
const HISTORY = 120;            // samples per node: two minutes at one per second
const LAYERS = [                // bottom to top; they sum to the pool's capacity
  ["interactive", "var(--interactive)"],
  ["batch", "var(--batch)"],
  ["slack", "var(--slack)"],
  ["reserve", "var(--reserve)"],
];

let apiKey = null;
let selected = null;
const history = new Map();      // node -> [{t, interactive, batch, slack, reserve, capacity}]
const timers = [];

// $, el and say: dom.js.

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${apiKey}` } });
  if (response.status === 401) {
    stop();
    say("The API refused this key. Enter a valid one.");
    throw new Error("unauthorized");
  }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function relative(unix) {
  if (unix === null || unix === undefined) return "-";
  const delta = Math.round(unix - Date.now() / 1000);
  const span = Math.abs(delta);
  const text = span < 90 ? `${span}s` : span < 5400 ? `${Math.floor(span / 60)}m`
    : `${Math.floor(span / 3600)}h${String(Math.floor((span % 3600) / 60)).padStart(2, "0")}m`;
  return delta >= 0 ? `in ${text}` : `${text} ago`;
}

function eta(unix) {
  // The server's ETA can fall behind while the page keeps polling: never show it as past.
  if (unix !== null && unix !== undefined && unix < Date.now() / 1000) return "due now";
  return relative(unix);
}

function progressBar(items, total) {
  const bar = el("div", { class: "bar", title: STATES.map((s) => `${s} ${items[s] || 0}`).join(", ") });
  for (const state of STATES) {
    const n = items[state] || 0;
    if (n > 0 && total > 0) {
      // Through the CSSOM: the page's policy (style-src 'self') drops style attributes.
      const part = el("span", { class: `s-${state}` });
      part.style.width = `${(100 * n) / total}%`;
      bar.append(part);
    }
  }
  return bar;
}

function renderJobs(page) {
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren();
  const jobs = page.data || [];
  $("no-jobs").hidden = jobs.length > 0;
  // Until the user picks one, the newest job is the one shown in detail.
  if (!jobs.some((j) => j.id === selected)) selected = jobs.length ? jobs[0].id : null;
  for (const job of jobs) {
    const counts = job.request_counts || { total: 0, completed: 0, failed: 0 };
    const extra = job.backfill || {};
    const done = counts.completed + counts.failed;
    const row = el("tr", { class: `job${job.id === selected ? " selected" : ""}`, "data-id": job.id },
      el("td", { class: "id" }, job.id),
      el("td", {}, el("span", { class: `status ${job.status}` }, job.status)),
      el("td", {}, progressBar(extra.items || {}, counts.total)),
      el("td", { class: "count" }, `${done}/${counts.total}`),
      el("td", {}, eta(extra.eta)),
      el("td", {}, relative(extra.deadline)));
    row.addEventListener("click", () => { selected = job.id; renderJob(job); renderJobs(page); });
    body.append(row);
    if (job.id === selected) renderJob(job);
  }
  $("jobs-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

const DOCUMENT_STATES = ["succeeded", "failed", "pending"];

function documentBar(documents, total) {
  // Widths through the CSSOM: the page's policy (style-src 'self') drops style attributes.
  const bar = el("div", { class: "bar", title: DOCUMENT_STATES.map((s) => `${s} ${documents[s] || 0}`).join(", ") });
  for (const state of DOCUMENT_STATES) {
    const n = documents[state] || 0;
    if (n > 0 && total > 0) {
      const part = el("span", { class: `s-${state}`, "data-state": state, "data-n": n });
      part.style.width = `${(100 * n) / total}%`;
      bar.append(part);
    }
  }
  return bar;
}

async function downloadResults(job) {
  // The results need the key, which a plain link would not send: fetched here, then saved.
  const response = await fetch(`/v1/summary_jobs/${job.id}/results`,
    { headers: { Authorization: `Bearer ${apiKey}` } });
  if (!response.ok) { say(`Results of ${job.id}: HTTP ${response.status}`); return; }
  const url = URL.createObjectURL(await response.blob());
  const link = el("a", { href: url, download: `${job.id}.jsonl` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function renderSummaries(page) {
  const body = $("summaries").querySelector("tbody");
  body.replaceChildren();
  const jobs = page.data || [];
  $("no-summaries").hidden = jobs.length > 0;
  for (const job of jobs) {
    const progress = job.progress || {};
    const documents = progress.documents || {};
    const total = DOCUMENT_STATES.reduce((sum, s) => sum + (documents[s] || 0), 0);
    const ended = (documents.succeeded || 0) + (documents.failed || 0);
    const split = progress.split_documents || 0;
    const results = el("a", { class: "results", href: `/v1/summary_jobs/${job.id}/results`,
      title: "the job's rows as JSON lines (partial while it runs)" }, "results.jsonl");
    results.addEventListener("click", (event) => { event.preventDefault(); downloadResults(job); });
    body.append(el("tr", { class: "summary", "data-id": job.id },
      el("td", { class: "id" }, job.id),
      el("td", {}, el("span", { class: `status ${job.status}` }, job.status)),
      el("td", {}, documentBar(documents, total)),
      job.documents_open
        ? el("td", { class: "count", title: "more documents are being sent" }, `${ended}/${total}+`)
        : el("td", { class: "count" }, `${ended}/${total}`),
      el("td", { class: "count" }, `${progress.steps_done || 0}/${progress.steps_planned || 0}`),
      el("td", { class: "split" }, split ? `${split} (depth ${progress.deepest_split || 0})` : "0"),
      el("td", {}, job.status === "in_progress" ? eta(progress.eta) : "-"),
      el("td", {}, relative(job.expires_at)),
      el("td", {}, results)));
  }
  $("summaries-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function renderJob(job) {
  const extra = job.backfill || {};
  const items = extra.items || {};
  const tokens = extra.tokens || {};
  $("job").hidden = false;
  $("job-id").textContent = job.id;
  const states = el("table", { class: "states" },
    el("thead", {}, el("tr", {}, el("th", {}, "state"), el("th", {}, "items"))));
  const tbody = el("tbody");
  for (const state of STATES) {
    tbody.append(el("tr", { "data-state": state },
      el("td", {}, el("i", { class: `s-${state}` }), state),
      el("td", { class: "n" }, items[state] || 0)));
  }
  states.append(tbody);
  const facts = el("table", { class: "facts" },
    el("tbody", {},
      el("tr", {}, el("th", {}, "status"), el("td", {}, job.status)),
      el("tr", {}, el("th", {}, "model"), el("td", {}, extra.model || job.model || "-")),
      el("tr", {}, el("th", {}, "output tokens"), el("td", {}, `${tokens.done || 0} of at most ${tokens.total || 0}`)),
      el("tr", {}, el("th", {}, "prompt tokens"), el("td", {}, tokens.prompt || 0)),
      el("tr", {}, el("th", {}, "ETA"), el("td", {}, `${eta(extra.eta)}${extra.at_risk ? " (past the deadline)" : ""}`)),
      el("tr", {}, el("th", {}, "deadline"), el("td", {}, relative(extra.deadline)))));
  $("job-detail").replaceChildren(el("div", { class: "detail-grid" }, states, facts));
}

function sampleOf(node) {
  const capacity = node.capacity_tokens || 0;
  const interactive = node.interactive_in_use ?? 0;
  const batch = node.batch_in_use ?? node.batch_reserved_tokens ?? 0;
  const slack = node.slack_tokens || 0;
  const reserve = Math.max(0, capacity - interactive - batch - slack);
  return { t: Date.now(), interactive, batch, slack, reserve, capacity };
}

function drawPool(name, samples) {
  const width = 600;
  const height = 160;
  const svgNs = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNs, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("data-node", name);
  const top = Math.max(1, ...samples.map((s) => s.capacity));
  // The newest sample sits at the right edge; the chart fills leftwards as history grows.
  const x = (i) => width - ((samples.length - 1 - i) * width) / (HISTORY - 1);
  const y = (v) => height - (v * height) / top;
  const base = samples.map(() => 0);
  for (const [layer, colour] of LAYERS) {
    const upper = samples.map((s, i) => base[i] + s[layer]);
    let d = "";
    if (samples.length === 1) {
      d = `M0,${y(base[0])} L${width},${y(base[0])} L${width},${y(upper[0])} L0,${y(upper[0])} Z`;
    } else {
      d = upper.map((v, i) => `${i ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
      for (let i = samples.length - 1; i >= 0; i--) d += ` L${x(i).toFixed(1)},${y(base[i]).toFixed(1)}`;
      d += " Z";
    }
    const path = document.createElementNS(svgNs, "path");
    path.setAttribute("d", d);
    path.setAttribute("fill", colour);
    path.setAttribute("data-layer", layer);
    svg.append(path);
    upper.forEach((v, i) => { base[i] = v; });
  }
  return svg;
}

function renderPools(report) {
  const nodes = report.nodes || [];
  $("no-nodes").hidden = nodes.length > 0;
  const box = $("pools");
  box.replaceChildren();
  for (const node of nodes) {
    const samples = history.get(node.name) || [];
    samples.push(sampleOf(node));
    while (samples.length > HISTORY) samples.shift();
    history.set(node.name, samples);
    const now = samples[samples.length - 1];
    const fmt = (n) => n.toLocaleString("en-US");
    box.append(el("div", { class: "pool", "data-node": node.name },
      el("h3", {}, `${node.name} `, el("span", { class: "muted" }, `${node.model || ""} · ${fmt(now.capacity)} tokens · ${node.source}`)),
      el("div", { class: "now" },
        `interactive ${fmt(now.interactive)} · batch ${fmt(now.batch)} · slack ${fmt(now.slack)} · reserve ${fmt(now.reserve)}`),
      drawPool(node.name, samples)));
  }
}

async function pollJobs() {
  try { renderJobs(await api("/v1/batches?limit=100")); say(""); }
  catch (e) { if (e.message !== "unauthorized") say(`Jobs: ${e.message}`); }
}

async function pollSummaries() {
  try { renderSummaries(await api("/v1/summary_jobs?limit=100")); }
  catch (e) { if (e.message !== "unauthorized") say(`Summary jobs: ${e.message}`); }
}

async function pollPools() {
  try { renderPools(await api("/v1/capacity")); }
  catch (e) { if (e.message !== "unauthorized") say(`Capacity: ${e.message}`); }
}

function stop() { while (timers.length) clearInterval(timers.pop()); $("main").hidden = true; }

function start(key) {
  stop();
  apiKey = key;
  sessionStorage.setItem("backfill-key", key);
  $("main").hidden = false;
  pollJobs();
  pollSummaries();
  pollPools();
  timers.push(setInterval(pollJobs, 2000), setInterval(pollSummaries, 2000),
    setInterval(pollPools, 1000));
}

function keyFromHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const key = params.get("key");
  if (key) history_replace();
  return key;
}

function history_replace() {
  // Keep the key out of the address bar (and out of anything that records URLs).
  window.history.replaceState(null, "", location.pathname + location.search);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (key) { $("key-input").value = ""; say(""); start(key); }
});
$("forget").addEventListener("click", () => {
  stop();
  apiKey = null;
  sessionStorage.removeItem("backfill-key");
  say("Key forgotten.");
});

const initial = keyFromHash() || sessionStorage.getItem("backfill-key");
if (initial) start(initial); else say("Enter a tenant's API key to see its jobs.");
