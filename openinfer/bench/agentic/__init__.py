"""Agentic serving workload: multi-turn agent sessions replayed from a trace (AgentX style)."""
