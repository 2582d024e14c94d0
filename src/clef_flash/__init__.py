"""clef-flash: a fast, exact runtime for Cloudflare's clef-flash decision model."""

import os

# Transparent huge pages for torch's CPU allocations of 2 MB and more (c10 reads this once, at its first allocation,
# so it must be set before the process makes any tensor; a value already set is kept: THP_MEM_ALLOC_ENABLE=0 turns it
# off). Loading packs every 8-bit weight into fresh memory, and on the VMs measured most of a load's system time was the
# kernel zeroing 4 KiB pages: 9B bundle under the AVX2 emulation, `load` 9.6-9.8 s with it against 10.8-15.2 s without
# (benchmarks/results/bundle-9b-ready-A-avx2-emulated.json). Linux only; elsewhere torch ignores it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .errors import (  # noqa: E402
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
