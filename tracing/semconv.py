"""The one vocabulary of lightspan: every attribute name any component reads or writes.

OpenTelemetry GenAI semantic conventions come first; ``lightspan.*`` names exist only where
reinforcement learning needs something the conventions do not have (docs/architecture.md,
"Attributes"). Token ids and logprobs travel as little-endian bytes: as OTel int arrays they cost
~30x more to encode in the agent and to decode in the collector.
"""

from __future__ import annotations

import functools
import os
import struct
import sys
from array import array

# --- OpenTelemetry GenAI conventions (reused as they are) -----------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# traceloop's instrumentation (the one we ship with) still writes the older names
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
OPERATION_INVOKE_AGENT = "invoke_agent"
"""``gen_ai.operation.name`` of an agent span (its name: ``invoke_agent {gen_ai.agent.name}``)."""
TRACELOOP_SPAN_KIND = "traceloop.span.kind"
"""traceloop's span kind (``workflow``, ``agent``, ``task``, ``tool``); ``agent`` marks an agent span."""
TRACELOOP_ENTITY_NAME = "traceloop.entity.name"
"""traceloop's name of the workflow, agent, task or tool a span runs."""
LLM_REQUEST_TYPE = "llm.request.type"
"""traceloop's older name for the operation (``chat``, ``completion``)."""
LLM_OPERATIONS = frozenset({"chat", "text_completion", "completion", "generate_content"})
"""The ``gen_ai.operation.name`` (or ``llm.request.type``) values of a span that describes one LLM call.
The store's ``llm_calls`` view holds its own copy (``store.views.LLM_OPERATIONS``: the store imports
no other part), which tests/test_layers.py pins equal to this one."""
SERVICE_NAME = "service.name"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
"""The provider's id of one completion (``chatcmpl-…``): how an evaluation names the call it scores
when it cannot be parented to the call's span."""

# --- GenAI conventions v0.1.0 (open-telemetry/semantic-conventions-genai) and the older names -----
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
"""v0.1.0's name of :data:`GEN_AI_SYSTEM` (``openai``, ``anthropic``)."""
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
"""v0.1.0: the session a call belongs to; on lightspan's own spans, the rollout (one episode)."""
GEN_AI_WORKFLOW_NAME = "gen_ai.workflow.name"
"""Before v0.1.0, the name on an ``invoke_workflow`` span; v0.1.0 merged that span into
``invoke_agent`` with :data:`GEN_AI_AGENT_NAME`. Read as the agent's name."""
GEN_AI_AGENT_ID = "gen_ai.agent.id"
OPERATION_INVOKE_WORKFLOW = "invoke_workflow"
"""The older operation of a workflow span: read as :data:`OPERATION_INVOKE_AGENT`."""
OPERATION_EXECUTE_TOOL = "execute_tool"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
"""An int in v0.1.0, a double before it."""
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
GEN_AI_USAGE_REASONING_OUTPUT_TOKENS = "gen_ai.usage.reasoning.output_tokens"
RENAMED = {
    GEN_AI_PROVIDER_NAME: GEN_AI_SYSTEM,
    GEN_AI_USAGE_INPUT_TOKENS: GEN_AI_USAGE_PROMPT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS: GEN_AI_USAGE_COMPLETION_TOKENS,
    GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: "gen_ai.usage.cache_read_input_tokens",
    GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: "gen_ai.usage.cache_creation_input_tokens",
    GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: "gen_ai.usage.reasoning_tokens",
    GEN_AI_AGENT_NAME: GEN_AI_WORKFLOW_NAME,
}
"""Each v0.1.0 name and the older name traceloop's 0.62 instrumentations and most agents in the
field write for it; every reader reads both, the v0.1.0 name first (collector/otlp.py). A writer
(:func:`genai`) writes the older name only where lightspan wrote it before: ``gen_ai.system``."""
_WRITTEN_OLD = {GEN_AI_PROVIDER_NAME: GEN_AI_SYSTEM}
_NEW_ONLY = frozenset({GEN_AI_CONVERSATION_ID})
SEMCONV_OPT_IN_ENV = "OTEL_SEMCONV_STABILITY_OPT_IN"
GENAI_LATEST = "gen_ai_latest_experimental"
"""The value of :data:`SEMCONV_OPT_IN_ENV` (comma-separated with other signals') with which the OTel
instrumentations write the current GenAI names instead of the older ones; lightspan too."""
GENAI_LATEST_DUP = "gen_ai_latest_experimental/dup"
"""Both the older and the current names, as ``http/dup`` and ``database/dup`` do for theirs."""


