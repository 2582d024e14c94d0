"""The peak RSS of a long record's last decoder step and its head, without running the tokens before it.

    python benchmarks/long_last_step.py [--model benchmarks/.peer/bundle-9b-part] [--tokens 65536] [--segment 2048]

In a fresh process: load, answer a ~370-token record (its peak is the short record's), then build what a
record of --tokens tokens holds when its last segment starts, as a segmented run leaves it: K/V buffers of
the whole length (filled with random values up to the segment), DeltaNet states, and the head's memory rows of
the tokens so far (random); then run the last segment and the head on the real token ids, as the backend does.
The peak is where a long record's is (K/V and memory rows at their largest, the longest past attended), so
this measures it in minutes where the whole record takes an hour on a loaded machine. It does not see the
allocator's fragmentation over the earlier segments: the whole-record figure is `state_reuse.py --parts long`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import clef_flash
from clef_flash.model.head_batch import build_head_batch
from clef_flash.model.joint_head import FeatureBuilder
from clef_flash.model.qwen3_5 import AttentionState, DecoderState, DeltaNetState
from clef_flash.prefill import DEFAULT_SEGMENT_TOKENS, run_segments
from clef_flash.request.samples import request_of_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_mb  # noqa: E402
from state_reuse import rss_mb, tokens_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/.peer/bundle-9b-part")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--segment", type=int, default=DEFAULT_SEGMENT_TOKENS)
    args = parser.parse_args()
    load = os.getloadavg()
    model = clef_flash.load(args.model, state_cache_mb=0)
    model.answer(request_of_tokens(lambda request: tokens_of(model, request), 370, seed=1))
    short_peak = peak_rss_mb()
    record = model.encode(request_of_tokens(lambda request: tokens_of(model, request), args.tokens))
    decoder, head, segment = model.parts.decoder, model.parts.head, args.segment
    total = record.token_count
    past = total - (total - 1) % segment - 1  # where a segmented run's last step starts
    generator = torch.Generator().manual_seed(0)
    layers = []
    for layer in decoder.empty_state().layers:
        if isinstance(layer, DeltaNetState):
            layers.append(layer)
        else:  # the buffers a segmented run allocates once, at the record's length
            key, value = (torch.randn(1, layer.key.shape[1], total, layer.key.shape[3], generator=generator, dtype=layer.key.dtype) for _ in range(2))
            layers.append(AttentionState(key, value, growable=True))
    state = DecoderState((past,), layers)
    head_batch = build_head_batch([record], model.device)
    builder = FeatureBuilder(head, head_batch, [total], model.device)
    builder.add_memory(0, torch.randn(past, head.config.width, generator=generator))
    before = rss_mb()
    start = time.perf_counter()
    with torch.inference_mode():
        run_segments(decoder, [record.input_ids[past:]], segment=segment, pad_id=model.checkpoint.tokenizer.pad_id,
                     device=model.device, on_segment=lambda hidden, rows, done, counts: builder.add(hidden, rows, [past + d for d in done], counts),
                     state=state)
        head.score(builder.features(), head_batch, model.parts.lm_head)
    report = {
        "tokens": total, "segment": segment, "last_segment_from": past, "seconds": time.perf_counter() - start,
        "short_record_peak_mb": short_peak, "rss_before_last_step_mb": before, "peak_mb": peak_rss_mb(),
        "kv_mb": (decoder.state_nbytes(total) - decoder.state_nbytes(0)) / 2**20, "head_memory_mb": total * head.config.width * 4 / 2**20,
        "precision": model.precision, "load_average": [load, os.getloadavg()],
    }
    report["peak_over_short_mb"] = report["peak_mb"] - short_peak
    report["rest_mb"] = report["peak_over_short_mb"] - report["kv_mb"] - report["head_memory_mb"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
