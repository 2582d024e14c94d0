"""schemathesis against `clef-flash serve`, from its /openapi.json alone, every check on: the README's
fuzzing figures (issue 30; the suite's bounded run is tests/test_schema_fuzz.py).

    python benchmarks/schema_fuzz.py [--model tiny] [--max-examples 500] [--seed 30] [--min-cases 1000]
                                     [--out benchmarks/results/schema-fuzz.json]

Starts the real server as a subprocess on 127.0.0.1 (`--threads 1`), runs `schemathesis run
URL/openapi.json --checks all --max-examples N` (coverage and fuzzing phases, positive and negative
data, one worker, a fixed seed), and reports cases, failures, errors and seconds with the
schemathesis version and the CPU. Exits 1 on any failure or error, or under --min-cases cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from server_load import server

from clef_flash.machine import this_machine
from clef_flash.testing.schema_fuzz import run_schemathesis


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="what `clef-flash serve --model` gets (default tiny)")
    parser.add_argument("--max-examples", type=int, default=500, help="cases per operation and phase (default 500)")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--min-cases", type=int, default=1000, help="fewer cases than this is a failed run")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()

    machine = this_machine()
    with server(args.model, precision=None, threads=1, extra=[]) as (url, _), tempfile.TemporaryDirectory() as workdir:
        run = run_schemathesis(url, max_examples=args.max_examples, seed=args.seed, workdir=Path(workdir))
    figures = {
        "schemathesis": run.version,
        "model": args.model,
        "max_examples": args.max_examples,
        "seed": args.seed,
        "operations": run.operations,
        "cases": run.cases,
        "failures": run.failures,
        "errors": run.errors,
        "seconds": round(run.seconds, 1),
        "cpu": machine.cpu,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    print(run.output if not run.clean else "")
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if run.clean and run.cases >= args.min_cases else 1


if __name__ == "__main__":
    sys.exit(main())
