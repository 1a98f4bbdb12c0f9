// lightspan web UI: plain JavaScript, no build step. Every element is built with textContent,
// never innerHTML: span data (messages, tool calls, names) is shown, never run.
"use strict";

const main = document.getElementById("main");
const statusLine = document.getElementById("status");
let pollTimer = null;

// ---- small helpers -----------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "—";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e15) return v.toLocaleString("en-US");
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return v.toFixed(digits);
}

function fixed(v, digits = 3) { return v === null || v === undefined ? "—" : v.toFixed(digits); }

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function time(ns) {
  if (!ns) return "—";
  return new Date(ns / 1e6).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function duration(ns) {
  if (ns === null || ns === undefined) return "—";
  const ms = ns / 1e6;
  return ms < 1000 ? `${ms.toFixed(ms < 10 ? 2 : 0)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function badge(text, cls) { return el("span", {class: `badge ${cls || ""}`, text}); }
function splitBadge(split) { return split ? badge(split, split === "val" ? "val" : split === "train" ? "train" : "") : ""; }

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path) {
  const headers = {};
  const token = sessionStorage.getItem("lightspan-token");
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path, {headers});
  if (response.status === 401) {
    document.getElementById("token-form").hidden = false;
    throw new HttpError(401, "the collector asks for its bearer token (below)");
  }
  const doc = await response.json();
  if (!response.ok) throw new HttpError(response.status, doc.error || response.statusText);
  return doc;
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("lightspan-token", document.getElementById("token").value.trim());
  document.getElementById("token-form").hidden = true;
  route();
});

function show(...nodes) {
  main.replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined && n !== ""));
  main.dataset.state = "ready";
}

function showError(err) {
  // a failed request is part of the page, not an uncaught error
  main.replaceChildren(el("p", {class: "error", id: "error", text: `Error: ${err.message}`}));
  main.dataset.state = "error";
}

function stat(label, value, id) {
  return el("div", {class: "stat"}, el("div", {class: "label", text: label}), el("div", {class: "value", id, text: value}));
}

// ---- charts (SVG) ------------------------------------------------------------------------------

const COLORS = ["#2f6fdf", "#9b4dca", "#e08a1a", "#238a4a", "#c8362f", "#138d90"];

function niceTicks(lo, hi, n = 4) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const step0 = (hi - lo) / n;
  const mag = 10 ** Math.floor(Math.log10(step0));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
  return ticks;
}

// series: [{name, points: [[x, y], ...]}]; null y values are gaps
function lineChart(title, series, {xLabel = "step", id} = {}) {
  const W = 420, H = 180, L = 46, R = 10, T = 8, B = 24;
  const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
  const box = el("div", {class: "chart", id, "data-points": String(pts.length)}, el("h3", {text: title}));
  if (!pts.length) {
    box.append(el("p", {class: "muted", text: "no data yet"}));
    return box;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const yt = niceTicks(y0, y1);
  y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": title});
  for (const t of yt) {
    root.append(svg("line", {class: "grid", x1: L, x2: W - R, y1: sy(t), y2: sy(t)}));
    root.append(svg("text", {x: L - 4, y: sy(t) + 3, "text-anchor": "end"}, fmt(t, 3)));
  }
  const integral = pts.every((p) => Number.isInteger(p[0]));    // steps and versions: no 0.5 ticks
  for (const t of niceTicks(x0, x1, 5).filter((t) => t >= x0 && t <= x1 && (!integral || Number.isInteger(t)))) {
    root.append(svg("text", {x: sx(t), y: H - 8, "text-anchor": "middle"}, fmt(t, 1)));
  }
  root.append(svg("line", {class: "axis", x1: L, x2: L, y1: T, y2: H - B}));
  root.append(svg("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}));
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    let d = "", pen = false;
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)} `;
      pen = true;
    }
    if (d) root.append(svg("path", {class: "line", d, stroke: color}));
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) continue;
      const dot = svg("circle", {cx: sx(x), cy: sy(y), r: 2.5, fill: color});
      dot.append(svg("title", {}, `${s.name}: ${xLabel} ${fmt(x)} → ${fmt(y, 4)}`));
      root.append(dot);
    }
  });
  box.append(root);
  const keys = el("div", {class: "keys"});
  if (series.length > 1) {
    series.forEach((s, i) => {
      const key = el("span", {text: s.name});
      key.style.setProperty("--c", s.color || COLORS[i % COLORS.length]);
      keys.append(key);
    });
  }
  keys.append(el("em", {class: "muted", text: `x: ${xLabel}`}));
  box.append(keys);
  return box;
}

