"""Test agent for what survives an agent's death: two chat calls, then what the task's ``behaviour``
says: ``exit`` (exit status 0), ``exit1`` (``sys.exit(1)``), ``raise`` (an uncaught exception),
``hang`` (sleeps past any timeout, its pid in the task's ``pid_file``) or ``kill`` (SIGKILLs itself,
as the OOM killer would).

With ``go_file`` set it first writes its pid to ``pid_file`` and waits (up to 120 s) for that file to
appear before it makes its calls, so a test can change the world (stop the collector) meanwhile.
"""

import json
import os
import signal
import sys
import time

from openai import OpenAI

task = json.loads(os.environ["LIGHTSPAN_TASK"])
if task.get("go_file"):
    with open(task["pid_file"], "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not os.path.exists(task["go_file"]) and time.monotonic() < deadline:
        time.sleep(0.05)
client = OpenAI(max_retries=0)
for n in range(2):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"call {n}"}],
                                   max_tokens=2, temperature=0.0)
behaviour = task["behaviour"]
if behaviour == "exit1":
    sys.exit(1)
if behaviour == "raise":
    raise RuntimeError(f"task {task['id']} raises, as asked")
if behaviour == "hang":
    with open(task["pid_file"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
if behaviour == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
print(json.dumps({"task": task["id"], "ok": True}))
