"""A Search-R1 agent on the plain ``openai`` client: it alternates reasoning with calls to a search
engine, then answers. No lightspan code in it but the reward.

The shape is Agent Lightning's Search-R1 example (a chat loop of at most ``max_turns`` model turns;
the question and its gold answers given as ``QUESTION`` and ``GOLDEN_ANSWERS``; the retriever at
``SEARCH_R1_RETRIEVAL_URL``), in Search-R1's text protocol:

    model ──▶ <search>Orlen Vask</search>
    tool  ──▶ <information>Doc 1(Title: Orlen Vask) Orlen Vask is a poet. Vask was born in Tarrow.
              Doc 2(Title: ...) ...</information>          (the next user turn)
    model ──▶ <answer>Tarrow</answer>                     ──▶ exact-match reward

Each model turn stops at its first ``</search>`` or ``</answer>``; a turn with neither ends the
episode (an invalid action, reward 0, as in Search-R1); after ``max_turns`` turns without an answer
the reward is 0. The retriever is any server with Search-R1's contract (``POST /retrieve`` with
``queries``, ``topk``, ``return_scores``): ``retriever.py`` beside this file, on BM25. SmolLM2-135M
makes no native tool calls, so the protocol is text, which is also Search-R1's own; one or two worked
dialogues come first as earlier chat turns (task field ``shots``), because a 135M model copies a
dialogue's form far better than it follows an instruction.

Reward (Search-R1's exact match): 1 when the last ``<answer>`` equals one of the gold answers after
normalisation (lower case, no punctuation, no articles, single spaces), else 0.

A retriever that cannot be reached, or that answers with an error or outside the contract, is not
the model's fault: the agent then emits no reward and exits with status 75 (``os.EX_TEMPFAIL``,
sysexits' "temporary failure"), which ``lightspan rollout`` records as an infrastructure failure
(retried, never trained on, never a reward of 0). It checks the retriever once before the first model
call, so a rollout against a service that is down makes no LLM call at all.

    lightspan rollout --tasks examples/search_r1/data/train.jsonl --samples 4 \\
      --env-map QUESTION=input.question,GOLDEN_ANSWERS=input.golden_answers -- python examples/search_r1/agent.py

Settings, as Agent Lightning's example takes them, from the environment: ``SEARCH_R1_RETRIEVAL_URL``
(``http://127.0.0.1:8010/retrieve``), ``SEARCH_R1_TOPK`` (documents per search: 1; Search-R1 uses 3,
which a 135M model cannot read: it answered a name from the wrong document, 12.5 % of 40 training
questions solved greedily against 22.5 % with 1), ``SEARCH_R1_MAX_TURNS`` (4), ``SEARCH_R1_MAX_TOKENS``
per turn (24); a task field of the same name in lower case (``topk``, ``max_turns``, ``max_tokens``) wins,
and ``temperature`` (0.7; ``lightspan experiment`` sets it, 0 for held-out tasks) and ``shots`` (2) are
task fields.
"""

from __future__ import annotations

import json
import os
import re
import string
import sys

import requests
from openai import OpenAI

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

DEFAULT_RETRIEVAL_URL = "http://127.0.0.1:8010/retrieve"
INSTRUCTION = ("Answer the question. You may search an encyclopedia: write <search>query</search> and the "
               "results come back inside <information> and </information>. Search as often as you need. "
               "When you know the answer, write it inside <answer> and </answer>, with no explanation.")
STOP = ["</search>", "</answer>"]
# worked dialogues about people and places that are not in the corpus: (question, [(query, passage)], answer)
SHOTS = [("In which city was Amber Tolk born?",
          [("Amber Tolk", "Doc 1(Title: Amber Tolk) Amber Tolk is a baker. Tolk was born in Rivenby.")], "Rivenby"),
         ("In which country was Jon Brisk born?",
          [("Jon Brisk", "Doc 1(Title: Jon Brisk) Jon Brisk is a tailor. Brisk was born in Osterfell."),
           ("Osterfell", "Doc 1(Title: Osterfell) Osterfell is a city in Norvania. It lies on the river Esk.")],
          "Norvania")]
_TAG = re.compile(r"<(search|answer)>(.*?)(?:</\1>|$)", re.DOTALL)


class RetrieverUnavailable(RuntimeError):
    """The retrieval service could not be reached or broke its contract: an infrastructure failure."""


def first_turn(question: str) -> str:
    return f"{INSTRUCTION}\nQuestion: {question}"


def information(passages: str) -> str:
    return f"<information>{passages.strip()}</information>"


def shot_turns(n: int = 2) -> list[dict]:
    turns = []
    for question, searches, answer in SHOTS[:n]:
        turns.append({"role": "user", "content": first_turn(question)})
        for query, passage in searches:
            turns += [{"role": "assistant", "content": f"<search>{query}</search>"},
                      {"role": "user", "content": information(passage)}]
        turns.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
    return turns


