"""The port's speed and quality tables for a Core ML export, run on a Mac.

    python benchmarks/coreml_mac.py EXPORT --source SRC [--requests 20 | --requests-file JSONL] [--tokens 512] [--rounds 5]
                                    [--json coreml-mac.json] [--markdown coreml-mac.md]

EXPORT is `clef-flash export coreml SRC EXPORT`'s directory; SRC the release or bundle it came from.
Speed: load time (the host, then the first prediction, which compiles and loads the package), one part at
L512 (median of --rounds predictions), every part in order at each bucket of the export (the decoder's time
per bucket, and tokens/s at a full bucket), one record end to end (tokenize, parts, head). The machine: macOS
version and chip. Written as one JSON and one Markdown table, both for pasting back. Quality: decisions
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
import subprocess
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


def machine() -> dict:
    """The OS and chip (on a Mac: macOS version and `machdep.cpu.brand_string`, e.g. Apple M3 Pro)."""
    chip = platform.processor() or platform.machine()
    if sys.platform == "darwin":
        chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip() or chip
    return {"os": f"macOS {platform.mac_ver()[0]}" if sys.platform == "darwin" else platform.platform(), "chip": chip,
            "python": platform.python_version()}  # fmt: skip


def markdown(report: dict) -> str:
    """The tables a Mac user pastes back."""
    speed, quality = report["speed"], report["quality_vs_fp32"]
    lines = [
        f"clef-flash Core ML on {report['machine']['os']}, {report['machine']['chip']}; runner {report['runner']}; "
        f"{report['parts']} parts",
        "",
        f"| load | first prediction | one record ({speed['record_tokens']} tokens) | peak RSS |",
        "|---:|---:|---:|---:|",
        f"| {speed['load_ms']:.0f} ms | {speed['first_prediction_ms']:.0f} ms | {speed['one_record_ms']:.1f} ms | {speed['peak_rss_mb']:,} MB |",
        "",
        "| bucket | all parts, ms (median) | tokens/s at a full bucket |",
        "|---:|---:|---:|",
        *(f"| L{bucket} | {row['decoder_ms']:.1f} | {row['tokens_per_s']:,.0f} |" for bucket, row in speed["per_bucket"].items()),
        "",
        "| vs our fp32 path | questions | decisions differing | median \\|dp\\| | max \\|dp\\| |",
        "|---|---:|---:|---:|---:|",
        f"| {quality['requests']} requests | {quality['questions']} | {quality['answers_differing']} | "
        f"{quality['median_abs_dp']:.2e} | {quality['max_abs_dp']:.2e} |",
    ]
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--json", type=Path, default=Path("coreml-mac.json"), help="the report (default coreml-mac.json)")
    parser.add_argument("--markdown", type=Path, default=Path("coreml-mac.md"), help="the tables (default coreml-mac.md)")
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
    per_bucket, widest = {}, host.decoder_inputs(record, max(host.layout.buckets[-1], bucket))
    for size in host.layout.buckets:  # every part in order on the record's first `size` positions (cos, sin: prefixes)
        padded = {"hidden": widest["hidden"][:, :size].contiguous(), "cos": widest["cos"][:size], "sin": widest["sin"][:size]}

        def decoder() -> None:
            hidden = padded["hidden"]
            for entry in host.layout.parts:
                hidden = host.runner.predict(entry["package"], function_name(size), {**padded, "hidden": hidden})

        decoder()  # loads (on a Mac compiles) each part's function at this bucket
        decoder_ms, _ = median_ms(decoder, args.rounds)
        per_bucket[str(size)] = {"decoder_ms": round(decoder_ms, 2), "tokens_per_s": round(size / decoder_ms * 1000, 1)}
    model.answer(requests[0])  # warm every part and the head at this record's bucket
    record_ms, record_rounds = median_ms(lambda: model.answer(requests[0]), args.rounds)

    # quality: the same requests through our fp32 torch path on the source
    candidate = model.score([model.encode(request) for request in requests])
    reference_model = clef_flash.load(args.source, precision="fp32")
    reference = reference_model.score([reference_model.encode(request) for request in requests])
    quality = agreement(reference, candidate)
    quality.pop("differing")

    report = {
        "machine": machine(),
        "runner": "torch stand-in (" + args.stand_in_dtype + ")" if args.stand_in else "Core ML (" + host.runner.compute_units.name + ")",
        "export": str(args.export),
        "parts": len(host.layout.parts),
        "speed": {
            "load_ms": round(load_ms, 1),
            "first_prediction_ms": round(first_ms, 1),
            f"one_part_L{bucket}_ms": round(part_ms, 2),
            "one_part_rounds_ms": [round(t, 2) for t in part_rounds],
            "per_bucket": per_bucket,
            "one_record_ms": round(record_ms, 2),
            "one_record_rounds_ms": [round(t, 2) for t in record_rounds],
            "record_tokens": record.token_count,
            "peak_rss_mb": round(peak_rss_mb()),
        },
        "quality_vs_fp32": quality,
    }
    table = markdown(report)
    print(table)
    args.json.write_text(json.dumps(report, indent=1))
    args.markdown.write_text(table)
    print(f"wrote {args.json} and {args.markdown}: send both")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
