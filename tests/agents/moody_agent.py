"""Test agent for the runner's outcomes: one chat call, then what the task's ``behaviour`` says:
``ok`` (reward 1), ``crash`` (an uncaught exception: exit status 1) or ``hang`` (sleeps past any
timeout, after writing its pid to the task's ``pid_file``)."""

import json
import os
import time

from openai import OpenAI

from lightspan.tracing import emit_reward

task = json.loads(os.environ["LIGHTSPAN_TASK"])
client = OpenAI()
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}],
                               max_tokens=4, temperature=0.0)
if task["behaviour"] == "crash":
    raise RuntimeError(f"task {task['id']} crashes, as asked")
if task["behaviour"] == "hang":
    with open(task["pid_file"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
emit_reward(1.0)
print(json.dumps({"task": task["id"], "ok": True}))
