// The training page: the steps of one run (reward, loss, KL, clipping, entropy against its floor,
// IS ratio, throughput, staleness, sync time), the reward per policy version and the reward drift.

import {lineChart} from "./charts.js";
import {api, el, fmt, show, stat, time} from "./lib.js";

export async function trainingPage(params) {
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
  const floor = steps.map((s) => [s.step, s.entropy_floor]);
  const sources = [...new Set(doc.reward_by_source.map((r) => r.source))].sort();
  const bySource = sources.map((source) => ({name: source, points: doc.reward_by_source
    .filter((r) => r.source === source && r.policy_version !== null).map((r) => [r.policy_version, r.reward_mean])}));
  show(
    el("h1", {text: "Training"}),
    doc.runs.length ? el("div", {class: "filters card"}, el("label", {}, "run", runPicker))
      : el("p", {class: "muted", id: "no-runs", text: "No training steps yet (lightspan train writes them)."}),
    entropyWarning(doc),
    el("div", {class: "summary"},
      ...(doc.policy ? [stat("policy", doc.policy, "policy-name")] : []),
      stat("steps", fmt(steps.length), "step-count"), stat("policy version", fmt(last && last.policy_version), "policy-version"),
      stat("last train reward", last ? fmt(last.reward_mean, 3) : "—", "last-reward"),
      stat("last loss", last ? fmt(last.loss, 4) : "—")),
    el("div", {class: "charts"},
      lineChart(`Reward per ${doc.policy ? `${doc.policy} ` : ""}policy version (rollouts' final reward)`, [
        {name: "train", points: versions("train")}, {name: "val", points: versions("val")}], {xLabel: "policy version", id: "chart-reward-version"}),
      lineChart("Reward drift: each source's mean rollout reward per policy version", bySource,
        {xLabel: "policy version", id: "chart-reward-source"}),
      lineChart("Train reward (batch mean)", [{name: "reward", points: by("reward_mean")}], {id: "chart-reward"}),
      lineChart("Loss", [{name: "loss", points: by("loss")}], {id: "chart-loss"}),
      lineChart("KL to the reference", [{name: "kl", points: by("kl")}], {id: "chart-kl"}),
      lineChart("Clip ratio", [{name: "clip", points: by("clip_ratio")}], {id: "chart-clip"}),
      lineChart("Entropy (nats/token)", [{name: "entropy", points: by("entropy")},
        ...(floor.some((p) => p[1] !== null) ? [{name: "entropy_floor", points: floor, color: "#c8362f", dashed: true}] : [])],
        {id: "chart-entropy"}),
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

// steps whose entropy fell below the trainer's entropy_floor: exploration is collapsing
function entropyWarning(doc) {
  const below = doc.entropy_warnings;
  if (!below.length) return "";
  const step = doc.steps.find((s) => s.step === below[below.length - 1]);
  return el("p", {class: "error warning", id: "entropy-warning",
    text: `Entropy below the floor at ${below.length} step(s), last at step ${step.step}: ${fmt(step.entropy, 3)} < `
      + `${fmt(step.entropy_floor, 3)} nats/token. Exploration is collapsing: the policy samples nearly the same tokens every `
      + "time (consider a lower learning rate, a KL penalty, a higher temperature, or an earlier checkpoint)."});
}
