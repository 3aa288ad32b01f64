// Capacity lab: plays a trace the server computed. Both worlds come from backfill_analysis.lab, so the
// KV mode shows decisions of the real admission policy, not a JavaScript imitation of it;
// this page only draws one step at a time.
"use strict";

const TICK_MS = 150;
const TIMELINE = 160;           // cells shown; older requests scroll off to the left
const PLAY_TICKS = 120;         // a long run still plays in about this many ticks

let trace = null;
let traceMode = "lru";
let position = 0;
let timer = null;
let asked = 0;                  // the latest fetch; answers to older ones are dropped

// $, el and say: dom.js.

function modeChosen() { return document.querySelector('input[name="mode"]:checked').value; }

function num(id) { return Number($(id).value); }

function params(mode) {
  const p = { capacity_slots: num("capacity"), working_set: num("working-set"), requests: num("requests") };
  if (mode === "kv") {
    Object.assign(p, {
      prompt_tokens: num("prompt-tokens"),
      output_tokens: num("output-tokens"),
      interactive_every: num("interactive-every"),
      reserve_slots: num("reserve-slots"),
    });
  }
  return p;
}

async function reset() {
  pause();
  const mode = modeChosen();
  document.body.dataset.mode = mode;
  const ticket = ++asked;
  const response = await fetch(`/lab/${mode}`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(params(mode)),
  });
  if (ticket !== asked) return false;
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    say((body.error && body.error.message) || `The lab answered HTTP ${response.status}.`);
    trace = null;
    render();
    return false;
  }
  const answer = await response.json();
  if (ticket !== asked) return false;
  say("");
  trace = answer;
  traceMode = mode;
  position = 0;
  render();
  return true;
}

function total() { return trace ? trace.steps.length : 0; }

function done() { return trace !== null && position >= total(); }

function pause() {
  if (timer !== null) clearInterval(timer);
  timer = null;
  $("play").textContent = "Play";
}

function advance(n) {
  if (!trace) return;
  position = Math.min(total(), position + n);
  render();
  if (done()) pause();
}

async function play() {
  if (timer !== null) { pause(); return; }
  if (!trace || done()) { if (!(await reset())) return; }
  const perTick = Math.max(1, Math.ceil(total() / PLAY_TICKS));
  $("play").textContent = "Pause";
  timer = setInterval(() => advance(perTick), TICK_MS);
}

async function step() {
  pause();
  if (!trace) { if (!(await reset())) return; }
  advance(1);
}

const fmt = (n) => Number(n).toLocaleString("en-US");

function counters(s) {
  const n = total();
  const items = [];
  if (traceMode === "lru") {
    const hits = s ? s.hits : 0;
    const misses = s ? s.misses : 0;
    items.push(["hits", fmt(hits)], ["misses", fmt(misses)],
      ["hit rate", position ? `${Math.round((100 * hits) / position)}%` : "-"]);
  } else {
    const v = (k) => fmt(s ? s[k] : 0);
    items.push(["hits", v("hits")], ["admitted", v("admits")], ["resumed", v("resumes")],
      ["deferred", v("deferrals")], ["preempted", v("preemptions")], ["finished", v("finished")],
      ["recomputed tokens", v("recomputed_tokens")]);
  }
  const request = el("span", { class: "counter", "data-counter": "request" }, "request ", el("b", {}, fmt(position)), ` of ${fmt(n)}`);
  return [request, ...items.map(([k, v]) => el("span", { class: "counter", "data-counter": k }, el("b", {}, v), ` ${k}`))];
}

function verdict(hits) {
  const raw = $("prediction").value.trim();
  if (!trace) return "";
  if (!done()) return raw === "" ? "Predict the hit count, then play." : `Your prediction: ${raw} hits. Play to the end to see whether it holds.`;
  const summary = `${fmt(hits)} hits of ${fmt(total())} requests.`;
  if (raw === "") return summary;
  return Number(raw) === hits
    ? `${summary} You predicted ${raw}: your prediction held.`
    : `${summary} You predicted ${raw}: it did not hold.`;
}

const CLASS_OF = (id) => (trace && trace.interactive && trace.interactive.includes(id) ? "interactive" : "batch");

function slotBoxes(s) {
  const size = trace ? (trace.capacity_slots ?? trace.config.capacity_slots) : num("capacity");
  const slots = s ? s.slots : new Array(size).fill(null);
  return slots.map((id, i) => {
    const classes = ["slot"];
    if (id === null) classes.push("empty");
    if (traceMode === "kv" && id !== null) classes.push(CLASS_OF(id));
    if (s && id === s.identifier) classes.push(traceMode === "lru" ? (s.hit ? "hit" : "miss") : s.outcome);
    return el("div", { class: classes.join(" "), "data-slot": i, title: `slot ${i + 1}` }, id === null ? "" : id);
  });
}

function nowLine(s) {
  if (!s) return traceMode === "lru"
    ? "Press Step or Play: identifiers arrive 1, 2, …, s, 1, 2, …"
    : "Press Step or Play: each request asks its sequence for one more token.";
  if (traceMode === "lru") {
    const what = s.hit ? "hit" : s.evicted === null ? "miss, into a free slot" : `miss, evicted ${s.evicted}`;
    return `Request ${fmt(s.index)}: identifier ${s.identifier} — ${what}`;
  }
  return `Request ${fmt(s.index)}: sequence ${s.identifier} (${s.service_class}) — ${s.outcome}`;
}

