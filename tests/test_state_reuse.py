"""One state, many question sets; long records in segments (issue 14).

Every answer from segments or from a kept state is compared with one pass over the whole record
(no segments, no state cache, one record at a time): fp32 logits within 1e-5 relative, the same decisions.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import clef_flash
from clef_flash.cli import main
from clef_flash.engine import Timings
from clef_flash.request.samples import random_request
from clef_flash.state_cache import CachedState, StateCache

SEGMENT = 16  # tokens: every record below spans several segments (a record has ~100 or more)


@pytest.fixture(scope="module")
def one_pass():
    return clef_flash.load("tiny", precision="fp32", state_cache_mb=0, segment_tokens=1 << 20)


@pytest.fixture(scope="module")
def requests():
    """Three states (0 tokens, 1 token, many) each with three question sets, and an unrelated neighbour."""
    rng = random.Random(14)
    schemas = [random_request(rng, questions=count)["questions"] for count in (1, 2, 3)]
    states = ["", "yes", random_request(rng, state_words=150)["state"]]
    asked = [{"model": "clef-flash", "state": state, "questions": questions} for state in states for questions in schemas]
    return [*asked, random_request(rng, state_words=40)]


def logits_of(model, request_list):
    prepared, results = model._run(request_list)
    return [{result.question_id: result.logits for result in per_record} for per_record in results]


def worst_relative(actual, expected) -> float:
    worst = 0.0
    for got, want in zip(actual, expected):
        for question, values in want.items():
            reference = torch.tensor(values, dtype=torch.float64)
            difference = (torch.tensor(got[question], dtype=torch.float64) - reference).abs().max()
            worst = max(worst, (difference / reference.abs().max()).item())
    return worst


def decisions(per_record):
    return [{question: max(range(len(values)), key=values.__getitem__) for question, values in record.items()} for record in per_record]


def assert_close(actual, expected, tolerance=2e-4):
    """Equal structure and strings; numbers within 4-decimal rounding of float-rounding differences."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_close(actual[key], expected[key], tolerance)
    elif isinstance(expected, float):
        assert abs(actual - expected) <= tolerance
    else:
        assert actual == expected


def test_state_token_counts(one_pass, requests):
    counts = [one_pass.encode(request).state_tokens for request in requests[:9:3]]
    assert counts[0] == 0 and counts[1] == 1 and counts[2] > 3 * SEGMENT


@pytest.mark.parametrize(("segment", "cache_mb"), [(SEGMENT, 0), (SEGMENT, 64), (1 << 20, 64)])
def test_segments_and_kept_states_equal_one_pass(one_pass, requests, segment, cache_mb):
    expected = [logits_of(one_pass, [request])[0] for request in requests]
    model = clef_flash.load("tiny", precision="fp32", state_cache_mb=cache_mb, segment_tokens=segment)
    model.keep_from_tokens = 0  # keep every state on first sight (tiny's are all short)
    together = logits_of(model, requests)  # shared states, batch neighbours, several segments
    first = model.last_timings
    again = logits_of(model, requests[::-1])[::-1]  # from the cache when it is on
    errors = worst_relative(together, expected), worst_relative(again, expected)
    print(f"segment {segment}, cache {cache_mb} MB: fp32 logits vs one pass: {errors[0]:.1e}, again {errors[1]:.1e}")
    assert max(errors) <= 1e-5
    assert decisions(together) == decisions(expected) == decisions(again)
    state_tokens = [model.encode(request).prefix_tokens + model.encode(request).state_tokens for request in requests]
    assert first.tokens_reused == 2 * sum(state_tokens[0:9:3])  # each state's 2nd and 3rd question sets
    assert model.last_timings.tokens_reused == (sum(state_tokens) if cache_mb else first.tokens_reused)


def test_the_head_reads_a_long_memory_in_chunks(one_pass, requests, monkeypatch):
    """Over ONE_CALL_ROWS memory rows the head attends chunk by chunk (a running log-sum-exp): the same logits."""
    import clef_flash.model.joint_head as joint_head

    expected = logits_of(one_pass, requests)
    monkeypatch.setattr(joint_head, "ONE_CALL_ROWS", 16)
    monkeypatch.setattr(joint_head, "MEMORY_CHUNK", 16)
    chunked = logits_of(one_pass, requests)
    error = worst_relative(chunked, expected)
    print(f"head memory in chunks of 16 rows vs one SDPA call: fp32 {error:.1e}")
    assert error <= 1e-5 and decisions(chunked) == decisions(expected)


