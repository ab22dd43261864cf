"""The agent server's HTTP edge: the app factory, the REST routes, the request guard and rate limits, the
transport's connection caps and timeouts, the hot command path, and every use of Starlette's and uvicorn's
private code (`internals`)."""
