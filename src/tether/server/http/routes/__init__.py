"""The REST API's routes under /api/v1, one module per resource; `tether.server.http.app` includes them in order
(the order of the OpenAPI document's paths)."""