def test_question_sets_on_one_state_run_unpadded_and_share_the_heads_memory(one_pass):
    """8 question sets of different lengths on one state (issue 28): the continuations' MLPs run on their
    real tokens alone and the head attends to the state's memory rows once for all 8; fp32 logits within
    1e-5 relative of each record run cold and alone, the same decisions."""
    from clef_flash.model import joint_head

    rng = random.Random(28)
    state = random_request(rng, state_words=120)["state"]
    asked = [{"model": "clef-flash", "state": state, "questions": random_request(rng, questions=1 + index % 3)["questions"]} for index in range(8)]
    expected = [logits_of(one_pass, [request])[0] for request in asked]
    model = clef_flash.load("tiny", precision="fp32", state_cache_mb=0)
    mlp_rows, prefixes = [], []
    mlp = model.parts.decoder.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda x: mlp_rows.append(x.shape[:-1].numel()) or forward(x)
    attend_memory = joint_head._Attention.attend_memory

    def spy(self, queries, memory, mask, memory_norm=None, prefixes_given=()):
        prefixes.append([(len(prefix.records), prefix.memory.shape[0]) for prefix in prefixes_given])
        return attend_memory(self, queries, memory, mask, memory_norm, prefixes_given)

    joint_head._Attention.attend_memory = spy
    try:
        shared = logits_of(model, asked)
    finally:
        joint_head._Attention.attend_memory = attend_memory
    records = [model.encode(request) for request in asked]
    state_tokens = records[0].prefix_tokens + records[0].state_tokens
    continuations = [record.token_count - state_tokens for record in records]
    error = worst_relative(shared, expected)
    print(f"8 question sets on one state vs each cold: fp32 {error:.1e}; continuations {continuations}, MLP rows {mlp_rows}")
    assert error <= 1e-5 and decisions(shared) == decisions(expected)
    assert len(set(continuations)) > 1 and mlp_rows == [state_tokens, sum(continuations)]  # no padding through the MLP
    assert prefixes and all(each == [(8, state_tokens)] for each in prefixes)  # the state's rows, once for all 8


def test_answer_many_runs_a_shared_state_once(requests):
    model = clef_flash.load("tiny", precision="fp32", state_cache_mb=0)
    calls = []
    backend = model.engine.backend
    original = backend.run_states
    backend.run_states = lambda rows, timings: calls.append(len(rows)) or original(rows, timings)
    model.answer_many(requests[6:9])  # one state, three question sets
    assert calls == [1] and model.state_cache.stats.hits == 2 and model.state_cache.stats.misses == 1
    model.answer_many(requests[6:9])  # the cache is off: run once again, shared again
    assert calls == [1, 1] and len(model.state_cache) == 0


def test_which_states_are_kept(requests):
    model = clef_flash.load("tiny", precision="fp32", state_cache_mb=64)
    short, long = requests[3], requests[6]  # "yes" and ~200 tokens of state
    long_tokens = model.encode(long).prefix_tokens + model.encode(long).state_tokens
    model.keep_from_tokens = long_tokens
    model.answer(short)
    assert len(model.state_cache) == 0  # short and never asked before: one pass, nothing kept
    model.answer(short)
    assert len(model.state_cache) == 1  # asked again: kept
    model.answer(long)
    assert len(model.state_cache) == 2  # long enough to keep on first sight
    model.answer({**long, "questions": requests[7]["questions"]})
    assert model.last_timings.tokens_reused == long_tokens


def test_segments_bound_every_decoder_step(requests):
    model = clef_flash.load("tiny", precision="fp32", state_cache_mb=0, segment_tokens=SEGMENT)
    widths = []
    forward = model.parts.decoder.forward
    model.parts.decoder.forward = lambda ids, *args, **kwargs: widths.append(ids.shape[1]) or forward(ids, *args, **kwargs)
    model.answer_many(requests)
    timings = model.last_timings
    assert max(widths) == SEGMENT and timings.forwards == len(widths) > len(requests)


