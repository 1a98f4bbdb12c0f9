// The rollouts page: the filters, the matching rollouts newest first, each with its status.

import {api, badge, captureBadge, duration, el, fmt, show, splitBadge, stat, statusBadge, time} from "./lib.js";

const STATUSES = ["rewarded", "unrewarded", "failed", "timeout", "infra"];
const FILTERS = ["task", "split", "agent", "status", "min_reward", "max_reward", "version", "since", "until", "limit", "offset"];

export async function rolloutsPage(params) {
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
    select("status", "status", STATUSES),
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
    el("td", {class: "status"}, statusBadge(r), " ", captureBadge(r), r.has_error && r.status !== "failed" ? badge("error", "err") : "")));
  const first = page.total ? page.offset + 1 : 0, last = page.offset + page.rollouts.length;
  show(
    el("h1", {text: "Rollouts"}), form,
    el("div", {class: "summary"},
      stat("rollouts matching", fmt(page.total), "rollout-total"),
      stat("mean final reward", page.reward_mean === null ? "—" : page.reward_mean.toFixed(3), "reward-mean"),
      stat("with a reward", fmt(page.with_reward), "with-reward")),
    el("table", {id: "rollouts"},
      el("thead", {}, el("tr", {}, ["rollout", "task", "split", "agent", "policy version", "final reward", "LLM calls",
        "spans", "started (UTC)", "duration", "status"].map((h, i) => el("th", {class: [4, 5, 6, 7, 9].includes(i) ? "num" : "", text: h})))),
      el("tbody", {}, rows)),
    el("p", {class: "muted"}, `${first}–${last} of ${page.total} `,
      el("button", {class: "plain", disabled: page.offset === 0 ? "" : null,
        onclick: () => go({offset: String(Math.max(0, page.offset - page.limit))}), text: "← newer"}), " ",
      el("button", {class: "plain", disabled: last >= page.total ? "" : null,
        onclick: () => go({offset: String(page.offset + page.limit)}), text: "older →"})));
}
