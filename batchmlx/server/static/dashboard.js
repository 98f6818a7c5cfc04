// batchmlx dashboard: plain JavaScript, no build step, no library. Polls the server once a
// second; the chart is drawn as SVG by hand. The API key (when the server has one) lives in
// sessionStorage and travels only as an Authorization header, never in a URL.
"use strict";

const POLL_MS = 1000;
const KEY_STORE = "batchmlx.apiKey";
const STEPS = ["created", "in_progress", "finalizing", "done"];
const $ = (id) => document.getElementById(id);

let key = sessionStorage.getItem(KEY_STORE);
let timer = null;
let lastSummary = null;

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (key) headers["Authorization"] = "Bearer " + key;
  if (options.method === "POST") headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { ...options, headers, cache: "no-store" });
  if (resp.status === 401) throw new Unauthorized();
  if (!resp.ok) {
    let message = resp.status + " " + resp.statusText;
    try { message = (await resp.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return resp;
}

// -- formatting ------------------------------------------------------------------------------
const num = (n) => (n == null ? "—" : Number(n).toLocaleString("en-US"));
const pct = (x) => (x == null ? "—" : (100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0) + "%");
function rate(r) { return r == null ? "—" : r.toLocaleString("en-US", { maximumFractionDigits: 1 }) + " tok/s"; }
function duration(s) {
  if (s == null) return "—";
  s = Math.round(s);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}
const clock = (t) => (t == null ? "" : new Date(t * 1000).toLocaleTimeString());

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function setBar(bar, fraction, status) {
  const p = Math.round(100 * Math.min(1, Math.max(0, fraction)));
  bar.setAttribute("aria-valuenow", String(p));
  bar.firstElementChild.style.width = p + "%";
  bar.classList.toggle("done", status === "completed");
  bar.classList.toggle("stopped", ["cancelling", "cancelled", "expired", "failed"].includes(status));
}

function progressBar(b) {
  const bar = el("div", { class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100" }, el("div"));
  setBar(bar, b.dashboard.progress, b.status);
  return bar;
}

const cancellable = (b) => ["validating", "in_progress"].includes(b.status);

// -- overview --------------------------------------------------------------------------------
function renderSummary(s) {
  $("model").textContent = "model: " + s.model;
  const series = s.series;
  const recent = series.slice(-5);
  const tps = recent.length ? recent.reduce((a, p) => a + p.tokens, 0) / recent.length : 0;
  $("tile-rate").textContent = num(Math.round(tps));
  $("tile-running").textContent = num(s.engine.running);
  const e = s.engine;
  $("tile-blocks").textContent = num(e.blocks_in_use);
  $("tile-blocks-unit").textContent = "of " + num(e.blocks_in_use + e.blocks_free) + " · " + num(e.blocks_cached) + " cached";
  $("tile-worker").textContent = s.worker ? "running" : "none";
  drawChart(series);

  const body = document.querySelector("#batches tbody");
  const rows = s.batches.map((b) => {
    const c = b.request_counts, d = b.dashboard;
    const cancel = el("button", { class: "cancel danger", title: "cancel this batch" }, "Cancel");
    cancel.hidden = !cancellable(b);
    cancel.addEventListener("click", (ev) => { ev.stopPropagation(); cancelBatch(b.id); });
    const tr = el("tr", { "data-batch-id": b.id },
      el("td", { class: "id" }, b.id),
      el("td", { class: "status " + b.status }, b.status),
      el("td", { class: "progress" }, progressBar(b), " ", pct(d.progress)),
      el("td", { class: "counts" }, `${num(d.done - c.failed)} / ${num(c.failed)} / ${num(c.total)}`),
      el("td", { class: "tokens" }, `${num(b.usage.input_tokens)} / ${num(b.usage.output_tokens)}`),
      el("td", { class: "cache" }, `${pct(d.cache_hit_rate)} · ${num(d.cached_tokens)}`),
      el("td", { class: "rate" }, rate(d.tokens_per_s)),
      el("td", { class: "eta" }, b.status === "in_progress" ? duration(d.eta_s) : "—"),
      el("td", {}, cancel));
    tr.addEventListener("click", () => { location.hash = "#/batch/" + b.id; });
    return tr;
  });
  body.replaceChildren(...rows);
  $("empty").hidden = s.batches.length > 0;
}

function drawChart(series) {
  const svg = $("chart");
  // drawn in the element's own pixels, so text is never stretched
  const W = Math.max(200, svg.clientWidth || 720), H = 180, top = 16, bottom = 18, left = 4, right = 4;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const n = series.length;
  const maxTok = Math.max(1, ...series.map((p) => p.tokens));
  const maxRun = Math.max(1, ...series.map((p) => p.running));
  const x = (i) => left + (W - left - right) * (n > 1 ? i / (n - 1) : 0);
  const y = (v, max) => top + (H - top - bottom) * (1 - v / max);
  const ns = "http://www.w3.org/2000/svg";
  const make = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text != null) node.textContent = text;
    return node;
  };
  const tokPts = series.map((p, i) => `${x(i).toFixed(1)},${y(p.tokens, maxTok).toFixed(1)}`);
  const runPts = [];
  series.forEach((p, i) => {  // a step line: the batch size holds until it changes
    const yy = y(p.running, maxRun).toFixed(1);
    if (i > 0) runPts.push(`${x(i).toFixed(1)},${y(series[i - 1].running, maxRun).toFixed(1)}`);
    runPts.push(`${x(i).toFixed(1)},${yy}`);
  });
  const base = y(0, 1).toFixed(1);
  const children = [
    make("line", { class: "grid", x1: 0, x2: W, y1: base, y2: base }),
    make("line", { class: "grid", x1: 0, x2: W, y1: top, y2: top }),
  ];
  if (n > 1) {
    children.push(make("polygon", { class: "tokens-area", points: `${x(0)},${base} ${tokPts.join(" ")} ${x(n - 1)},${base}` }));
    children.push(make("polyline", { class: "tokens", points: tokPts.join(" ") }));
    children.push(make("polyline", { class: "running", points: runPts.join(" ") }));
  }
  children.push(make("text", { x: 6, y: 11 }, `${num(maxTok)} tok/s`));
  children.push(make("text", { x: W - 6, y: 11, "text-anchor": "end" }, `${num(maxRun)} running`));
  children.push(make("text", { x: 6, y: H - 4 }, "−5 min"));
  children.push(make("text", { x: W - 6, y: H - 4, "text-anchor": "end" }, "now"));
  svg.replaceChildren(...children);
}

// -- one batch -------------------------------------------------------------------------------
let shownBatch = null;

function renderDetail(b) {
  shownBatch = b;
  const c = b.request_counts, d = b.dashboard;
  $("detail-id").textContent = b.id;
  const st = $("detail-status");
  st.textContent = b.status;
  st.className = "status " + b.status;
  setBar($("detail-bar"), d.progress, b.status);
  $("detail-pct").textContent = pct(d.progress);
  const facts = [
    ["endpoint", b.endpoint], ["model", b.model || "—"],
    ["requests", `${num(c.total)} total · ${num(c.completed)} completed · ${num(c.failed)} failed`],
    ["tokens", `${num(b.usage.input_tokens)} prompt · ${num(b.usage.output_tokens)} generated`],
    ["prefix cache", `hit rate ${pct(d.cache_hit_rate)} · ${num(d.cached_tokens)} cached tokens` +
      (d.outcomes.hits != null ? ` · HIT ${d.outcomes.hits}, PREFIX_HIT ${d.outcomes.prefix_hits}, MISS ${d.outcomes.misses}` : "")],
    ["throughput", rate(d.tokens_per_s)],
    ["ETA", b.status === "in_progress" ? duration(d.eta_s) : "—"],
  ];
  $("detail-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  $("download-output").hidden = !b.output_file_id;
  $("download-errors").hidden = !b.error_file_id || b.error_file_missing;
  $("cancel").hidden = !cancellable(b);

  const end = b.completed_at ? ["completed", b.completed_at] : b.failed_at ? ["failed", b.failed_at]
    : b.cancelled_at ? ["cancelled", b.cancelled_at] : b.expired_at ? ["expired", b.expired_at] : null;
  const steps = [
    ["created", b.created_at], ["in progress", b.in_progress_at],
    b.cancelling_at ? ["cancelling", b.cancelling_at] : ["finalizing", b.finalizing_at],
    end || ["done", null],
  ];
  let prev = null;
  $("timeline").replaceChildren(...steps.map(([label, t]) => {
    const since = t != null && prev != null ? " (+" + duration(t - prev) + ")" : "";
    if (t != null) prev = t;
    return el("li", { class: t == null ? "pending" : "reached", "data-step": label },
      label, el("span", {}, t == null ? "…" : clock(t) + since));
  }));

  const items = [];
  for (const e of (b.errors && b.errors.data) || []) {
    items.push(el("li", {}, `${e.line ? "line " + e.line : "file"}: ${e.code}${e.param ? " [" + e.param + "]" : ""}: ${e.message}`));
  }
  for (const e of b.error_lines) {
    items.push(el("li", {}, `${e.custom_id}: ${e.status_code ?? ""} ${e.code ?? ""}: ${e.message ?? ""}`));
  }
  if (b.error_file_missing) {
    items.push(el("li", { class: "muted" }, `error file ${b.error_file_id} was deleted or expired`));
  }
  if (!items.length) items.push(el("li", { class: "muted" }, "none"));
  $("errors").replaceChildren(...items);
}

async function download(fileId, name) {
  const resp = await api("/v1/files/" + encodeURIComponent(fileId) + "/content");
  const url = URL.createObjectURL(await resp.blob());
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

async function cancelBatch(id) {
  $("action-error").textContent = "";
  try {
    await api("/v1/batches/" + encodeURIComponent(id) + "/cancel", { method: "POST", body: "{}" });
  } catch (err) {
    $("action-error").textContent = err.message;
  }
  poll();
}

// -- the loop --------------------------------------------------------------------------------
function route() {
  const m = location.hash.match(/^#\/batch\/(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

async function poll() {
  clearTimeout(timer);
  try {
    const batchId = route();
    if (batchId) {
      renderDetail(await (await api("/dashboard/api/batches/" + encodeURIComponent(batchId))).json());
    } else {
      lastSummary = await (await api("/dashboard/api/summary")).json();
      renderSummary(lastSummary);
    }
    $("overview").hidden = !!batchId;
    $("detail").hidden = !batchId;
    $("key-form").hidden = true;
    $("conn").textContent = "live · updated " + new Date().toLocaleTimeString();
  } catch (err) {
    if (err instanceof Unauthorized) {
      askForKey(key ? "That key was refused." : "");
      return;  // no polling until a key is given
    }
    $("conn").textContent = "disconnected: " + err.message;
  }
  timer = setTimeout(poll, POLL_MS);
}

function askForKey(message) {
  key = null;
  sessionStorage.removeItem(KEY_STORE);
  $("overview").hidden = $("detail").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  $("conn").textContent = "locked";
  $("key-input").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    key = $("key-input").value.trim();
    $("key-input").value = "";
    sessionStorage.setItem(KEY_STORE, key);
    poll();
  });
  $("download-output").addEventListener("click", () => download(shownBatch.output_file_id, shownBatch.id + "_output.jsonl"));
  $("download-errors").addEventListener("click", () => download(shownBatch.error_file_id, shownBatch.id + "_errors.jsonl"));
  $("cancel").addEventListener("click", () => cancelBatch(shownBatch.id));
  window.addEventListener("hashchange", poll);
  poll();
});
