"""Fitted calibration (issue 51): a temperature per question id (and per adapter) fitted on a labelled file less a
held-out share, saved in a versioned file, applied at answer time.

The labelled set comes from the tiny release itself with KNOWN temperature distortions (clef_flash.testing.calibration):
each question's labels are drawn from softmax(logits / T_true), so the model's own softmax(logits) is miscalibrated by
exactly T_true and the fit must find it. The tiny model's logits are small (its options differ by ~0.1), so its true
temperatures are small too: the model is underconfident. Overconfident cases (T > 1) are fitted on synthetic logits.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import clef_flash
from clef_flash.calibration import (
    FORMAT,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    Calibration,
    fit_temperature,
    read_calibration,
    tempered,
)
from clef_flash.cli import main
from clef_flash.engine import QuestionResult
from clef_flash.errors import CalibrationError
from clef_flash.evaluate import calibration_markdown, decision, fit_calibration
from clef_flash.request.protocol import SystemOneResponse
from clef_flash.testing.calibration import QUESTIONS, distorted_labelled_set, write_jsonl

TRUE_TEMPERATURES = {"urgent": 0.02, "team": 0.15, "level": 0.05}
RECORDS = 240
RARE = {"type": "noul", "instructions": "Is it about a refund?"}  # labelled on RARE_LABELS records only: kept at T = 1
RARE_LABELS = 12


@pytest.fixture(scope="module")
def distorted(model, module_tmp) -> Path:
    """RECORDS labelled records: urgent, team and level labelled at TRUE_TEMPERATURES, `rare` on a few only."""
    lines = distorted_labelled_set(model, TRUE_TEMPERATURES, records=RECORDS, seed=1, questions={**QUESTIONS, "rare": RARE})
    for index, line in enumerate(lines[:RARE_LABELS]):
        line["expected"]["rare"] = index % 2 == 0
    return write_jsonl(module_tmp("calibration") / "distorted.jsonl", lines)


@pytest.fixture(scope="module")
def fitted(model, distorted):
    return fit_calibration(distorted, model, holdout=0.3, seed=0)


def requests_of(path: Path, count: int) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    return [{key: value for key, value in line.items() if key != "expected"} for line in lines]


# -- the fit ---------------------------------------------------------------------------------------


def test_fit_finds_the_known_distortions_and_the_held_out_ece_drops(fitted, figures):
    calibration, report = fitted
    (side,) = report["sides"]
    assert side["adapter"] is None and report["held_out_records"] == round(0.3 * RECORDS)
    for question, true_temperature in TRUE_TEMPERATURES.items():
        found = calibration.temperature(None, question)
        assert abs(math.log(found / true_temperature)) < 0.3, (question, found, true_temperature)  # within ~35%
        row = side["temperatures"][question]
        assert row["temperature"] == found and row["note"] is None and row["fit_examples"] + row["held_out_examples"] == RECORDS
    rare = side["temperatures"]["rare"]
    assert rare["temperature"] == 1.0 and "fewer than 20" in rare["note"] and "rare" not in calibration.temperatures[None]
    before, after = side["before"], side["after"]
    assert after["ece"] < before["ece"] / 2 and after["log_loss"] < before["log_loss"] and after["brier"] < before["brier"]
    for question in TRUE_TEMPERATURES:
        assert after["by_question"][question]["ece"] < before["by_question"][question]["ece"], question
    assert after["accuracy"] == before["accuracy"]  # a temperature never changes a decision
    fits = ", ".join(f"{q} {calibration.temperature(None, q):.3f} (true {t})" for q, t in TRUE_TEMPERATURES.items())
    figures(f"calibration, tiny, {RECORDS} records, 30% held out: held-out ECE {before['ece']:.4f} -> {after['ece']:.4f}, "
            f"log-loss {before['log_loss']:.4f} -> {after['log_loss']:.4f}; T fitted {fits}")
    markdown = calibration_markdown(report)
    assert "| overall |" in markdown and "kept at 1: " in markdown and f"{before['ece']:.4f} -> {after['ece']:.4f}" in markdown


@pytest.mark.parametrize("true_temperature", [0.3, 1.0, 2.5])
def test_fit_recovers_synthetic_temperatures_both_ways(true_temperature):
    generator, draw = np.random.default_rng(7), random.Random(7)
    logits = (generator.normal(size=(3000, 4)) * 2).tolist()
    truths = [draw.choices(range(4), weights=tempered(row, true_temperature))[0] for row in logits]
    found = fit_temperature(logits, truths)
    print(f"T true {true_temperature}, fitted {found:.4f}")
    assert found == pytest.approx(true_temperature, rel=0.1)


def test_fit_edge_cases():
    assert fit_temperature([[0.5, 0.5], [1.0, 1.0]], [0, 1]) == 1.0  # no information: T stays 1
    separable = fit_temperature([[1.0, 0.0], [0.0, 1.0]] * 10, [0, 1] * 10)  # always right: as sharp as allowed
    assert separable == pytest.approx(MIN_TEMPERATURE, rel=1e-3)
    assert fit_temperature([[1.0, 0.0, -1.0]], [2]) == pytest.approx(MAX_TEMPERATURE, rel=1e-3)  # always wrong: uniform
    assert fit_temperature([[1.0, 0.0], [0.2, 0.0, 3.0]], [0, 2]) > 0  # a question id with other options elsewhere


# -- decisions never change --------------------------------------------------------------------------


def test_decisions_never_change_under_any_temperature():
    """Over random logits (exact ties, near-ties below float32's resolution, wide ranges) and temperatures across the
    whole range: the calibrated answer's argmax (ties to the first option) is the model's own float32 softmax's, and
    softmax(logits / T) alone keeps the logits' argmax (up to logits apart by less than float64 resolves)."""
    draw = random.Random(0)
    temperatures = [MIN_TEMPERATURE, 0.01, 0.1, 0.5, 0.99, 1.01, 2.0, 10.0, 100.0, MAX_TEMPERATURE]
    calibrations = [Calibration({None: {"q": temperature}}) for temperature in temperatures]
    checked = split_by_float64 = 0
    for _ in range(1500):
        count = draw.randint(2, 12)
        scale = 10 ** draw.uniform(-4, 1.5)
        logits = [round(draw.gauss(0, scale), draw.choice([2, 5, 9])) for _ in range(count)]  # rounding makes ties
        if draw.random() < 0.2:
            logits[draw.randrange(count)] = max(logits)  # an exact tie at the top
        if draw.random() < 0.2:  # a near-tie: the next float32 below the top
            logits[draw.randrange(count)] = float(np.nextafter(np.float32(max(logits)), np.float32(-np.inf)))
        logits32 = torch.tensor(logits, dtype=torch.float32)  # as the runtime: float32 softmax, read back as float64
        result = QuestionResult("q", tuple(map(str, range(count))), tuple(logits32.double().tolist()), tuple(torch.softmax(logits32, 0).double().tolist()))
        model_decision = decision(result.probabilities)
        split_by_float64 += model_decision != decision(result.logits)
        for temperature, calibration in zip(temperatures, calibrations):
            (applied,) = calibration.apply(None, [result])
            assert decision(applied.probabilities) == model_decision, (logits, temperature)
            assert math.fsum(applied.probabilities) == pytest.approx(1.0, abs=1e-12) and applied.temperature == temperature
            alone = tempered(result.logits, temperature)  # the logits' argmax, up to a tie float64 cannot split
            assert alone[decision(alone)] == alone[decision(result.logits)]
            checked += 1
    assert checked == 15000 and split_by_float64 > 0  # the float32 ties that float64 alone would have split were met
    print(f"{checked} tempered answers, {split_by_float64} of 1500 logit rows tied at the top only by float32's softmax")


def test_real_answers_keep_their_decisions(model, distorted):
    """The tiny model's answers, then the same results through temperatures far from 1 both ways (as Clef.score
    applies them): every choice, noul side and top level stays."""
    prepared = [model.prepare(request) for request in requests_of(distorted, 40)]
    results = model.score([item.record for item in prepared])
    calibration = Calibration({None: {"urgent": 0.01, "team": 5.0, "level": 0.3, "rare": 250.0}})
    for item, per_question in zip(prepared, results, strict=True):
        plain = model.respond(item, per_question, decimals=None)["answers"]
        tempered_answers = model.respond(item, calibration.apply(None, per_question), decimals=None)["answers"]
        for question, answer in plain.items():
            after = tempered_answers[question]
            assert option_probabilities(after) != option_probabilities(answer)  # every question here is tempered
            if answer["type"] == "noul":
                assert (answer["noul"] >= 0.5) == (after["noul"] >= 0.5)
            else:
                assert decision(list(answer["probabilities"].values())) == decision(list(after["probabilities"].values()))
                assert answer.get("choice") == after.get("choice")


# -- the file: save, load, apply ---------------------------------------------------------------------


def test_save_load_apply_round_trip(model, fitted, distorted, tiny_dir, tmp_path):
    calibration, _ = fitted
    path = calibration.save(tmp_path / "calibration.json")
    read = read_calibration(path)
    assert read.temperatures == calibration.temperatures
    assert read.digest == calibration.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert json.loads(path.read_text())["format"] == FORMAT and read.fitted_on["model"]["fingerprint"] == model.checkpoint.fingerprint

    # No state cache: the same records score to the same bits in both runs below.
    calibrated = clef_flash.load(tiny_dir, precision="fp32", calibration=path, state_cache_mb=0)
    assert calibrated.describe()["calibration"]["sha256"] == calibration.digest[:16]
    prepared = [calibrated.prepare(request) for request in requests_of(distorted, 6)]
    results = calibrated.score([item.record for item in prepared])
    calibrated.calibration = None
    try:
        plain_results = calibrated.score([item.record for item in prepared])
        plain = [calibrated.respond(item, per_question, decimals=None) for item, per_question in zip(prepared, plain_results)]
    finally:
        calibrated.calibration = read
    for item, per_question, plain_questions, plain_body in zip(prepared, results, plain_results, plain, strict=True):
        body = calibrated.respond(item, per_question, decimals=None)
        note = body.pop("calibration")
        assert set(plain_body) == {"model", "answers", "usage"}  # without a calibration: the body as before
        assert note["sha256"] == calibration.digest[:16] and list(note["temperatures"]) == list(item.request.questions)
        for result, plain_result in zip(per_question, plain_questions, strict=True):
            temperature = calibration.temperature(None, result.question_id)
            assert result.logits == plain_result.logits and note["temperatures"][result.question_id] == temperature == result.temperature
            if temperature != 1.0:  # the logits divided by T
                expected = torch.softmax(torch.tensor(result.logits, dtype=torch.float64) / temperature, dim=0).tolist()
                assert result.probabilities == pytest.approx(expected, abs=1e-12)
            answer = body["answers"][result.question_id]
            by_option = dict(zip(result.option_ids, result.probabilities))
            assert option_probabilities(answer) == {option: by_option[option] for option in option_probabilities(answer)}
            if temperature == 1.0:  # a question the file does not temper: the model's own probabilities, bit for bit
                assert result.probabilities == plain_result.probabilities and answer == plain_body["answers"][result.question_id]
    assert any(result.temperature == 1.0 for result in results[0]) and any(result.temperature != 1.0 for result in results[0])
    SystemOneResponse.model_validate({**body, "calibration": note})
    SystemOneResponse.model_validate(plain[0])
    assert calibrated.answer(item.request)["calibration"] == note  # the public path says so too


def option_probabilities(answer: dict) -> dict[str, float]:
    """An answer's probabilities by option id (a noul's: p(true))."""
    return {"true": answer["noul"]} if answer["type"] == "noul" else answer["probabilities"]


def edit(path: Path, change) -> Path:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value) if not isinstance(value, str) else value)
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda value: value.update(version=2), "is calibration format version 2; this clef-flash reads version 1"),
        (lambda value: value.update(format="clef-flash-bundle"), "is not a clef-flash calibration file (format 'clef-flash-bundle'"),
        (lambda value: value["temperatures"]["base"].update(team=-1.5), "temperatures.base.team is -1.5: a temperature is a number from 0.001 to 1000"),
        (lambda value: value["temperatures"]["base"].update(team="hot"), "temperatures.base.team is 'hot'"),
        (lambda value: value["temperatures"]["adapters"].update(a={"team": 0}), "temperatures.adapters.a.team is 0"),
        (lambda value: value.update(extra=1), "has unexpected keys ['extra']"),
        (lambda value: value["fitted_on"]["model"].update(fingerprint="f" * 64), "was fitted on another model"),
    ],
)
def test_bad_files_are_one_clear_line(fitted, tiny_dir, tmp_path, capsys, change, message):
    path = edit(fitted[0].save(tmp_path / "bad.json"), change)
    with pytest.raises(CalibrationError, match="^" + re.escape(str(path))) as error:
        clef_flash.load(tiny_dir, precision="fp32", calibration=path)  # refused before any weights load
    assert message in str(error.value)
    code = main(["answer", "--model", str(tiny_dir), "--calibration", str(path), "--state", "s", "--question", "u=noul:Urgent?"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unreadable_files(tmp_path):
    with pytest.raises(CalibrationError, match="no calibration file at .*: fit one with `clef-flash eval labelled"):
        read_calibration(tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(CalibrationError, match="is not JSON"):
        read_calibration(tmp_path / "text.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(CalibrationError, match="is not a clef-flash calibration file \\(format 'list'"):
        read_calibration(tmp_path / "list.json")


# -- the command line, adapters, Ray -----------------------------------------------------------------


def test_command_line_fits_then_answers(distorted, tiny_dir, tmp_path, capsys):
    small = write_jsonl(tmp_path / "small.jsonl", [json.loads(line) for line in distorted.read_text().splitlines()[:60]])
    out, reports = tmp_path / "fitted" / "calibration.json", tmp_path / "report"
    argv = ["eval", "labelled", str(small), "--model", str(tiny_dir), "--precision", "fp32", "--fit-calibration", str(out)]
    code = main([*argv, "--holdout", "0.25", "--seed", "3", "--out", str(reports)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert f"answer with --calibration {out}" in err
    report = json.loads((reports / "report.json").read_text())
    assert (report["records"], report["held_out_records"], report["seed"]) == (60, 15, 3)
    assert (reports / "report.md").read_text() == printed and "# clef-flash eval: fitted calibration" in printed
    assert (reports / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(read_calibration(out).temperatures[None]) == set(TRUE_TEMPERATURES)

    request = tmp_path / "request.json"
    request.write_text(json.dumps(requests_of(small, 1)[0]))
    assert main(["answer", str(request), "--model", str(tiny_dir), "--precision", "fp32", "--calibration", str(out), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["calibration"]["sha256"] == read_calibration(out).digest[:16]

    assert main([*argv, "--calibration", str(out)]) == 2
    assert "--fit-calibration fits on the model's own probabilities: leave out --calibration" in capsys.readouterr().err


def test_per_adapter_temperatures(distorted, tiny_dir, tmp_path, module_tmp):
    pytest.importorskip("peft")
    from clef_flash.testing.adapters import write_random_adapter

    adapter = write_random_adapter(module_tmp("adapter") / "checkpoint-1", "tiny", rank=4, seed=1)
    model = clef_flash.load(tiny_dir, adapters={"a": adapter}, precision="fp32")
    small = write_jsonl(tmp_path / "small.jsonl", [json.loads(line) for line in distorted.read_text().splitlines()[:40]])
    calibration, report = fit_calibration(small, model, adapters=[None, "a"], holdout=0.3, seed=0)
    assert [side["adapter"] for side in report["sides"]] == [None, "a"]
    assert set(calibration.temperatures) == {None, "a"} and calibration.fitted_on["model"]["adapters"] == {"a": model.adapter_fingerprints["a"]}
    assert calibration.temperatures[None] != calibration.temperatures["a"]  # each fitted on its own logits
    path = calibration.save(tmp_path / "calibration.json")
    assert set(read_calibration(path).temperatures) == {None, "a"}

    model.calibration = read_calibration(path)
    request = requests_of(small, 1)[0]
    for name in (None, "a"):
        asked = {**request, "adapter": name} if name else request
        logits, answer = model.logits(asked), model.answer(asked, decimals=None)
        for question in TRUE_TEMPERATURES:
            temperature = calibration.temperature(name, question)
            assert answer["calibration"]["temperatures"][question] == temperature
            expected = dict(zip(logits[question], tempered(list(logits[question].values()), temperature)))
            assert option_probabilities(answer["answers"][question]) == pytest.approx(
                {option: expected[option] for option in option_probabilities(answer["answers"][question])}, abs=1e-12
            )

    edit(path, lambda value: value["fitted_on"]["model"]["adapters"].update(a="0" * 64))  # as if fitted for another "a"
    with pytest.raises(CalibrationError, match="was fitted for another adapter named 'a'"):
        clef_flash.load(tiny_dir, adapters={"a": adapter}, precision="fp32", calibration=path)


def test_every_model_option_reaches_load_and_ray_workers(fitted, tiny_dir, tmp_path):
    """Each flag of MODEL_OPTIONS is a keyword of `load` and a field of Ray's EngineSpec (--adapter is refused on Ray),
    and a calibration travels to the workers as its content (no worker needs the file)."""
    import dataclasses
    import inspect

    from clef_flash.cli_options import MODEL_OPTION_NAMES
    from clef_flash.distributed import EngineSpec
    from clef_flash.loader import load

    keywords = set(inspect.signature(load).parameters)
    fields = {field.name for field in dataclasses.fields(EngineSpec)}
    for name in MODEL_OPTION_NAMES:
        assert ("source" if name == "model" else name) in keywords, name
        assert name == "adapter" or ("source" if name == "model" else name) in fields, name
    path = fitted[0].save(tmp_path / "calibration.json")
    spec = EngineSpec.resolve(str(tiny_dir), precision="fp32", device="cpu", calibration=str(path))
    assert isinstance(spec.calibration, Calibration) and spec.calibration.digest == fitted[0].digest
    worker = spec.load()
    assert worker.calibration.digest == fitted[0].digest and "calibration" in worker.describe()


def test_info_lines(fitted, tiny_dir, tmp_path):
    from clef_flash.console import calibration_lines
    from clef_flash.loader import describe_calibration

    path = fitted[0].save(tmp_path / "calibration.json")
    lines = calibration_lines(describe_calibration(str(tiny_dir), path))
    assert lines[0].startswith(f"calibration  {path} (sha256 {fitted[0].digest[:16]}), fitted on file distorted.jsonl, records {RECORDS}")
    assert lines[1].strip() == "base: 3 questions tempered (level, team, urgent)"


def test_served_answers_say_they_are_calibrated_and_the_official_client_reads_them(model):
    """Over HTTP: the body's `calibration` field and /health's; typesafe-sdk (the official client) parses the answers
    unchanged beside the new field."""
    pytest.importorskip("fastapi")
    typesafe_sdk = pytest.importorskip("typesafe_sdk")
    from fastapi.testclient import TestClient

    from clef_flash.server import create_app
    from clef_flash.testing.server import running_server

    calibration = Calibration({None: {"refund": 0.05, "team": 0.2}})
    questions = {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges", "technical": None}},
    }
    request = {"model": "clef-flash", "state": "Charged twice, refund please.", "questions": questions}
    model.calibration = calibration
    try:
        with TestClient(create_app(model)) as client:
            deadline = time.monotonic() + 30
            while (health := client.get("/health")).status_code != 200:  # warming up
                assert time.monotonic() < deadline, health.json()
                time.sleep(0.01)
            assert health.json()["calibration"]["sha256"] == calibration.digest[:16]
            body = client.post("/v1/systemone", json=request).json()
            assert body["calibration"] == {"sha256": calibration.digest[:16], "temperatures": {"refund": 0.05, "team": 0.2}}
        with running_server(create_app(model)) as base_url, typesafe_sdk.TypeSafeClient(
            api_key="unused", base_url=base_url, model="clef-flash", retry=typesafe_sdk.RetryPolicy(max_retries=0)
        ) as sdk:
            asked = {
                "refund": typesafe_sdk.Noul(instructions="Does the customer ask for a refund?"),
                "team": typesafe_sdk.Choice(instructions="Which team?", criteria={"billing": "Charges", "technical": None}),
            }
            result = sdk.system_one(state=request["state"], questions=asked)
        assert result.nouls["refund"].noul == body["answers"]["refund"]["noul"]
        assert result.choices["team"].probabilities == body["answers"]["team"]["probabilities"]
    finally:
        model.calibration = None


def test_batch_records_the_calibration_and_refuses_to_resume_with_another(fitted, distorted, tiny_dir, tmp_path, capsys):
    first = fitted[0].save(tmp_path / "first.json")
    other = Calibration({None: {"team": 2.0}}).save(tmp_path / "other.json")
    requests = write_jsonl(tmp_path / "requests.jsonl", requests_of(distorted, 3))
    argv = ["batch", str(requests), str(tmp_path / "answers.jsonl"), "--model", str(tiny_dir), "--precision", "fp32"]
    assert main([*argv, "--calibration", str(first)]) == 0
    lines = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [line["calibration"]["sha256"] for line in lines] == [fitted[0].digest[:16]] * 3
    capsys.readouterr()
    assert main([*argv, "--calibration", str(other)]) == 2  # a resumed job never mixes calibrations
    assert f"calibration {fitted[0].digest[:16]}" in capsys.readouterr().err
