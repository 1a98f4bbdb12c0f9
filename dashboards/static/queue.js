// The annotation queue: the rollouts with no reward yet, newest first, one at a time, each shown as
// the rollout page shows it with the feedback form on top; storing a score or skipping moves on.

import {feedbackForm} from "./feedback.js";
import {api, el, show, time} from "./lib.js";
import {rolloutView} from "./rollout.js";

// #/queue?after_time=NS&after_key=KEY: the next unrewarded rollout after the one shown last.
// The cursor travels as the server wrote it (nanoseconds do not fit a JavaScript number).
export async function queuePage(params) {
  const query = new URLSearchParams();
  for (const name of ["task", "split", "after_time", "after_key"]) if (params.get(name)) query.set(name, params.get(name));
  const q = await api(`/api/ui/queue?${query}`);
  const header = el("h1", {text: "Annotation queue"});
  const counts = el("p", {class: "muted", id: "queue-count",
    text: `${q.total} rollout(s) without a reward; ${q.remaining} from here on (newest first)`});
  if (!q.next) {
    show(header, counts, el("p", {id: "queue-empty", text: q.total ? "Nothing further: the rest were skipped. "
      : "Every finished rollout has a reward."}, q.total ? el("a", {href: "#/queue", text: "Start again"}) : ""));
    return;
  }
  const past = new URLSearchParams(query);
  past.set("after_time", q.next.cursor.after_time);
  past.set("after_key", q.next.cursor.after_key);
  const next = () => { location.hash = `#/queue?${past}`; };
  const doc = await api(`/api/ui/rollouts/${encodeURIComponent(q.next.rollout_key)}`);
  const bar = el("div", {class: "queue-bar card"},
    el("span", {}, "Rollout ", el("a", {href: `#/rollout/${encodeURIComponent(doc.rollout_key)}`, class: "mono",
      id: "queue-key", text: doc.rollout_key}), ` · task ${doc.task_id || "—"} · started ${time(doc.start_time_unix_nano)}`),
    el("button", {type: "button", class: "plain", id: "queue-skip", text: "Skip →", onclick: next}));
  show(header, counts, bar, rolloutView(doc, feedbackForm({rollout: doc, onStored: next})));
}
