"""Seconds for a 370-token and a 4,096-token record, and peak RSS, in this process (one side of an A/B).

    python benchmarks/record_speed.py [--model benchmarks/.peer/bundle-9b-part] [--repeats 5,2] [--tokens 370,4096] [--precision P]

Prints one JSON line: the seconds until ready and of the first answer, the median seconds of each record (state
cache off, after that first answer on the first record) and the process's peak RSS. To compare two commits, run it alternately from each checkout
(`PYTHONPATH=OTHER/src python benchmarks/record_speed.py`), a fresh process each time, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import clef_flash
from clef_flash.request.samples import request_of_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_mb  # noqa: E402
from state_reuse import tokens_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/.peer/bundle-9b-part")
    parser.add_argument("--repeats", default="5,2", help="timed runs of each record, in the order of --tokens")
    parser.add_argument("--tokens", default="370,4096", help="the records' lengths")
    parser.add_argument("--precision", help="as load's (default: this machine's default)")
    args = parser.parse_args()
    start = time.perf_counter()
    model = clef_flash.load(args.model, precision=args.precision)
    ready_s = time.perf_counter() - start
    model.state_cache.max_bytes = 0
    lengths = [int(tokens) for tokens in args.tokens.split(",")]
    records = {tokens: request_of_tokens(lambda request: tokens_of(model, request), tokens, seed=tokens) for tokens in lengths}
    start = time.perf_counter()
    model.answer(records[lengths[0]])
    out = {"ready_s": ready_s, "first_answer_s": time.perf_counter() - start}
    for (tokens, request), repeats in zip(records.items(), map(int, args.repeats.split(","))):
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.answer(request)
            seconds.append(time.perf_counter() - start)
        out[f"{tokens}_s"] = statistics.median(seconds)
    out["peak_rss_mb"] = peak_rss_mb()
    out["precision"] = model.precision
    print(json.dumps(out))


if __name__ == "__main__":
    main()
