"""State reuse and long records (issue 14): the figures of the README's table.

    python benchmarks/state_reuse.py [--model benchmarks/.peer/bundle-9b-part] [--rounds 3] [--parts sets,server,long,segments]

- sets:     8 question sets (3 questions each) on one 4,000-token state as one `answer_many` call (the state
            runs once) against the 8 records run independently (cache off, one call each); alternating
            rounds after a warm-up with the shared call, medians; the answers of both compared.
- pairs:    the same on a loaded machine: the shared call alternates with ONE of the 8 records run alone
            (cycling through them), so each pair sees the same load; the 8 alone are estimated as 8 x the
            mean of those; decisions and logits of each record alone compared with the shared call's.
- server:   the same 8 as sequential HTTP requests from one client to a real uvicorn server, state cache
            on (emptied before each round) against off; alternating rounds.
- long:     one record of 370, 4K, 16K and 64K tokens, each in a fresh process: tokens/s and peak RSS, with
            segments (the default) and in one pass (up to --one-pass-up-to; one that would not fit the
            memory available, judged from the largest one pass measured, is reported with the figure it
            needs instead). With segments, RSS is sampled after every decoder step, and the peak over the
            370-token record is split into K/V, the head's memory rows and the rest.
- segments: tokens/s of a 4K record for several segment sizes (what the default is chosen from).
- overhead: what keeping the state costs a ~400-token record that is never asked again (two decoder
            steps instead of one pass).

Run it alone on a quiet machine (load average < 0.5); every figure says the CPU it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

import clef_flash
from clef_flash.engine import KEEP_FROM_TOKENS
from clef_flash.errors import RecordTooLong
from clef_flash.machine import this_machine
from clef_flash.prefill import DEFAULT_SEGMENT_TOKENS
from clef_flash.request.samples import WORDS, random_request, request_of_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_mb  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def state_of_tokens(model, tokens: int, seed: int = 0) -> str:
    """Random words whose state part is `tokens` tokens, give or take a word."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens * 2)]
    low, high = 1, len(words)
    while high - low > 1:
        middle = (low + high) // 2
        count = model.encode({"state": " ".join(words[:middle]), "questions": {"q": {"type": "noul"}}}).state_tokens
        low, high = (middle, high) if count <= tokens else (low, middle)
    return " ".join(words[:low])