// ---- page: rollouts ----------------------------------------------------------------------------

const FILTERS = ["task", "split", "agent", "min_reward", "max_reward", "version", "since", "until", "limit", "offset"];

async function rolloutsPage(params) {
  const query = new URLSearchParams();
  for (const name of FILTERS) if (params.get(name)) query.set(name, params.get(name));
  const [facets, page] = await Promise.all([api("/api/ui/facets"), api(`/api/ui/rollouts?${query}`)]);
  const go = (changes) => {
    const next = new URLSearchParams(query);
    for (const [k, v] of Object.entries(changes)) { if (v === "" || v === null) next.delete(k); else next.set(k, v); }
    location.hash = `#/rollouts?${next}`;
  };
  const select = (name, label, values) => el("label", {}, label,
    el("select", {name}, el("option", {value: "", text: "any"}),
      values.map((v) => el("option", {value: String(v), text: String(v), selected: String(v) === query.get(name) ? "" : null}))));
  const input = (name, label, placeholder) => el("label", {}, label,
    el("input", {name, value: query.get(name) || "", placeholder, size: 10}));
  const form = el("form", {class: "filters card", id: "filters"},
    select("task", "task", facets.tasks), select("split", "split", facets.splits),
    select("agent", "agent", facets.agents), select("version", "policy version", facets.versions),
    input("min_reward", "reward ≥", "e.g. 0.5"), input("max_reward", "reward ≤", ""),
    input("since", "since", "1h, 2026-01-31T12:00Z"), input("until", "until", ""),
    el("button", {type: "submit", text: "Filter"}),
    el("button", {type: "button", class: "plain", text: "Clear", onclick: () => { location.hash = "#/rollouts"; }}));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const changes = {offset: ""};
    for (const field of form.querySelectorAll("select, input")) changes[field.name] = field.value.trim();
    go(changes);
  });
  const rows = page.rollouts.map((r) => el("tr", {class: "clickable rollout-row", "data-key": r.rollout_key,
      onclick: () => { location.hash = `#/rollout/${encodeURIComponent(r.rollout_key)}`; }},
    el("td", {class: "mono"}, el("a", {href: `#/rollout/${encodeURIComponent(r.rollout_key)}`, text: r.rollout_key})),
    el("td", {text: r.task_id || "—"}), el("td", {}, splitBadge(r.split)),
    el("td", {text: (r.agents && r.agents.length ? r.agents.join(", ") : r.service_name) || "—"}),
    el("td", {class: "num", text: fmt(r.model_version)}),
    el("td", {class: "num reward", text: r.final_reward === null ? "—" : r.final_reward.toFixed(3)}),
    el("td", {class: "num", text: fmt(r.num_llm_calls)}), el("td", {class: "num", text: fmt(r.num_spans)}),
    el("td", {text: time(r.start_time_unix_nano)}),
    el("td", {class: "num", text: duration(r.end_time_unix_nano - r.start_time_unix_nano)}),
    el("td", {}, r.has_error ? badge("error", "err") : "")));
  const first = page.total ? page.offset + 1 : 0, last = page.offset + page.rollouts.length;
  show(
    el("h1", {text: "Rollouts"}), form,
    el("div", {class: "summary"},
      stat("rollouts matching", fmt(page.total), "rollout-total"),
      stat("mean final reward", page.reward_mean === null ? "—" : page.reward_mean.toFixed(3), "reward-mean"),
      stat("with a reward", fmt(page.with_reward), "with-reward")),
    el("table", {id: "rollouts"},
      el("thead", {}, el("tr", {}, ["rollout", "task", "split", "agent", "policy version", "final reward", "LLM calls",
        "spans", "started (UTC)", "duration", ""].map((h, i) => el("th", {class: [4, 5, 6, 7, 9].includes(i) ? "num" : "", text: h})))),
      el("tbody", {}, rows)),
    el("p", {class: "muted"}, `${first}–${last} of ${page.total} `,
      el("button", {class: "plain", disabled: page.offset === 0 ? "" : null,
        onclick: () => go({offset: String(Math.max(0, page.offset - page.limit))}), text: "← newer"}), " ",
      el("button", {class: "plain", disabled: last >= page.total ? "" : null,
        onclick: () => go({offset: String(page.offset + page.limit)}), text: "older →"})));
}

