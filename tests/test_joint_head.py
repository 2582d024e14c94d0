"""The batched joint head against Cloudflare's reference JointSchemaHead (SPEC §5, §8)."""

from __future__ import annotations

import copy
import random
from dataclasses import asdict

import pytest
import torch

from clef_flash.model.head_batch import build_head_batch, softmax_per_question, split_logits
from clef_flash.model.joint_head import HeadConfig, JointHead

REAL = HeadConfig(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096)
SMALL = HeadConfig(hidden_size=72, width=48, routing_layers=2, layers=2, heads=4, feedforward=80)
VOCAB = 500
TOLERANCE = 1e-5


# ---------------------------------------------------------------------------------------------
# helpers


def random_reference(reference, config: HeadConfig, scales: tuple[float, float, float], seed: int = 0):
    """A reference head with every parameter random (LayerNorms and attention biases included)."""
    torch.manual_seed(seed)
    head = reference.JointSchemaHead(**asdict(config)).eval()
    gate, joint, prior = scales
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if parameter.ndim == 0:
                continue
            if "norm" in name and name.endswith("weight"):
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
        head.residual_gate.fill_(gate)
        head.joint_logit_scale.fill_(joint)
        head.prior_logit_scale.fill_(prior)
    return head


def ours_from(reference_head, config: HeadConfig) -> JointHead:
    """Built on the meta device and filled strictly from the reference's state dict."""
    with torch.device("meta"):
        head = JointHead(config)
    head.load_state_dict(reference_head.state_dict(), strict=True, assign=True)
    assert not any(p.is_meta for p in head.parameters())
    return head.eval()


def random_span(rng: random.Random, length: int, longest: int) -> tuple[int, int]:
    size = rng.randint(1, min(longest, length))
    start = rng.randint(0, length - size)
    return start, start + size


def random_record(
    reference, rng: random.Random, length: int, question_count: int, option_counts: list[int], record_id: str
):
    """A reference EncodedRecord with random ids and random (possibly overlapping) spans."""
    questions = tuple(
        reference.EncodedQuestion(
            question_id=f"q{index}",
            question_type=rng.randint(0, 2),
            question_span=random_span(rng, length, 20),
            option_spans=tuple(random_span(rng, length, 12) for _ in range(option_counts[index])),
            option_ids=tuple(f"o{m}" for m in range(option_counts[index])),
        )
        for index in range(question_count)
    )
    input_ids = tuple(rng.randrange(VOCAB) for _ in range(length))
    return reference.EncodedRecord(input_ids=input_ids, questions=questions, record_id=record_id)


def mixed_records(reference, rng: random.Random, count: int) -> list:
    records = []
    for index in range(count):
        questions = rng.randint(1, 8)
        records.append(
            random_record(
                reference, rng, rng.randint(30, 160), questions, [rng.randint(2, 12) for _ in range(questions)], f"r{index}"
            )
        )
    return records


