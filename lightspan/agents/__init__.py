"""Agents that ship with lightspan, run as scripts (``python .../math_agent.py``), never imported by
lightspan itself: ``math_agent.py`` is the demo's. They live in the package so that ``lightspan demo``
finds its agent in an installed wheel; ``examples/`` runs the same files."""
