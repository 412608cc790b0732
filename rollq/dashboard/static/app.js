// rollq dashboard: polls /api/queues/{queue} once per sampler interval and redraws; re-reads
// the queue list (/api/queues) every QUEUES_EVERY_MS, so a queue used later gets its button.
// Plain DOM + inline SVG; every value from the API is set with textContent (dead-letter
// reasons are arbitrary text).
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
// SVG presentation attributes take plain colours (mirrors the palette in style.css)
const C = { blue: "#2f6fdf", green: "#1a9a5a", orange: "#e07b16", red: "#d23c3c", violet: "#7b4fd6" };
const state = { queue: null, queues: [], interval: 1, history: 600, since: null, hist: null, timer: null };
const QUEUES_EVERY_MS = 10000;

// ---- formatting ---------------------------------------------------------------------------
const dash = "–";
function num(v, digits = 0) {
  if (v === null || v === undefined) return dash;
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  return v.toFixed(digits);
}
function rate(v) { return v === null || v === undefined ? dash : num(v, v < 10 && v > 0 ? 1 : 0); }
function ms(v) {
  if (v === null || v === undefined) return dash;
  return v >= 1000 ? (v / 1000).toFixed(v >= 10000 ? 0 : 1) + " s" : v + " ms";
}
function upTo(v) { return v === null || v === undefined ? dash : "≤ " + ms(v); }
function secs(v) {
  if (v === null || v === undefined) return dash;
  if (v < 1) return (v * 1000).toFixed(0) + " ms";
  if (v < 60) return v.toFixed(1) + " s";
  if (v < 3600) return Math.floor(v / 60) + "m" + (Math.floor(v % 60) ? " " + Math.floor(v % 60) + "s" : "");
  return Math.floor(v / 3600) + "h " + Math.floor((v % 3600) / 60) + "m";
}
function ago(t) { return t ? secs(Math.max(0, Date.now() / 1000 - t)) + " ago" : dash; }
function bytes(n) {
  if (!n && n !== 0) return dash;
  const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}

// ---- DOM helpers ----------------------------------------------------------------------------
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "title") e.title = v; else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fillRows(table, rows, cols, emptyText) {
  const body = document.querySelector(`#${table} tbody`);
  body.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colspan: cols }, emptyText))]));
}
function meter(frac) {
  const f = Math.max(0, Math.min(1, frac || 0));
  const i = el("i"); i.style.width = (f * 100).toFixed(0) + "%";
  if (f > 0.9) i.style.background = "var(--orange)";
  return el("span", { class: "meter" }, i);
}
function set(k, text) { document.querySelector(`[data-k="${k}"]`).textContent = text; }

// ---- charts ------------------------------------------------------------------------------
function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}
// Draw in the SVG's own pixel width so text keeps its size whatever the layout.
function fitWidth(root, height) {
  const W = Math.max(240, Math.round(root.getBoundingClientRect().width) || 600);
  root.setAttribute("viewBox", `0 0 ${W} ${height}`);
  return W;
}
function lineChart(id, t, series, fmt) {
  const root = document.getElementById(id);
  const W = fitWidth(root, 180), H = 180, L = 52, R = 8, T = 22, B = 20;
  const nodes = [];
  const tmax = t.length ? t[t.length - 1] : Date.now() / 1000;
  const span = Math.min(state.history, Math.max(60, t.length ? tmax - t[0] : 60));
  const t0 = tmax - span;
  let vmax = 0;
  for (const s of series) for (const v of s.values) if (v !== null && v > vmax) vmax = v;
  vmax = niceMax(vmax);
  const x = (tt) => L + ((tt - t0) / span) * (W - L - R);
  const y = (v) => T + (1 - v / vmax) * (H - T - B);
  for (const f of [0, 0.5, 1]) {
    nodes.push(svg("line", { class: "grid", x1: L, x2: W - R, y1: y(f * vmax), y2: y(f * vmax) }));
    nodes.push(svg("text", { x: L - 6, y: y(f * vmax) + 4, "text-anchor": "end" }, fmt(f * vmax)));
  }
  nodes.push(svg("text", { x: L, y: H - 4 }, "-" + secs(span)));
  nodes.push(svg("text", { x: W - R, y: H - 4, "text-anchor": "end" }, "now"));
  let lx = L;
  for (const s of series) {
    let d = "", pen = false;
    for (let i = 0; i < t.length; i++) {
      const v = s.values[i];
      if (v === null || v === undefined || t[i] < t0) { pen = false; continue; }
      d += (pen ? "L" : "M") + x(t[i]).toFixed(1) + " " + y(v).toFixed(1);
      pen = true;
    }
    if (d) nodes.push(svg("path", { class: "line", d, stroke: s.color }));
    const last = [...s.values].reverse().find((v) => v !== null && v !== undefined);
    nodes.push(svg("rect", { x: lx, y: 6, width: 10, height: 3, fill: s.color }));
    const label = svg("text", { x: lx + 14, y: 11 }, `${s.name} ${last === undefined ? dash : fmt(last)}`);
    nodes.push(label);
    lx += 28 + 7 * label.textContent.length;
  }
  root.replaceChildren(...nodes);
}

