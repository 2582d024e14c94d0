"""What an explanation costs (issue 51): `Clef.explain` of a request whose JSON state has 8 fields (8 parts), against
answering the 8 requests with one field left out as independent records, and against one answer.

    python benchmarks/explain.py [--model runs/bundle-9b-part] [--precision P] [--rounds 3] [--field-repeat 1]
                                 [--faithful 6] [--label L]

- explain:      `model.explain(request)` (leave-out): the full record's shared prefix runs once, each of the 8
                variants from its field on (engine/core.py `score_branches`), with the host's work (8 variants rendered);
- independent:  the 8 requests with one field left out, one `answer` call each, state cache off (what a caller
                without `explain` runs: 8 whole records);
- batched:      the same 8 in one `answer_many` call (one forward; the cache off);
- one answer:   the full request once, the cache off (a caller without `explain` also needs it: the 8 + 1 records).
Rounds alternate the four (their order rotates), after a warm-up round; medians; ratios explain / each. The figures
say how many decoder tokens each ran (explain's `Cost`), and explain's probabilities are checked against the
independent answers (max relative difference). --field-repeat R repeats each field's text R times (longer parts).

What bounds the ratio: a variant must run everything after its part again (the later parts sit at other positions
after another past), and the schema after them. With a prompt prefix P, a state of S tokens in N equal parts and a
schema of Q, explain runs P + S + Q (the full record, as the chain of kept states) + Σᵢ (the state after part i + Q)
= P + S(1 + (N-1)/2) + (N+1)Q tokens, against N(P + S(N-1)/N + Q) for the N records with a part left out: for
N = 8, (1 + 3.5)/7 = 0.64 of their tokens as the state dominates, (N + 1)/N as the schema does. Against the N + 1
records a caller needs (the full answer too): 4.5/8 = 0.56 at most. With --faithful N, the deletion-curve areas of both methods on N
generated requests (lower is better than a random order). Written to benchmarks/results/explain-<label>.json.

The default model is the 9b-part bundle at runs/bundle-9b-part when it exists, else the tiny random release (its
figures are the tiny's: a model that small is all overhead). Run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import clef_flash
from clef_flash.explain import faithfulness, state_parts, without
from clef_flash.machine import this_machine
from clef_flash.request.samples import random_requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import typical_request  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_BUNDLE = Path(__file__).resolve().parent.parent / "runs" / "bundle-9b-part"

FIELDS = {  # 8 fields of a ticket, about 20 to 45 tokens each
    "subject": "Charged twice for my annual Business plan after the upgrade on 28 November",
    "body": "I upgraded to the annual Business plan and my card was charged twice: two payments of $1,299.00.",
    "request": "Please refund the duplicate charge and the $35 overdraft fee the bank added because of it.",
    "customer": "Dana Whitfield, finance lead at Acme Logistics, customer since 2019, 48 seats",
    "history": "Two earlier tickets this year, both about invoices; both closed within a day.",
    "payment": "Visa ending 4411, references 8841-AF and 8842-AF, both settled on 29 November.",
    "sentiment": "Polite but firm; mentions that their auditors are asking about the duplicate.",
    "channel": "Email to support, copied to the account manager; no phone call yet.",
}


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def cost_figures(model, request: dict, rounds: int) -> dict:
    """Explain against the 8 records with a field left out, run alone or batched, and against one answer."""
    parsed = model.parse(request)
    parts = state_parts(parsed)
    assert len(parts) == 8, [part.label for part in parts]
    variants = [without(parsed, parts, [index]) for index in range(len(parts))]
    bound = model.state_cache.max_bytes
    model.state_cache.max_bytes = 0  # nothing kept between calls: each mode runs what it runs
    out: dict = {}
    modes = {
        "explain": lambda: out.__setitem__("explanation", model.explain(request)),
        "independent": lambda: out.__setitem__("independent", [model.probabilities(variant) for variant in variants]),
        "batched": lambda: model.answer_many(variants),
        "one_answer": lambda: model.answer(request),
    }
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    for round_index in range(rounds + 1):  # round 0 warms up
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            elapsed = timed(modes[name])
            if round_index:
                seconds[name].append(elapsed)
    model.state_cache.max_bytes = bound
    explanation = out["explanation"]
    worst = 0.0
    for index, alone in enumerate(out["independent"]):
        for question in explanation.questions:
            scale = max(alone[question.question_id].values())
            for option in question.options:
                worst = max(worst, abs(option.without[index] - alone[question.question_id][option.option_id]) / scale)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    records = [model.encode(variant) for variant in variants]
    full = model.encode(request)
    return {
        "parts": [part.label for part in parts],
        "tokens": {
            "full_record": full.token_count,
            "prefix": full.prefix_tokens,
            "state": full.state_tokens,
            "schema_and_suffix": full.schema_tokens + full.suffix_tokens,
            "eight_records": sum(record.token_count for record in records),
            "explain_run": explanation.cost.tokens_run,
            "explain_whole": explanation.cost.tokens_whole,
            "explain_decoder_steps": explanation.cost.passes,
        },
        "seconds": seconds,
        "median_s": median,
        "explain_vs_independent": median["explain"] / median["independent"],
        "explain_vs_independent_and_full": median["explain"] / (median["independent"] + median["one_answer"]),
        "tokens_explain_vs_independent": explanation.cost.tokens_run / sum(record.token_count for record in records),
        "tokens_explain_vs_independent_and_full": explanation.cost.tokens_run / (sum(record.token_count for record in records) + full.token_count),
        "explain_vs_batched": median["explain"] / median["batched"],
        "explain_vs_one_answer": median["explain"] / median["one_answer"],
        "max_relative_difference_vs_independent": worst,
    }


def faithful_figures(model, count: int) -> dict:
    """Deletion-curve areas of both methods (leave-out; integrated gradients, 8 steps, where the model can) on generated
    requests of 4 to 10 parts: each request's first question's decision, parts left out in the order of their
    contribution against random orders (3 each)."""
    requests = [
        request for request in random_requests(51, 200, state_words=(40, 90)) if 4 <= len(state_parts(model.parse(request))) <= 10
    ][:count]
    methods = {"leave-out": {}}
    if not model.plan.precision.quantized:
        methods["integrated-gradients"] = {"steps": 8}
    figures: dict = {}
    for method, options in methods.items():
        areas = [faithfulness(model, request, method=method, **options) for request in requests]
        figures[method] = {
            "by_attribution": statistics.mean(area for area, _ in areas),
            "random_order": statistics.mean(area for _, area in areas),
            "requests_better_than_random": sum(attributed < shuffled for attributed, shuffled in areas),
            "requests": len(requests),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_BUNDLE) if DEFAULT_BUNDLE.is_dir() else "tiny")
    parser.add_argument("--precision", help="default: the fastest qualified on this machine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--field-repeat", type=int, default=1, help="each field's text this many times (default 1: 20 to 30 tokens a field)")
    parser.add_argument("--faithful", type=int, default=0, help="deletion curves on this many generated requests (default 0: none)")
    parser.add_argument("--label", help="the results file's label (default: the model's name)")
    args = parser.parse_args()
    label = args.label or Path(args.model).name.removeprefix("bundle-") + (f"-fields-x{args.field_repeat}" if args.field_repeat > 1 else "")

    started = time.perf_counter()
    model = clef_flash.load(args.model, precision=args.precision)
    load_s = time.perf_counter() - started
    request = {**typical_request(), "state": {name: " ".join([text] * args.field_repeat) for name, text in FIELDS.items()}}
    figures = {
        "label": label,
        "model": args.model,
        "random_weights": model.is_random,
        "precision": model.precision,
        "field_repeat": args.field_repeat,
        "machine": this_machine().cpu,
        "threads": this_machine().threads,
        "load_average_before": os.getloadavg(),
        "load_s": load_s,
        "cost": cost_figures(model, request, args.rounds),
    }
    if args.faithful:
        figures["deletion_area"] = faithful_figures(model, args.faithful)
    figures["load_average_after"] = os.getloadavg()
    cost = figures["cost"]
    median = cost["median_s"]
    tokens = cost["tokens"]
    print(
        f"{label} ({model.precision}{', random weights' if model.is_random else ''}; state {tokens['state']} tokens in 8 fields, "
        f"schema {tokens['schema_and_suffix']}): explain {median['explain']:.3f} s; 8 independent records "
        f"{median['independent']:.3f} s ({cost['explain_vs_independent']:.2f}x; with the full answer too "
        f"{cost['explain_vs_independent_and_full']:.2f}x), batched {median['batched']:.3f} s ({cost['explain_vs_batched']:.2f}x), "
        f"one answer {median['one_answer']:.3f} s ({cost['explain_vs_one_answer']:.2f}x); decoder tokens: explain "
        f"{tokens['explain_run']}, the 8 records {tokens['eight_records']} ({cost['tokens_explain_vs_independent']:.2f}x; "
        f"{cost['tokens_explain_vs_independent_and_full']:.2f}x with the full one); max rel difference vs independent "
        f"{cost['max_relative_difference_vs_independent']:.1e}"
    )
    for method, areas in figures.get("deletion_area", {}).items():
        print(f"deletion-curve area, {method}: by attribution {areas['by_attribution']:.4f}, random order {areas['random_order']:.4f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"explain-{label}.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
