"""Sequence and batch buckets: the fixed shapes a GPU runs a decoder step in.

On a GPU every step is padded to a few shapes (device_io.is_gpu): its width to a sequence bucket, and a step of
records run from their start (no kept state: what a CUDA graph captures, engine/graphs.py) to a batch bucket of rows.
Padding never changes an answer: every layer is causal, so a record's real positions never read the padding after
them, a padding row is dropped, and a state continued past padding takes each row's own end (model/qwen3_5.py).
Fixed shapes buy three things: a captured graph per (bucket, batch) replayed without Python in the loop, the shape
rules of torch._int_mm met by the shape itself (M = rows x bucket, a multiple of 8 above 16), and no recompilation
by shape. On a CPU they buy nothing (a product's cost grows with its rows; the projections skip the padding there).
"""

from __future__ import annotations

# The Core ML port's sequence buckets (256, 512, 1024, 2048) with one between each two (a ~370-token record pads to
# 384, not 512: 28% fewer multiply-adds), two shorter ones for what follows a kept state (a schema and its suffix, tens
# of tokens), and above 2048 (a segment longer than the default's) multiples of 2048. All multiples of 64.
SEQUENCE_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def sequence_bucket(tokens: int) -> int:
    """The width a step of `tokens` tokens (its longest row) runs at: the smallest bucket that holds it."""
    if tokens < 1:
        raise ValueError(f"a step needs at least one token, not {tokens}")
    for bucket in SEQUENCE_BUCKETS:
        if tokens <= bucket:
            return bucket
    largest = SEQUENCE_BUCKETS[-1]
    return -(-tokens // largest) * largest


def batch_bucket(rows: int) -> int:
    """The rows a step of `rows` records from their start runs as (padding rows are dropped after): the smallest
    bucket that holds them; above the largest, `rows` itself (a step that big is seldom repeated)."""
    if rows < 1:
        raise ValueError(f"a step needs at least one row, not {rows}")
    return next((bucket for bucket in BATCH_BUCKETS if rows <= bucket), rows)
