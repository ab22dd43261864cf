"""Commands that run things and follow tasks: `run`, `tasks`, `log` (run), `answer`, `approve`, `deny`, `cancel` (task),
`approvals`, `webhooks` (approvals), `undo`, `sessions` (journal) and `demo`."""
