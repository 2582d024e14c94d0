"""`clef-flash eval`: the metrics on constructed cases with hand-computed answers, the PNG encoder,
and both evaluations end to end on the tiny release."""

from __future__ import annotations

import json
import math
import struct

import pytest

from clef_flash.cli import main
from clef_flash.engine import QuestionResult
from clef_flash.evaluate import (
    Prediction,
    accuracy,
    agreement,
    brier,
    expected_calibration_error,
    log_loss,
    macro_f1,
    option_of_label,
    reliability_bins,
    summary,
)
from clef_flash.plots import agreement_figure, png, reliability_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Four records, each with a yes/no question and a three-way choice, with known probabilities.
NOUL = [((0.9, 0.1), 0), ((0.6, 0.4), 1), ((0.3, 0.7), 1), ((0.2, 0.8), 0)]  # (p(true), p(false)), truth
CHOICE = [((0.7, 0.2, 0.1), 0), ((0.5, 0.4, 0.1), 1), ((0.1, 0.3, 0.6), 2), ((0.25, 0.25, 0.5), 0)]


def noul_predictions() -> list[Prediction]:
    return [Prediction("urgent", "noul", ("true", "false"), p, truth) for p, truth in NOUL]


def choice_predictions() -> list[Prediction]:
    return [Prediction("team", "choice", ("a", "b", "c"), p, truth) for p, truth in CHOICE]


def test_metrics_on_a_yes_no_question():
    # predicted true, true, false, false; truth true, false, false, true: records 1 and 3 are right.
    predictions = noul_predictions()
    assert accuracy(predictions) == 0.5
    assert log_loss(predictions) == pytest.approx(-(math.log(0.9) + math.log(0.4) + math.log(0.7) + math.log(0.2)) / 4)
    assert log_loss(predictions) == pytest.approx(0.746941, abs=1e-6)  # 2.987764 / 4
    # sum over both options: 0.02, 0.72, 0.18, 1.28
    assert brier(predictions) == pytest.approx(0.55)
    # confidences 0.9 (right), 0.6 (wrong), 0.7 (right), 0.8 (wrong), one per bin: gaps 0.1, 0.6, 0.3, 0.8
    assert expected_calibration_error(predictions) == pytest.approx(0.45)
    # label true: TP 1, FP 1, FN 1 -> 0.5; label false: the same -> 0.5
    assert summary(predictions)["macro_f1"] == pytest.approx(0.5)


def test_metrics_on_a_three_way_choice():
    # predicted a, a, c, c; truth a, b, c, a.
    predictions = choice_predictions()
    assert accuracy(predictions) == 0.5
    assert log_loss(predictions) == pytest.approx(0.7925214, abs=1e-6)  # -(ln .7 + ln .4 + ln .6 + ln .25) / 4
    assert brier(predictions) == pytest.approx((0.14 + 0.62 + 0.26 + 0.875) / 4)
    bins = reliability_bins(predictions)
    assert [b["count"] for b in bins] == [0, 0, 0, 0, 0, 2, 1, 1, 0, 0]
    assert bins[5] == {"lower": 0.5, "upper": 0.6, "count": 2, "confidence": 0.5, "accuracy": 0.0}
    assert expected_calibration_error(predictions) == pytest.approx((0.3 + 2 * 0.5 + 0.4) / 4)
    # a: TP 1, FP 1, FN 1 -> 1/2; b: TP 0, FN 1 -> 0; c: TP 1, FP 1 -> 2/3
    assert macro_f1(["a", "b", "c", "a"], ["a", "a", "c", "c"]) == pytest.approx((0.5 + 0 + 2 / 3) / 3)


def test_overall_figures_pool_questions_and_average_macro_f1_over_question_ids():
    figures = summary(noul_predictions() + choice_predictions())
    assert figures["questions"] == 8
    assert figures["accuracy"] == 0.5
    assert figures["log_loss"] == pytest.approx((0.746941 * 4 + 0.7925214 * 4) / 8, abs=1e-6)
    assert figures["macro_f1"] == pytest.approx((0.5 + (0.5 + 2 / 3) / 3) / 2)
    # pooled bins: 0.5: two wrong (gap 0.5 each); 0.6: one right, one wrong (accuracy 0.5, gap 0.1 each);
    # 0.7: two right (0.3 each); 0.8: one wrong (0.8); 0.9: one right (0.1)
    assert figures["ece"] == pytest.approx((2 * 0.5 + 2 * 0.1 + 2 * 0.3 + 0.8 + 0.1) / 8)


