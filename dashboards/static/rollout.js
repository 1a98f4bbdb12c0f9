// One rollout: its status, span tree (a waterfall), rewards with who gave them, LLM calls with
// their messages, tokens, credit and advantage, where each segment of its trajectory begins and
// why, and its transitions; a person can score it.

import {feedbackForm} from "./feedback.js";
import {api, badge, duration, el, fixed, fmt, show, stat, time} from "./lib.js";
import {messageNodes, parseAttr, tokenNodes} from "./messages.js";

function callCard(span, doc) {
  const t = span.transition;
  const head = el("div", {class: "call-head"},
    el("strong", {text: `LLM call #${span.call_index}`}), el("span", {class: "mono", text: span.name}),
    el("span", {text: `model ${span.response_model || span.request_model || "—"}`}),
    el("span", {text: `policy version ${fmt(span.model_version)}`}),
    el("span", {text: `tokens in/out ${fmt(span.num_prompt_tokens ?? span.input_tokens)} / ${fmt((span.completion_token_ids || []).length || span.output_tokens)}`}),
    span.cache_read_input_tokens != null ? el("span", {class: "cached", text: `cached in ${fmt(span.cache_read_input_tokens)}`}) : "",
    span.reasoning_output_tokens != null ? el("span", {class: "reasoning", text: `reasoning out ${fmt(span.reasoning_output_tokens)}`}) : "",
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
  body.append(el("details", {class: "call-feedback"}, el("summary", {text: "Score this call"}),
    feedbackForm({rollout: doc, span})));
  return el("section", {class: "call", "data-call-index": String(span.call_index)}, head, body);
}

// why a call's prompt did not extend the sequence before it (the builder's segment_cause)
const SEGMENT_WHY = {
  compaction: "the agent's history was summarised, truncated or rewritten",
  chat_template: "the chat template re-rendered the previous turn",
  retokenization: "the same text was tokenised differently",
  tool_text: "the previous reply was re-written in its place (e.g. as the harness's tool-call text)",
  reply_dropped: "the previous reply was left out of the history (e.g. a reply the harness could not parse)",
};

// a new segment of the trajectory begins at this call (per_rollout builds): where and why
function segmentMarker(t) {
  if (!t || !t.segment) return "";
  return el("div", {class: "segment-marker", "data-segment": String(t.segment), "data-cause": t.segment_cause || ""},
    el("strong", {text: `Segment ${t.segment} begins here`}),
    `: ${t.segment_cause || "unknown"} (${SEGMENT_WHY[t.segment_cause] || "no cause recorded"}). `,
    "Its tokens are a row of their own, credited with the rollout's advantage.");
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

// the rollout's summary, span tree, rewards, calls and transitions; ``top``: nodes shown above them
export function rolloutView(doc, top = []) {
  const calls = doc.spans.filter((s) => s.call_index !== null && s.call_index !== undefined)
    .sort((a, b) => a.call_index - b.call_index);
  const transitions = doc.transitions.length ? el("table", {id: "transitions"},
    el("thead", {}, el("tr", {}, ["transition", "call", "segment", "outcome", "policy version", "reward", "credit", "advantage", "credit policy", "estimator", "tokens"]
      .map((h) => el("th", {text: h})))),
    el("tbody", {}, doc.transitions.map((t) => el("tr", {},
      el("td", {class: "mono", text: t.transition_id}), el("td", {class: "num", text: fmt(t.call_index)}),
      el("td", {class: "segment", text: t.segment === null || t.segment === undefined ? "—"
        : `${t.segment}${t.segment_cause ? ` (${t.segment_cause})` : ""}`}),
      el("td", {class: "outcome"}, badge(t.loss_weight === 0 ? `${t.outcome}, no loss` : t.outcome,
        t.outcome === "ok" ? "train" : "err")),
      el("td", {class: "num", text: fmt(t.model_version)}), el("td", {class: "num", text: fmt(t.reward, 3)}),
      el("td", {class: "num", text: fmt(t.credit, 3)}), el("td", {class: "num", text: fmt(t.advantage, 3)}),
      el("td", {text: t.credit_policy}), el("td", {text: t.advantage_estimator}),
      el("td", {class: "num", text: fmt(t.num_completion_tokens)})))))
    : el("p", {class: "muted", text: "No transitions built from this rollout yet (lightspan transitions build)."});
  return [
    el("h1", {}, "Rollout ", el("span", {class: "mono", id: "rollout-key", text: doc.rollout_key})),
    el("div", {class: "summary"},
      stat("status", doc.status || "—", "rollout-status"),
      stat("task", doc.task_id || "—"), stat("split", doc.split || "—"),
      stat("final reward", doc.final_reward === null ? "—" : doc.final_reward.toFixed(3), "final-reward"),
      stat("policy version", fmt(doc.model_version)), stat("LLM calls", fmt(doc.num_llm_calls)),
      stat("spans", fmt(doc.spans.length), "span-count"),
      stat("duration", duration(doc.end_time_unix_nano - doc.start_time_unix_nano))),
    outcomeNote(doc),
    doc.num_uncaptured_calls ? el("p", {class: "error", id: "capture-reason",
      text: `${doc.num_uncaptured_calls} LLM call(s) not captured (${doc.capture_problem}): ${doc.capture_reason || "no reason recorded"}`}) : "",
    doc.truncated ? el("p", {class: "error", text: "Only the first spans are shown."}) : "",
    top,
    el("h2", {text: "Span tree"}), waterfall(doc),
    el("h2", {text: "Rewards"}),
    doc.rewards.length ? rewardsTable(doc) : el("p", {class: "muted", text: "No reward recorded."}),
    el("h2", {text: `LLM calls (${calls.length})`}), calls.map((span) => [segmentMarker(span.transition), callCard(span, doc)]),
    el("h2", {text: "Transitions"}), transitions];
}

// a failed or timed-out rollout says so: it is a failure, not a reward of 0; an infrastructure
// failure (a service the agent needs was down) is not even that
function outcomeNote(doc) {
  const exit = doc.exit_code !== null && doc.exit_code !== undefined ? ` (exit code ${doc.exit_code})` : "";
  if (doc.status === "infra") {
    return el("p", {class: "error", id: "outcome-note",
      text: `The rollout failed for the infrastructure${exit}: it is retried, left out of pass@k and never trained on.`});
  }
  if (doc.status !== "failed" && doc.status !== "timeout") return "";
  const what = doc.status === "timeout" ? "timed out" : `failed${exit}`;
  return el("p", {class: "error", id: "outcome-note",
    text: `The rollout ${what}: it counts as a failure in pass@k, and trains (as the builder's outcomes say) as a failure with its real reward, masked or dropped, never with a reward of 0.`});
}

function rewardsTable(doc) {
  const callOf = new Map(doc.spans.filter((s) => s.call_index !== null && s.call_index !== undefined)
    .map((s) => [s.span_id, s.call_index]));
  return el("table", {id: "rewards"},
    el("thead", {}, el("tr", {}, ["name", "value", "source", "scores", "comment", "correction", "time (UTC)"]
      .map((h) => el("th", {text: h})))),
    el("tbody", {}, doc.rewards.map((r) => el("tr", {class: `reward-row source-${r.source}`},
      el("td", {text: r.reward_name}), el("td", {class: "num", text: fmt(r.reward, 3)}),
      el("td", {}, badge(r.source, r.source === "human" ? "val" : ""), r.judge_model ? ` ${r.judge_model}` : ""),
      el("td", {text: r.call_span_id ? `call #${callOf.get(r.call_span_id) ?? r.call_span_id}` : "rollout"}),
      el("td", {class: "comment", text: r.comment || ""}), el("td", {class: "correction", text: r.correction || ""}),
      el("td", {text: time(r.time_unix_nano)})))));
}

export async function rolloutPage(key) {
  const doc = await api(`/api/ui/rollouts/${encodeURIComponent(key)}`);
  show(el("p", {}, el("a", {href: "#/rollouts", text: "← rollouts"})),
    rolloutView(doc, el("details", {class: "rollout-feedback"}, el("summary", {text: "Score this rollout"}),
      feedbackForm({rollout: doc}))));
}
