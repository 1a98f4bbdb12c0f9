"""lightspan: train any LLM agent with RL from its own OpenTelemetry traces."""
