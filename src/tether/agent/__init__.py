"""The reasoning loop: LLM client, planner, executor, recovery, answer (seed 004).

Sub-packages, each importing only the ones before it: `llm` (the LLM client), `planning` (plan, planner),
`run` (the task model, executor, recovery, answer), `tasks` (the task service, store and API);
`server_app` puts them on the agent server.
"""