def padded_inputs(records, hidden_size: int, seed: int, pad_value: float = 0.0):
    """Right-padded hidden states, ids and mask as the reference takes them, plus lengths."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(record.input_ids) for record in records])
    longest = int(lengths.max())
    hidden = torch.full((len(records), longest, hidden_size), pad_value)
    input_ids = torch.zeros((len(records), longest), dtype=torch.long)
    mask = torch.zeros((len(records), longest), dtype=torch.long)
    for index, record in enumerate(records):
        length = len(record.input_ids)
        hidden[index, :length] = 3.0 * torch.randn(length, hidden_size, generator=generator) + 0.5
        input_ids[index, :length] = torch.tensor(record.input_ids)
        mask[index, :length] = 1
    return hidden, lengths, input_ids, mask


def output_embedding(hidden_size: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(VOCAB, hidden_size, generator=torch.Generator().manual_seed(seed)) * 0.05


def per_question_errors(ours: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]):
    """max|d| / max|ref| for every question, and whether every argmax agrees."""
    errors, same_argmax = [], True
    for ours_record, expected_record in zip(ours, expected, strict=True):
        for ours_logits, expected_logits in zip(ours_record, expected_record, strict=True):
            assert ours_logits.shape == expected_logits.shape
            scale = expected_logits.abs().max().clamp_min(1e-30)
            errors.append(float((ours_logits - expected_logits).abs().max() / scale))
            same_argmax &= int(ours_logits.argmax()) == int(expected_logits.argmax())
    return errors, same_argmax


def compare_with_reference(reference, records, config: HeadConfig, scales, seed: int = 0, label: str = ""):
    reference_head = random_reference(reference, config, scales, seed)
    head = ours_from(reference_head, config)
    hidden, lengths, input_ids, mask = padded_inputs(records, config.hidden_size, seed + 1)
    table = output_embedding(config.hidden_size, seed + 2)
    with torch.inference_mode():
        expected = reference_head(hidden, input_ids, mask, records, table)
        exact = copy.deepcopy(reference_head).double()(hidden.double(), input_ids, mask, records, table.double())
        batch = build_head_batch(records)
        logits = head(hidden, lengths, batch, table)
    assert logits.dtype == torch.float32 and logits.shape == (batch.num_options,)
    per_question = split_logits(logits, batch)
    errors, same_argmax = per_question_errors(per_question, expected)
    worst = max(errors)
    ours_exact = max(per_question_errors([[t.double() for t in r] for r in per_question], exact)[0])
    reference_exact = max(per_question_errors([[t.double() for t in r] for r in expected], exact)[0])
    print(
        f"\n[{label}] {len(errors)} questions, {batch.num_options} options: worst max|d|/max|ref| = {worst:.2e}"
        f" (vs the reference in float64: ours {ours_exact:.2e}, reference {reference_exact:.2e})"
    )
    assert worst <= TOLERANCE
    assert same_argmax
    return head, batch, logits


# ---------------------------------------------------------------------------------------------
# structure


@pytest.mark.parametrize("config", [REAL, SMALL], ids=["real", "small"])
def test_state_dict_matches_reference(reference, config):
    with torch.device("meta"):
        ours = JointHead(config)
        theirs = reference.JointSchemaHead(**asdict(config))
    ours_shapes = [(name, tuple(t.shape)) for name, t in ours.state_dict().items()]
    theirs_shapes = [(name, tuple(t.shape)) for name, t in theirs.state_dict().items()]
    assert ours_shapes == theirs_shapes


def test_config_from_dict_keeps_known_keys():
    values = {**asdict(REAL), "dropout": 0.1, "something_new": "x"}
    assert HeadConfig.from_dict(values) == REAL
    with pytest.raises(ValueError, match="heads"):
        HeadConfig.from_dict({key: value for key, value in asdict(REAL).items() if key != "heads"})


def test_malformed_spans_are_refused(reference):
    rng = random.Random(0)
    record = random_record(reference, rng, 10, 1, [2], "r")
    question = record.questions[0]
    empty = reference.EncodedRecord(
        input_ids=record.input_ids,
        questions=(
            reference.EncodedQuestion(
                question_id="q", question_type=0, question_span=(3, 3),
                option_spans=question.option_spans, option_ids=question.option_ids,
            ),
        ),
        record_id="r",
    )
    with pytest.raises(ValueError, match="question_span"):
        build_head_batch([empty])
    outside = reference.EncodedRecord(
        input_ids=record.input_ids,
        questions=(
            reference.EncodedQuestion(
                question_id="q", question_type=1, question_span=(0, 2),
                option_spans=((1, 2), (8, 11)), option_ids=("a", "b"),
            ),
        ),
        record_id="r",
    )
    with pytest.raises(ValueError, match="option 1"):
        build_head_batch([outside])


# ---------------------------------------------------------------------------------------------
# parity with the reference


def test_parity_mixed_batch(reference):
    records = mixed_records(reference, random.Random(1), 6)
    compare_with_reference(reference, records, SMALL, scales=(0.7, 1.3, -0.4), label="mixed batch")


def test_parity_when_scales_hit_the_clamp(reference):
    records = mixed_records(reference, random.Random(2), 4)
    compare_with_reference(reference, records, SMALL, scales=(-0.3, 5.2, 4.9), seed=3, label="clamped scales")


def test_parity_hosted_limits(reference):
    """A record with 64 questions, one with a 255-option question, and a small one, in one batch."""
    rng = random.Random(3)
    records = [
        random_record(reference, rng, 700, 64, [rng.randint(2, 6) for _ in range(64)], "many-questions"),
        random_record(reference, rng, 900, 3, [2, 255, 7], "many-options"),
        random_record(reference, rng, 50, 2, [2, 3], "small"),
    ]
    _, batch, _ = compare_with_reference(
        reference, records, SMALL, scales=(0.7, 1.3, -0.4), seed=5, label="64 questions, 255 options"
    )
    assert batch.max_questions == 64 and batch.max_question_options == 255


def test_probabilities_match_reference_softmax(reference):
    records = mixed_records(reference, random.Random(4), 3)
    _, batch, logits = compare_with_reference(reference, records, SMALL, scales=(0.7, 1.3, -0.4), label="probs")
    probabilities = softmax_per_question(logits, batch)
    assert probabilities.dtype == torch.float32
    for record_logits, record_probabilities in zip(split_logits(logits, batch), split_logits(probabilities, batch)):
        for question_logits, question_probabilities in zip(record_logits, record_probabilities):
            torch.testing.assert_close(question_probabilities, question_logits.float().softmax(-1), rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# batching and inputs


def small_head(reference, seed: int = 0) -> JointHead:
    return ours_from(random_reference(reference, SMALL, (0.7, 1.3, -0.4), seed), SMALL)


def test_batch_invariance(reference):
    records = mixed_records(reference, random.Random(5), 8)
    head = small_head(reference)
    table = output_embedding(SMALL.hidden_size)
    hidden, lengths, _, _ = padded_inputs(records, SMALL.hidden_size, seed=9)
    with torch.inference_mode():
        batch = build_head_batch(records)
        together = split_logits(head(hidden, lengths, batch, table), batch)
        worst = 0.0
        for index, record in enumerate(records):
            length = len(record.input_ids)
            alone_batch = build_head_batch([record])
            alone = split_logits(head(hidden[index : index + 1, :length], lengths[index : index + 1], alone_batch, table), alone_batch)[0]
            errors, same_argmax = per_question_errors([together[index]], [alone])
            worst = max(worst, *errors)
            assert same_argmax
    print(f"\n[batch invariance] 8 records: worst max|d|/max|alone| = {worst:.2e}")
    assert worst <= TOLERANCE


def test_padding_content_never_leaks(reference):
    """Padded hidden rows are ignored, even when they hold NaN or huge values."""
    records = mixed_records(reference, random.Random(6), 4)
    head = small_head(reference)
    table = output_embedding(SMALL.hidden_size)
    clean, lengths, _, _ = padded_inputs(records, SMALL.hidden_size, seed=11)
    batch = build_head_batch(records)
    with torch.inference_mode():
        expected = head(clean, lengths, batch, table)
        for pad_value in (float("nan"), 1e30):
            dirty, _, _, _ = padded_inputs(records, SMALL.hidden_size, seed=11, pad_value=pad_value)
            torch.testing.assert_close(head(dirty, lengths, batch, table), expected, rtol=0, atol=0)


def test_output_embedding_callable_matches_tensor(reference):
    records = mixed_records(reference, random.Random(7), 3)
    head = small_head(reference)
    table = output_embedding(SMALL.hidden_size)
    hidden, lengths, _, _ = padded_inputs(records, SMALL.hidden_size, seed=13)
    batch = build_head_batch(records)
    requested: list[torch.Tensor] = []

    def rows(ids: torch.Tensor) -> torch.Tensor:
        requested.append(ids)
        return table[ids]

    with torch.inference_mode():
        expected = head(hidden, lengths, batch, table)
        got = head(hidden, lengths, batch, rows)
    assert torch.equal(got, expected)
    (ids,) = requested
    option_tokens = {
        record.input_ids[position]
        for record in records
        for question in record.questions
        for start, end in question.option_spans
        for position in range(start, end)
    }
    assert ids.tolist() == sorted(option_tokens)  # each needed row once, nothing else


def test_low_precision_hidden_is_computed_in_float32(reference):
    records = mixed_records(reference, random.Random(8), 2)
    head = small_head(reference)
    table = output_embedding(SMALL.hidden_size)
    hidden, lengths, _, _ = padded_inputs(records, SMALL.hidden_size, seed=15)
    batch = build_head_batch(records)
    hidden_bf16 = hidden.to(torch.bfloat16)
    with torch.inference_mode():
        got = head(hidden_bf16, lengths, batch, table.to(torch.bfloat16))
        expected = head(hidden_bf16.float(), lengths, batch, table.to(torch.bfloat16).float())
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