// ---- page: one rollout -------------------------------------------------------------------------

function parseAttr(v) { try { return JSON.parse(v); } catch (e) { return v; } }

// OTel GenAI messages ({role, parts: [{type, content | name, arguments | response}]}) and the
// older OpenAI shape ({role, content, tool_calls}); anything else is shown as JSON
function messageNodes(messages) {
  if (messages === null || messages === undefined) return [];
  if (!Array.isArray(messages)) return [el("div", {class: "msg"}, typeof messages === "string" ? messages : JSON.stringify(messages, null, 2))];
  return messages.map((m) => {
    const role = (m && m.role) || "message";
    const node = el("div", {class: `msg role-${role}`}, el("span", {class: "role", text: role + (m.finish_reason ? ` · finish: ${m.finish_reason}` : "")}));
    const parts = Array.isArray(m.parts) ? m.parts : [];
    if (typeof m.content === "string") parts.push({type: "text", content: m.content});
    else if (Array.isArray(m.content)) for (const c of m.content) parts.push({type: c.type === "text" ? "text" : "json", content: c.text || c});
    for (const call of m.tool_calls || []) {
      const fn = call.function || call;
      parts.push({type: "tool_call", id: call.id, name: fn.name, arguments: fn.arguments});
    }
    if (m.tool_call_id) parts.unshift({type: "tool_call_response_id", id: m.tool_call_id});
    for (const p of parts) {
      if (p.type === "text") node.append(el("div", {text: String(p.content ?? "")}));
      else if (p.type === "reasoning") node.append(el("div", {class: "muted", text: `reasoning: ${p.content ?? ""}`}));
      else if (p.type === "tool_call") {
        let args = p.arguments;
        if (typeof args === "string") args = parseAttr(args);
        node.append(el("div", {class: "tool-call"}, `tool call ${p.name || "?"}${p.id ? ` (${p.id})` : ""}\n`,
          typeof args === "string" ? args : JSON.stringify(args, null, 2)));
      } else if (p.type === "tool_call_response") {
        node.append(el("div", {class: "tool-call"}, `tool result${p.id ? ` (${p.id})` : ""}\n`,
          typeof p.response === "string" ? p.response : JSON.stringify(p.response, null, 2)));
      } else if (p.type === "tool_call_response_id") node.append(el("div", {class: "muted mono", text: `result of ${p.id}`}));
      else node.append(el("div", {class: "mono", text: JSON.stringify(p)}));
    }
    return node;
  });
}

// logprob 0 -> green, -5 and below -> red
function logprobColor(lp) {
  const t = Math.max(0, Math.min(1, (lp + 5) / 5));
  return `hsl(${Math.round(t * 120)}, 70%, 82%)`;
}

