// How a call's content is shown: chat messages (OTel GenAI and OpenAI shapes) and completion
// tokens coloured by their logprob.

import {el, fmt} from "./lib.js";

export function parseAttr(v) { try { return JSON.parse(v); } catch (e) { return v; } }

// OTel GenAI messages ({role, parts: [{type, content | name, arguments | response}]}) and the
// older OpenAI shape ({role, content, tool_calls}); anything else is shown as JSON
export function messageNodes(messages) {
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

export function tokenNodes(span) {
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
