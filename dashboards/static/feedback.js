// Human feedback: a score (good / bad or a number), a comment and optionally the better answer, for a
// rollout or one of its LLM calls, posted to the collector's POST /v1/rewards with source
// "human" (the one home of the reward contract). The rollout page and the annotation queue
// (queue.js) show the form; this module imports neither, so the modules form no cycle.

import {el, fmt, post} from "./lib.js";

// the reward every person's score is stored under: one per rollout (and one per call); a stored
// reward is never changed (it may have been trained on), so a second, different score is refused
const NAME = "human";

// ``rollout``: the rollout's document (rollout_key, task_id); ``span``: the LLM call scored, if one
export function feedbackForm({rollout, span = null, onStored = null}) {
  const value = el("input", {type: "text", inputmode: "decimal", name: "value", class: "fb-value", size: 6,
                             placeholder: "e.g. 0.5"});
  const thumb = (v, label, cls) => el("button", {type: "button", class: `plain ${cls}`, title: `score ${v}`, text: label,
    onclick: () => { value.value = String(v); }});
  const comment = el("textarea", {name: "comment", class: "fb-comment", rows: 2, cols: 50, maxlength: 4096,
                                  placeholder: "why (optional)"});
  const correction = el("textarea", {name: "correction", class: "fb-correction", rows: 3, cols: 50, maxlength: 65536,
                                     placeholder: "the better answer (optional)"});
  const submit = el("button", {type: "submit", class: "fb-submit", text: "Save score"});
  const note = el("span", {class: "fb-note muted"});
  const form = el("form", {class: "feedback card", "data-scope": span ? "call" : "rollout"},
    el("div", {class: "fb-score"}, thumb(1, "Good · 1", "thumb-up"), thumb(0, "Bad · 0", "thumb-down"),
      el("label", {}, "score ", value)),
    el("label", {}, "comment", comment), el("label", {}, "correction", correction),
    el("div", {}, submit, " ", note));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = value.value.trim(), score = Number(text);
    if (!text || !Number.isFinite(score)) {
      note.className = "fb-note error";
      note.textContent = "give a score: Good, Bad or a number";
      return;
    }
    const reward = {rollout_id: rollout.rollout_key, value: score, name: NAME, source: "human"};
    if (rollout.task_id) reward.task_id = rollout.task_id;
    if (span) reward.span_id = span.span_id;
    if (comment.value.trim()) reward.comment = comment.value.trim();
    if (correction.value.trim()) reward.correction = correction.value;
    submit.disabled = true;
    form.dataset.state = "saving";
    try {
      const doc = await post("/v1/rewards", reward);
      const stored = doc.rewards[0];
      note.className = "fb-note";
      note.textContent = stored.status === "already_stored" ? "this score was stored already"
        : `stored: ${fmt(stored.value, 3)} (shown once the collector writes it)`;
      form.dataset.state = "stored";
      if (onStored) onStored(stored);
    } catch (err) {
      note.className = "fb-note error";
      note.textContent = err.message;
      form.dataset.state = "error";
      submit.disabled = false;
    }
  });
  return form;
}
