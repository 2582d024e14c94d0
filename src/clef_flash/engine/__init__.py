"""The engine: encoded records -> question results, over one of two backends.

    core.py            Engine: token budget, grouping, state reuse (the state cache), the same for every backend
    backend.py         the Backend protocol, QuestionResult, Timings
    torch_backend.py   TorchBackend: decoder + head modules, segments, states continued
    coreml_backend.py  CoreMLBackend: an export's packages, a record at a time (Core ML, or its torch twins)
    graphs.py          GraphPool: a GPU's whole decoder steps captured as CUDA graphs, one per (batch, bucket)
"""

from __future__ import annotations

from .backend import Backend, QuestionResult, Timings
from .core import DEFAULT_BATCH_TOKENS, GPU_BATCH_TOKENS, KEEP_FROM_TOKENS, Engine, fitting

__all__ = ["DEFAULT_BATCH_TOKENS", "GPU_BATCH_TOKENS", "KEEP_FROM_TOKENS", "Backend", "Engine", "QuestionResult", "Timings", "fitting"]