def test_the_cache_stays_within_its_bound_and_evicts_least_recent():
    def entry(tokens: int) -> CachedState:
        from clef_flash.model.qwen3_5 import AttentionState, DecoderState

        key_value = torch.zeros(1, 1, tokens, 8)
        return CachedState(DecoderState((tokens,), [AttentionState(key_value, key_value.clone())]), torch.zeros(tokens, 8), tokens)

    size = entry(10).nbytes  # 960 bytes: K, V and memory rows of 10 tokens
    cache = StateCache(4 * size + 100, identity="model|fp32|cpu")
    keys = [cache.key([index]) for index in range(6)]
    for key in keys[:4]:
        assert cache.put(key, entry(10))
    assert cache.get(keys[0]) is not None  # now the most recent
    assert cache.put(keys[4], entry(10)) and cache.stats.evictions == 1
    assert keys[1] not in cache and keys[0] in cache and cache.stats.bytes <= cache.max_bytes
    assert not cache.put(keys[5], entry(12))  # more than a quarter of the bound: never kept
    assert cache.stats.bytes == 4 * size and cache.stats.entries == 4
    assert not StateCache(0, "off").put(keys[0], entry(1))
    cache.max_bytes = 2 * size + 100  # a smaller bound evicts the least recent until the rest fits
    assert cache.stats.entries == 2 and keys[0] in cache and keys[4] in cache and cache.stats.evictions == 3
    cache.max_bytes = 0
    assert len(cache) == 0 and cache.stats.bytes == 0 and not cache.enabled


def test_a_state_is_never_used_by_another_model_precision_or_device(requests):
    tokens = [1, 2, 3]
    fp32 = clef_flash.load("tiny", precision="fp32")
    bf16 = clef_flash.load("tiny", precision="bf16")
    other = clef_flash.load("random:tiny:1", precision="fp32")
    keys = {model.state_cache.key(tokens) for model in (fp32, bf16, other)}
    assert len(keys) == 3
    assert "fp32" in fp32.state_cache.identity and "cpu" in fp32.state_cache.identity
    fp32.keep_from_tokens = 0
    fp32.answer(requests[0])
    assert len(fp32.state_cache) == 1 and len(bf16.state_cache) == 0  # per engine, never shared


def test_batch_with_several_schemas(tmp_path, one_pass, requests):
    schemas = []
    for index, request in enumerate(requests[6:8]):
        path = tmp_path / f"schema{index}.json"
        path.write_text(json.dumps({"questions": request["questions"]}))
        schemas.append(path)
    states = [requests[0]["state"], {"state": requests[8]["state"], "id": "long"}, "not", "x" * 3]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(state) for state in states) + "\n{bad\n")
    out = tmp_path / "out.jsonl"
    arguments = ["batch", str(tmp_path / "in.jsonl"), str(out), "--model", "tiny", "--precision", "fp32"]
    arguments += [part for path in schemas for part in ("--schema", str(path))] + ["--batch-size", "2"]
    assert main(arguments) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["line"], line["schema"]) for line in lines] == [(n, s) for n in range(1, 6) for s in (0, 1)]
    assert lines[2]["id"] == "long" and "error" in lines[-1] and "error" in lines[-2]
    for line in lines[:-2]:
        state = states[line["line"] - 1]
        asked = {"questions": requests[6 + line["schema"]]["questions"], "state": state["state"] if isinstance(state, dict) else state}
        assert_close(line["answers"], one_pass.answer(asked)["answers"])
    complete = out.read_bytes()
    # a crash after the first block (lines 1-2, both schemas) and within the next: resuming writes the rest
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:5]) + b'{"line": 3, "sch')
    assert main(arguments) == 0
    assert out.read_bytes() == complete


def test_server_reuses_states_across_requests(requests):
    from fastapi.testclient import TestClient

    from clef_flash.server import create_app

    for cache_mb, hits in ((64, 1), (0, 0)):  # a short state is kept when asked the 2nd time, used the 3rd
        model = clef_flash.load("tiny", precision="fp32", state_cache_mb=cache_mb)
        with TestClient(create_app(model)) as client:
            before = model.state_cache.stats.hits  # start-up's warm-up request
            answers = [client.post("/v1/systemone", json=request).json() for request in requests[6:9]]
            metrics = client.get("/metrics").text
        assert model.state_cache.stats.hits - before == hits
        assert f"clef_flash_state_cache_hits_total {float(model.state_cache.stats.hits)}" in metrics
        assert "clef_flash_state_cache_bytes" in metrics and "clef_flash_state_cache_evictions_total 0.0" in metrics
        assert "clef_flash_state_tokens_reused_total" in metrics
        assert all("answers" in answer for answer in answers)


def test_timings_count_reused_tokens():
    timings = Timings(tokens_reused=5)
    assert timings.as_dict()["tokens_reused"] == 5