def env(name: str) -> str:
    """``os.environ.get(name, "")``, in a twentieth of its time: the agent's side reads a few
    variables per call, and ``os.environ``'s ``get`` of an unset one raises and catches two
    ``KeyError`` (2-5 µs each on a loaded host: nine reads made a tenth of a captured call's
    overhead, bench/README.md). It reads the dict that ``os.environ`` keeps its encoded variables
    in (``_data``, which every change through ``os.environ`` updates: ``monkeypatch.setenv``,
    ``os.environ[k] = v``), with ``os.environ``'s own encoding; an ``os.environ`` without one (a
    test's plain dict) is read with ``get``."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(data) is not dict:
        return environ.get(name, "")
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = environ.encodekey(name)
    raw = data.get(key)
    return "" if raw is None else environ.decodevalue(raw)


_ENV_KEYS: dict = {}


def env_raw(names: tuple) -> tuple:
    """The values of several variables as ``os.environ`` keeps them (None: unset), read at once, as
    :func:`env` reads one (a tenth of its time per variable): a key for a cache of what is made of
    them; :func:`env_text` gives their text."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(data) is not dict:
        return tuple(environ.get(name) for name in names)
    keys = _ENV_KEYS.get(names)
    if keys is None:
        keys = _ENV_KEYS[names] = tuple(map(environ.encodekey, names))
    return tuple(map(data.get, keys))


def env_text(raw: tuple) -> tuple:
    """The text of :func:`env_raw`'s values, as :func:`env` gives each ("" when unset)."""
    decode = getattr(os.environ, "decodevalue", None)
    return tuple("" if value is None else value if type(value) is str or decode is None else decode(value)
                 for value in raw)


def genai_names(environ=None) -> tuple[bool, bool]:
    """(write the older names, write the v0.1.0 names), as ``OTEL_SEMCONV_STABILITY_OPT_IN`` asks:
    unset, the older ones (the OTel instrumentations' default); :data:`GENAI_LATEST`, the new ones;
    :data:`GENAI_LATEST_DUP`, both."""
    return _genai_names(env(SEMCONV_OPT_IN_ENV) if environ is None else environ.get(SEMCONV_OPT_IN_ENV, ""))


@functools.lru_cache(maxsize=16)
def _genai_names(raw: str) -> tuple[bool, bool]:
    values = {v.strip() for v in raw.split(",")}
    if GENAI_LATEST_DUP in values:
        return True, True
    return (False, True) if GENAI_LATEST in values else (True, False)


def genai(attrs: dict, environ=None) -> dict:
    """The attributes of a span lightspan makes (given in v0.1.0 names) in the names
    :func:`genai_names` asks for; with the new names, a span that carries :data:`ROLLOUT_ID` also
    carries it as :data:`GEN_AI_CONVERSATION_ID` (a rollout is one session), and
    :data:`GEN_AI_REQUEST_TOP_K` is an int (a double in the older names)."""
    old, new = genai_names(environ)
    out = {}
    for key, value in attrs.items():
        older = _WRITTEN_OLD.get(key)
        if key == GEN_AI_REQUEST_TOP_K:
            out[key] = int(value) if new else float(value)
        elif older is not None:
            if new:
                out[key] = value
            if old:
                out[older] = value
        elif new or key not in _NEW_ONLY:
            out[key] = value
    if new and attrs.get(ROLLOUT_ID) is not None and GEN_AI_CONVERSATION_ID not in attrs:
        out[GEN_AI_CONVERSATION_ID] = str(attrs[ROLLOUT_ID])
    return out


# --- GenAI evaluation events: rewards from any evaluator (collector/evaluations.py) -------------
GEN_AI_EVALUATION_RESULT = "gen_ai.evaluation.result"
"""The event (an OTLP log record's ``event_name``, or a span event's name) that carries one
evaluation of a GenAI operation: parented to the evaluated span, or naming :data:`GEN_AI_RESPONSE_ID`."""
GEN_AI_EVALUATION_NAME = "gen_ai.evaluation.name"
"""What was evaluated (required): ``Relevance``, ``correctness``; it becomes the reward's name."""
GEN_AI_EVALUATION_SCORE_VALUE = "gen_ai.evaluation.score.value"
"""The evaluation's number: the reward's value."""
GEN_AI_EVALUATION_SCORE_LABEL = "gen_ai.evaluation.score.label"
"""The evaluation's label (``relevant``, ``pass``); without a value it trains only where the
collector's ``evaluation_label_values`` gives it one."""
GEN_AI_EVALUATION_EXPLANATION = "gen_ai.evaluation.explanation"
"""Why the evaluator scored so: the reward's comment."""
ERROR_TYPE = "error.type"
"""OTel's error class; on an evaluation event: the evaluation failed, and makes no reward."""

