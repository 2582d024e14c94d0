"""CUDA graphs: a whole decoder step (records from their start, nothing kept) captured once per (batch, bucket) shape
and replayed, so that a step of 32 layers costs one launch instead of thousands of Python-issued kernels.

    pool = GraphPool(decoder, pad_id, device, capture="lazy")
    hidden = pool(input_ids)        # input_ids [B, L] long on the host, B and L buckets (buckets.py); -> [B, L, D]

A step's shape is fixed by the buckets (prefill.run_segments pads it), so a handful of graphs serve every record.
Each is captured on first use ("lazy") or for every (batch, bucket) at load ("load": slower to start, no capture in
the first requests), all in one memory pool (they never run at once). Replaying writes into the graph's own input
and output buffers: the input ids are copied in (the one upload), the output is valid until the next replay of any
graph of the pool (they share memory: another's replay may reuse it), which prefill's callback has consumed by then
(the head reads it into tensors of its own).

What runs inside a capture must not read the device on the host or send anything up (a capture records kernels,
not host work): `device_io.capturing()` marks the region, and testing/fake_gpu.py refuses uploads inside it.
Where no CUDA runtime exists (that harness), `GraphPool(capture="eager")` runs the same steps on the same fixed
buffers without capturing: everything but the replay is exercised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import device_io
from ..device_io import CAPTURE_MODES
from ..buckets import BATCH_BUCKETS, SEQUENCE_BUCKETS
from ..model.qwen3_5 import Qwen35Decoder

WARMUP_RUNS = 2  # eager runs on a side stream before a capture (cuBLAS and Triton pick their kernels there)


@dataclass
class _Graph:
    input_ids: torch.Tensor  # [B, L] long, on the device: what each replay reads
    hidden: torch.Tensor  # [B, L, D]: what each replay writes
    graph: Any = None  # torch.cuda.CUDAGraph; None: eager


class GraphPool:
    """Captured steps of `decoder` by shape; `capture`: "lazy", "load" (CUDA), or "eager" (no capture)."""

    def __init__(self, decoder: Qwen35Decoder, pad_id: int, device: torch.device, capture: str = "lazy", max_batch: int = 32):
        if capture not in CAPTURE_MODES[:3]:
            raise ValueError(f"unknown capture mode {capture!r}: use one of {', '.join(CAPTURE_MODES[:3])}")
        if capture != "eager" and device.type != "cuda":
            raise ValueError(f"CUDA graphs capture on a CUDA device, not {device}")
        self.decoder, self.pad_id, self.device, self.capture = decoder, pad_id, device, capture
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0
        self.memory_pool = torch.cuda.graph_pool_handle() if capture != "eager" else None
        if capture == "load":
            for batch in (size for size in BATCH_BUCKETS if size <= max_batch):
                for width in SEQUENCE_BUCKETS:
                    self._graph(batch, width)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] long (host) -> the step's last_hidden_state [B, L, D] (the graph's output buffer)."""
        entry = self._graph(*input_ids.shape)
        entry.input_ids.copy_(input_ids, non_blocking=False)  # the step's one upload
        if entry.graph is None:
            with device_io.capturing():
                entry.hidden = self.decoder(entry.input_ids)
        else:
            entry.graph.replay()
        self.replays += 1
        return entry.hidden

    def describe(self) -> dict[str, Any]:
        return {"capture": self.capture, "graphs": sorted(self.graphs), "replays": self.replays}

    @torch.inference_mode()  # as every forward runs (clef.py): captured at load too, no autograd recorded
    def _graph(self, batch: int, width: int) -> _Graph:
        key = (batch, width)
        if key not in self.graphs:
            input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long, device=self.device)
            if self.capture == "eager":  # as a capture: warmed up first (each device's constants made there)
                self.decoder(input_ids)
                self.graphs[key] = _Graph(input_ids, torch.empty(0))
            else:
                self.graphs[key] = self._captured(input_ids)
        return self.graphs[key]

    def _captured(self, input_ids: torch.Tensor) -> _Graph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.decoder(input_ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool), device_io.capturing():
            hidden = self.decoder(input_ids)
        return _Graph(input_ids, hidden, graph)
