"""The gateway's session reward route: ``POST /rollouts/{id}/reward``.

A harness that can only be given a base URL (``http://GATEWAY/rollouts/{id}/v1``) reports its
rollout's reward next to it, ``POST http://GATEWAY/rollouts/{id}/reward`` with the JSON body
``{"value": 0.75, "name": "reward"}`` (``name`` optional, default ``reward``). The rollout is the
path's (a ``/tasks/{id}`` in the prefix gives the task); the body may name nothing else.

The gateway stores nothing itself: it posts the reward to the collector's ``POST /v1/rewards``
(``collector_api_url``, with ``collector_token``), as ``{"rollout_id", "value", "name",
"source": "agent"}``, and answers with the collector's answer. So the collector's rules hold:
one value per key (rollout, name), the same value again is idempotent (200, ``already_stored``),
another value is 409 with the stored one, and nothing is acknowledged before it is durable. The
source is ``agent``, what the collector makes of any reward a sender without its reward token
posts: a harness calls the policy through the gateway and reports through it, so its reward is the
agent's own, never ``human``, ``judge`` or ``api`` (the body cannot name a source; the collector
refuses any but ``agent`` without its reward token, and the gateway is given none).

Errors: a body that is not ``{"value": number, "name"?: string}`` is 400 naming the field; the
collector's 400 and 409 are passed on; a collector that cannot be reached, or that is busy, is
503 with ``Retry-After`` (the reward is not stored: send it again); a collector that refuses the
gateway's token is 502 (the gateway's configuration, not the caller's request). :func:`reward_doc`
is pure; :class:`RewardPoster` is the I/O.
"""

from __future__ import annotations

import json
import math

import requests

from lightspan.rollout.upstream import Upstream
from lightspan.tracing import semconv

MAX_BODY_BYTES = 4096
"""A reward is a number and a name: larger bodies are refused with 413 before they are read."""
MAX_NAME_CHARS = 128
REWARD_SOURCE = "agent"
_EXAMPLE = '{"value": 1.0, "name": "reward"}'


class BadReward(ValueError):
    """The caller's reward body is wrong (400); ``field`` names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def reward_doc(ids: dict, doc) -> dict:
    """The collector's reward (``POST /v1/rewards``) for the body ``doc`` posted under the path
    attributes ``ids`` (semconv rollout and task ids). Raises :class:`BadReward`."""
    if not isinstance(doc, dict):
        raise BadReward("body", f"the body must be a JSON object like {_EXAMPLE}")
    unknown = sorted(set(doc) - {"value", "name"})
    if unknown:
        raise BadReward(unknown[0], f"unknown field(s) {unknown}: a session reward is {_EXAMPLE}; the rollout is "
                                    "the path's, and its source is the agent's")
    value = doc.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadReward("value", f"'value' must be a finite number, got {json.dumps(value)[:40]}: send {_EXAMPLE}")
    name = doc.get("name", "reward")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise BadReward("name", f"'name' must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    reward = {"rollout_id": ids[semconv.ROLLOUT_ID], "value": float(value), "name": name, "source": REWARD_SOURCE}
    if ids.get(semconv.TASK_ID):
        reward["task_id"] = ids[semconv.TASK_ID]
    return reward


class RewardPoster:
    """Posts rewards to the collector's API at ``base`` with ``token``; :meth:`post` returns
    (status, JSON body, headers) to answer the caller with."""

    def __init__(self, base: str, token: str, timeout_s: float, retry_after_s: int):
        self.client = Upstream(base.rstrip("/"), 4, timeout_s)
        self.token, self.retry_after_s = token, retry_after_s

    def post(self, reward: dict) -> tuple[int, dict, dict]:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        retry = {"Retry-After": str(self.retry_after_s)}
        try:
            resp = self.client.send("POST", "/v1/rewards", headers, json.dumps(reward).encode())
        except requests.RequestException as e:
            return 503, {"error": f"the collector cannot be reached ({type(e).__name__}); the reward is not "
                                  "stored: send it again"}, retry
        try:
            answer = resp.json()
        except ValueError:
            answer = {"error": resp.text[:500]}
        if resp.status_code in (200, 400, 409):
            return resp.status_code, answer, {}
        if resp.status_code in (401, 403):
            return 502, {"error": f"the collector refused the gateway ({resp.status_code}: "
                                  f"{str(answer.get('error', ''))[:300]}); set gateway.collector_token to the "
                                  "collector's auth_token"}, {}
        return 503, {"error": f"the collector answered {resp.status_code}: {str(answer.get('error', ''))[:300]}; "
                              "the reward is not stored: send it again"}, {**retry, **(
                                  {"Retry-After": resp.headers["retry-after"]} if resp.headers.get("retry-after") else {})}