# --- lightspan: what RL needs on top ---------------------------------------------------------
ROLLOUT_ID = "lightspan.rollout.id"
"""One episode of one agent on one task (resource or root span)."""
TASK_ID = "lightspan.task.id"
"""The task; rollouts of one task form a GRPO group (resource or root span)."""
SPLIT = "lightspan.split"
"""``train`` or ``val`` (resource or root span)."""
PROMPT_TOKEN_IDS = "lightspan.prompt_token_ids"
"""int32 little-endian bytes: the prompt exactly as the server tokenised it (LLM span)."""
COMPLETION_TOKEN_IDS = "lightspan.completion_token_ids"
"""A sequence of int32 little-endian bytes values, one per choice (LLM span)."""
COMPLETION_LOGPROBS = "lightspan.completion_logprobs"
"""A sequence of float32 little-endian bytes values, one per choice: sampled-token logprobs."""
MODEL_VERSION = "lightspan.model.version"
"""The policy version that served the call (LLM span); with several policies, the version of
:data:`POLICY_NAME`'s policy."""
POLICY_NAME = "lightspan.policy.name"
"""The policy that served the call (LLM span), when a data directory trains several: the model name
the call used, which vLLM serves that policy's LoRA adapter under (lightspan/store/policies.py)."""
POLICY_VERSIONS_ENV = "LIGHTSPAN_POLICY_VERSIONS"
"""Environment variable the rollout runner gives an agent when several policies are served:
``name=version,...``, each policy's served version by its model name (:func:`format_policy_versions`).
A call to one of those model names records :data:`POLICY_NAME` and that :data:`MODEL_VERSION`."""
CAPTURE_STATUS = "lightspan.capture.status"
"""``ok``, or why the call could not be captured (LLM span): ``no_token_ids``, ``no_logprobs`` (the
ids are recorded, the logprobs are not: vLLM's Responses API), ``logprobs_mismatch``,
``multiple_prompts``, ``multiple_turns``, ``unsupported_request`` (a request lightspan sends as it
is), ``unparsed_response``, ``stream_incomplete`` (the stream was not read to its end),
``capture_error``, ``other_url`` (a call to a server that is not a capture URL), ``upstream_error``
(gateway), ``duplicate`` (see below), or ``invalid_logprobs`` (set by the collector: the logprobs
held NaN or an infinity and were not stored in the logprobs column). A call with any status but
``ok`` is not trained; ``lightspan.capture.reason`` says why and what to do."""
CAPTURE_REASON = "lightspan.capture.reason"
"""On an LLM span whose capture status is not ``ok``: why, and the fix, in words."""
CAPTURE_DUPLICATE_OF = "lightspan.capture.duplicate_of"
"""On an LLM span that encloses another LLM span of the same call (two OpenAI instrumentations,
or a framework's span around the client's): the hex span id of the inner span, which carries the
token ids. Such a span has ``lightspan.capture.status=duplicate`` and is not a separate call."""
REWARD = "lightspan.reward"
"""A float reward, on a reward span or on any span."""
REWARD_NAME = "lightspan.reward.name"
"""Names the reward (``lightspan.reward.name``); the default name is ``reward``."""
REWARD_SOURCE = "lightspan.reward.source"
"""Who gave the reward: ``agent`` (a reward span the agent emitted; the default), ``judge``
(``lightspan reward judge``), ``human`` (the web UI), ``api`` (any other ``POST /v1/rewards``), or the
``service.name`` of the evaluator whose ``gen_ai.evaluation.result`` event the collector made it of
(collector/evaluations.py). Only the collector sets it: on a span sent over OTLP it is set aside
(:data:`REWARD_CLAIMED_SOURCE`)."""
REWARD_CLAIMED_SOURCE = "lightspan.reward.claimed_source"
"""Set by the collector: the :data:`REWARD_SOURCE` an OTLP span claimed, set aside. Only rewards
posted to the collector's API have a source other than ``agent`` (collector/reward_integrity.py)."""
REWARD_COMMENT = "lightspan.reward.comment"
"""Why: a judge's reason or a person's comment."""
REWARD_CORRECTION = "lightspan.reward.correction"
"""A person's corrected answer for the rollout or call (for supervised fine-tuning elsewhere)."""
REWARD_CALL_SPAN_ID = "lightspan.reward.call_span_id"
"""The hex span id of the LLM call a reward scores, when it scores one call, not the rollout."""
REWARD_JUDGE_MODEL = "lightspan.reward.judge.model"
"""The model that judged (source ``judge``)."""
REWARD_RUBRIC_SHA256 = "lightspan.reward.rubric.sha256"
"""The SHA-256 of the rubric file the judge scored against (source ``judge``)."""
REWARD_EVALUATOR = "lightspan.reward.evaluator"
"""On a reward the collector made of a :data:`GEN_AI_EVALUATION_RESULT` event: the ``service.name``
of the process that emitted the event (its source is that name, or ``agent``: collector/evaluations.py)."""
REWARD_EVALUATED_TRACE_ID = "lightspan.reward.evaluated.trace_id"
"""On a reward made of an evaluation event: the hex trace id of the span it evaluated."""
REWARD_EVALUATED_SPAN_ID = "lightspan.reward.evaluated.span_id"
"""On a reward made of an evaluation event: the hex span id of the span it evaluated."""
ROLLOUT_EXIT_CODE = "lightspan.rollout.exit_code"
"""The agent process's exit code, on the runner's outcome span."""
ROLLOUT_OUTCOME = "lightspan.rollout.outcome"
"""``ok``, ``failed`` or ``timeout``, on the runner's outcome span."""
ROLLOUT_END = "lightspan.rollout.end"
"""How the agent process ended, on the runner's outcome span: ``exit`` (it exited, with
:data:`ROLLOUT_EXIT_CODE`, ``sys.exit(1)`` included), ``exception`` (an uncaught exception ended it,
exit status 1: :data:`ROLLOUT_EXCEPTION_TYPE`), ``timeout`` (the runner killed it at its time limit),
``signal`` (killed by a signal the runner did not send, such as the OOM killer's SIGKILL:
:data:`ROLLOUT_SIGNAL`) or ``unknown`` (it could not start, or its worker died)."""
ROLLOUT_ENDS = ("exit", "exception", "timeout", "signal", "unknown")
ROLLOUT_EXCEPTION_TYPE = "lightspan.rollout.exception.type"
"""The type of the uncaught exception that ended the agent process (:data:`ROLLOUT_END` ``exception``),
as OTel's ``exception.type``: its fully-qualified class name (``openai.APIConnectionError``), the bare
name for a built-in or the script's own (``RuntimeError``). The agent's spool records it
(tracing/spool.py)."""
ROLLOUT_SIGNAL = "lightspan.rollout.signal"
"""The number of the signal that killed the agent process (:data:`ROLLOUT_END` ``signal``, ``timeout``)."""
ROLLOUT_SPANS_SPOOLED = "lightspan.rollout.spans.spooled"
"""On the runner's outcome span: the spans the agent process ended, read back from its spool
(:data:`SPOOL_ENV`); absent when the agent wrote no spool (it did not run lightspan's instrumentor)."""
ROLLOUT_SPANS_LOST = "lightspan.rollout.spans.lost"
"""On the runner's outcome span: of those, the spans the collector did not acknowledge (lost)."""
ROLLOUT_SPANS_DAMAGED = "lightspan.rollout.spans.damaged"
"""On the runner's outcome span: spool records cut short (the process was killed mid-write), skipped."""
SPOOL_ENV = "LIGHTSPAN_SPOOL"
"""Environment variable the rollout runner gives each rollout: the file the agent appends every
ended span to (tracing/spool.py), which the runner ships to the collector once the process is gone."""
AGENT_HEADER = "x-lightspan-agent"
"""HTTP request header by which a caller of the gateway names the agent making the call (an agent
lightspan does not instrument, or several agents behind one base URL): the gateway's span of the
call gets it as ``gen_ai.agent.name`` (:data:`GEN_AI_AGENT_NAME`), which the transition builder and
``--agent-match`` read like any agent span's."""

