"""The demo's agent, an unchanged OpenAI-client script: ``lightspan/agents/math_agent.py`` (it ships
in the package, so that ``lightspan demo`` finds it in an installed wheel). This file runs that one,
so the commands written against ``examples/math_agent.py`` keep working:

    lightspan rollout --tasks deploy/compose/math-tasks.jsonl -- python examples/math_agent.py
"""

import runpy

runpy.run_module("lightspan.agents.math_agent", run_name="__main__", alter_sys=True)