def parse_action(reply: str) -> tuple[str | None, str]:
    """The first ``<search>`` or ``<answer>`` of a reply and its content (the closing tag may be
    missing: generation stops at it); ``(None, "")`` when there is neither."""
    match = _TAG.search(reply or "")
    return (match.group(1), match.group(2).strip()) if match else (None, "")


def normalize(text: str) -> str:
    """SQuAD's answer normalisation, as Search-R1's exact match uses it."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(answer: str | None, golden: list[str]) -> float:
    return float(answer is not None and normalize(answer) in {normalize(g) for g in golden})


def golden_answers(raw: str) -> list[str]:
    """``GOLDEN_ANSWERS`` as the runner gives it: a JSON list, or one answer as plain text."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return [raw]
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def passages(result: list) -> str:
    """One query's documents as Search-R1 shows them: ``Doc i(Title: t) text`` per line."""
    lines = []
    for i, item in enumerate(result, 1):
        doc = item.get("document", item) if isinstance(item, dict) else {}
        title, _, text = str(doc.get("contents", "")).partition("\n")
        if not doc.get("contents"):
            title, text = str(doc.get("title", "")), str(doc.get("text", ""))
        lines.append(f"Doc {i}(Title: {title.strip(chr(34))}) {text}")
    return "\n".join(lines)


def retrieve(url: str, queries: list[str], topk: int, timeout_s: float = 30.0) -> list[list]:
    """Search-R1's contract: ``POST url {"queries", "topk", "return_scores"}`` → ``{"result": [...]}``,
    one list per query. Anything else raises :class:`RetrieverUnavailable`."""
    try:
        response = requests.post(url, json={"queries": queries, "topk": topk, "return_scores": True},
                                 timeout=timeout_s)
    except requests.RequestException as e:
        raise RetrieverUnavailable(f"retrieval service at {url} unreachable: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        raise RetrieverUnavailable(f"retrieval service at {url} answered {response.status_code}: "
                                   f"{response.text[:200]}")
    try:
        result = response.json()["result"]
    except (ValueError, KeyError, TypeError):
        result = None
    if not isinstance(result, list) or len(result) != len(queries) or not all(isinstance(r, list) for r in result):
        raise RetrieverUnavailable(f"retrieval service at {url} answered outside the contract: {response.text[:200]}")
    return result


def search_episode(client: OpenAI, question: str, golden: list[str], *, retrieval_url: str,
                   model: str = "policy", temperature: float = 0.7, max_tokens: int = 24, max_turns: int = 4,
                   topk: int = 1, shots: int = 2) -> dict:
    """One episode; raises :class:`RetrieverUnavailable` when the retriever fails, at the start or
    at any search."""
    retrieve(retrieval_url, [], topk)        # the service is up and speaks the contract, before any LLM call
    messages = [*shot_turns(shots), {"role": "user", "content": first_turn(question)}]
    searches, answer, ended, turns = [], None, "turns", 0
    for turns in range(1, max_turns + 1):
        response = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                                  max_tokens=max_tokens, stop=STOP)
        action, content = parse_action(response.choices[0].message.content or "")
        if action is None:
            ended = "invalid"
            break
        messages.append({"role": "assistant", "content": f"<{action}>{content}</{action}>"})
        if action == "answer":
            answer, ended = content, "answer"
            break
        found = retrieve(retrieval_url, [content], topk)[0]
        searches.append(content)
        messages.append({"role": "user", "content": information(passages(found) or "No results.")})
    return {"searches": searches, "answer": answer, "ended": ended, "turns": turns,
            "reward": exact_match(answer, golden)}


def main() -> None:
    task = json.loads(os.environ.get("LIGHTSPAN_TASK") or "{}")
    question = os.environ.get("QUESTION") or task["question"]
    golden = golden_answers(os.environ["GOLDEN_ANSWERS"]) if "GOLDEN_ANSWERS" in os.environ \
        else [str(a) for a in task["golden_answers"]]
    url = os.environ.get("SEARCH_R1_RETRIEVAL_URL", DEFAULT_RETRIEVAL_URL)

    def setting(name: str, default: int) -> int:
        return int(task.get(name, os.environ.get(f"SEARCH_R1_{name.upper()}", default)))

    try:
        episode = search_episode(
            OpenAI(), question, golden, retrieval_url=url, model=os.environ.get("AGENT_MODEL", "policy"),
            temperature=float(task.get("temperature", 0.7)), max_tokens=setting("max_tokens", 24),
            max_turns=setting("max_turns", 4), topk=setting("topk", 1), shots=int(task.get("shots", 2)))
    except RetrieverUnavailable as e:
        # not the policy's doing: no reward, and the exit status that says "infrastructure, retry"
        print(f"search_r1 agent: {e}", file=sys.stderr)
        sys.exit(os.EX_TEMPFAIL)
    emit_reward(episode["reward"])
    print(json.dumps({"task": task.get("id"), "question": question, "golden": golden, **episode}))


if __name__ == "__main__":
    main()
