"""The System One HTTP server: `create_app(model, **settings)` builds it around a loaded `Clef`.

    app.py        SystemOneServer: the routes as a table, errors, health (the worker's watchdog), metrics (FastAPI)
    settings.py   ServerSettings (and the flags `serve` and `mcp` take from them), the API key, the served names
    body.py       reading a body: content type, size limits before and after zstd / gzip, the parse budget
    batcher.py    the bounded queue and the one model worker thread (dynamic batching)
    schemas.py    the API routes' request and response schemas for /openapi.json
    transport.py  uvicorn with header / body read deadlines, a connection cap and a shutdown deadline
    mcp_tools.py  the model as MCP tools (`clef-flash mcp`), on the same settings and batcher
    metrics.py    the Prometheus metrics (prometheus_client), one registry per app
    demo.html     the support-ticket triage page served at /

Needs `fastapi`, `uvicorn` and `prometheus_client` (`pip install "clef-flash[serve]"`); settings.py needs none of
them, so the command line reads it without importing the web stack.
"""

from .settings import DEFAULT_MAX_BODY_BYTES, MODEL_ALIASES, ServerSettings

_LAZY = {"create_app": "app", "serve": "app"}


def __getattr__(name: str):
    # FastAPI is imported on first use of the app, not by `clef_flash.server.settings` (the command line's flags).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_MAX_BODY_BYTES", "MODEL_ALIASES", "ServerSettings", "create_app", "serve"]
