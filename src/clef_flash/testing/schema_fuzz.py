"""schemathesis against a served app's own /openapi.json, every check on: the suite's bounded run
(tests/test_schema_fuzz.py) and the benchmark's long one (benchmarks/schema_fuzz.py).

Its CLI, as a new user would run it from the published document alone: every phase that applies
(coverage, then fuzzing), positive and negative data, `--checks all`, one worker, a fixed seed, no
example database (nothing is kept between runs), and Hypothesis's `too_slow` health check off (it
times data generation, so a busy machine would fail a run the API passes). The figures come from its
JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FuzzRun:
    cases: int  # test cases generated and sent
    failures: int  # cases with a failed check
    errors: int  # cases that could not be run (e.g. an unreachable server)
    tested: int  # operations tested
    operations: int  # operations in the document
    seconds: float  # the whole command, schema download and startup included
    version: str  # schemathesis's
    output: str  # its console report: the failures and how to reproduce them

    @property
    def clean(self) -> bool:
        return self.failures == 0 and self.errors == 0 and self.tested == self.operations > 0


# What the published schema cannot state, allowed per operation as schemathesis advises (`st explain ST202`): a body
# /v1/explain refuses although it is schema-valid, with 422 by design: a state of one part or none, more parts than
# max_parts, question_ids that name no question of the request (cross-field rules). Every other check stays on.
CONFIG = """\
[[operations]]
include-name = "POST /v1/explain"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx", "422"]
"""


def run_schemathesis(base_url: str, *, max_examples: int, seed: int, workdir: Path, timeout: float = 3600) -> FuzzRun:
    """`schemathesis run BASE_URL/openapi.json --checks all` with `max_examples` per operation and phase;
    its report and any files it writes stay in `workdir`."""
    report = workdir / "schemathesis.json"
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{base_url}/openapi.json",
        "--checks", "all",
        "--max-examples", str(max_examples),
        "--seed", str(seed),
        "--workers", "1",
        "--generation-database", "none",
        "--suppress-health-check", "too_slow",  # generation speed on a busy machine; not a check of the API
        "--request-timeout", "60",
        "--report", "json", "--report-json-path", str(report),
        "--no-color",
    ]  # fmt: skip
    start = time.perf_counter()
    environment = {**os.environ, "SCHEMATHESIS_HOOKS": "clef_flash.testing.schema_fuzz_hooks"}  # real images
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=environment)
    seconds = time.perf_counter() - start
    if not report.exists():
        raise RuntimeError(f"schemathesis wrote no report (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    summary: dict[str, Any] = json.loads(report.read_text())
    cases, operations = summary["test_cases"], summary["operations"]
    return FuzzRun(
        cases=cases["generated"],
        failures=cases["with_failures"],
        errors=cases["errored"] + len(summary["errors"]),
        tested=operations["tested"],
        operations=operations["total"],
        seconds=seconds,
        version=summary["schemathesis_version"],
        output=done.stdout + done.stderr,
    )
