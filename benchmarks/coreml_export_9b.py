"""The full-size 9B Core ML export, from random 9B tensors drawn in memory (no 19 GB release on disk).

    python benchmarks/coreml_export_9b.py [--parts 0] [--buckets 256] [--tables] [--out DIR] [--keep] [--json OUT]

Exports `random:9b` (32 layers, hidden 4096, vocabulary 248,320) with `export_coreml`: the chosen parts (4 layers
each), the head, and with `--tables` the two fp16 tables; prints the size of every file, the time of each step
and the peak RSS, then deletes what it wrote unless `--keep`. All 8 parts at all 6 buckets is the real export
(`clef-flash export coreml random:9b OUT`); on a 2-core machine one part and the head at one bucket is what
fits a benchmark run, and the figures say which parts and buckets they cover.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from clef_flash.coreml.export import export_coreml


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="0", help="comma-separated part indices (0-7; default 0)")
    parser.add_argument("--buckets", default="256", help="comma-separated buckets (default 256)")
    parser.add_argument("--tables", action="store_true", help="also write embeddings.f16 and output_embeddings.f16 (2 x 2.0 GB)")
    parser.add_argument("--source", default="random:9b")
    parser.add_argument("--out", type=Path, help="where to write (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the export")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    root = args.out or Path(tempfile.mkdtemp(prefix="coreml-9b-"))
    out = root / "export"
    start = time.perf_counter()
    try:
        report = export_coreml(
            args.source,
            out,
            buckets=[int(b) for b in args.buckets.split(",")],
            only_parts=[int(p) for p in args.parts.split(",")],
            tables=args.tables,
            overwrite=True,
            log=lambda message: print(f"[{time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True),
        )
    finally:
        if not args.keep:
            shutil.rmtree(root if args.out is None else out, ignore_errors=True)
    report.update(source=args.source, parts=args.parts, buckets=args.buckets)
    print("| file | size | seconds |\n|---|---|---|")
    for name, size in report["files"].items():
        print(f"| {name} | {size / 1e6:,.1f} MB | {report['seconds'].get(name, '')} |")
    print(f"total {report['seconds']['total']} s, peak RSS {report['peak_rss_mb']:,} MB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