def result(question_id, options, probabilities):
    return QuestionResult(question_id, tuple(options), logits=(), probabilities=tuple(probabilities))


def test_agreement_counts_differing_answers_and_near_ties():
    reference = [
        [result("q1", "ab", (0.6, 0.4)), result("q2", "ab", (0.51, 0.49))],
        [result("q3", "abc", (0.1, 0.7, 0.2))],
    ]
    candidate = [
        [result("q1", "ab", (0.55, 0.45)), result("q2", "ab", (0.48, 0.52))],  # q2 flips on a 0.02 margin
        [result("q3", "abc", (0.1, 0.2, 0.7))],  # q3 flips on a 0.5 margin
    ]
    report = agreement(reference, candidate, near_tie=0.05)
    assert (report["requests"], report["questions"], report["answers_differing"], report["near_ties"]) == (2, 3, 2, 1)
    # |dp|: 0.05, 0.05, 0.03, 0.03, 0, 0.5, 0.5
    assert report["median_abs_dp"] == pytest.approx(0.05)
    assert report["max_abs_dp"] == pytest.approx(0.5)
    assert [(d["question"], d["reference"], d["candidate"], d["near_tie"]) for d in report["differing"]] == [
        ("q2", "a", "b", True),
        ("q3", "b", "c", False),
    ]
    assert report["differing"][0]["reference_margin"] == pytest.approx(0.02)


