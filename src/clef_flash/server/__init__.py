"""The System One HTTP server: `create_app(model, **settings)` builds it around a loaded `Clef`.

    app.py       SystemOneServer: the routes as a table, errors, health, metrics (FastAPI)
    body.py      reading a body: size limits before and after zstd / gzip decompression
    batcher.py   the bounded queue and the one model worker thread (dynamic batching)
    metrics.py   the Prometheus text format, written by hand
    demo.html    the support-ticket triage page served at /

Needs `fastapi` and `uvicorn` (`pip install "clef-flash[serve]"`).
"""

from .app import (
    DEFAULT_MAX_BODY_BYTES,
    MODEL_ALIASES,
    ServerSettings,
    create_app,
    serve,
)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "MODEL_ALIASES", "ServerSettings", "create_app", "serve"]
