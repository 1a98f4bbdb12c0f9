// The training page: the steps of one run (reward, loss, KL, clipping, entropy against its floor,
// IS ratio, throughput, staleness, sync time), the reward per policy version and the reward drift,
// and the canaries: which version serves, the candidate's share and evidence, the latest decisions.

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
    deploymentsSection(doc.deployments),
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

// canaries (lightspan deploy, [canary] of the gateway): nothing when the store has no decision
function deploymentsSection(d) {
  if (!d.policies.length) return "";
  const arms = (p) => p.arms ? Object.entries(p.arms).map(([v, a]) => `v${v}: ${fmt(a.rollouts)} rewarded, mean ${fmt(a.reward_mean, 3)}`).join("; ") : "—";
  return el("div", {id: "deployments"},
    el("h2", {text: "Deployments"}),
    el("table", {id: "deployment-versions"},
      el("thead", {}, el("tr", {}, ["policy", "serving", "canary", "share", "since (UTC)", "evidence", "rolled back"].map((h) => el("th", {text: h})))),
      el("tbody", {}, d.policies.map((p) => el("tr", {class: "deployment-row"},
        el("td", {text: p.policy || "(unnamed)"}), el("td", {class: "num", text: `v${p.serving}`}),
        el("td", {class: "num", text: p.candidate === null ? "—" : `v${p.candidate}`}),
        el("td", {class: "num", text: p.candidate === null ? "—" : `${fmt(100 * p.share, 0)}%`}),
        el("td", {class: "num", text: p.since_unix_nano ? time(p.since_unix_nano) : "—"}),
        el("td", {text: arms(p)}), el("td", {text: p.rolled_back.map((v) => `v${v}`).join(", ") || "—"}))))),
    el("table", {id: "deployment-decisions"},
      el("thead", {}, el("tr", {}, ["time (UTC)", "policy", "decision", "version", "by", "candidate / serving rollouts", "p", "reason"].map((h) => el("th", {text: h})))),
      el("tbody", {}, d.decisions.map((r) => el("tr", {class: "decision-row"},
        el("td", {class: "num", text: time(r.time_unix_nano)}), el("td", {text: r.policy || "(unnamed)"}),
        el("td", {text: r.action}), el("td", {class: "num", text: `v${r.version}`}), el("td", {text: r.actor}),
        el("td", {class: "num", text: r.candidate_rollouts === null ? "—" : `${fmt(r.candidate_rollouts)} / ${fmt(r.serving_rollouts)}`}),
        el("td", {class: "num", text: r.p_value === null ? "—" : fmt(r.p_value, 3)}), el("td", {text: r.reason}))))));
}