function timeline(versions) {
  const root = document.getElementById("timeline");
  const W = fitWidth(root, 70), L = 16, R = 16, Y = 36;
  const pts = versions.filter((v) => v.published_at).slice().reverse();
  const nodes = [svg("line", { class: "grid", x1: L, x2: W - R, y1: Y, y2: Y })];
  if (!pts.length) {
    nodes.push(svg("text", { x: W / 2, y: Y - 8, "text-anchor": "middle" }, "no version published yet"));
    root.replaceChildren(...nodes); return;
  }
  const now = Date.now() / 1000;
  const t0 = Math.min(pts[0].published_at, now - 60), span = Math.max(1, now - t0);
  const x = (t) => L + ((t - t0) / span) * (W - L - R);
  let labelled = Infinity; // x of the last label drawn, newest first: labels never overlap
  for (let i = pts.length - 1; i >= 0; i--) {
    const v = pts[i], cx = x(v.published_at);
    const dot = svg("circle", { cx, cy: Y, r: 5, fill: C.violet });
    dot.append(svg("title", {}, `v${v.version} · ${new Date(v.published_at * 1000).toLocaleTimeString()} · ${v.transport}`));
    nodes.push(dot);
    const label = "v" + v.version;
    if (labelled - cx >= 8 * label.length + 6) {
      nodes.push(svg("text", { x: cx, y: Y - 10, "text-anchor": "middle" }, label));
      labelled = cx;
    }
  }
  nodes.push(svg("text", { x: L, y: 64 }, "-" + secs(span)));
  nodes.push(svg("text", { x: W - R, y: 64, "text-anchor": "end" }, "now"));
  root.replaceChildren(...nodes);
}