function tokenNodes(span) {
  const ids = span.completion_token_ids || [], lps = span.completion_logprobs || [];
  const texts = span.completion_tokens;
  const box = el("div", {class: "tokens", "data-tokens": String(ids.length)});
  ids.forEach((id, i) => {
    const lp = lps[i];
    const text = texts ? texts[i] : String(id);
    const tok = el("span", {class: "tok", title: `token ${id} · logprob ${fmt(lp, 4)} · p ${lp === undefined || lp === null ? "—" : Math.exp(lp).toFixed(3)}`,
      text: texts ? text : `${text} `});
    if (lp !== undefined && lp !== null) tok.style.background = logprobColor(lp);
    box.append(tok);
  });
  return box;
}

function callCard(span) {
  const t = span.transition;
  const head = el("div", {class: "call-head"},
    el("strong", {text: `LLM call #${span.call_index}`}), el("span", {class: "mono", text: span.name}),
    el("span", {text: `model ${span.response_model || span.request_model || "—"}`}),
    el("span", {text: `policy version ${fmt(span.model_version)}`}),
    el("span", {text: `tokens in/out ${fmt(span.num_prompt_tokens ?? span.input_tokens)} / ${fmt((span.completion_token_ids || []).length || span.output_tokens)}`}),
    el("span", {class: "matched-reward", text: `reward matched ${span.matched_reward === null || span.matched_reward === undefined ? "—" : span.matched_reward.toFixed(3)}`}),
    el("span", {class: "credit", text: t ? `credit ${fixed(t.credit)} (${t.credit_policy})` : "no transition built"}),
    t ? el("span", {class: "advantage", text: `advantage ${fixed(t.advantage)} (${t.advantage_estimator})`}) : "",
    span.capture_status && span.capture_status !== "ok" ? badge(`capture: ${span.capture_status}`, "err") : "");
  const body = el("div", {class: "call-body"},
    el("h2", {text: "Messages"}), messageNodes(span.input_messages), messageNodes(span.output_messages));
  if ((span.completion_token_ids || []).length) {
    body.append(el("h2", {text: span.completion_tokens ? "Completion tokens by logprob" : "Completion token ids by logprob (no tokenizer found)"}),
      el("div", {class: "legend"}, "logprob ≤ −5", el("span", {class: "grad"}), "0 (p = 1); hover a token for its id and logprob"),
      tokenNodes(span));
  }
  return el("section", {class: "call", "data-call-index": String(span.call_index)}, head, body);
}

function spanDetail(span) {
  const attrs = Object.entries(span.attributes || {}).map(([k, v]) => el("tr", {}, el("td", {class: "mono", text: k}),
    el("td", {class: "mono", text: typeof parseAttr(v) === "string" ? parseAttr(v) : JSON.stringify(parseAttr(v))})));
  return el("div", {class: "span-detail"},
    el("div", {class: "mono", text: `trace ${span.trace_id} · span ${span.span_id} · parent ${span.parent_span_id || "—"} · ${span.kind} · service ${span.service_name} · scope ${span.scope_name}`}),
    el("div", {text: `status ${span.status_code}${span.status_message ? `: ${span.status_message}` : ""}`}),
    attrs.length ? el("table", {}, el("tbody", {}, attrs)) : "");
}