def test_labels_in_every_accepted_form():
    noul = {"type": "noul"}
    score = {"type": "score", "criteria": ["Low", "High"]}
    choice = {"type": "choice", "criteria": {"bugs": None, "billing": None}}
    assert option_of_label(noul, False) == "false"
    assert option_of_label(noul, "true") == "true"
    assert option_of_label(score, 1) == "1"
    assert option_of_label(score, "0") == "0"
    assert option_of_label(score, "High") == "1"
    assert option_of_label(choice, "bugs") == "bugs"
    for question, label in ((noul, "yes"), (noul, 1), (score, 2), (score, True), (choice, "other")):
        with pytest.raises(ValueError, match="is not an option"):
            option_of_label(question, label)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR."""
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def readable(figure) -> list:
    """Every panel of a figure has a title, labelled axes and a legend: a reader can tell what it shows."""
    axes = figure.get_axes()
    assert axes
    for panel in axes:
        assert panel.get_title() and panel.get_xlabel() and panel.get_ylabel(), panel
        assert panel.get_legend() is not None and panel.get_legend().get_texts()
    return axes


def test_reliability_diagram_is_readable():
    figure = reliability_figure(reliability_bins(choice_predictions()))
    (axes,) = readable(figure)
    assert axes.get_xlim() == (0, 1) and "confidence" in axes.get_xlabel() and "accuracy" in axes.get_ylabel()
    bars = [patch for patch in axes.patches if patch.get_height() > 0 and patch.get_facecolor()[:3] == (66 / 255, 120 / 255, 190 / 255)]
    assert bars and min(bar.get_x() for bar in bars) >= 0.5  # no prediction below a confidence of 0.5
    assert png_size(png(figure)) == (550, 500)


def test_agreement_figure_is_readable():
    reference = [[QuestionResult("q", ("a", "b"), (0.0, 0.0), (0.6, 0.4))], [QuestionResult("q", ("a", "b"), (0.0, 0.0), (0.3, 0.7))]]
    candidate = [[QuestionResult("q", ("a", "b"), (0.0, 0.0), (0.61, 0.39))], [QuestionResult("q", ("a", "b"), (0.0, 0.0), (0.3, 0.7))]]
    report = agreement(reference, candidate)
    assert sum(report["abs_dp_histogram"]["counts"]) == 4 and report["abs_dp_histogram"]["counts"][0] == 2  # the two zeros
    (axes,) = readable(agreement_figure(report))
    assert axes.get_xscale() == "log" and "|dp|" in axes.get_xlabel()


@pytest.fixture(scope="module")
def tiny_models(tiny_dir):
    """The tiny release by precision, each loaded once for this module."""
    from clef_flash import load

    cache = {}

    def get(precision):
        if precision not in cache:
            cache[precision] = load(tiny_dir, device="cpu", precision=precision)
        return cache[precision]

    return get


@pytest.fixture
def cached_load(monkeypatch, tiny_dir, tiny_models):
    """`clef_flash.loader.load` answered from `tiny_models`: the commands run as they are, without reloading."""

    def load(source, *, precision=None, **options):
        assert str(source) == str(tiny_dir)
        return tiny_models(precision)

    monkeypatch.setattr("clef_flash.loader.load", load)


@pytest.fixture(scope="module")
def labelled_file(module_tmp):
    lines = []
    for index in range(4):
        lines.append(
            {
                "id": index,
                "state": f"ticket {index}: please refund the double charge",
                "questions": {
                    "urgent": {"type": "noul"},
                    "team": {"type": "choice", "criteria": {"billing": None, "bugs": "Bugs", "other": None}},
                    "level": {"type": "score", "criteria": ["Low", "High"]},
                    "unscored": {"type": "noul"},
                },
                "expected": {"urgent": index % 2 == 0, "team": ["billing", "bugs", "other", "billing"][index], "level": [0, "1", "High", "Low"][index]},
            }
        )
    path = module_tmp("eval") / "labelled.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, lines


def test_eval_labelled_end_to_end(capsys, tiny_dir, tmp_path, labelled_file, cached_load, tiny_models):
    path, lines = labelled_file
    code = main(["eval", "labelled", str(path), "--model", str(tiny_dir), "--precision", "fp32", "--out", str(tmp_path / "report")])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (report["records"], report["questions"]) == (4, 12)
    assert list(report["by_question"]) == ["urgent", "team", "level"] and report["by_question"]["team"]["type"] == "choice"
    assert (tmp_path / "report" / "report.md").read_text() == out and "| accuracy | macro-F1 |" in out
    assert png_size((tmp_path / "report" / "reliability.png").read_bytes()) == (550, 500)

    # The same figures from the model's own probabilities and the pure functions.
    model = tiny_models("fp32")
    truths = {"urgent": lambda i: ("true", "false")[i % 2], "team": lambda i: ["billing", "bugs", "other", "billing"][i], "level": lambda i: "0110"[i]}
    predictions = []
    for index, line in enumerate(lines):
        probabilities = model.probabilities({key: value for key, value in line.items() if key != "expected"})
        for question_id, truth in truths.items():
            options = tuple(probabilities[question_id])
            values = tuple(probabilities[question_id].values())
            predictions.append(Prediction(question_id, "", options, values, options.index(truth(index))))
    for name, value in summary(predictions).items():
        assert report[name] == pytest.approx(value, abs=1e-5), name


def test_eval_agreement_end_to_end(capsys, tiny_dir, tmp_path, labelled_file, cached_load):
    path, _ = labelled_file
    argv = ["eval", "agreement", str(path), "--model", str(tiny_dir), "--precision", "bf16"]
    code = main([*argv, "--against-model", str(tiny_dir), "--against-precision", "fp32", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["candidate"] == {"source": str(tiny_dir), "precision": "bf16", "random": True}
    assert report["reference"]["precision"] == "fp32"
    assert (report["requests"], report["questions"]) == (4, 16)
    assert 0 < report["median_abs_dp"] <= report["max_abs_dp"] < 0.05
    assert report["answers_differing"] == len(report["differing"]) >= report["near_ties"]
    assert "| questions | answers differing |" in out
    assert png_size((tmp_path / "agreement.png").read_bytes()) == (650, 400)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "labelled", "/no/such.jsonl"], "no input file at /no/such.jsonl"),
        (["eval", "labelled", "UNLABELLED"], 'line 1: a labelled line is a request with "expected"'),
        (["eval", "labelled", "BAD_LABEL"], "line 1, question 'u': label 'maybe' is not an option of this noul question"),
        (["eval", "labelled", "UNKNOWN_QUESTION"], "expected labels for questions the request does not ask: ['v']"),
        (["eval", "agreement", "NOT_JSON", "--against-model", "tiny"], "line 2: the body is not valid JSON"),
        (["eval", "agreement", "UNLABELLED", "--against-model", "/no/such/dir"], "no model at '/no/such/dir'"),
    ],
)
def test_errors_are_one_clear_line(capsys, tiny_dir, tmp_path, argv, message):
    request = {"state": "s", "questions": {"u": {"type": "noul"}}}
    files = {
        "UNLABELLED": [request],
        "BAD_LABEL": [{**request, "expected": {"u": "maybe"}}],
        "UNKNOWN_QUESTION": [{**request, "expected": {"v": True}}],
    }
    names = {}
    for name, rows in files.items():
        names[name] = tmp_path / f"{name}.jsonl"
        names[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    names["NOT_JSON"] = tmp_path / "not_json.jsonl"
    names["NOT_JSON"].write_text(json.dumps(request) + "\n{oops\n")
    code = main([*(str(names.get(arg, arg)) for arg in argv), "--model", str(tiny_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
