"""The reasoning loop: LLM client, planner, executor, recovery, answer (seed 004)."""
