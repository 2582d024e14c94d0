"""`--ray`: batch on Ray Data and serving on Ray Serve, on a local 2-CPU cluster and the tiny release.

The Ray batch output must be the local batch's, line for line (byte for byte with the same blocks and
one torch thread on both sides), after a scoring actor is SIGKILLed mid-run and after the driver is;
Ray Serve must answer the official client, and every error case exactly as the local server does.
Run alone with `python -m pytest -q -m ray`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clef_flash.batch import BatchJob, progress_path
from clef_flash.cli import main

# Ray warns about its own deprecated settings from inside (setting any DataContext field checks them all).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")

MAX_LENGTH = 400
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges", "bugs": None}},
}


def request_line(index: int) -> str:
    return json.dumps({"state": f"ticket {index}: I was charged twice for the plan", "questions": QUESTIONS, "id": f"t{index}"})


def write_requests(path: Path, count: int) -> Path:
    """`count` lines of requests, with the error cases of the local batch among them."""
    lines = [request_line(index) for index in range(count)]
    lines[2] = "{not json"
    lines[5] = ""  # blank: skipped, counted
    lines[7] = json.dumps({"state": "s", "questions": {"team": {"type": "choice", "criteria": {"only": None}}}})
    lines[9] = json.dumps({"state": "word " * 500, "questions": QUESTIONS})  # over MAX_LENGTH
    path.write_text("".join(line + "\n" for line in lines))
    return path


def made_with(precision: str = "fp32") -> dict:
    return {"source": "tiny", "revision": None, "precision": precision, "max_length": MAX_LENGTH}


def ray_processes(kind: str) -> list[int]:
    """Pids of this test's Ray workers whose title names `kind` (e.g. "MapWorker("): descendants of
    this process only, never another user's Ray."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found = []
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor and ancestor != os.getpid():
            ancestor = parents.get(ancestor)
        if ancestor == os.getpid():
            with contextlib.suppress(OSError):
                if kind.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
    return found


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of 2 CPUs for the module; shut down after it, and no Ray process left behind."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    deadline = time.monotonic() + 30
    while ray_processes("ray") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes("ray"), "Ray processes were left behind"


@pytest.fixture(scope="module")
def spec(cluster, tiny_dir):
    from clef_flash.distributed import EngineSpec

    return EngineSpec.resolve(str(tiny_dir), precision="fp32", device="cpu", max_length=MAX_LENGTH, threads=1)


@pytest.fixture(scope="module")
def model(tiny_dir, one_torch_thread):
    from clef_flash import load

    return load(tiny_dir, device="cpu", precision="fp32", max_length=MAX_LENGTH)


def local_output(model, source: Path, out: Path, batch_size: int, **options) -> bytes:
    BatchJob.open(source, out, model=made_with(), **options).run(model, batch_size=batch_size)
    return out.read_bytes()


def assert_same_answers(lines: bytes, expected: bytes) -> None:
    """The same lines, ids and decisions; probabilities within 2e-4 (4-decimal rounding of floats that
    differ by rounding across batch compositions)."""
    rows, others = [json.loads(line) for line in lines.splitlines()], [json.loads(line) for line in expected.splitlines()]
    assert [(row["line"], row.get("schema"), row["id"]) for row in rows] == [
        (row["line"], row.get("schema"), row["id"]) for row in others
    ]
    worst = 0.0
    for row, other in zip(rows, others):
        assert ("error" in row) == ("error" in other) and row.get("error") == other.get("error")
        for question, answer in row.get("answers", {}).items():
            expected_answer = other["answers"][question]
            if answer["type"] == "noul":
                worst = max(worst, abs(answer["noul"] - expected_answer["noul"]))
                assert (answer["noul"] >= 0.5) == (expected_answer["noul"] >= 0.5)
            else:
                assert answer[answer["type"]] == expected_answer[answer["type"]]
                for option, probability in answer["probabilities"].items():
                    worst = max(worst, abs(probability - expected_answer["probabilities"][option]))
    print(f"max |dp| against the local batch: {worst:.1e}")
    assert worst <= 2e-4


