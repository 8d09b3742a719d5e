// The asyncrl dashboard: polls /api/data for the run's new records and redraws its uPlot charts.
// Series are found by key, not listed: any `mismatch_*` metric and any `<metric>/lag=N` split of it in the step
// rows, and any `queue/*` or `pool/*` figure of the pool snapshots, are plotted as they appear.
"use strict";

const POLL_MS = 2000;
// The server embeds its token in the page it serves; every API call sends it (a cross-site page cannot read it).
const AUTH = { Authorization: "Bearer " + document.querySelector('meta[name="asyncrl-token"]').content };
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"];
const QUEUE_KEYS = ["queue/ready_groups", "queue/backlog_groups", "queue/groups_in_flight", "queue/groups_ahead"];

const run = { seq: 0, live: false, steps: [], evals: [], syncs: [], pools: [], notes: [], alarms: [] };
const dash = { charts: {}, run: run, polls: 0, mismatchBase: null };
window.dash = dash; // tests read the charts' data from here

function mean(values) {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : null;
}

// x = sorted distinct values of `xOf` over `rows`; one series per label, `null` where a row lacks it.
function aligned(rows, xOf, seriesOf) {
  const xs = [...new Set(rows.map(xOf).filter((x) => x !== null && x !== undefined))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const series = {};
  for (const row of rows) {
    for (const [label, value] of Object.entries(seriesOf(row))) {
      if (value === null || value === undefined) continue;
      if (!series[label]) series[label] = xs.map(() => []);
      series[label][index.get(xOf(row))].push(value);
    }
  }
  return { x: xs, series: Object.entries(series).map(([label, buckets]) => ({ label, values: buckets.map(mean) })) };
}

function rewardByVersion() {
  const rows = run.steps.map((r) => ({ version: r.version, reward: r.reward }))
    .concat(run.evals.map((e) => ({ version: e.version, "held-out accuracy": e.accuracy })));
  return aligned(rows, (r) => r.version, ({ version, ...rest }) => rest);
}

function stalenessHistogram() {
  const counts = {};
  for (const row of run.steps) {
    for (const [lag, n] of Object.entries(row.lag_counts || {})) counts[lag] = (counts[lag] || 0) + n;
  }
  const lags = Object.keys(counts).map(Number).sort((a, b) => a - b);
  return { x: lags, series: [{ label: "samples", values: lags.map((l) => counts[l]) }], bars: true };
}

function mismatchBases() {
  const bases = new Set();
  for (const row of run.steps) {
    for (const key of Object.keys(row)) if (key.startsWith("mismatch_")) bases.add(key.split("/lag=")[0]);
  }
  return [...bases].sort();
}

function mismatchByLag() {
  const bases = mismatchBases();
  if (!bases.includes(dash.mismatchBase)) dash.mismatchBase = bases.includes("mismatch_k3_kl") ? "mismatch_k3_kl" : bases[0] || null;
  const base = dash.mismatchBase;
  const pick = (row) => Object.fromEntries(Object.entries(row)
    .filter(([k]) => k === base || k.startsWith(base + "/lag="))
    .map(([k, v]) => [k === base ? "all lags" : k.slice(base.length + 1), v]));
  return aligned(run.steps, (r) => r.step, pick);
}

function poolSeries(keys, rename) {
  return aligned(run.pools, (p) => p.wall_s, (p) => Object.fromEntries(
    keys(p).filter((k) => k in p).map((k) => [rename ? rename(k) : k, p[k]])));
}

const CHARTS = [
  { id: "reward", title: "reward and held-out accuracy by version", x: "version", build: rewardByVersion },
  { id: "staleness", title: "staleness histogram (trained samples by policy lag)", x: "lag (versions)", build: stalenessHistogram },
  { id: "mismatch", title: "mismatch by staleness bucket", x: "step", build: mismatchByLag, select: mismatchBases },
  { id: "queue", title: "queue depth (groups)", x: "seconds", build: () => poolSeries(() => QUEUE_KEYS, (k) => k.slice(6)) },
  { id: "busy", title: "busy / idle fractions (run so far; window: the last rate window, what autoscaling reads)", x: "seconds",
    build: () => poolSeries(() => ["rollout_busy_fraction", "learner_idle_fraction", "learner_idle_window", "rollout_idle_window"]) },
  { id: "throughput", title: "tokens per second", x: "seconds",
    build: () => poolSeries(() => ["rollout_tokens_per_s", "learner_tokens_per_s"]) },
  { id: "sync", title: "weight sync seconds by version", x: "version",
    build: () => aligned(run.syncs, (s) => s.version, (s) => ({ "sync seconds": s.seconds })) },
  { id: "pool", title: "pool sizes (workers)", x: "seconds",
    build: () => poolSeries((p) => Object.keys(p).filter((k) => k.startsWith("pool/")), (k) => k.slice(5)) },
];

function chartBox(spec) {
  const box = document.createElement("div");
  box.className = "chart";
  box.id = "chart-" + spec.id;
  box.innerHTML = `<h2>${spec.title}</h2><div class="plot"><p class="empty">no data yet</p></div>`;
  if (spec.select) {
    const select = document.createElement("select");
    select.addEventListener("change", () => { dash.mismatchBase = select.value; draw(spec, true); });
    box.querySelector("h2").appendChild(select);
  }
  document.getElementById("charts").appendChild(box);
  return box;
}

function options(spec, built, width) {
  const series = built.series.map((s, i) => ({
    label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
    ...(built.bars ? { fill: COLORS[i % COLORS.length] + "88", paths: uPlot.paths.bars({ size: [0.6] }) } : { points: { size: 5 } }),
  }));
  return {
    width: width, height: 240, series: [{ label: spec.x }, ...series],
    axes: [{ label: spec.x, values: built.bars ? integerTicks : undefined }, { size: 60, values: (u, splits) => splits.map(tick) }],
    scales: built.bars
      ? { x: { time: false, range: (u, min, max) => [min - 0.5, max + 0.5] }, y: { range: (u, min, max) => [0, max * 1.1] } }
      : { x: { time: false }, y: { range: flatSafeRange } },
  };
}

// Small figures (mismatch KLs of 1e-4) need an exponent: the default tick labels would all read 0.001.
function tick(v) {
  if (v === 0 || v === null) return v;
  return Math.abs(v) < 0.01 || Math.abs(v) >= 1e5 ? v.toExponential(1) : String(+v.toPrecision(4));
}

const integerTicks = (u, splits) => splits.map((v) => (Number.isInteger(v) ? v : ""));

// uPlot spreads a flat series (a tiny model's reward of 0, a parity-exact mismatch of 0) over 0..100; keep it near its value.
function flatSafeRange(u, min, max) {
  if (min === max) return [min - 1, max + 1];
  return uPlot.rangeNum(min, max, 0.1, true);
}

function fillSelect(spec, box) {
  const select = box.querySelector("select");
  const names = spec.select();
  if (select.options.length === names.length) return;
  select.innerHTML = names.map((n) => `<option${n === dash.mismatchBase ? " selected" : ""}>${n}</option>`).join("");
}

// Redraws one chart; a chart whose set of series changed (a new lag bucket, a new engine) is rebuilt.
function draw(spec, rebuild) {
  const box = document.getElementById("chart-" + spec.id) || chartBox(spec);
  const built = spec.build();
  if (spec.select) fillSelect(spec, box);
  if (!built.x.length || !built.series.length) return;
  const data = [built.x, ...built.series.map((s) => s.values)];
  const labels = built.series.map((s) => s.label).join("|");
  const old = dash.charts[spec.id];
  if (old && old.labels === labels && !rebuild) return old.setData(data);
  if (old) old.destroy();
  const plot = box.querySelector(".plot");
  plot.innerHTML = "";
  dash.charts[spec.id] = new uPlot(options(spec, built, Math.max(300, plot.clientWidth)), data, plot);
  dash.charts[spec.id].labels = labels;
}

const esc = (text) => String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const fmt = (v, d = 3) => (v === null || v === undefined ? "-" : Number(v).toFixed(d));

function drawStatus() {
  const last = run.steps[run.steps.length - 1];
  const acc = run.evals[run.evals.length - 1];
  const parts = [run.live ? "running" : "finished"];
  if (last) parts.push(`step ${last.step}`, `v${last.version}`, `reward ${fmt(last.reward)}`, `staleness ${fmt(last.staleness_mean, 2)}`);
  if (acc) parts.push(`held-out ${fmt(acc.accuracy)}`);
  if (!last && run.notes.length) parts.push(run.notes[run.notes.length - 1].text);
  document.getElementById("status").textContent = parts.join(" · ");
  document.getElementById("scale").hidden = !run.live;
}

function drawPanels() {
  const time = (t) => new Date(t * 1000).toLocaleTimeString();
  document.querySelector("#alarms tbody").innerHTML = run.alarms.map((a) =>
    `<tr class="${a.active === false ? "cleared" : a.stop ? "stop" : ""}"><td>${time(a.time)}</td>` +
    `<td>${esc(a.name)}${a.active === false ? " (back within)" : ""}</td><td>${fmt(a.value, 4)}</td>` +
    `<td>${fmt(a.threshold, 4)}</td><td>${esc(a.message)}</td></tr>`).join("");
  document.getElementById("notes").innerHTML = run.notes.map((n) => `<li>${time(n.time)} ${esc(n.text)}</li>`).join("");
  const pool = run.pools[run.pools.length - 1];
  if (pool) {
    document.getElementById("pool-sizes").textContent = Object.keys(pool).filter((k) => k.startsWith("pool/"))
      .map((k) => `${k.slice(5)}: ${pool[k]}`).join(", ");
  }
}

const BY_KIND = { step: run.steps, eval: run.evals, sync: run.syncs, pool: run.pools, note: run.notes, phase: run.notes, alarm: run.alarms };

async function poll() {
  try {
    const reply = await (await fetch(`/api/data?since=${run.seq}`, { headers: AUTH })).json();
    for (const rec of reply.records) if (BY_KIND[rec.kind]) BY_KIND[rec.kind].push(rec.data);
    run.seq = reply.seq;
    run.live = reply.live;
    document.getElementById("title").textContent = reply.title;
    if (reply.records.length || dash.polls === 0) redraw();
    dash.polls += 1;
  } catch (e) {
    document.getElementById("status").textContent = `no answer from the run (${e})`;
  }
  if (run.live || dash.polls < 2) setTimeout(poll, POLL_MS);
}

function redraw() {
  for (const spec of CHARTS) draw(spec, false);
  drawStatus();
  drawPanels();
}

async function scale(event) {
  event.preventDefault();
  const n = Number(document.getElementById("scale-n").value);
  const pool = document.getElementById("scale-pool").value;
  const reply = await fetch("/api/scale", { method: "POST", headers: { ...AUTH, "Content-Type": "application/json" }, body: JSON.stringify({ [pool]: n }) });
  const body = await reply.json();
  const unit = pool === "learner" ? "learner rank(s)" : "rollout worker(s)";
  document.getElementById("scale-result").textContent = reply.ok ? `asked for ${body[pool]} ${unit}` : body.error;
}

document.getElementById("scale").addEventListener("submit", scale);
poll();