# span names lightspan itself creates
SPAN_ROLLOUT = "lightspan.rollout"
SPAN_REWARD = "lightspan.reward"
SPAN_RUNNER = "lightspan.runner"

# --- bytes encoding of token ids and logprobs ------------------------------------------------
_LITTLE = sys.byteorder == "little"


def encode_ids(ids) -> bytes:
    """int32 little-endian bytes of a sequence of token ids (``struct`` packs a list 2-3x faster
    than ``array`` converts one: 1,000 ids in 5 µs). An id outside int32 raises ``struct.error``."""
    ids = ids if isinstance(ids, (list, tuple)) else list(ids)
    return struct.pack(f"<{len(ids)}i", *ids)


def decode_ids(data: bytes) -> list[int]:
    a = array("i")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def encode_floats(values) -> bytes:
    """float32 little-endian bytes of a sequence of floats."""
    a = array("f", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def decode_floats(data: bytes) -> list[float]:
    a = array("f")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


# --- the served policies, as the runner hands them to an agent ----------------------------------

def format_policy_versions(versions: dict[str, int]) -> str:
    """``{"writer": 3, "checker": 1}`` -> ``"checker=1,writer=3"`` (policy names hold no ``=`` or ``,``)."""
    return ",".join(f"{name}={int(version)}" for name, version in sorted(versions.items()))


def parse_policy_versions(raw: str) -> dict[str, int]:
    """The inverse of :func:`format_policy_versions`; malformed items are left out."""
    out = {}
    for item in raw.split(","):
        name, sep, version = item.strip().partition("=")
        if sep and name and version.strip().lstrip("-").isdigit():
            out[name.strip()] = int(version)
    return out
