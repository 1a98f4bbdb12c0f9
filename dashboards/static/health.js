// The collector page: its own metrics (ingest rate, refusals by reason, queue, WAL, flush times).

import {lineChart} from "./charts.js";
import {api, bytes, el, fmt, show, stat, statusLine} from "./lib.js";

const history = [];

export async function healthPage() {
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
