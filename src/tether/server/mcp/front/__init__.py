"""`/mcp` as the HTTP client meets it, written around the SDK session: who may come in (`admission`), the
OAuth protected-resource metadata (`resource_metadata`) and the transport that answers with a JSON body unless
a call must stream (`transport`)."""