function waterfall(doc) {
  const spans = doc.spans;
  const byParent = new Map();
  for (const s of spans) {
    const key = s.is_root ? "" : `${s.trace_id}/${s.parent_span_id}`;
    if (!byParent.has(key)) byParent.set(key, []);
    byParent.get(key).push(s);
  }
  const t0 = doc.start_time_unix_nano, total = Math.max(1, doc.end_time_unix_nano - t0);
  const box = el("div", {class: "waterfall", id: "waterfall"});
  const walk = (span, depth) => {
    const start = span.start_time_unix_nano - t0, dur = Math.max(0, span.end_time_unix_nano - span.start_time_unix_nano);
    const kind = span.status_code === "ERROR" ? "error" : span.call_index !== null && span.call_index !== undefined ? "llm"
      : span.reward !== null ? "reward" : "";
    const bar = el("div", {class: `span-bar ${kind}`});
    bar.style.left = `${(start / total * 100).toFixed(3)}%`;
    bar.style.width = `${(dur / total * 100).toFixed(3)}%`;
    const name = el("div", {class: "span-name", title: span.name},
      span.name, span.reward !== null ? el("span", {class: "muted", text: ` = ${fmt(span.reward, 3)}`}) : "");
    name.style.paddingLeft = `${8 + depth * 16}px`;
    let detail = null;
    const row = el("div", {class: "span-row", "data-span-id": span.span_id, "data-depth": String(depth),
      onclick: () => {
        if (detail) { detail.remove(); detail = null; row.classList.remove("selected"); return; }
        detail = spanDetail(span); row.after(detail); row.classList.add("selected");
      }}, name, el("div", {class: "span-track"}, bar), el("div", {class: "span-dur", text: duration(dur)}));
    box.append(row);
    const children = byParent.get(`${span.trace_id}/${span.span_id}`) || [];
    for (const child of children) walk(child, depth + 1);
  };
  for (const root of byParent.get("") || []) walk(root, 0);
  return box;
}

async function rolloutPage(key) {
  const doc = await api(`/api/ui/rollouts/${encodeURIComponent(key)}`);
  const calls = doc.spans.filter((s) => s.call_index !== null && s.call_index !== undefined)
    .sort((a, b) => a.call_index - b.call_index);
  const transitions = doc.transitions.length ? el("table", {id: "transitions"},
    el("thead", {}, el("tr", {}, ["transition", "call", "policy version", "reward", "credit", "advantage", "credit policy", "estimator", "tokens"]
      .map((h) => el("th", {text: h})))),
    el("tbody", {}, doc.transitions.map((t) => el("tr", {},
      el("td", {class: "mono", text: t.transition_id}), el("td", {class: "num", text: fmt(t.call_index)}),
      el("td", {class: "num", text: fmt(t.model_version)}), el("td", {class: "num", text: fmt(t.reward, 3)}),
      el("td", {class: "num", text: fmt(t.credit, 3)}), el("td", {class: "num", text: fmt(t.advantage, 3)}),
      el("td", {text: t.credit_policy}), el("td", {text: t.advantage_estimator}),
      el("td", {class: "num", text: fmt(t.num_completion_tokens)})))))
    : el("p", {class: "muted", text: "No transitions built from this rollout yet (lightspan transitions build)."});
  show(
    el("p", {}, el("a", {href: "#/rollouts", text: "← rollouts"})),
    el("h1", {}, "Rollout ", el("span", {class: "mono", id: "rollout-key", text: doc.rollout_key})),
    el("div", {class: "summary"},
      stat("task", doc.task_id || "—"), stat("split", doc.split || "—"),
      stat("final reward", doc.final_reward === null ? "—" : doc.final_reward.toFixed(3), "final-reward"),
      stat("policy version", fmt(doc.model_version)), stat("LLM calls", fmt(doc.num_llm_calls)),
      stat("spans", fmt(doc.spans.length), "span-count"),
      stat("duration", duration(doc.end_time_unix_nano - doc.start_time_unix_nano))),
    doc.truncated ? el("p", {class: "error", text: "Only the first spans are shown."}) : "",
    el("h2", {text: "Span tree"}), waterfall(doc),
    el("h2", {text: "Rewards"}),
    doc.rewards.length ? el("table", {id: "rewards"}, el("tbody", {}, doc.rewards.map((r) => el("tr", {},
      el("td", {text: r.reward_name}), el("td", {class: "num", text: fmt(r.reward, 3)}), el("td", {text: time(r.time_unix_nano)})))))
      : el("p", {class: "muted", text: "No reward recorded."}),
    el("h2", {text: `LLM calls (${calls.length})`}), calls.map(callCard),
    el("h2", {text: "Transitions"}), transitions);
}

