"""The published OpenAPI document is the validation: schemathesis, from /openapi.json alone and with
every check on, finds nothing against the served tiny release (issue 30). A bounded run: the long
one is benchmarks/schema_fuzz.py."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("schemathesis")

from clef_flash.server import create_app
from clef_flash.testing.schema_fuzz import run_schemathesis
from clef_flash.testing.server import running_server

MAX_EXAMPLES = 100  # per operation and phase: about 380 cases, ~20 s on two busy cores (60 s budget)
SEED = 30


@pytest.mark.slow  # a long end-to-end or oracle run: the full suite (CI) runs it, the quick loop does not
def test_schemathesis_finds_nothing_in_the_published_schema(model, tmp_path):
    with running_server(create_app(model, batch_wait_ms=0)) as url:
        run = run_schemathesis(url, max_examples=MAX_EXAMPLES, seed=SEED, workdir=tmp_path, timeout=300)
    print(f"schemathesis {run.version}: {run.cases} cases, {run.failures} failures in {run.seconds:.1f} s")
    assert run.clean, run.output
    assert run.cases >= 2 * MAX_EXAMPLES, run.output  # coverage and fuzzing both ran