// ---- sections ----------------------------------------------------------------------------
function render(doc) {
  const q = doc.queue, r = doc.rates, lat = doc.latency;
  const live = doc.replicas.filter((x) => x.lease).length;
  set("waiting", num(q.waiting)); set("in_flight", num(q.in_flight)); set("oldest", secs(q.oldest_waiting_s));
  set("submit_rate", rate(r.submitted_per_s)); set("complete_rate", rate(r.completed_per_s));
  // quantiles are histogram bucket bounds: "at most"; the last minute's, else all time
  set("p50", upTo(lat.p50_ms ?? lat.all_time.p50_ms)); set("p99", upTo(lat.p99_ms ?? lat.all_time.p99_ms));
  set("dlq", num(q.dlq_length)); set("version", doc.versions.current ?? dash);
  set("replicas", `${live} / ${doc.replicas.length}`);
  document.getElementById("totals").textContent =
    `submitted ${q.submitted} · completed ${q.completed} · failed ${q.failed} · dead-lettered ${q.dead_lettered}` +
    ` · ${num(r.tokens_per_s)} tokens/s · latency all time p50 ${upTo(lat.all_time.p50_ms)} / p99 ${upTo(lat.all_time.p99_ms)}` +
    ` (${lat.all_time.count} results)` +
    // a sharded queue: the tiles are sums; each shard's waiting / in flight shows an imbalance
    (q.shards > 1 ? ` · ${q.shards} shards, waiting / in flight per shard ` +
      q.shard_waiting.map((w, i) => `${i}: ${num(w)} / ${num(q.shard_in_flight[i])}`).join(", ") : "");
  document.getElementById("lat-window").textContent = lat.window_s;

  const h = state.hist;
  lineChart("chart-depth", h.t, [
    { name: "waiting", values: h.waiting, color: C.blue },
    { name: "in flight", values: h.in_flight, color: C.green },
    { name: "dead letters", values: h.dlq, color: C.red },
  ], (v) => num(v));
  lineChart("chart-rate", h.t, [
    { name: "submitted", values: h.submitted_per_s, color: C.blue },
    { name: "completed", values: h.completed_per_s, color: C.green },
    { name: "failed", values: h.failed_per_s, color: C.red },
  ], (v) => rate(v));
  lineChart("chart-latency", h.t, [
    { name: "p50", values: h.p50_ms, color: C.violet },
    { name: "p99", values: h.p99_ms, color: C.orange },
  ], (v) => ms(v));

  const states = Object.entries(doc.replica_states).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`);
  document.getElementById("replica-states").textContent = states.join(" · ");
  fillRows("replicas", doc.replicas.map((x) => el("tr", { "data-replica": x.id },
    el("td", {}, x.id),
    el("td", {}, el("span", { class: "badge " + x.state, title: `reported: ${x.reported_state}; lease ${x.lease ? "live" : "expired"}` }, x.state)),
    el("td", {}, x.version ?? dash),
    el("td", {}, meter(x.cap ? x.inflight / x.cap : 0), `${x.inflight} / ${x.cap}`),
    el("td", {}, x.kv_usage === null ? dash : meter(x.kv_usage), x.kv_usage === null ? "" : (x.kv_usage * 100).toFixed(0) + "%"),
    el("td", {}, num(x.tokens_per_s)),
    el("td", {}, num(x.completed)),
    el("td", {}, secs(x.heartbeat_age_s) + " ago"),
    el("td", {}, `${x.engine} · ${x.host}:${x.pid}`),
  )), 9, "no replica registered");

  timeline(doc.versions.log);
  fillRows("versions", doc.versions.log.slice(0, 8).map((v) => el("tr", {},
    el("td", {}, "v" + v.version), el("td", {}, ago(v.published_at)), el("td", {}, v.transport || dash),
    el("td", {}, bytes(v.nbytes)), el("td", {}, v.num_tensors ?? dash), el("td", {}, v.trainer || dash),
  )), 6, "no version published yet");
  fillRows("updates", doc.replicas.map((x) => el("tr", {},
    el("td", {}, x.id), el("td", {}, x.version ?? dash), el("td", {}, x.versions_behind ?? dash),
    el("td", {}, secs(x.last_update_s)), el("td", {}, secs(x.last_pause_s)),
    el("td", {}, secs(x.paused_s_total)), el("td", {}, x.updates ?? 0),
  )), 7, "no replica registered");

  const lag = doc.versions.lag, total = lag.recent.reduce((a, b) => a + b.count, 0);
  const peak = Math.max(1, ...lag.recent.map((b) => b.count));
  document.getElementById("lag-window").textContent = `results of the last ${secs(lag.window_s)}`;
  document.getElementById("lag").replaceChildren(...(lag.recent.length ? lag.recent.map((b) => {
    const bar = el("div", { class: "bar" }); bar.style.width = ((b.count / peak) * 100).toFixed(1) + "%";
    return el("div", { class: "row" }, el("span", {}, `lag ${b.lag}`), bar,
      el("span", { class: "n" }, `${b.count} · ${((b.count / total) * 100).toFixed(0)}%`));
  }) : [el("p", { class: "sub" }, "no results in this window")]));
  const all = lag.all_time.map((b) => `${b.lag}: ${b.count}`).join(", ");
  document.getElementById("lag-all").textContent = all ? `all time (lag: results) ${all}` : "";

  const dl = doc.dead_letters;
  document.getElementById("dlq-sub").textContent = `${dl.length} in the stream · ${dl.total} dead-lettered in all`;
  fillRows("dlq", dl.latest.map((d) => el("tr", {},
    el("td", {}, ago(d.at)), el("td", {}, d.ref || d.entry_id), el("td", {}, d.job_id ?? dash), el("td", {}, d.error_type),
    el("td", { class: "reason", title: d.reason }, d.reason.length > 200 ? d.reason.slice(0, 200) + "…" : d.reason),
    el("td", {}, d.deliveries), el("td", {}, d.consumer || dash), el("td", {}, d.requeueable ? "yes" : "no"),
  )), 8, "no dead letters");
}

function showStatus(doc) {
  const s = doc.sampler, st = document.getElementById("status"), err = document.getElementById("error");
  st.textContent = `sampled ${ago(s.last_sample_at)} · every ${s.interval_s} s`;
  st.classList.toggle("bad", !s.ok);
  err.hidden = !s.error;
  err.textContent = s.error ? `sampling ${doc.name} failed: ${s.error} (showing the last good sample)` : "";
}

// ---- polling ------------------------------------------------------------------------------
function appendHistory(h) {
  if (!state.hist) { state.hist = h; } else {
    for (const k of Object.keys(h)) state.hist[k] = (state.hist[k] || []).concat(h[k]);
  }
  const t = state.hist.t, cut = t.length ? t[t.length - 1] - state.history : 0;
  let i = 0; while (i < t.length && t[i] < cut) i++;
  if (i) for (const k of Object.keys(state.hist)) state.hist[k] = state.hist[k].slice(i);
  if (t.length) state.since = state.hist.t[state.hist.t.length - 1];
}

async function poll() {
  const q = state.queue;
  try {
    const url = `/api/queues/${encodeURIComponent(q)}` + (state.since ? `?since=${state.since}` : "");
    const resp = await fetch(url, { cache: "no-store" });
    if (!resp.ok) throw new Error(`${resp.status} ${resp.statusText}`);
    const doc = await resp.json();
    if (q !== state.queue) return; // switched meanwhile
    appendHistory(doc.history);
    showStatus(doc);
    if (doc.queue) render(doc);
  } catch (e) {
    const st = document.getElementById("status");
    st.textContent = `dashboard unreachable: ${e.message}`; st.classList.add("bad");
  }
}

function select(q) {
  state.queue = q; state.since = null; state.hist = null;
  history.replaceState(null, "", "#" + encodeURIComponent(q));
  for (const b of document.querySelectorAll("#queues button")) b.classList.toggle("active", b.dataset.queue === q);
  clearInterval(state.timer);
  poll();
  state.timer = setInterval(poll, Math.max(500, state.interval * 1000));
}

async function loadQueues() {
  const resp = await fetch("/api/queues", { cache: "no-store" });
  if (!resp.ok) throw new Error(`${resp.status} ${resp.statusText}`);
  const data = await resp.json();
  const names = data.queues.map((q) => q.name);
  state.interval = data.interval_s; state.history = data.history_s;
  if (names.join("\n") === state.queues.join("\n")) return;
  state.queues = names;
  document.getElementById("queues").replaceChildren(...names.map((name) => {
    const b = el("button", { type: "button" }, name); b.dataset.queue = name;
    b.classList.toggle("active", name === state.queue);
    b.addEventListener("click", () => select(name));
    return b;
  }));
  if (state.queue === null && names.length) {
    const wanted = decodeURIComponent(location.hash.slice(1));
    select(names.includes(wanted) ? wanted : names[0]);
  }
}

async function main() {
  await loadQueues();
  setInterval(() => loadQueues().catch(() => {}), QUEUES_EVERY_MS); // poll() reports an unreachable dashboard
}

main().catch((e) => {
  const st = document.getElementById("status");
  st.textContent = `dashboard unreachable: ${e.message}`; st.classList.add("bad");
});
