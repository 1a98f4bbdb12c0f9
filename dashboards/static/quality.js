// The quality page: pass@k (at least one of k tries succeeds) and pass^k (all k succeed) per policy
// version and task, over rollouts whose outcome is known (failed and timed-out ones count as
// failures, unrewarded ones not at all), and how well the judge's scores agree with people's.

import {lineChart} from "./charts.js";
import {api, el, fixed, fmt, show, stat} from "./lib.js";

export async function qualityPage(params) {
  const query = new URLSearchParams();
  for (const name of ["k", "threshold"]) if (params.get(name)) query.set(name, params.get(name));
  const doc = await api(`/api/ui/quality?${query}`);
  const form = el("form", {class: "filters card", id: "quality-form"},
    el("label", {}, "k", el("select", {name: "k"}, [...new Set([...doc.k_shown, doc.k])].sort((a, b) => a - b)
      .map((k) => el("option", {value: String(k), text: String(k), selected: k === doc.k ? "" : null})))),
    el("label", {}, "success: final reward ≥", el("input", {name: "threshold", value: String(doc.threshold), size: 6})),
    el("button", {type: "submit", text: "Show"}));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const field of form.querySelectorAll("select, input")) if (field.value.trim()) next.set(field.name, field.value.trim());
    location.hash = `#/quality?${next}`;
  });
  const at = doc.by_version.filter((r) => r.k === doc.k && r.model_version !== null);
  const series = (split, key, name) => ({name, points: at.filter((r) => r.split === split).map((r) => [r.model_version, r[key]])});
  const a = doc.agreement;
  show(
    el("h1", {text: "Quality"}), form,
    el("div", {class: "charts"},
      lineChart(`pass@${doc.k} and pass^${doc.k} per policy version (mean over tasks)`, [
        series("train", "pass_at_k", `pass@${doc.k} train`), series("train", "pass_hat_k", `pass^${doc.k} train`),
        series("val", "pass_at_k", `pass@${doc.k} val`), series("val", "pass_hat_k", `pass^${doc.k} val`)],
        {xLabel: "policy version", id: "chart-pass-k"}),
      lineChart("Judge − human score per policy version (mean over rollouts both scored)",
        [{name: "judge − human", points: doc.judge_drift.filter((r) => r.model_version !== null)
          .map((r) => [r.model_version, r.judge_minus_human])}], {xLabel: "policy version", id: "chart-judge-drift"})),
    el("h2", {text: "pass@k and pass^k per policy version"}),
    el("table", {id: "pass-by-version"},
      el("thead", {}, el("tr", {}, ["policy version", "split", "k", "tasks", "pass@k", "pass^k"].map((h) => el("th", {text: h})))),
      el("tbody", {}, doc.by_version.map((r) => el("tr", {class: "pass-row"},
        [r.model_version, r.split, r.k, r.tasks].map((v) => el("td", {text: fmt(v)})),
        [r.pass_at_k, r.pass_hat_k].map((v) => el("td", {class: "num", text: fixed(v, 3)})))))),
    el("h2", {text: `Per task, k = ${doc.k}`}),
    doc.tasks.length ? el("table", {id: "pass-by-task"},
      el("thead", {}, el("tr", {}, ["task", "policy version", "split", "rollouts (n)", "succeeded (c)", `pass@${doc.k}`, `pass^${doc.k}`]
        .map((h) => el("th", {text: h})))),
      el("tbody", {}, doc.tasks.map((r) => el("tr", {class: "task-row"},
        [r.task_id, r.model_version, r.split, r.n, r.c].map((v) => el("td", {text: fmt(v)})),
        [r.pass_at_k, r.pass_hat_k].map((v) => el("td", {class: "num", text: fixed(v, 3)}))))))
      : el("p", {class: "muted", text: `No task has ${doc.k} rollouts with a known outcome yet.`}),
    el("h2", {text: "Judge and human agreement"}),
    el("div", {class: "summary"},
      stat("rollouts scored by both", fmt(a.rollouts), "agreement-count"),
      stat("mean |judge − human|", fixed(a.mean_abs_difference, 3), "agreement-mae"),
      stat("correlation", fixed(a.correlation, 3), "agreement-corr"),
      stat(`agree on success (≥ ${fmt(doc.threshold)})`, a.success_agreement === null ? "—" : `${(100 * a.success_agreement).toFixed(0)}%`,
        "agreement-success")),
    doc.pairs.length ? el("table", {id: "agreement"},
      el("thead", {}, el("tr", {}, ["rollout", "task", "policy version", "judge", "human"].map((h) => el("th", {text: h})))),
      el("tbody", {}, doc.pairs.map((r) => el("tr", {},
        el("td", {class: "mono"}, el("a", {href: `#/rollout/${encodeURIComponent(r.rollout_key)}`, text: r.rollout_key})),
        el("td", {text: r.task_id || "—"}), el("td", {text: fmt(r.model_version)}),
        el("td", {class: "num", text: fmt(r.judge, 3)}), el("td", {class: "num", text: fmt(r.human, 3)})))))
      : el("p", {class: "muted", text: "No rollout has both a judge's and a person's score yet (lightspan reward judge; the annotation queue)."}));
}
