// Helpers every page uses: element builders, number and time formats, the collector's API.
// Every element is built with textContent, never innerHTML: span data (messages, tool calls,
// names) is shown, never run.

export const main = document.getElementById("main");
export const statusLine = document.getElementById("status");

export function el(tag, attrs, ...children) {
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
export function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

export function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "—";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e15) return v.toLocaleString("en-US");
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return v.toFixed(digits);
}

export function fixed(v, digits = 3) { return v === null || v === undefined ? "—" : v.toFixed(digits); }

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

export function time(ns) {
  if (!ns) return "—";
  return new Date(ns / 1e6).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

export function duration(ns) {
  if (ns === null || ns === undefined) return "—";
  const ms = ns / 1e6;
  return ms < 1000 ? `${ms.toFixed(ms < 10 ? 2 : 0)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

export function badge(text, cls, title) { return el("span", {class: `badge ${cls || ""}`, text, title}); }
export function splitBadge(split) { return split ? badge(split, split === "val" ? "val" : split === "train" ? "train" : "") : ""; }

// a rollout's status (the rollouts view): failed and timed-out rollouts are not a reward of 0
const STATUS_CLASS = {rewarded: "train", unrewarded: "", failed: "err", timeout: "err"};
export function statusBadge(row) {
  if (!row.status) return "";
  const exit = row.exit_code !== null && row.exit_code !== undefined && row.status === "failed" ? ` (exit ${row.exit_code})` : "";
  return badge(row.status + exit, `status ${STATUS_CLASS[row.status] ?? ""}`);
}
export function captureBadge(row) {
  return row.num_uncaptured_calls ? badge(`${row.num_uncaptured_calls} uncaptured: ${row.capture_problem}`, "err capture", row.capture_reason) : "";
}

export class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers(extra) {
  const out = {...extra};
  const token = sessionStorage.getItem("lightspan-token");
  if (token) out.Authorization = `Bearer ${token}`;
  return out;
}

async function answer(response) {
  if (response.status === 401) {
    document.getElementById("token-form").hidden = false;
    throw new HttpError(401, "the collector asks for its bearer token (below)");
  }
  const doc = await response.json();
  if (!response.ok) throw new HttpError(response.status, doc.error || response.statusText);
  return doc;
}

export async function api(path) {
  return answer(await fetch(path, {headers: headers()}));
}

// POST a JSON body to the collector's own API (same origin, the same bearer token)
export async function post(path, body) {
  return answer(await fetch(path, {method: "POST", headers: headers({"Content-Type": "application/json"}),
                                   body: JSON.stringify(body)}));
}

export function show(...nodes) {
  main.replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined && n !== ""));
  main.dataset.state = "ready";
}

export function showError(err) {
  // a failed request is part of the page, not an uncaught error
  main.replaceChildren(el("p", {class: "error", id: "error", text: `Error: ${err.message}`}));
  main.dataset.state = "error";
}

export function stat(label, value, id) {
  return el("div", {class: "stat"}, el("div", {class: "label", text: label}), el("div", {class: "value", id, text: value}));
}
