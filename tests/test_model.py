"""The whole model (our decoder + head) against the reference (transformers + the authors' head), SPEC §4-§5."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

import clef_flash
from clef_flash.engine import Timings
from clef_flash.request.samples import random_request, random_requests

RELEASES = ["tiny", "9b-heads"]
# The reference on 9b-heads costs ~0.5 s a record: those cases run in the full suite only.
CASES = ["tiny", pytest.param("9b-heads", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def ours(tiny_dir, heads_dir):
    cache = {}

    def get(name: str, precision: str = "fp32"):
        if (name, precision) not in cache:
            cache[(name, precision)] = clef_flash.load({"tiny": tiny_dir, "9b-heads": heads_dir}[name], device="cpu", precision=precision)
        return cache[(name, precision)]

    return get


# >= 200 generated requests over the two releases; the 9b-heads reference costs ~0.5 s a record here.
REQUEST_COUNTS = {"tiny": 182, "9b-heads": 18}


def requests_for(name: str) -> list[dict]:
    seed = RELEASES.index(name)
    requests = random_requests(seed, REQUEST_COUNTS[name])
    rng = random.Random(100 + seed)
    # The hosted limits: 64 questions (short ones, to keep the reference's run time down), 255 options.
    many = random_request(rng, questions=1, state_words=20)
    many["questions"] = {f"q{index}": {"type": "noul", "instructions": f"Is point {index} true?"} for index in range(64)}
    requests.append(many)
    wide = random_request(rng, questions=1, state_words=20)
    wide["questions"] = {"pick": {"type": "choice", "instructions": "Pick one.", "criteria": {f"o{index}": None for index in range(255)}}}
    requests.append(wide)
    return requests


def compare(ours_logits, reference_logits):
    """Worst relative error over questions, and decisions that differ (top-2 ties within 1e-4 excepted)."""
    worst, flips = 0.0, []
    for question_id, reference_options in reference_logits.items():
        mine = ours_logits[question_id]
        assert list(mine) == list(reference_options)
        scale = max(abs(value) for value in reference_options.values())
        error = max(abs(mine[option] - value) for option, value in reference_options.items()) / max(scale, 1e-30)
        worst = max(worst, error)
        ranked = sorted(reference_options.values(), reverse=True)
        tie = len(ranked) > 1 and ranked[0] - ranked[1] <= 1e-4 * max(scale, 1e-30)
        if max(mine, key=mine.get) != max(reference_options, key=reference_options.get) and not tie:
            flips.append(question_id)
    return worst, flips


@pytest.mark.parametrize("name", CASES)
def test_whole_model_matches_reference_fp32(ours, reference_models, name, figures):
    model, reference_model = ours(name), reference_models(name)
    requests = requests_for(name)
    worst, flips, questions = 0.0, [], 0
    for request in requests:
        error, flipped = compare(model.logits(request), reference_model.logits(request))
        worst = max(worst, error)
        flips += flipped
        questions += len(request["questions"])
    figures(f"{name} fp32 vs the reference: {len(requests)} requests, {questions} questions, worst max|d|/max|ref| = {worst:.2e}, decisions differing: {len(flips)}")
    assert worst <= 1e-4
    assert flips == []


def test_encoding_matches_reference(ours, reference_models):
    model, reference_model = ours("tiny"), reference_models("tiny")
    for request in requests_for("tiny")[:20]:
        assert model.encode(request).input_ids == reference_model.encode(request).input_ids


@pytest.mark.parametrize("name", CASES)
def test_batch_invariance(ours, name):
    model = ours(name)
    requests = random_requests(7, 8, state_words=(3, 200))
    alone = [model.logits(request) for request in requests]
    timings = Timings()
    batch_logits = [
        {result.question_id: dict(zip(result.option_ids, result.logits)) for result in per_question}
        for per_question in model.score([model.encode(request) for request in requests], timings)
    ]
    # one forward for all 8, or two: their prefix + states (seen above, so now kept) and then the rest
    assert timings.forwards <= 2, "8 small records should share their forwards"
    worst = max(compare(batched, single)[0] for batched, single in zip(batch_logits, alone))
    print(f"\n{name}: batch of 8 vs alone, worst relative logit difference {worst:.2e}")
    assert worst <= 1e-5


# fp32 top-2 probability margin below which bf16 rounding may legitimately flip a decision: bf16 moves
# probabilities by up to a few 1e-3 (max |dp|), and on the tiny release the reference's own bf16 path flips a
# 2.0e-3 margin; ours flips a 1.4e-3 one on CPUs without native bf16 (AVX2 kernels round differently).
NEAR_TIE = 5e-3


@pytest.mark.parametrize("name", CASES)
def test_bf16_decisions_agree_with_fp32_reference(ours, reference_models, name):
    model, reference_model = ours(name, "bf16"), reference_models(name)
    requests = requests_for(name)[: {"tiny": 30, "9b-heads": 20}[name]]
    agree = total = near_ties = flipped_near_ties = 0
    deltas = []
    for request in requests:
        mine = model.probabilities(request)
        for question_id, logits in reference_model.logits(request).items():
            reference_p = torch.tensor(list(logits.values()), dtype=torch.float64).softmax(-1)
            my_p = torch.tensor(list(mine[question_id].values()), dtype=torch.float64)
            deltas += (my_p - reference_p).abs().tolist()
            top2 = reference_p.topk(min(2, len(reference_p))).values
            near_tie = len(top2) > 1 and float(top2[0] - top2[1]) < NEAR_TIE
            same = int(my_p.argmax()) == int(reference_p.argmax())
            total += 1
            agree += same
            near_ties += near_tie
            flipped_near_ties += near_tie and not same
    median = statistics.median(deltas)
    decided = total - near_ties
    agree_decided = agree - (near_ties - flipped_near_ties)
    print(
        f"\n{name}: bf16 vs fp32 reference: decisions agree on {agree}/{total} ({agree / total:.1%}); "
        f"{near_ties} near-ties (margin < {NEAR_TIE}), {flipped_near_ties} of them flipped; "
        f"outside near-ties {agree_decided}/{decided}; median |dp| {median:.2e}"
    )
    assert agree_decided / decided >= 0.99
    assert median < 2e-3


def test_answers_are_system_one_bodies(ours):
    model = ours("tiny")
    body = model.answer(requests_for("tiny")[0])
    assert set(body) == {"model", "answers", "usage"}
    assert body["usage"]["output_tokens"] == 0 and body["usage"]["input_tokens"] > 0
    timings = model.last_timings.as_dict()
    assert {"tokenize_ms", "decoder_ms", "head_ms", "total_ms"} <= set(timings)


def test_answer_many_names_the_invalid_request(ours):
    model = ours("tiny")
    valid = requests_for("tiny")[0]
    invalid = {"state": "x", "questions": {"team": {"type": "choice", "criteria": {"only": None}}}}
    with pytest.raises(clef_flash.RequestInvalid) as caught:
        model.answer_many([valid, invalid])
    assert caught.value.errors[0]["loc"][:3] == ["body", 1, "questions"]
    assert model.answer_many([]) == []


def test_over_length_request_is_refused_before_inference(tiny_dir):
    model = clef_flash.load(tiny_dir, device="cpu", precision="fp32", max_length=100)
    with pytest.raises(clef_flash.RecordTooLong) as caught:
        model.answer({"state": "word " * 200, "questions": {"q": {"type": "noul"}}})
    assert caught.value.limit == 100 and caught.value.token_count > 100
    assert model.last_timings.forwards == 0
