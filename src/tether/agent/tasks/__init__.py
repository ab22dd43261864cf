"""Tasks on the agent server: the task service (`service`, one module per part), their store (`store`), the
task API, its MCP tools and the approval inbox (`api`), what a restarted server does with an unfinished task
(`restart`), what several servers sharing a database or a cluster do (`cluster`), and the steps and edits the
service runs for the plans (`transfer_step`, `graph_edit`, `notices`)."""
