"""The web dashboard at `/`, and `/docs` + `/redoc` served from packaged assets (see routes.py)."""

from tether.server.web.routes import mount_web

__all__ = ["mount_web"]