// ---- page: training ----------------------------------------------------------------------------

async function trainingPage(params) {
  const run = params.get("run");
  const doc = await api(`/api/ui/training${run ? `?run=${encodeURIComponent(run)}` : ""}`);
  const steps = doc.steps;
  const by = (key) => steps.map((s) => [s.step, s[key]]);
  const versions = (split) => doc.reward_by_version.filter((r) => r.split === split && r.policy_version !== null
      && r.policy === doc.policy)
    .map((r) => [r.policy_version, r.reward_mean]);
  const runPicker = el("select", {id: "run", onchange: (e) => { location.hash = `#/training?run=${encodeURIComponent(e.target.value)}`; }},
    doc.runs.map((r) => el("option", {value: r.run_id, selected: r.run_id === doc.run_id ? "" : null,
      text: `${r.policy ? `${r.policy} · ` : ""}${r.run_id.slice(0, 12)} · ${r.steps} steps · v${r.policy_version} · ${time(r.last_time_unix_nano)}`})));
  const last = steps[steps.length - 1];
  show(
    el("h1", {text: "Training"}),
    doc.runs.length ? el("div", {class: "filters card"}, el("label", {}, "run", runPicker))
      : el("p", {class: "muted", id: "no-runs", text: "No training steps yet (lightspan train writes them)."}),
    el("div", {class: "summary"},
      ...(doc.policy ? [stat("policy", doc.policy, "policy-name")] : []),
      stat("steps", fmt(steps.length), "step-count"), stat("policy version", fmt(last && last.policy_version), "policy-version"),
      stat("last train reward", last ? fmt(last.reward_mean, 3) : "—", "last-reward"),
      stat("last loss", last ? fmt(last.loss, 4) : "—")),
    el("div", {class: "charts"},
      lineChart(`Reward per ${doc.policy ? `${doc.policy} ` : ""}policy version (rollouts' final reward)`, [
        {name: "train", points: versions("train")}, {name: "val", points: versions("val")}], {xLabel: "policy version", id: "chart-reward-version"}),
      lineChart("Train reward (batch mean)", [{name: "reward", points: by("reward_mean")}], {id: "chart-reward"}),
      lineChart("Loss", [{name: "loss", points: by("loss")}], {id: "chart-loss"}),
      lineChart("KL to the reference", [{name: "kl", points: by("kl")}], {id: "chart-kl"}),
      lineChart("Clip ratio", [{name: "clip", points: by("clip_ratio")}], {id: "chart-clip"}),
      lineChart("Entropy (nats/token)", [{name: "entropy", points: by("entropy")}], {id: "chart-entropy"}),
      lineChart("IS ratio (mean)", [{name: "is", points: by("is_ratio_mean")}], {id: "chart-is"}),
      lineChart("Tokens / s", [{name: "tokens/s", points: by("tokens_per_second")}], {id: "chart-tps"}),
      lineChart("Staleness (versions)", [{name: "staleness", points: by("staleness_mean")}], {id: "chart-staleness"}),
      lineChart("Weight-sync latency (s)", [{name: "sync", points: by("sync_seconds")}], {id: "chart-sync"})),
    el("h2", {text: "Steps"}),
    el("table", {id: "steps"},
      el("thead", {}, el("tr", {}, ["step", "version", "time (UTC)", "transitions", "tokens", "reward", "loss", "KL", "clip", "entropy",
        "IS ratio", "tokens/s", "staleness", "skipped stale", "step s", "sync s"].map((h) => el("th", {class: "num", text: h})))),
      el("tbody", {}, steps.slice().reverse().slice(0, 200).map((s) => el("tr", {class: "step-row"},
        [s.step, s.policy_version].map((v) => el("td", {class: "num", text: fmt(v)})),
        el("td", {class: "num", text: time(s.time_unix_nano)}),
        [s.num_transitions, s.num_tokens].map((v) => el("td", {class: "num", text: fmt(v)})),
        [s.reward_mean, s.loss, s.kl, s.clip_ratio, s.entropy, s.is_ratio_mean].map((v) => el("td", {class: "num", text: fmt(v, 4)})),
        [s.tokens_per_second, s.staleness_mean].map((v) => el("td", {class: "num", text: fmt(v, 1)})),
        el("td", {class: "num", text: fmt(s.skipped_stale)}),
        [s.step_seconds, s.sync_seconds].map((v) => el("td", {class: "num", text: fmt(v, 2)})))))));
}

