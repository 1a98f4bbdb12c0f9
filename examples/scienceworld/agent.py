"""A ReAct-style ScienceWorld agent on the plain ``openai`` client: no lightspan code in it but the reward.

ScienceWorld (Wang et al., 2022, arXiv:2203.07540) is a text game of elementary-school science tasks
("find a non-living thing", "find the animal with the longest life span", "make green paint"), scored
0-100 by the game with partial credit for the sub-goals reached. The shape is Agent Lightning's
ScienceWorld example (``sw_agent``: the task and variation given as ``TASK_NAME``, ``VARIATION_IDX``
and ``SIMPLIFICATION``; the game's JVM started per rollout; a step limit; the final score / 100 as the
one reward), with the ReAct protocol of the ScienceWorld baselines instead of numbered choices:

    user   <instruction, the task, the room>          Observation: This room is called the hallway ...
    model  Thought: a picture is not alive.  Action: focus on picture
    user   Observation: You focus on the picture.
    model  Thought: ...                      Action: go to kitchen
    ...

Each model turn stops at its first blank line; its last ``Action:`` line (lower-cased, trailing
punctuation dropped) goes to the game as typed. **Valid actions**: the game is the judge. An action it
does not know ("No known action matches that input.") is the agent's mistake, never the
infrastructure's: it costs a step, the next observation says so and lists a few actions that are valid
there, and the episode goes on; a reply with no ``Action:`` line is handled the same way. An ambiguous
action ("Ambiguous request: ... 0: ... 1: ...") is resolved with the first reading, as the game's own
baseline agents do. The episode ends when the game says so (task done, or a wrong ``focus on``) or
after ``max_steps`` actions; the reward is the game's final score / 100, clipped to [0, 1].

**History window (compaction).** The chat grows by one exchange a step, and a ScienceWorld episode
is tens of steps. Every ``compact_every`` steps the agent rewrites its prompt: the chat is replaced by
one user turn holding the instruction, the task, the actions taken so far (one line, each marked when
the game refused it) and the current room (the game's free ``look``). Between rewrites each prompt
extends the previous call's exactly; at a rewrite it does not. That is the case lightspan's transition
builder treats as a new segment of the same rollout (docs/architecture.md).

**Infrastructure.** A game engine that cannot start (no Java, the jar crashing) or dies mid-episode is
not the policy's doing: the agent emits no reward and exits with status 75 (``os.EX_TEMPFAIL``), which
``lightspan rollout`` records as an infrastructure failure (retried, never trained on, never a 0).

    lightspan rollout --tasks examples/scienceworld/data/train.jsonl --samples 4 \\
      --env-map TASK_NAME=input.task_name,VARIATION_IDX=input.variation -- python examples/scienceworld/agent.py

Settings come from the task JSON in ``LIGHTSPAN_TASK`` (``lightspan experiment`` sets ``temperature``,
0 for held-out tasks), else from ``SW_<NAME>`` in the environment: ``temperature`` (0.7),
``max_tokens`` per turn (48), ``max_steps`` (8), ``compact_every`` (4), ``shots`` (1 worked dialogue),
``hint_actions`` (valid actions of different kinds shown with each observation: 6), ``obs_chars`` (an observation's
characters kept: 900).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import sys
import zlib

from openai import OpenAI

try:  # optional: the reward could equally be posted later by id
    from lightspan.tracing import emit_reward
except ImportError:  # pragma: no cover
    def emit_reward(value, **_):
        pass

log = logging.getLogger("scienceworld_agent")

INSTRUCTION = ("You play a text game about science. Each turn, write one short thought, then one action:\n"
               "Thought: <why>\nAction: <action>\n"
               "You can: look around, look at OBJ, go to ROOM, teleport to ROOM, pick up OBJ, open OBJ, "
               "focus on OBJ, move OBJ to OBJ, pour OBJ in OBJ, mix OBJ, use OBJ on OBJ, wait, inventory. "
               "Use the names of things as the game writes them.")
STOP = ["\n\n", "\nObservation"]
REFUSED = ("No known action matches that input.", "Unknown action.")
# a worked dialogue made here (its rooms and things are not a real variation's): the model copies its form
SHOT_TASK = ("Your task is to find a(n) metal thing. First, focus on the thing. Then, move it to the blue box "
             "in the workshop.")
SHOT = [("This room is called the bathroom. In it, you see: \n\tthe agent\n\ta substance called air\n"
         "\ta bath tub\n\ta towel\nYou also see:\n\tA door to the workshop (that is open)\n"
         "Valid actions include: look at towel; go to workshop; pick up towel; focus on bath tub",
         "Thought: nothing here is metal. I go to the workshop.\nAction: go to workshop"),
        ("You move to the workshop.\nValid actions include: open blue box; look around; focus on table",
         "Thought: I look at the room.\nAction: look around"),
        ("This room is called the workshop. In it, you see: \n\tthe agent\n\ta blue box (containing nothing)\n"
         "\ta table. On the table is: an iron nail, a paper cup.\n"
         "Valid actions include: pick up paper cup; focus on iron nail; move table to blue box; look at table",
         "Thought: an iron nail is metal.\nAction: focus on iron nail"),
        ("You focus on the iron nail.\nValid actions include: look around; move iron nail to blue box; wait",
         "Thought: now I move it to the blue box.\nAction: move iron nail to blue box")]
_ACTION = re.compile(r"^\s*actions?\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


class EngineUnavailable(RuntimeError):
    """The ScienceWorld engine (a JVM) could not start or stopped answering: an infrastructure failure."""


def parse_action(reply: str) -> str | None:
    """The last ``Action:`` line of a reply (``Actions:`` too), lower-cased, cut at a ``;`` or `` (``
    (a copied history line), quotes and trailing punctuation dropped; None when there is none."""
    found = _ACTION.findall(reply or "")
    if not found:
        return None
    action = re.split(r";| \(", found[-1])[0].strip().strip("\"'`").rstrip(".!").strip().lower()
    return action or None


def first_turn(task: str, observation: str, done: list[tuple[str, bool]] | None = None) -> str:
    """The opening user turn, and the one a compaction rewrites the chat into (with ``done``)."""
    text = f"{INSTRUCTION}\nTask: {task}"
    if done:
        text += "\nYour actions so far: " + "; ".join(a + ("" if ok else " (refused)") for a, ok in done)
    return f"{text}\nObservation: {observation}"


def shot_turns(n: int) -> list[dict]:
    if n <= 0:
        return []
    turns = []
    for i, (observation, reply) in enumerate(SHOT):
        turns.append({"role": "user", "content": first_turn(SHOT_TASK, observation) if i == 0
                      else f"Observation: {observation}"})
        turns.append({"role": "assistant", "content": reply})
    return turns


def clip(text: str, chars: int) -> str:
    text = " ".join((text or "").replace("\t", " ").split(" ")).strip()
    return text if len(text) <= chars else text[:chars].rstrip() + " ..."


class Game:
    """The ScienceWorld engine behind the few calls the agent makes; every engine error is an
    :class:`EngineUnavailable`."""

    def __init__(self, step_limit: int = 100):
        try:
            from py4j.protocol import Py4JError
            from scienceworld import ScienceWorldEnv
        except ImportError as e:
            raise EngineUnavailable(f"the scienceworld package is not installed ({e}): "
                                    "pip install 'lightspan[scienceworld]'") from None
        self._errors = (Py4JError, OSError, EOFError)
        try:
            self.env = ScienceWorldEnv("", envStepLimit=step_limit)
        except Exception as e:   # no java (FileNotFoundError), a jar that exits at once (ValueError: no port)
            raise EngineUnavailable(f"the ScienceWorld engine did not start ({type(e).__name__}: {e}); it needs "
                                    "a Java runtime on PATH: bash examples/scienceworld/setup.sh") from None
        self.task = self.observation = ""

    def load(self, task_name: str, variation: int, simplification: str = "easy") -> None:
        """Load a task's variation and reset it; a task or variation the game does not have is bad
        input (ValueError naming the field), not a broken engine."""
        names = self._call(self.env.get_task_names)
        if task_name not in names:
            raise ValueError(f"TASK_NAME={task_name!r} is not a ScienceWorld task; the tasks are "
                             f"{', '.join(names)}: fix the task file")
        n = self._call(self.env.get_max_variations, task_name)
        if not 0 <= variation < n:
            raise ValueError(f"VARIATION_IDX={variation} is outside {task_name}'s 0..{n - 1}: fix the task file")
        self._call(self.env.load, task_name, variation, simplification)
        self.task = self._call(self.env.get_task_description)
        self.observation, _ = self._call(self.env.reset)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as e:
            raise EngineUnavailable(f"the ScienceWorld engine stopped answering ({type(e).__name__}: {e})") from None

    def step(self, action: str) -> tuple[str, int, bool]:
        """(observation, score 0-100, done) after ``action``; an ambiguous action takes the first reading."""
        observation, _, done, info = self._call(self.env.step, action)
        if observation.startswith("Ambiguous request"):
            observation, _, done, info = self._call(self.env.step, "0")
        return observation, int(info["score"]), bool(done)

    def look(self) -> str:
        return self._call(self.env.look)

    def valid_actions(self) -> dict[int, list[str]]:
        """The actions the game would take here, by action template (``focus on OBJ``, ``go to ROOM``, ...)."""
        out: dict[int, list[str]] = {}
        for a in self._call(self.env.get_valid_action_object_combinations_with_templates):
            out.setdefault(int(a["template_id"]), []).append(a["action"])
        return {t: sorted(actions) for t, actions in sorted(out.items())}

    def close(self) -> None:
        try:
            self.env.close()
        except Exception:  # noqa: BLE001 (the JVM may be gone already; it dies with this process anyway)
            pass
        self.env.close = lambda: None   # ScienceWorldEnv.__del__ closes again: a BrokenPipeError at exit


def suggest(valid: dict[int, list[str]], k: int, rng: random.Random) -> list[str]:
    """Up to ``k`` valid actions, each of a different kind (template), picked at random: a kitchen has
    a thousand valid actions, nearly all ``move X to Y`` and ``pour X in Y``. Never ``reset task``,
    ``task`` or ``wait1``, which tell the model nothing."""
    kinds = [actions for actions in valid.values() if actions[0] not in ("reset task", "task", "wait1")]
    rng.shuffle(kinds)
    return [rng.choice(actions) for actions in kinds[:k]]


def observe(game: Game, observation: str, hint_actions: int, obs_chars: int, rng: random.Random,
            prefix: str = "Observation: ") -> str:
    """A user turn: the game's answer, then a few actions valid where the agent stands."""
    text = prefix + clip(observation, obs_chars)
    hints = suggest(game.valid_actions(), hint_actions, rng) if hint_actions > 0 else []
    return text + ("\nValid actions include: " + "; ".join(hints) if hints else "")


def play(client: OpenAI, game: Game, *, model: str = "policy", temperature: float = 0.7, max_tokens: int = 48,
         max_steps: int = 8, compact_every: int = 4, shots: int = 1, hint_actions: int = 6,
         obs_chars: int = 900, seed: int = 0) -> dict:
    """One episode; returns what happened (the reward is ``score / 100``)."""
    rng = random.Random(seed)          # which valid actions are shown: fixed per task (greedy evals repeat)
    messages = [*shot_turns(shots), {"role": "user", "content": first_turn(
        game.task, observe(game, game.observation, hint_actions, obs_chars, rng, prefix=""))}]
    done_actions: list[tuple[str, bool]] = []
    score, finished, invalid, compactions, since = 0, False, 0, 0, 0
    for step in range(max_steps):
        if since == compact_every:     # rewrite the chat: task, actions so far, the room as it is now
            messages = [*shot_turns(shots),
                        {"role": "user", "content": first_turn(
                            game.task, observe(game, game.look(), hint_actions, obs_chars, rng, prefix=""), done_actions)}]
            compactions, since = compactions + 1, 0
        response = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                                  max_tokens=max_tokens, stop=STOP)
        reply = (response.choices[0].message.content or "").strip()
        messages.append({"role": "assistant", "content": reply})
        action = parse_action(reply)
        if action is None:    # no action: the agent's mistake, a step lost, as a refused action
            observation, ok = "Write your action on a line that starts with 'Action:'.", False
        else:
            observation, score, finished = game.step(action)
            ok = not observation.startswith(REFUSED)
        since += 1
        invalid += not ok
        done_actions.append((action or "(none)", ok))
        if finished or step == max_steps - 1:
            break
        messages.append({"role": "user", "content": observe(game, observation, hint_actions, obs_chars, rng)})
    return {"actions": [a for a, _ in done_actions], "steps": len(done_actions), "invalid": invalid,
            "compactions": compactions, "score": score, "finished": finished,
            "reward": max(0.0, min(1.0, score / 100.0))}


