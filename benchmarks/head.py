"""The batched joint head vs Cloudflare's reference JointSchemaHead, real clef-flash head config.

    python benchmarks/head.py [--repeats 3] [--threads N] [--device cpu]

Random weights (4096/1024/2/4/16/4096), random hidden states, records laid out like rendered
ones (disjoint spans at the end of the sequence). Both heads run fp32 under inference_mode; ours
is timed including `build_head_batch` (host indexing). Prints medians, the ratio, and the
largest per-question max|d|/max|ref| between the two.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict

import torch

from clef_flash.model.head_batch import build_head_batch, split_logits
from clef_flash.model.joint_head import HeadConfig, JointHead

try:
    from clef_finetune._vendor.joint_schema_model import EncodedQuestion, EncodedRecord, JointSchemaHead
except ImportError as error:  # the oracle is a dev dependency
    raise SystemExit("needs the oracle: pip install --no-deps clef-finetune==0.1.0") from error

CONFIG = HeadConfig(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096)
# lm_head.weight has 248,320 rows; a 32K-row random table keeps the benchmark at 0.5 GB instead of
# 4 GB, and the heads read only the rows of option tokens either way.
VOCAB = 32_768


def layout_record(
    rng: random.Random, option_counts: list[int], name: str, *, state_tokens: int | None = None, length: int | None = None
) -> EncodedRecord:
    """Spans placed as SPEC §3 renders them: prefix, state, then per field a header, the
    instruction (question span), and options (option spans), then the suffix. Give either the
    state's token count or the record's total length."""
    prefix, suffix = 36, 20  # system prompt + "STATE:" / "SCHEMA FIELDS:"; the assistant suffix
    position = 0  # inside the schema
    fields = []
    for count in option_counts:
        position += 12  # FIELD k / ID / TYPE / INSTRUCTION:
        question_span = (position, position + rng.randint(6, 20))
        position = question_span[1] + 5  # ALLOWED OPTIONS:
        spans = []
        for _ in range(count):
            position += 4  # OPTION m:
            spans.append((position, position + rng.randint(5, 15)))
            position = spans[-1][1] + 1
        position += 4  # END FIELD
        fields.append((question_span, spans))
    if state_tokens is None:
        state_tokens = length - prefix - position - suffix
        if state_tokens < 0:
            raise ValueError(f"the schema alone needs {prefix + position + suffix} tokens, over {length}")
    offset = prefix + state_tokens
    questions = tuple(
        EncodedQuestion(
            question_id=f"q{index}",
            question_type=rng.randint(0, 2),
            question_span=(question_span[0] + offset, question_span[1] + offset),
            option_spans=tuple((start + offset, end + offset) for start, end in spans),
            option_ids=tuple(str(m) for m in range(len(spans))),
        )
        for index, (question_span, spans) in enumerate(fields)
    )
    input_ids = tuple(rng.randrange(VOCAB) for _ in range(offset + position + suffix))
    return EncodedRecord(input_ids=input_ids, questions=questions, record_id=name)


def median_seconds(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    rng = random.Random(0)

    reference = JointSchemaHead(**asdict(CONFIG)).eval()
    with torch.no_grad():
        reference.residual_gate.fill_(0.7)
        reference.joint_logit_scale.fill_(1.3)
        reference.prior_logit_scale.fill_(-0.4)
    reference = reference.to(device)
    with torch.device("meta"):
        head = JointHead(CONFIG)
    head.load_state_dict(reference.state_dict(), strict=True, assign=True)
    head.eval()
    table = torch.randn(VOCAB, CONFIG.hidden_size, device=device) * 0.02  # lm_head.weight

    cases = {
        "T=370, 3 questions of 2-5 options": [layout_record(rng, [rng.randint(2, 5) for _ in range(3)], "short", length=370)],
        "8 such records, states of 50-250 tokens": [
            layout_record(rng, [rng.randint(2, 5) for _ in range(3)], f"r{i}", state_tokens=rng.randint(50, 250))
            for i in range(8)
        ],
        "64 questions x 4 options": [layout_record(rng, [4] * 64, "many", state_tokens=300)],
    }

    print(f"device {device}, threads {torch.get_num_threads()}, torch {torch.__version__}, fp32, head config {asdict(CONFIG)}")
    print(f"{'case':40s} {'tokens':>8s} {'options':>8s} {'reference':>11s} {'ours':>9s} {'speed-up':>9s} {'max rel err':>12s}")
    for name, records in cases.items():
        lengths = torch.tensor([len(record.input_ids) for record in records], device=device)
        longest = int(lengths.max())
        hidden = torch.zeros(len(records), longest, CONFIG.hidden_size, device=device)
        input_ids = torch.zeros(len(records), longest, dtype=torch.long, device=device)
        mask = torch.zeros(len(records), longest, dtype=torch.long, device=device)
        for index, record in enumerate(records):
            count = len(record.input_ids)
            hidden[index, :count] = 2.0 * torch.randn(count, CONFIG.hidden_size, device=device)
            input_ids[index, :count] = torch.tensor(record.input_ids, device=device)
            mask[index, :count] = 1

        def run_reference():
            return reference(hidden, input_ids, mask, records, table)

        def run_ours():
            batch = build_head_batch(records, device)
            return split_logits(head(hidden, lengths, batch, table), batch)

        with torch.inference_mode():
            expected, got = run_reference(), run_ours()
            worst = max(
                float((ours - theirs).abs().max() / theirs.abs().max())
                for ours_record, theirs_record in zip(got, expected)
                for ours, theirs in zip(ours_record, theirs_record)
            )
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            reference_time = median_seconds(lambda: (run_reference(), sync()), args.repeats)
            ours_time = median_seconds(lambda: (run_ours(), sync()), args.repeats)
        options = sum(len(q.option_spans) for record in records for q in record.questions)
        print(
            f"{name:40s} {int(lengths.sum()):8d} {options:8d} {reference_time * 1e3:9.1f}ms {ours_time * 1e3:7.1f}ms"
            f" {reference_time / ours_time:8.2f}x {worst:12.2e}"
        )


if __name__ == "__main__":
    main()
