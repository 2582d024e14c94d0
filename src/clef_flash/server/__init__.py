"""The System One HTTP server: `create_app(model, **settings)` builds it around a loaded `Clef`.

    app.py        SystemOneServer: the routes as a table, errors, health (the worker's watchdog), metrics (FastAPI)
    body.py       reading a body: content type, size limits before and after zstd / gzip, the parse budget
    batcher.py    the bounded queue and the one model worker thread (dynamic batching)
    schemas.py    the API routes' request and response schemas for /openapi.json
    transport.py  uvicorn with header / body read deadlines, a connection cap and a shutdown deadline
    metrics.py    the Prometheus metrics (prometheus_client), one registry per app
    demo.html     the support-ticket triage page served at /

Needs `fastapi`, `uvicorn` and `prometheus_client` (`pip install "clef-flash[serve]"`).
"""

from .app import (
    DEFAULT_MAX_BODY_BYTES,
    MODEL_ALIASES,
    ServerSettings,
    create_app,
    serve,
)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "MODEL_ALIASES", "ServerSettings", "create_app", "serve"]