# -- batch ---------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow  # a local Ray cluster
def test_ray_batch_of_parquet_states_and_several_schemas(spec, model, tmp_path):
    """Parquet rows as states, two schemas, other blocks than the local run's: the same answers."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    from clef_flash.distributed.ray_batch import run_ray_batch

    states = [f"customer {index}: the app crashes when I pay" for index in range(11)]
    table = pa.table({"state": states, "id": [f"s{index}" for index in range(11)]})
    parquet.write_table(table, tmp_path / "states.parquet", row_group_size=4)  # blocks cross row groups
    schemas = []
    for number, questions in enumerate(({"urgent": QUESTIONS["urgent"]}, {"team": QUESTIONS["team"]})):
        schemas.append(tmp_path / f"schema{number}.json")
        schemas[-1].write_text(json.dumps({"questions": questions}))
    source = tmp_path / "states.parquet"
    expected = local_output(model, source, tmp_path / "local.jsonl", batch_size=4, schema_path=schemas)
    assert [json.loads(line)["id"] for line in expected.splitlines()][:4] == ["s0", "s0", "s1", "s1"]
    job = BatchJob.open(source, tmp_path / "ray.jsonl", schema_path=schemas, model=made_with())
    run_ray_batch(job, spec, batch_size=3, workers=1, cpus_per_worker=1)
    assert_same_answers((tmp_path / "ray.jsonl").read_bytes(), expected)


class KillAWorker:
    """A progress meter that SIGKILLs one scoring actor when the first block is written."""

    def __init__(self):
        self.killed: int | None = None
        self.lines = 0

    def advance(self, lines: int) -> None:
        self.lines += lines
        if self.killed is None:
            workers = ray_processes("MapWorker(")
            assert workers, "no scoring actor found"
            self.killed = workers[0]
            os.kill(self.killed, signal.SIGKILL)

    def finish(self) -> None:
        pass


LINES = 48  # 24 blocks of 2: enough that a kill lands mid-run


@pytest.fixture(scope="module")
def requests_and_answers(model, module_tmp) -> tuple[Path, bytes]:
    """An input with the local batch's error cases, and the local batch's output for it (blocks of 2)."""
    folder = module_tmp("requests")
    source = write_requests(folder / "in.jsonl", LINES)
    return source, local_output(model, source, folder / "local.jsonl", batch_size=2)


@pytest.mark.ray
@pytest.mark.slow  # a local Ray cluster
def test_ray_batch_equals_the_local_batch_byte_for_byte_with_a_worker_killed(spec, requests_and_answers, tmp_path):
    """Two scoring actors, one SIGKILLed once the first block is written: Ray restarts it and retries
    its blocks; the output is the local one, byte for byte (same blocks, one thread each)."""
    from clef_flash.distributed.ray_batch import run_ray_batch

    source, expected = requests_and_answers
    job = BatchJob.open(source, tmp_path / "ray.jsonl", model=made_with())
    progress = KillAWorker()
    summary = run_ray_batch(job, spec, batch_size=2, workers=2, cpus_per_worker=0.75, progress=progress)
    assert progress.killed is not None and progress.killed not in ray_processes("MapWorker(")
    assert (summary.written, summary.errors) == (LINES - 1, 3) and progress.lines == LINES - 1
    assert (tmp_path / "ray.jsonl").read_bytes() == expected  # each line once, in order, the same bytes


@pytest.mark.ray
@pytest.mark.slow  # a local Ray cluster
def test_a_killed_driver_then_rerun_loses_and_duplicates_nothing(cluster, requests_and_answers, tiny_dir, tmp_path):
    source, expected = requests_and_answers
    out = tmp_path / "ray.jsonl"
    argv = ["batch", str(source), str(out), "--model", str(tiny_dir), "--precision", "fp32", "--max-length", str(MAX_LENGTH)]
    argv += ["--batch-size", "2", "--ray", "--address", cluster, "--cpus-per-worker", "1"]
    driver = subprocess.Popen([sys.executable, "-m", "clef_flash.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while not (out.exists() and out.stat().st_size) and time.monotonic() < deadline:
        assert driver.poll() is None, driver.communicate()[1].decode()[-2000:]
        time.sleep(0.005)
    os.kill(driver.pid, signal.SIGKILL)
    driver.communicate()
    interrupted = out.read_bytes().count(b"\n")
    assert 0 < interrupted < LINES - 1, interrupted
    # The progress file names the model as the command did: the same command resumes it.
    assert json.loads(progress_path(out).read_text())["model"] == {**made_with(), "source": str(tiny_dir)}

    assert main(argv) == 0  # in this process, on the same cluster
    assert out.read_bytes() == expected


@pytest.mark.ray
@pytest.mark.slow  # a local Ray cluster
def test_a_worker_with_another_copy_of_the_model_refuses_to_score(spec, tmp_path):
    import dataclasses

    from clef_flash.distributed.ray_batch import run_ray_batch
    from clef_flash.errors import ClefError

    job = BatchJob.open(write_requests(tmp_path / "in.jsonl", 12), tmp_path / "out.jsonl", model=made_with())
    other = dataclasses.replace(spec, weights_fingerprint="0" * 64)
    with pytest.raises(ClefError, match="opened another model at .* give every node the same copy$"):
        run_ray_batch(job, other, batch_size=4, workers=1, cpus_per_worker=1)
    assert (tmp_path / "out.jsonl").read_bytes() == b""


# -- serve ---------------------------------------------------------------------------------------


SETTINGS = {"api_key": "ray-test-key", "max_body_bytes": 4096, "batch_wait_ms": 0}
AUTH = {"authorization": "Bearer ray-test-key"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(cluster, spec):
    import httpx
    from ray import serve

    from clef_flash.distributed.ray_serve import APP_NAME, serve_on_ray

    port = free_port()
    serve_on_ray(spec, SETTINGS, port=port, cpus_per_replica=0.5, blocking=False)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while httpx.get(base_url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the Ray Serve replica never became ready"
        time.sleep(0.1)
    yield base_url
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def local_server(model):
    from fastapi.testclient import TestClient

    from clef_flash.server import create_app

    with TestClient(create_app(model, **SETTINGS)) as client:
        while client.get("/health").status_code != 200:
            time.sleep(0.01)
        yield client


def compressed(body: bytes) -> bytes:
    import gzip

    return gzip.compress(body)


ticket = {"model": "clef-flash", "state": "Charged twice, refund please.", "questions": QUESTIONS}
CASES = [  # (method, path, body bytes or None, extra headers)
    ("POST", "/v1/systemone", json.dumps(ticket).encode(), AUTH),
    ("POST", "/v1/systemone", b"{not json", AUTH),
    ("POST", "/v1/systemone", json.dumps({"state": "s"}).encode(), AUTH),
    ("POST", "/v1/systemone", json.dumps({**ticket, "model": "gpt-4"}).encode(), AUTH),
    ("POST", "/v1/systemone", json.dumps({**ticket, "state": "word " * 600}).encode(), AUTH),  # 413: over 4096 bytes
    ("POST", "/v1/systemone", json.dumps({**ticket, "state": "word " * 450}).encode(), AUTH),  # 422: too many tokens
    ("POST", "/v1/systemone", compressed(json.dumps({**ticket, "state": "x" * 9000}).encode()), {**AUTH, "content-encoding": "gzip"}),
    ("POST", "/v1/systemone", json.dumps(ticket).encode(), {**AUTH, "content-encoding": "br"}),
    ("POST", "/v1/systemone", json.dumps(ticket).encode(), {}),  # no key: 401
    ("POST", "/client/v4/accounts/acc/ai/run/@cf/cloudflare/clef-flash", json.dumps(ticket).encode(), AUTH),
    ("POST", "/client/v4/accounts/acc/ai/run/@cf/cloudflare/clef-flash", b"[1]", AUTH),
    ("POST", "/accounts/acc/ai/run/@cf/meta/llama", json.dumps(ticket).encode(), AUTH),
    ("GET", "/v1/models", None, AUTH),
    ("GET", "/v1/systemone", None, AUTH),  # 405
    ("GET", "/nowhere", None, {}),  # 404
]


@pytest.mark.ray
@pytest.mark.slow  # a local Ray cluster
def test_ray_serve_answers_every_case_as_the_local_server(ray_server, local_server):
    import httpx
    from ray import serve

    from clef_flash.distributed.ray_serve import APP_NAME

    seen = set()
    for method, path, body, headers in CASES:
        headers = {"content-type": "application/json", **headers}
        local = local_server.request(method, path, content=body, headers=headers)
        remote = httpx.request(method, ray_server + path, content=body, headers=headers, timeout=60)
        seen.add(local.status_code)
        assert (remote.status_code, remote.headers.get("content-type")) == (local.status_code, local.headers.get("content-type")), path
        assert remote.content == local.content, (method, path, remote.text[:300], local.text[:300])
        for name in ("www-authenticate", "retry-after"):
            assert remote.headers.get(name) == local.headers.get(name)
        assert remote.headers.get_list("x-request-id") == [remote.headers["x-typesafe-request-id"]]
    assert {200, 400, 401, 404, 405, 413, 415, 422} <= seen, seen
    echoed = httpx.get(ray_server + "/health", headers={"x-request-id": "trace-7"})
    assert echoed.headers.get_list("x-request-id") == ["trace-7"] and echoed.headers["x-typesafe-request-id"] == "trace-7"
    health, expected = echoed.json(), local_server.get("/health").json()
    assert {key: value for key, value in health.items()} == expected
    front = serve.get_deployment_handle("Front", APP_NAME)  # every request came through the front, none lost
    assert front.stats.remote().result(timeout_s=30) == {"retried": 0, "unavailable": 0, "errors": {}}


@pytest.mark.ray
@pytest.mark.slow  # a local Ray cluster
def test_a_client_gone_through_the_front_drops_its_job_on_the_replica(ray_server, spec):
    """A request held in the replica's batch queue (a batch wait of a minute), its client gone: the proxy cancels the
    front's request, the front the replica's, and the app takes the job out of its queue (dropped, 499)."""
    import httpx
    from ray import serve

    from clef_flash.distributed.ray_serve import deployment

    serve.run(deployment(spec, {**SETTINGS, "batch_wait_ms": 60_000}, cpus_per_replica=0.5), name="held", route_prefix="/held")
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(ray_server + "/held/v1/systemone", json=ticket, headers=AUTH, timeout=2)
        deadline = time.monotonic() + 20
        while "clef_flash_dropped_total 1.0" not in (metrics := httpx.get(ray_server + "/held/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.2)
        assert 'clef_flash_requests_total{route="/v1/systemone",status="499"} 1.0' in metrics
    finally:
        serve.delete("held")


@pytest.mark.ray
@pytest.mark.slow  # a local Ray cluster
def test_typesafe_sdk_against_ray_serve(ray_server, model):
    typesafe_sdk = pytest.importorskip("typesafe_sdk")

    long_state = "refund " * 160  # a body over 1 KiB, which the client compresses (zstd)
    with typesafe_sdk.TypeSafeClient(
        api_key="ray-test-key", base_url=ray_server, model="clef-flash", retry=typesafe_sdk.RetryPolicy(max_retries=0)
    ) as sdk:
        questions = {
            "refund": typesafe_sdk.Noul(instructions="Does the customer ask for a refund?"),
            "team": typesafe_sdk.Choice(instructions="Which team?", criteria={"billing": "Charges", "technical": None}),
        }
        for state in ("Charged twice, refund please.", long_state):
            result = sdk.system_one(state=state, questions=questions)
            expected = model.answer(
                {"state": state, "questions": {key: value.model_dump(exclude_none=True) for key, value in questions.items()}}
            )
            assert result.usage.input_tokens == expected["usage"]["input_tokens"]
            assert result.nouls["refund"].noul == expected["answers"]["refund"]["noul"]
            assert result.choices["team"].choice == expected["answers"]["team"]["choice"]
        with pytest.raises(typesafe_sdk.TypeSafeUnprocessableEntityError):
            sdk.system_one(state="word " * 450, questions=questions)


# -- without Ray ---------------------------------------------------------------------------------


def test_ray_flags_without_ray_say_how_to_install_it(monkeypatch, capsys, tmp_path):
    source = write_requests(tmp_path / "in.jsonl", 12)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["batch", str(source), str(tmp_path / "out.jsonl"), "--ray"]) == 2
    assert main(["serve", "--ray"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == ['error: Ray is not installed: pip install "clef-flash[ray]"'] * 2
    assert main(["batch", str(source), str(tmp_path / "out.jsonl"), "--workers", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --workers needs --ray"


def test_importing_clef_flash_does_not_import_ray():
    code = "import sys, clef_flash, clef_flash.cli, clef_flash.batch, clef_flash.server, clef_flash.distributed; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr

