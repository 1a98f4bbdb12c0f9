"""Toy agent for the never-silent tests: one call of each capture outcome.

1. a chat call through its own base URL variable, spelled ``localhost`` (the runner's capture URL
   says 127.0.0.1): captured;
2. a chat call to ``OTHER_BASE_URL``, a server that is not a capture URL: not captured (other_url);
3. two streamed Responses calls: their ids are captured, but vLLM drops the logprob of the
   end-of-turn token, whose delta has no text (no_logprobs; structured outputs make the random
   model end its turn).
"""

import json
import os

from openai import OpenAI

from lightspan.tracing import emit_reward

task = json.loads(os.environ["LIGHTSPAN_TASK"])
messages = [{"role": "user", "content": task["prompt"]}]
own = OpenAI(base_url=os.environ["OPENAI_BASE_URL"].replace("127.0.0.1", "localhost"))
own.chat.completions.create(model="policy", messages=messages, max_tokens=4)
OpenAI(base_url=os.environ["OTHER_BASE_URL"]).chat.completions.create(model="policy", messages=messages, max_tokens=4)
for _ in range(2):
    for _event in own.responses.create(model="policy", input=task["prompt"], max_output_tokens=8, stream=True,
                                       extra_body={"structured_outputs": {"regex": "Tokyo"}}):
        pass
emit_reward(0.5)
print(json.dumps({"task": task["id"]}))