def settings(task: dict) -> dict:
    """The episode's settings: the task's field, else ``SW_<NAME>``, else the default."""
    defaults = {"temperature": 0.7, "max_tokens": 48, "max_steps": 8, "compact_every": 4, "shots": 1,
                "hint_actions": 6, "obs_chars": 900}
    out = {}
    for name, default in defaults.items():
        raw = task.get(name, os.environ.get(f"SW_{name.upper()}", default))
        try:
            out[name] = type(default)(raw)
        except (TypeError, ValueError):
            raise SystemExit(f"scienceworld agent: {name}={raw!r} is not a {type(default).__name__}: "
                             f"fix the task field '{name}' or SW_{name.upper()}") from None
    if out["compact_every"] < 1 or out["max_steps"] < 1:
        raise SystemExit("scienceworld agent: compact_every and max_steps must be at least 1")
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    task = json.loads(os.environ.get("LIGHTSPAN_TASK") or "{}")
    task_name = os.environ.get("TASK_NAME") or task.get("task_name")
    variation = os.environ.get("VARIATION_IDX", task.get("variation"))
    if not task_name or variation is None:
        raise SystemExit("scienceworld agent: no task: set TASK_NAME and VARIATION_IDX (lightspan rollout "
                         "--env-map TASK_NAME=input.task_name,VARIATION_IDX=input.variation)")
    simplification = os.environ.get("SIMPLIFICATION", task.get("simplification", "easy"))
    opts = settings(task)
    try:
        game = Game()
    except EngineUnavailable as e:
        log.error("%s", e)
        sys.exit(os.EX_TEMPFAIL)   # not the policy's doing: no reward, "infrastructure, retry"
    try:
        game.load(task_name, int(variation), simplification)
        episode = play(OpenAI(), game, model=os.environ.get("AGENT_MODEL", "policy"),
                       seed=zlib.crc32(f"{task_name}:{variation}".encode()), **opts)
    except EngineUnavailable as e:
        log.error("%s", e)
        sys.exit(os.EX_TEMPFAIL)
    finally:
        game.close()
    emit_reward(episode["reward"])
    print(json.dumps({"task": task.get("id"), "task_name": task_name, "variation": int(variation), **episode}))


if __name__ == "__main__":
    main()
