"""Core ML: the port's packages exported from any source, and a host that runs them (macOS) or their torch twins.

    layout.py    the export directory: files, config.json, manifest (no torch, no coremltools)
    modules.py   the export twins (model/export.py) filled from a checkpoint, one part at a time
    export.py    `clef-flash export coreml`: trace, convert, quantize per op, merge bucket functions
    host.py      the host side: bucket, embedding gather, cos/sin, span matrices, masks, refusals
    runners.py   MLModelRunner (macOS) and TorchRunner (the traced twins, standing in for Core ML)
"""

from ..checkpoint.coreml_layout import DEFAULT_BUCKETS, HEAD_OPTIONS, HEAD_QUESTIONS, RUNNERS

__all__ = ["DEFAULT_BUCKETS", "HEAD_OPTIONS", "HEAD_QUESTIONS", "RUNNERS"]
