"""The port's speed and quality tables for a Core ML export, run on a Mac.

    python benchmarks/coreml_mac.py EXPORT --source SRC [--requests 20 | --requests-file JSONL] [--tokens 512] [--rounds 5] [--json OUT]

EXPORT is `clef-flash export coreml SRC EXPORT`'s directory; SRC the release or bundle it came from.
Speed: load time (the host, then the first prediction, which compiles and loads the package), one part at
L512 (median of --rounds predictions), one record end to end (tokenize, parts, head). Quality: decisions
differing and median / max |dp| against our fp32 torch path on SRC, on the same generated requests.

On macOS the packages run through Core ML (`MLModelRunner`). Elsewhere pass `--stand-in`: the traced torch
twins run instead of Core ML (fp32, or `--stand-in-dtype fp16`), so the whole script is known to work up to
the Core ML call (tests/test_coreml.py runs it this way); its figures then say nothing about a Mac.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


import clef_flash
from clef_flash.bench import generated_requests
from clef_flash.machine import peak_rss_mb
from clef_flash.checkpoint.coreml_layout import function_name, read_export
from clef_flash.coreml.runners import MLModelRunner, TorchRunner
from clef_flash.evaluate import agreement
from clef_flash.model.precision import COREML_PART_DTYPE, PRECISIONS

SPEED_BUCKET = 512


def runner_for(args: argparse.Namespace):
    if not args.stand_in:
        return MLModelRunner(args.export)
    part_dtype = {"fp32": PRECISIONS["fp32"].compute_dtype, "fp16": COREML_PART_DTYPE}[args.stand_in_dtype]
    return TorchRunner(args.source, read_export(args.export), part_dtype=part_dtype)


def median_ms(run, rounds: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), times


def main(argv: list[str] | None = None, runner=None) -> dict:
    """`runner`: an already built runner to use (the tests pass their stand-in)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--source", required=True, help="the release or bundle the export came from (the fp32 reference)")
    parser.add_argument("--requests", type=int, default=20, help="generated requests (three questions each)")
    parser.add_argument("--requests-file", type=Path, help="JSONL of System One requests to use instead")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per generated request, about")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stand-in", action="store_true", help="run the traced torch twins instead of Core ML (off macOS)")
    parser.add_argument("--stand-in-dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--json", type=Path, help="write the tables here")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = clef_flash.load(args.export, coreml_runner=runner or runner_for(args))
    host = model.host
    load_ms = (time.perf_counter() - start) * 1000
    if args.requests_file:
        requests = [json.loads(line) for line in args.requests_file.read_text().splitlines() if line.strip()]
    else:
        requests = generated_requests(model, records=args.requests, tokens=args.tokens, seed=args.seed)

    # speed: the first prediction loads (and on a Mac compiles) the package; then one part at L512, then records
    record = model.encode(requests[0])
    fitting = [b for b in host.layout.buckets if b >= max(SPEED_BUCKET, record.token_count)]
    bucket = fitting[0] if fitting else host.check(record)
    inputs = host.decoder_inputs(record, bucket)
    part = host.layout.parts[0]["package"]
    start = time.perf_counter()
    host.runner.predict(part, function_name(bucket), inputs)
    first_ms = (time.perf_counter() - start) * 1000
    part_ms, part_rounds = median_ms(lambda: host.runner.predict(part, function_name(bucket), inputs), args.rounds)
    model.answer(requests[0])  # warm every part and the head at this record's bucket
    record_ms, record_rounds = median_ms(lambda: model.answer(requests[0]), args.rounds)

    # quality: the same requests through our fp32 torch path on the source
    candidate = model.score([model.encode(request) for request in requests])
    reference_model = clef_flash.load(args.source, precision="fp32")
    reference = reference_model.score([reference_model.encode(request) for request in requests])
    quality = agreement(reference, candidate)
    quality.pop("differing")

    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "runner": "torch stand-in (" + args.stand_in_dtype + ")" if args.stand_in else "Core ML (" + host.runner.compute_units.name + ")",
        "export": str(args.export),
        "parts": len(host.layout.parts),
        "speed": {
            "load_ms": round(load_ms, 1),
            "first_prediction_ms": round(first_ms, 1),
            f"one_part_L{bucket}_ms": round(part_ms, 2),
            "one_part_rounds_ms": [round(t, 2) for t in part_rounds],
            "one_record_ms": round(record_ms, 2),
            "one_record_rounds_ms": [round(t, 2) for t in record_rounds],
            "record_tokens": record.token_count,
            "peak_rss_mb": round(peak_rss_mb()),
        },
        "quality_vs_fp32": quality,
    }
    print(f"runner: {report['runner']}  ({report['machine']['platform']})")
    print("| speed | ms |\n|---|---|")
    for key, value in report["speed"].items():
        if not key.endswith("rounds_ms"):
            print(f"| {key} | {value} |")
    print("| quality vs our fp32 | value |\n|---|---|")
    for key in ("requests", "questions", "answers_differing", "near_ties", "median_abs_dp", "max_abs_dp"):
        print(f"| {key} | {quality[key]} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
