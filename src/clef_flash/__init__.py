"""clef-flash: a fast, exact runtime for Cloudflare's clef-flash decision model."""

from .errors import (
    BundleError,
    CalibrationError,
    ClefError,
    InferenceError,
    ModelSourceError,
    QuestionSetError,
    RecordTooLong,
    RequestInvalid,
    WeightsError,
)

__version__ = "0.1.0"

_LAZY = {"load": "loader", "Clef": "clef", "EncodedRecord": "request.records", "EncodedQuestion": "request.records"}


def __getattr__(name: str):
    # torch is imported on first use of the engine, not by `import clef_flash` or `clef_flash.request.protocol`.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BundleError",
    "CalibrationError",
    "Clef",
    "ClefError",
    "EncodedQuestion",
    "EncodedRecord",
    "InferenceError",
    "ModelSourceError",
    "QuestionSetError",
    "RecordTooLong",
    "RequestInvalid",
    "WeightsError",
    "__version__",
    "load",
]