function eventText(e) {
  const who = `sequence ${e.identifier} (${e.service_class})`;
  const prompt = trace.config.prompt_tokens;
  switch (e.kind) {
    case "admit": return `${who} admitted: reserved ${fmt(e.tokens)} tokens, prefilled its prompt`;
    case "resume": return `${who} resumed: reserved ${fmt(e.tokens)} tokens, prefills ${fmt(prompt + e.generated)} again (prompt + ${e.generated} kept), decodes on from token ${e.generated + 1}`;
    case "preempt": return `${who} preempted: gave back ${fmt(e.tokens)} tokens, keeps its ${e.generated} output token(s) and waits to resume`;
    case "finish": return `${who} finished its ${e.generated} tokens: gave back ${fmt(e.tokens)} tokens`;
    case "defer": return `${who} deferred: waits in the queue, no engine work`;
    case "reject": return `${who} rejected: it could never fit`;
    default: return `${who} ${e.kind}`;
  }
}

function renderPool(s) {
  const c = trace.capacity_tokens;
  const interactive = s ? s.interactive_tokens : 0;
  const batch = s ? s.batch_tokens : 0;
  const free = c - interactive - batch;
  const pct = (v) => `${(100 * v) / c}%`;
  $("pool-numbers").textContent =
    `pool ${fmt(c)} tokens (${fmt(c / trace.block_size)} slots of ${trace.block_size}) · each sequence reserves ${fmt(trace.sequence_tokens)} · ` +
    `reserved ${fmt(interactive + batch)} (interactive ${fmt(interactive)}, batch ${fmt(batch)}) · free ${fmt(free)}` +
    (trace.reserve_tokens ? ` · interactive reserve ${fmt(trace.reserve_tokens)}` : "");
  const bar = $("pool-bar");
  bar.replaceChildren(
    el("span", { class: "seg interactive", style: `width:${pct(interactive)}`, "data-seg": "interactive" }),
    el("span", { class: "seg batch", style: `width:${pct(batch)}`, "data-seg": "batch" }),
    el("span", { class: "seg free", style: `width:${pct(free)}`, "data-seg": "free" }));
  $("reserve-legend").hidden = !trace.reserve_tokens;
  if (trace.reserve_tokens) {
    bar.append(el("span", { class: "reserve-mark", style: `left:${pct(c - trace.reserve_tokens)}` }));
  }
  const queue = s ? s.queue : [];
  $("queue").replaceChildren(...(queue.length
    ? queue.map((id) => el("span", { class: `chip ${CLASS_OF(id)}` }, id))
    : [el("span", { class: "muted" }, "empty")]));
  $("reason").textContent = s ? `policy: ${s.reason}` : "";
  $("events").replaceChildren(...(s ? s.events.map((e) => el("li", { class: `ev ${e.kind}` }, eventText(e))) : []));
}

function renderTimeline() {
  const box = $("timeline");
  box.replaceChildren();
  if (!trace) return;
  const from = Math.max(0, position - TIMELINE);
  for (let i = from; i < position; i++) {
    const s = trace.steps[i];
    const kind = traceMode === "lru" ? (s.hit ? "hit" : "miss") : s.outcome;
    box.append(el("span", { class: `cell ${kind}`, title: `request ${s.index}: ${s.identifier} ${kind}` }, s.identifier));
  }
  $("timeline-note").textContent = `${from > 0 ? `(the last ${TIMELINE}) ` : ""}${traceMode === "lru"
    ? "green hit, red miss" : "green hit, red admitted, amber resumed, grey deferred"}`;
}

function render() {
  const s = trace && position > 0 ? trace.steps[position - 1] : null;
  const run = $("run");
  const hits = s ? s.hits : 0;
  run.dataset.position = String(position);
  run.dataset.hits = String(hits);
  run.dataset.done = String(done());
  run.dataset.mode = traceMode;
  $("counters").replaceChildren(...counters(s));
  $("verdict").textContent = verdict(hits);
  $("verdict").className = done() && $("prediction").value.trim() !== ""
    ? (Number($("prediction").value) === hits ? "held" : "missed") : "";
  $("now").textContent = nowLine(s);
  $("slots").replaceChildren(...slotBoxes(s));
  $("slot-note").textContent = traceMode === "lru"
    ? "(one identifier per slot; a miss in a full cache evicts the least recently used)"
    : "(one 16-token KV block per slot; a sequence's blocks need not be adjacent)";
  $("mode-note").textContent = traceMode === "lru"
    ? "Cache world: eviction is automatic and free. A miss costs one fetch, nothing more."
    : "Engine world: each identifier is a sequence; a request decodes one token of it. Nothing is evicted: what does not fit waits, and interactive may preempt batch (progress kept). A hit: the sequence was resident and went on with its context in place.";
  if (trace && traceMode === "kv") renderPool(s);
  renderTimeline();
}

$("reset").addEventListener("click", () => { reset(); });
$("step").addEventListener("click", () => { step(); });
$("play").addEventListener("click", () => { play(); });
$("prediction").addEventListener("input", () => render());
// Any other control starts over with it: a trace belongs to one set of controls.
for (const input of document.querySelectorAll("#controls input:not(#prediction)")) {
  input.addEventListener("change", () => { reset(); });
}
$("controls").addEventListener("submit", (event) => { event.preventDefault(); reset(); });

document.body.dataset.mode = modeChosen();
reset();
