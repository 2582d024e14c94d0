"""`clef-flash batch`: output lines, error objects, and resuming after a crash or SIGKILL."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from clef_flash.batch import BatchJob, progress_path
from clef_flash.console import ProgressBar
from clef_flash.cli import main
from clef_flash.errors import ClefError


pytestmark = pytest.mark.usefixtures("one_torch_thread")


MAX_LENGTH = 400
MODEL = {"source": "tiny", "revision": None, "precision": "fp32", "max_length": MAX_LENGTH}


@pytest.fixture(scope="module")
def model(tiny_dir):
    from clef_flash import load

    return load(tiny_dir, device="cpu", precision="fp32", max_length=MAX_LENGTH)


def short_request(index: int) -> dict:
    """A ~130-token record: a state and one or two questions."""
    questions = {"urgent": {"type": "noul"}}
    if index % 3 == 0:
        questions["team"] = {"type": "choice", "criteria": {"billing": None, "bugs": None}}
    return {"state": f"ticket {index}: charged twice", "questions": questions}


def write_lines(path, lines) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def read_output(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_close_answers(body: dict, expected: dict) -> None:
    """Alone vs in a batch: equal up to float rounding, so at most one unit of the 4th decimal."""
    assert body["usage"] == expected["usage"] and body["model"] == expected["model"]
    assert body["answers"].keys() == expected["answers"].keys()
    for question_id, answer in body["answers"].items():
        other = expected["answers"][question_id]
        for key, value in answer.items():
            if isinstance(value, float) or key == "probabilities":
                assert value == pytest.approx(other[key], abs=2e-4)


def test_output_has_one_line_per_input_with_ids_and_error_objects(model, tmp_path):
    good = short_request(0)
    lines = [
        json.dumps({**good, "id": "first"}),
        "{not json",
        "",  # blank: skipped, but counted in line numbers
        json.dumps({**short_request(1), "id": 17}),
        json.dumps({"state": "s", "questions": {"team": {"type": "choice", "criteria": {"only": None}}}}),
        json.dumps({"state": "word " * 400, "questions": {"urgent": {"type": "noul"}}}),  # over MAX_LENGTH
        json.dumps(short_request(2)),
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, lines)
    job = BatchJob.open(source, out, model=MODEL)
    summary = job.run(model, batch_size=2)
    output = read_output(out)
    assert [row["line"] for row in output] == [1, 2, 4, 5, 6, 7]
    assert [row["id"] for row in output] == ["first", 2, 17, 5, 6, 7]
    assert (summary.written, summary.errors, summary.skipped) == (6, 3, 0)
    assert output[1]["error"]["detail"][0]["type"] == "json_invalid"
    assert output[3]["error"]["detail"][0]["loc"] == ["body", "questions", "team", "criteria"]
    too_long = output[4]["error"]["detail"][0]
    assert too_long["type"] == "record_too_long" and f"over the limit of {MAX_LENGTH}" in too_long["msg"]
    for row, request in ((output[0], good), (output[2], short_request(1)), (output[5], short_request(2))):
        assert "error" not in row
        assert_close_answers({key: row[key] for key in ("model", "answers", "usage")}, model.answer(request))


def test_states_with_a_schema(model, tmp_path):
    schema = {"model": "my-model", "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    rows = [
        json.dumps("a plain text state"),
        json.dumps({"state": {"subject": "refund"}, "id": "t-9"}),
        json.dumps({"subject": "no state key: the whole object is the state"}),
        "null",
    ]
    write_lines(tmp_path / "states.jsonl", rows)
    job = BatchJob.open(tmp_path / "states.jsonl", tmp_path / "out.jsonl", schema_path=tmp_path / "schema.json", model=MODEL)
    job.run(model, batch_size=8)
    output = read_output(tmp_path / "out.jsonl")
    assert [row["id"] for row in output] == [1, "t-9", 3, 4]
    states = ["a plain text state", {"subject": "refund"}, {"subject": "no state key: the whole object is the state"}]
    for row, state in zip(output, states):
        assert row["model"] == "my-model"
        assert_close_answers({key: row[key] for key in ("model", "answers", "usage")}, model.answer({**schema, "state": state}))
    assert output[3]["error"]["detail"][0]["type"] == "state_null"


def test_resume_after_a_partial_last_line_equals_an_uninterrupted_run(model, tmp_path):
    source = tmp_path / "in.jsonl"
    write_lines(source, [json.dumps({**short_request(index), "id": f"r{index}"}) for index in range(12)])
    clean = tmp_path / "clean.jsonl"
    BatchJob.open(source, clean, model=MODEL).run(model, batch_size=4)

    crashed = tmp_path / "crashed.jsonl"
    text = clean.read_bytes()
    cut = text.index(b'"id": "r5"') + 20  # inside line 6, in the middle of the second block
    crashed.write_bytes(text[:cut])
    shutil.copyfile(progress_path(clean), progress_path(crashed))
    job = BatchJob.open(source, crashed, model=MODEL)
    assert job.done == {(line, None) for line in range(1, 6)}  # the partial line 6 is cut off and scored again
    summary = job.run(model, batch_size=4)
    assert (summary.written, summary.skipped) == (7, 5)
    assert crashed.read_bytes() == text  # block 5-8 was scored whole again: the same floats

    again = BatchJob.open(source, crashed, model=MODEL)
    assert again.run(model, batch_size=4).written == 0 and crashed.read_bytes() == text


def test_another_job_is_refused_unless_overwrite(model, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [json.dumps(short_request(0))])
    BatchJob.open(source, out, model=MODEL).run(model)
    with pytest.raises(ClefError, match="its model was source tiny, precision fp32"):
        BatchJob.open(source, out, model={**MODEL, "precision": "bf16"})
    write_lines(source, [json.dumps(short_request(1))])
    with pytest.raises(ClefError, match="its input was .*in.jsonl, not this file's content"):
        BatchJob.open(source, out, model=MODEL)
    job = BatchJob.open(source, out, model=MODEL, overwrite=True)
    assert job.done == set() and job.run(model).written == 1
    progress_path(out).unlink()
    with pytest.raises(ClefError, match="has no out.jsonl.progress.json"):
        BatchJob.open(source, out, model=MODEL)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["batch", "/no/such.jsonl", "OUT"], "no input file at /no/such.jsonl"),
        (["batch", "IN", "OUT", "--schema", "/no/schema.json"], "no schema file at /no/schema.json"),
        (["batch", "IN", "OUT", "--schema", "IN"], "is not JSON"),
        (["batch", "IN", "OUT", "--schema", "BAD_SCHEMA"], "is not a valid schema: invalid request (1 error): body.questions.t.criteria"),
        (["batch", "IN", "OUT", "--model", "/no/such/dir"], "no model at '/no/such/dir'"),
        (["batch", "IN", "IN"], "the output file is the input file"),
    ],
)
def test_errors_are_one_clear_line(capsys, tmp_path, argv, message):
    source = tmp_path / "in.jsonl"
    write_lines(source, [json.dumps(short_request(0)), json.dumps(short_request(1))])
    (tmp_path / "bad.json").write_text(json.dumps({"questions": {"t": {"type": "choice", "criteria": {"a": None}}}}))
    names = {"IN": str(source), "OUT": str(tmp_path / "out.jsonl"), "BAD_SCHEMA": str(tmp_path / "bad.json")}
    code = main([names.get(arg, arg) for arg in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()  # nothing is written before the model is loaded


def start_batch(source, out) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every run: the same floats
    command = [sys.executable, "-m", "clef_flash.cli", "batch", str(source), str(out), "--precision", "fp32", "--batch-size", "8"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_batch(source, out) -> str:
    process = start_batch(source, out)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return err


@pytest.mark.slow  # a long end-to-end or oracle run: the full suite (CI) runs it, the quick loop does not
def test_sigkill_in_the_middle_then_resume_equals_an_uninterrupted_run(tmp_path):
    count = 160
    lines = [json.dumps({**short_request(index), "id": index * 10}) for index in range(count)]
    lines[37] = "{broken"
    source = tmp_path / "in.jsonl"
    write_lines(source, lines)
    run_batch(source, tmp_path / "clean.jsonl")
    clean = read_output(tmp_path / "clean.jsonl")
    assert [row["line"] for row in clean] == list(range(1, count + 1))

    out = tmp_path / "out.jsonl"
    process = start_batch(source, out)
    written = 0
    deadline = time.monotonic() + 240
    while written < 16 and time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before it could be killed: " + process.stderr.read()
        time.sleep(0.01)
        written = out.read_bytes().count(b"\n") if out.exists() else 0
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    interrupted = out.read_bytes().count(b"\n")
    assert 16 <= interrupted < count, interrupted

    assert f"resuming: {interrupted} of {count} lines" in run_batch(source, out)
    output = read_output(out)
    assert [row["line"] for row in output] == list(range(1, count + 1))  # each input exactly once, in order
    assert output == clean


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_otherwise():
    piped = io.StringIO()
    progress = ProgressBar(10, "batch", done=2, stream=piped, interval=0)
    progress.advance(4)
    progress.finish()
    text = piped.getvalue()
    assert "\r" not in text and "\x1b" not in text  # a log file gets plain lines
    lines = text.splitlines()
    assert lines[-1].startswith("batch:  60%|") and " 6/10 [" in lines[-1] and "records/s]" in lines[-1]

    terminal = Terminal()
    progress = ProgressBar(4, "batch", stream=terminal)
    progress.advance(2)
    progress.finish()
    text = terminal.getvalue()
    assert text.startswith("\r") and "batch:  50%|" in text and " 2/4 [" in text and text.endswith("\n")  # redrawn in place

    quiet = io.StringIO()
    with ProgressBar(3, "converting", unit="B", stream=quiet, enabled=False) as meter:
        meter.advance(3)
    assert quiet.getvalue() == ""