// ---- page: collector health --------------------------------------------------------------------

const history = [];

async function healthPage() {
  const doc = await api("/api/ui/health");
  history.push([history.length ? history[history.length - 1][0] + 2 : 0, doc.rates.spans_per_second]);
  if (history.length > 150) history.shift();
  const c = doc.counters;
  const q = doc.limits.max_queue_bytes ? ` (${(100 * doc.queue_bytes / doc.limits.max_queue_bytes).toFixed(1)}% of max)` : "";
  show(
    el("h1", {text: "Collector"}),
    el("div", {class: "summary"},
      stat("state", doc.running ? "running" : "stopping", "state"),
      stat("ingest (spans/s, 60 s)", doc.rates.spans_per_second === null ? "—" : fmt(doc.rates.spans_per_second, 1), "ingest-rate"),
      stat("spans accepted", fmt(c.spans_accepted_total), "spans-accepted"),
      stat("refused requests", fmt(doc.refused_total), "refused-total"),
      stat("queue depth", bytes(doc.queue_bytes) + q, "queue-bytes"),
      stat("WAL size", bytes(doc.wal_bytes), "wal-bytes"),
      stat("flush (mean)", doc.flush_seconds_mean === null ? "—" : `${(doc.flush_seconds_mean * 1000).toFixed(1)} ms`),
      stat("fsync (mean)", doc.fsync_seconds_mean === null ? "—" : `${(doc.fsync_seconds_mean * 1000).toFixed(2)} ms`)),
    el("div", {class: "charts"}, lineChart("Ingest rate (spans/s) while this page is open", [{name: "spans/s", points: history.slice()}], {xLabel: "seconds", id: "chart-ingest"})),
    el("h2", {text: "Refusals by reason"}),
    el("table", {id: "refusals"}, el("tbody", {}, Object.entries(doc.refused).map(([reason, n]) =>
      el("tr", {}, el("td", {text: reason}), el("td", {class: "num", text: fmt(n)}))))),
    el("h2", {text: "Counters"}),
    el("table", {id: "counters"}, el("tbody", {}, Object.entries(c).map(([name, n]) =>
      el("tr", {}, el("td", {class: "mono", text: `lightspan_collector_${name}`}), el("td", {class: "num", text: fmt(n)}))))));
  statusLine.textContent = `updated ${new Date().toISOString().slice(11, 19)}Z`;
}

// ---- router ------------------------------------------------------------------------------------

async function route() {
  clearTimeout(pollTimer);
  const hash = location.hash.replace(/^#/, "") || "/rollouts";
  const [path, query] = hash.split("?");
  const params = new URLSearchParams(query || "");
  const page = path.split("/")[1];
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.page === (page === "rollout" ? "rollouts" : page));
  main.dataset.state = "loading";
  statusLine.textContent = "";
  try {
    if (page === "rollout") await rolloutPage(decodeURIComponent(path.slice("/rollout/".length)));
    else if (page === "training") await trainingPage(params);
    else if (page === "health") {
      await healthPage();
      const tick = async () => {
        if (!location.hash.startsWith("#/health")) return;
        try { await healthPage(); } catch (err) { showError(err); }
        pollTimer = setTimeout(tick, 2000);
      };
      pollTimer = setTimeout(tick, 2000);
    } else await rolloutsPage(params);
  } catch (err) {
    showError(err);
  }
}

window.addEventListener("hashchange", route);
route();
