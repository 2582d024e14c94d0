"""clef-flash: a fast, exact runtime for Cloudflare's clef-flash decision model."""

from .errors import (
    BundleError,
    ClefError,
    InferenceError,
    ModelSourceError,
    RecordTooLong,
    RequestInvalid,
    WeightsError,
)

__version__ = "0.1.0"

__all__ = [
    "BundleError",
    "ClefError",
    "InferenceError",
    "ModelSourceError",
    "RecordTooLong",
    "RequestInvalid",
    "WeightsError",
    "__version__",
]