def question_sets(count: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [random_request(rng, questions=3, options=4)["questions"] for _ in range(count)]


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def part_sets(model, rounds: int) -> dict:
    state = state_of_tokens(model, 4000)
    requests = [{"model": "clef-flash", "state": state, "questions": questions} for questions in question_sets(8)]
    records = [model.encode(request) for request in requests]
    bound = model.state_cache.max_bytes
    shared_s, independent_s = [], []
    logits = {}
    for round_index in range(rounds + 1):  # round 0 warms up (the shared call runs every step the other does)
        for mode in ("shared", "independent") if round_index % 2 else ("independent", "shared")[round_index == 0 :]:
            model.state_cache.clear()
            if mode == "shared":
                model.state_cache.max_bytes = bound
                seconds = timed(lambda: logits.__setitem__(mode, model._run(requests)[1]))
                reused = model.last_timings.tokens_reused
            else:
                model.state_cache.max_bytes = 0
                out = []
                seconds = timed(lambda: out.extend(model._run([request])[1][0] for request in requests))
                logits[mode] = out
            if round_index:
                (shared_s if mode == "shared" else independent_s).append(seconds)
    model.state_cache.max_bytes = bound
    worst, flips = 0.0, 0
    for shared, independent in zip(logits["shared"], logits["independent"]):
        for a, b in zip(shared, independent):
            scale = max(abs(value) for value in b.logits)
            worst = max(worst, max(abs(x - y) for x, y in zip(a.logits, b.logits)) / scale)
            flips += max(range(len(a.logits)), key=a.logits.__getitem__) != max(range(len(b.logits)), key=b.logits.__getitem__)
    model.state_cache.clear()
    model._run(requests[:1])
    entry_bytes = model.state_cache.stats.bytes
    tokens = [record.token_count for record in records]
    state_tokens = records[0].prefix_tokens + records[0].state_tokens
    return {
        "state_tokens": state_tokens,
        "schema_and_suffix_tokens": [record.schema_tokens + record.suffix_tokens for record in records],
        "shared_s": shared_s,
        "independent_s": independent_s,
        "speedup": statistics.median(independent_s) / statistics.median(shared_s),
        "token_bound": sum(tokens) / (state_tokens + sum(t - state_tokens for t in tokens)),
        "tokens_reused": reused,
        "max_relative_logit_difference": worst,
        "decisions_differing": flips,
        "cached_state_mb": entry_bytes / 2**20,
    }


def part_pairs(model, rounds: int) -> dict:
    state = state_of_tokens(model, 4000)
    requests = [{"model": "clef-flash", "state": state, "questions": questions} for questions in question_sets(8)]
    bound = model.state_cache.max_bytes
    shared_s, alone_s, loads, worst, flips = [], [], [], 0.0, 0
    shared_logits = None
    for index in range(rounds + 1):  # pair 0 warms up
        model.state_cache.clear()
        model.state_cache.max_bytes = bound
        start = time.perf_counter()
        shared_logits = model._run(requests)[1]
        seconds = time.perf_counter() - start
        model.state_cache.clear()
        model.state_cache.max_bytes = 0
        record = index % len(requests)
        start = time.perf_counter()
        alone = model._run([requests[record]])[1][0]
        alone_seconds = time.perf_counter() - start
        if index:
            shared_s.append(seconds)
            alone_s.append(alone_seconds)
            loads.append(os.getloadavg()[0])
        for a, b in zip(shared_logits[record], alone):
            scale = max(abs(value) for value in b.logits)
            worst = max(worst, max(abs(x - y) for x, y in zip(a.logits, b.logits)) / scale)
            flips += max(range(len(a.logits)), key=a.logits.__getitem__) != max(range(len(b.logits)), key=b.logits.__getitem__)
    model.state_cache.max_bytes = bound
    ratios = [len(requests) * alone / shared for shared, alone in zip(shared_s, alone_s)]
    return {"shared_s": shared_s, "alone_s": alone_s, "load_1min": loads, "pair_ratios": ratios,
            "speedup": len(requests) * statistics.mean(alone_s) / statistics.median(shared_s),
            "max_relative_logit_difference": worst, "decisions_differing": flips}


def part_server(model, rounds: int) -> dict:
    from clef_flash.server import create_app
    from clef_flash.testing.server import running_server

    state = state_of_tokens(model, 4000)
    requests = [{"model": "clef-flash", "state": state, "questions": questions} for questions in question_sets(8, seed=2)]
    bound = model.state_cache.max_bytes
    on_s, off_s = [], []
    with running_server(create_app(model, batch_wait_ms=0)) as url, httpx.Client(base_url=url, timeout=3600) as client:
        for round_index in range(rounds + 1):
            for mode in ("on", "off") if round_index % 2 else ("off", "on"):
                model.state_cache.clear()
                model.state_cache.max_bytes = bound if mode == "on" else 0
                seconds = timed(lambda: [client.post("/v1/systemone", json=request).raise_for_status() for request in requests])
                if round_index:
                    (on_s if mode == "on" else off_s).append(seconds)
        metrics = client.get("/metrics").text
    model.state_cache.max_bytes = bound
    hits = next(line for line in metrics.splitlines() if line.startswith("clef_flash_state_cache_hits_total"))
    return {"cache_on_s": on_s, "cache_off_s": off_s, "speedup": statistics.median(off_s) / statistics.median(on_s), "metrics": hits}


def tokens_of(model, request) -> int:
    """The record's tokens, also over the model's limit."""
    try:
        return model.encode(request).token_count
    except RecordTooLong as error:
        return error.token_count


def rss_mb() -> float:
    """Resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_record(source: str, tokens: int, segment: int) -> dict:
    """In this (fresh) process: load, answer one record of `tokens` tokens, report time and peak RSS,
    and RSS after every decoder step of it (resident now, and the peak so far)."""
    model = clef_flash.load(source, segment_tokens=segment)
    request = request_of_tokens(lambda request: tokens_of(model, request), tokens)
    loaded_rss = peak_rss_mb()
    # warm up on a short record (weights paged in and packed), then time the record once
    model.answer(request_of_tokens(lambda request: tokens_of(model, request), 370, seed=1))
    model.state_cache.clear()
    warm_rss = peak_rss_mb()
    decoder, steps = model.parts.decoder, []
    forward = decoder.forward

    def sampled(*args, **kwargs):
        out = forward(*args, **kwargs)
        steps.append((round(rss_mb()), round(peak_rss_mb())))
        return out

    decoder.forward = sampled
    start = time.perf_counter()
    model.answer(request)
    seconds = time.perf_counter() - start
    count = model.encode(request).token_count
    return {"tokens": count, "segment": segment, "seconds": seconds, "tokens_per_s": count / seconds,
            "peak_rss_mb": peak_rss_mb(), "rss_after_load_mb": loaded_rss, "peak_rss_after_warm_up_mb": warm_rss,
            "precision": model.precision, "rss_by_step_mb": steps,
            "kv_mb": (decoder.state_nbytes(count) - decoder.state_nbytes(0)) / 2**20,
            "head_memory_mb": count * model.parts.head.config.width * 4 / 2**20}


def in_fresh_process(source: str, tokens: int, segment: int) -> dict:
    output = subprocess.run(
        [sys.executable, __file__, "--model", source, "--one", str(tokens), "--segment", str(segment)],
        capture_output=True, text=True, check=False,
    )
    if output.returncode:
        return {"tokens": tokens, "segment": segment, "failed": f"exit {output.returncode}: {output.stderr[-500:]}"}
    return json.loads(output.stdout.splitlines()[-1])


def available_mb() -> float:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 1024


ONE_PASS = 1 << 20  # segment tokens: the whole record in one decoder step


def part_long(source: str, lengths: list[int], one_pass_up_to: int) -> dict:
    rows = []
    for tokens in lengths:
        runs = [DEFAULT_SEGMENT_TOKENS] + ([ONE_PASS] if tokens <= one_pass_up_to else [])
        for segment in runs:
            passes = [row for row in rows if row["segment"] == ONE_PASS and "peak_rss_mb" in row and row["tokens"] > rows[0]["tokens"]]
            if segment == ONE_PASS and passes and rows[0]["tokens"] <= 512:
                # what a one pass of this length needs, scaled from the largest measured (activations grow
                # with the record, the rest does not), against what this machine has free now
                largest = max(passes, key=lambda row: row["tokens"])
                growth = (largest["peak_rss_mb"] - rows[0]["peak_rss_mb"]) / (largest["tokens"] - rows[0]["tokens"])
                needs = rows[0]["peak_rss_mb"] + growth * (tokens - rows[0]["tokens"])
                if needs > 0.7 * available_mb():  # a shared machine: leave room, never invite the OOM killer
                    rows.append({"tokens": tokens, "segment": segment, "does_not_fit": True, "needs_mb_estimate": needs,
                                 "available_mb": available_mb()})
                    print(json.dumps(rows[-1]), file=sys.stderr)
                    continue
            rows.append({**in_fresh_process(source, tokens, segment), "load_average": os.getloadavg()})
            print(json.dumps({key: value for key, value in rows[-1].items() if key != "rss_by_step_mb"}), file=sys.stderr)
    base = next(row for row in rows if row["tokens"] <= 512 and row["segment"] != ONE_PASS)
    longest = max((row for row in rows if row["segment"] != ONE_PASS), key=lambda row: row["tokens"])
    over = longest["peak_rss_mb"] - base["peak_rss_mb"]
    return {
        "rows": rows,
        "peak_rss_over_short_mb": over,
        "breakdown_mb": {"tokens": longest["tokens"], "kv": longest["kv_mb"] - base["kv_mb"],
                         "head_memory_rows": longest["head_memory_mb"] - base["head_memory_mb"],
                         "rest": over - (longest["kv_mb"] - base["kv_mb"]) - (longest["head_memory_mb"] - base["head_memory_mb"])},
    }


def part_segments(model, rounds: int, sizes=(512, 1024, 2048, 4096)) -> dict:
    request = request_of_tokens(lambda request: model.encode(request).token_count, 4096, seed=3)
    model.state_cache.max_bytes = 0
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for round_index in range(rounds + 1):
        for size in sizes if round_index % 2 else sizes[::-1]:
            model.segment_tokens = size
            seconds = timed(lambda: model.answer(request))
            if round_index:
                times[size].append(seconds)
    count = model.encode(request).token_count
    return {str(size): {"median_s": statistics.median(values), "tokens_per_s": count / statistics.median(values)} for size, values in times.items()}


def part_overhead(model, rounds: int) -> dict:
    """What keeping a state costs a record never seen again: the typical ~400-token record, cache on
    (emptied before each record, so the state is computed and kept: two decoder steps) against off (one pass)."""
    from common import typical_request

    request = typical_request()
    bound = model.state_cache.max_bytes
    times: dict[str, list[float]] = {"kept": [], "one_pass": []}
    for round_index in range(rounds + 1):
        for mode in ("kept", "one_pass") if round_index % 2 else ("one_pass", "kept"):
            model.state_cache.max_bytes = bound if mode == "kept" else 0
            model.state_cache.clear()
            model.keep_from_tokens = 0 if mode == "kept" else KEEP_FROM_TOKENS  # kept: split even a short state
            seconds = timed(lambda: model.answer(request))
            if round_index:
                times[mode].append(seconds)
    model.state_cache.max_bytes, model.keep_from_tokens = bound, KEEP_FROM_TOKENS
    return {**times, "kept_over_one_pass": statistics.median(times["kept"]) / statistics.median(times["one_pass"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/.peer/bundle-9b-part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="sets,server,long,segments,overhead")
    parser.add_argument("--lengths", default="370,4096,16384,65536")
    parser.add_argument("--one-pass-up-to", type=int, default=65536, help="tokens: longer records only in segments")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--segment", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "state-reuse.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_record(args.model, args.one, args.segment)))
        return
    machine = this_machine()
    report = {"machine": machine.key, "cpu": machine.cpu, "load_average": os.getloadavg(), "model": args.model}
    parts = args.parts.split(",")
    if {"sets", "pairs", "server", "segments", "overhead"} & set(parts):
        model = clef_flash.load(args.model)
        report["precision"] = model.precision
        runs = (("sets", part_sets), ("pairs", part_pairs), ("server", part_server), ("segments", part_segments), ("overhead", part_overhead))
        for name, run in runs:
            if name in parts:
                report[name] = run(model, args.rounds)
                print(name, json.dumps(report[name]), file=sys.stderr)
        del model
    if "long" in parts:
        report["long"] = part_long(args.model, [int(value) for value in args.lengths.split(",")], args.one_pass_up_to)
    report["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
