"""The whole 9B Core ML export, from random 9B tensors drawn in memory (no 19 GB release on disk), resumable.

    python benchmarks/coreml_export_9b.py --out DIR [--parts 0-7] [--buckets 256,512,1024,2048] [--no-tables] [--json OUT]

Exports `random:9b` (32 layers, hidden 4096, vocabulary 248,320) with `export_coreml` into DIR/export: the chosen
parts (4 layers each; all 8 by default), the head, and the two fp16 tables; prints the size of every file next to
the port's, the time of each step and the peak RSS. On 2 cores the whole export takes hours: interrupted (Ctrl-C,
a kill, the end of a session), the same command resumes it, part by part, skipping every package and table that is
already written and still matches the sha256 recorded when it was finished (DIR/.export.exporting/progress.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from clef_flash.coreml.export import export_coreml

# The port's files (README, "Core ML"): 6.5 GB of parts (8 x 0.81 GiB), a 465 MB head, 2 x 2.0 GB tables.
PORT_BYTES = {"part": 0.81 * 2**30, "Head.mlpackage": 465 * 2**20, "embeddings.f16": 2.0e9, "output_embeddings.f16": 2.0e9}


def indices(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last) + 1)) if last else [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the export goes to OUT/export (kept: it is the product)")
    parser.add_argument("--parts", default="0-7", help="part indices, 0-7 or 0,3 (default all 8)")
    parser.add_argument("--buckets", default="256,512,1024,2048", help="comma-separated buckets (default 256,512,1024,2048)")
    parser.add_argument("--no-tables", action="store_true", help="skip embeddings.f16 and output_embeddings.f16 (2 x 2.0 GB)")
    parser.add_argument("--source", default="random:9b")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    parts = indices(args.parts)
    start = time.perf_counter()
    report = export_coreml(
        args.source,
        args.out / "export",
        buckets=[int(b) for b in args.buckets.split(",")],
        only_parts=None if parts == list(range(8)) else parts,
        tables=not args.no_tables,
        log=lambda message: print(f"[{time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True),
    )
    report.update(source=args.source, parts=parts, buckets=args.buckets)
    print("| file | size | the port | seconds (this run or when written) |\n|---|---:|---:|---:|")
    for name, size in report["files"].items():
        port = PORT_BYTES.get("part" if name.startswith("part") else name)
        print(f"| {name} | {size / 1e6:,.1f} MB | {port / 1e6:,.1f} MB | {report['seconds'].get(name, '')} |")
    print(f"this run {report['seconds']['total']} s (resumed: {', '.join(report['resumed']) or 'nothing'}), peak RSS {report['peak_rss_mb']:,} MB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
