"""clef-finetune's adapters served as they are (issue 42): parity with clef-finetune's own evaluation and merge,
strict loading, many adapters on one base (mixed batches, the state cache, the server's field), an int8 base.

The parity adapter is trained in the test by clef-finetune's own `train` (2 optimizer steps on the `tiny` release,
CPU, fp32; with its oracle runs, ~60 s: `slow`). Its `load_tokenizer_and_processor` loads the release's
AutoProcessor, whose video processor needs torchvision (which does not import beside this torch): text-only
training never reads the processor, so the test hands it the tokenizer alone. The quick tests run random
checkpoints in the same layout (`clef_flash.testing.adapters`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("clef_finetune")

import clef_flash  # noqa: E402
from clef_flash.errors import ModelSourceError, RequestInvalid, WeightsError  # noqa: E402

RECORDS = [
    {
        "id": f"r{i}",
        "state": f"ticket {i}: the customer writes about order {i * 7} and is {'happy' if i % 2 else 'upset'}",
        "questions": {
            "ok": {"type": "noul", "instructions": "Is the customer satisfied?"},
            "mood": {"type": "choice", "instructions": "Mood", "criteria": {"calm": "calm words", "angry": None, "sad": "sad"}},
            "urgency": {"type": "score", "instructions": "How urgent", "criteria": ["not", "somewhat", "very"]},
        },
        "labels": {"ok": i % 2 == 1, "mood": "calm" if i % 2 else "angry", "urgency": i % 3},
    }
    for i in range(4)
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """(conftest's one_torch_thread: tiny models on a shared machine)"""


def request_of(record: dict, **extra) -> dict:
    return {"state": record["state"], "questions": record["questions"], **extra}


@pytest.fixture(scope="module")
def finetune(tiny_dir):
    """clef-finetune's modules, its processor loader given the tokenizer alone (module docstring)."""
    import clef_finetune.model as finetune_model
    from transformers import AutoTokenizer

    patch = pytest.MonkeyPatch()
    patch.setattr(finetune_model, "load_tokenizer_and_processor", lambda model_dir: (AutoTokenizer.from_pretrained(str(model_dir)), None))
    yield finetune_model
    patch.undo()


@pytest.fixture(scope="module")
def trained(finetune, tiny_dir, module_tmp) -> Path:
    """A checkpoint written by `clef_finetune.train.train`: rank 4 on every decoder projection, 2 steps."""
    from clef_finetune.train import load_config, train

    root = module_tmp("finetune")
    (root / "train.jsonl").write_text("\n".join(json.dumps(record) for record in RECORDS))
    config = load_config(
        None,
        {
            "model": {"path": str(tiny_dir), "dtype": "float32"},
            "data": {"train": str(root / "train.jsonl")},
            "lora": {"r": 4, "alpha": 8},
            "train": {"max_steps": 2, "grad_accum": 2, "warmup_steps": 0, "lr": 2e-2, "head_lr": 1e-2, "gradient_checkpointing": False},
            "output_dir": str(root / "run"),
        },
    )
    torch.manual_seed(0)
    return Path(train(config, device="cpu")["checkpoint"])


@pytest.fixture(scope="module")
def first(module_tmp) -> Path:
    from clef_flash.testing.adapters import write_random_adapter

    return write_random_adapter(module_tmp("first") / "checkpoint-1", "tiny", rank=16, seed=1)


@pytest.fixture(scope="module")
def second(module_tmp) -> Path:
    """Another adapter of another rank, on the MLPs and attention only."""
    from clef_flash.testing.adapters import write_random_adapter

    return write_random_adapter(module_tmp("second") / "checkpoint-1", "tiny", rank=8, seed=2, suffixes=("mlp.down_proj", "mlp.up_proj", "_proj"))


@pytest.fixture(scope="module")
def oracle_logits(finetune, tiny_dir, trained) -> list[dict[str, list[float]]]:
    """clef-finetune's own evaluation model of the checkpoint (PeftModel over transformers, its fp32 head), per
    record: question id -> logits in the model's option order; and its `predict_rows` probabilities agree."""
    from clef_finetune.evaluate import predict_rows
    from clef_finetune.train import encode_example

    model, tokenizer, processor, jsm = finetune.build_eval_model(tiny_dir, "cpu", torch.float32, trained)
    out = []
    with torch.inference_mode():
        for record in RECORDS:
            encoded, _ = encode_example(jsm, tokenizer, processor, record, Path("."), 8192)
            logits = model(jsm.collate_records([encoded], tokenizer.pad_token_id, torch.device("cpu")))[0]
            out.append({q.question_id: row.double().tolist() for q, row in zip(encoded.questions, logits)})
        rows = predict_rows(model, tokenizer, processor, jsm, RECORDS, Path("."))
    for row in rows:
        record = next(index for index, r in enumerate(RECORDS) if r["id"] == row["record_id"])
        expected = torch.tensor(out[record][row["question_id"]], dtype=torch.float64).softmax(-1)
        assert torch.allclose(expected, torch.tensor(row["probs"], dtype=torch.float64), atol=1e-6)
    return out


def relative_error(model, records_logits, **extra) -> float:
    worst = 0.0
    for record, expected in zip(RECORDS, records_logits):
        ours = model.logits(request_of(record, **extra))
        for question_id, reference in expected.items():
            mine = torch.tensor(list(ours[question_id].values()), dtype=torch.float64)
            reference = torch.tensor(reference, dtype=torch.float64)
            worst = max(worst, float((mine - reference).abs().max() / reference.abs().max()))
    return worst


@pytest.mark.slow  # trains with clef-finetune and runs its evaluation (~60 s)
def test_parity_with_clef_finetune(tiny_dir, trained, oracle_logits):
    merged = clef_flash.load(tiny_dir, adapter=trained, precision="fp32")
    (described,) = merged.describe()["adapters"]
    assert described["mode"].startswith("merged") and described["rank"] == 4 and described["projections"] == 31
    apart = clef_flash.load(tiny_dir, adapters={"tickets": trained}, precision="fp32")
    errors = {"merged": relative_error(merged, oracle_logits), "kept apart": relative_error(apart, oracle_logits, adapter="tickets")}
    print(f"logits vs clef-finetune's evaluation, fp32, relative: {errors}")
    assert max(errors.values()) <= 1e-5
    base = clef_flash.load(tiny_dir, precision="fp32")
    assert relative_error(base, oracle_logits) > 1e-3  # the adapter changes the answers: the test can fail
    assert relative_error(apart, oracle_logits) > 1e-3  # no field: the base


@pytest.mark.slow  # trains with clef-finetune, merges with it
def test_same_decisions_as_clef_finetune_merge(tiny_dir, trained, finetune, tmp_path):
    from clef_finetune.export import merge

    released = merge(tiny_dir, trained, tmp_path / "merged", dtype="float32", head_dtype="float32")
    merged_release = clef_flash.load(released, precision="fp32")
    ours = clef_flash.load(tiny_dir, adapter=trained, precision="fp32")
    for record in RECORDS:
        theirs, mine = merged_release.answer(request_of(record)), ours.answer(request_of(record))
        for question_id, answer in mine["answers"].items():
            assert decision(answer) == decision(theirs["answers"][question_id]), question_id


def decision(answer: dict) -> object:
    if answer["type"] == "noul":
        return answer["noul"] > 0.5
    return max(answer["probabilities"], key=answer["probabilities"].get)


@pytest.fixture(scope="module")
def two(tiny_dir, first, second):
    """The base with adapters "a" and "b" kept apart, no state cache (fp32)."""
    return clef_flash.load(tiny_dir, adapters={"a": first, "b": second}, precision="fp32", state_cache_mb=0)


def test_mixed_batch_equals_one_at_a_time(two, one_torch_thread):
    model = two
    long_state = " ".join(f"line {i} of a long ticket" for i in range(120))  # > MLP_ROWS tokens: the MLP's chunks
    requests = [
        request_of(RECORDS[0], adapter="a"),
        request_of(RECORDS[1], adapter="b"),
        request_of(RECORDS[2]),
        {**request_of(RECORDS[3], adapter="b"), "state": long_state},
        {**request_of(RECORDS[0], adapter="a"), "state": long_state},
        request_of(RECORDS[3], adapter="a"),
    ]
    together = model.answer_many(requests, decimals=None)
    assert model.last_timings.forwards <= 4  # one batch (the long ones split in segments at most)
    alone = [model.answer(request, decimals=None) for request in requests]
    worst = max(
        abs(x - y)
        for t, a in zip(together, alone)
        for question_id in t["answers"]
        for x, y in zip(_probabilities(t["answers"][question_id]), _probabilities(a["answers"][question_id]))
    )
    print(f"mixed batch vs one at a time: max |dp| {worst:.1e}")
    assert worst <= 1e-5
    kept = model.segment_tokens
    model.segment_tokens = 97  # rows leave the steps at different segments: the routing follows the rows left
    try:
        segmented = model.answer_many(requests, decimals=None)
    finally:
        model.segment_tokens = kept
    assert model.last_timings.forwards > 4
    assert max(
        abs(x - y)
        for t, a in zip(segmented, together)
        for question_id in t["answers"]
        for x, y in zip(_probabilities(t["answers"][question_id]), _probabilities(a["answers"][question_id]))
    ) <= 1e-5
    a_answer = model.answer(request_of(RECORDS[1], adapter="a"), decimals=None)
    assert _probabilities(a_answer["answers"]["mood"]) != pytest.approx(_probabilities(together[1]["answers"]["mood"]), abs=1e-4)


def _probabilities(answer: dict) -> list[float]:
    return list(answer["probabilities"].values()) if "probabilities" in answer else [answer["noul"]]


def test_state_cache_never_shares_between_adapters(tiny_dir, first, second, two):
    model = clef_flash.load(tiny_dir, adapters={"a": first, "b": second}, precision="fp32", state_cache_mb=64)
    fresh = two
    long_state = " ".join(f"paragraph {i}: the same long state" for i in range(100))  # kept on first sight
    first = {**request_of(RECORDS[0], adapter="a"), "state": long_state}
    second = {**request_of(RECORDS[1], adapter="b"), "state": long_state}
    model.answer(first)
    assert model.state_cache.stats.entries == 1
    # b's answer from a's kept state would be off by the adapters' difference (~1e-1), not by rounding
    assert max_dp(model, fresh, [second]) <= 1e-5
    assert model.state_cache.stats.entries == 2 and model.state_cache.stats.hits == 0
    third = {**second, "questions": RECORDS[2]["questions"]}
    assert max_dp(model, fresh, [third]) <= 1e-5
    assert model.state_cache.stats.hits == 1


@pytest.mark.slow  # against the trained adapter's oracle logits
def test_int8_base_keeps_the_updates_apart(tiny_dir, trained, oracle_logits):
    int8 = clef_flash.load(tiny_dir, adapter=trained, precision="int8")
    (described,) = int8.describe()["adapters"]
    assert described["mode"].startswith("kept apart")
    error = relative_error(int8, oracle_logits)
    base_error = relative_error(clef_flash.load(tiny_dir, precision="int8"), oracle_logits)
    print(f"int8 base + LoRA vs clef-finetune fp32: relative {error:.1e} (the int8 base alone: {base_error:.1e})")
    assert error < 2e-2 and error < base_error / 5


def max_dp(left, right, requests) -> float:
    worst = 0.0
    for request in requests:
        a, b = left.probabilities(request), right.probabilities(request)
        worst = max(worst, max(abs(a[q][o] - b[q][o]) for q in a for o in a[q]))
    return worst


def test_merged_equals_kept_apart_and_int8_keeps_apart(tiny_dir, first):
    """The two ways of holding an adapter agree in fp32; beside an int8 base the updates stay apart in fp32 and
    move the answers as they move the fp32 model's."""
    requests = [request_of(record) for record in RECORDS]
    merged = clef_flash.load(tiny_dir, adapter=first, precision="fp32")
    apart = clef_flash.load(tiny_dir, adapters={"a": first}, precision="fp32")
    twin = 0.0
    for request in requests:
        a, b = merged.probabilities(request), apart.probabilities({**request, "adapter": "a"})
        twin = max(twin, max(abs(a[q][o] - b[q][o]) for q in a for o in a[q]))
    int8 = clef_flash.load(tiny_dir, adapter=first, precision="int8")
    (described,) = int8.describe()["adapters"]
    assert described["mode"].startswith("kept apart") and described["default"]
    int8_error = max_dp(int8, merged, requests)
    moved = max_dp(merged, clef_flash.load(tiny_dir, precision="fp32"), requests)
    print(f"fp32 merged vs kept apart: max |dp| {twin:.1e}; int8 base + LoRA vs fp32 fine-tune: {int8_error:.1e} (the adapter moves p by {moved:.1e})")
    assert twin <= 1e-5
    assert int8_error < moved / 5


def test_unknown_adapter_is_a_request_error(two):
    with pytest.raises(RequestInvalid, match="adapter 'nope' is not loaded here; loaded: 'a', 'b'") as caught:
        two.answer(request_of(RECORDS[0], adapter="nope"))
    assert caught.value.errors[0]["loc"] == ["body", "adapter"]
    assert two.adapters == ["a", "b"] and two.default_adapter is None


# -- strict loading ---------------------------------------------------------------------------------


def edited(trained: Path, tmp_path: Path, *, config=None, weights=None, drop=None) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "checkpoint-9"
    shutil.copytree(trained, out)
    if config:
        path = out / "adapter/adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if weights:
        path = out / "adapter/adapter_model.safetensors"
        save_file(weights(load_file(str(path))), str(path))
    if drop:
        (out / drop).unlink()
    return out


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"drop": "joint_head.safetensors"}, ModelSourceError, r"joint_head.safetensors is missing \(the retrained joint head\)"),
        ({"config": {"use_dora": True}}, ModelSourceError, r"sets use_dora=true \(DoRA"),
        ({"config": {"rank_pattern": {"q_proj": 8}}}, ModelSourceError, r"rank_pattern=.*per-module rank"),
        ({"config": {"alpha_pattern": {"q_proj": 8}}}, ModelSourceError, r"alpha_pattern="),
        ({"config": {"some_new_peft_option": 3}}, ModelSourceError, r"some_new_peft_option=3 \(a PEFT option clef-flash does not run\)"),
        ({"config": {"init_lora_weights": "pissa"}}, ModelSourceError, r"init_lora_weights='pissa' also rewrites the base"),
        ({"config": {"peft_type": "IA3"}}, ModelSourceError, r"peft_type is 'IA3'"),
        ({"config": {"target_modules": ["visual_qkv_only"]}}, ModelSourceError, r"names none of this base's decoder projections"),
        (
            {"weights": lambda w: {k: (v[:, :-1].contiguous() if k.endswith("layers.0.mlp.up_proj.lora_A.weight") else v) for k, v in w.items()}},
            WeightsError,
            r"wrong shape: base_model\.model\.model\.language_model\.layers\.0\.mlp\.up_proj\.lora_A\.weight \[16, 63\] \(expected \[16, 64\]\)",
        ),
        (
            {"weights": lambda w: {**w, "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.zeros(16, 8)}},
            WeightsError,
            r"unexpected: base_model\.model\.model\.visual\.blocks\.0\.attn\.qkv\.lora_A\.weight",
        ),
        (
            {"weights": lambda w: {k: v for k, v in w.items() if "layers.3.self_attn.o_proj" not in k}},
            WeightsError,
            r"missing: base_model\.model\.model\.language_model\.layers\.3\.self_attn\.o_proj\.lora_A\.weight",
        ),
    ],
    ids=["no-head", "dora", "rank-pattern", "alpha-pattern", "unknown-option", "pissa", "not-lora", "other-targets", "shape", "vision", "missing"],
)
def test_strict_loading(tiny_dir, first, tmp_path, change, error, message):
    broken = edited(first, tmp_path, **change)
    with pytest.raises(error, match=message) as caught:
        clef_flash.load(tiny_dir, adapters={"x": broken}, precision="fp32")
    assert "\n" not in str(caught.value)


# -- the server ---------------------------------------------------------------------------------------


def test_server_field_openapi_and_health(two):
    import time

    from fastapi.testclient import TestClient

    from clef_flash.server import create_app

    with TestClient(create_app(two, batch_wait_ms=0)) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        health = client.get("/health").json()
        assert [item["name"] for item in health["adapters"]] == ["a", "b"]
        assert all(item["mode"].startswith("kept apart") and not item["default"] for item in health["adapters"])

        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        adapter = schemas["SystemOneRequest"]["properties"]["adapter"]
        assert "clef-flash's own field" in adapter["description"]
        assert {"type": "string", "enum": ["a", "b"]} in adapter["anyOf"]

        body = request_of(RECORDS[1], adapter="b")
        served = client.post("/v1/systemone", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["answers"] == two.answer(body)["answers"]
        assert client.post("/v1/systemone", json=request_of(RECORDS[1])).json()["answers"] == two.answer(request_of(RECORDS[1]))["answers"]

        refused = client.post("/v1/systemone", json=request_of(RECORDS[1], adapter="nope"))
        assert refused.status_code == 422
        (error,) = refused.json()["detail"]
        assert error["type"] == "adapter_not_loaded" and error["loc"] == ["body", "adapter"]
        assert "loaded: 'a', 'b'" in error["msg"]


# -- the command line -------------------------------------------------------------------------------


def test_command_line_adapter(tiny_dir, first, two, tmp_path, capsys):
    from clef_flash.cli import main

    (tmp_path / "request.json").write_text(json.dumps(request_of(RECORDS[0])))
    assert main(["answer", str(tmp_path / "request.json"), "--model", str(tiny_dir), "--precision", "fp32", "--adapter", f"a={first}"]) == 0
    assert json.loads(capsys.readouterr().out)["answers"] == two.answer(request_of(RECORDS[0]))["answers"]  # named: the base
    assert main(["answer", str(tmp_path / "request.json"), "--model", str(tiny_dir), "--precision", "fp32", "--adapter", str(first)]) == 0
    assert json.loads(capsys.readouterr().out)["answers"] == two.answer(request_of(RECORDS[0], adapter="a"))["answers"]

    labelled = [{**request_of(record), "expected": {"ok": record["labels"]["ok"]}} for record in RECORDS]
    (tmp_path / "labelled.jsonl").write_text("\n".join(map(json.dumps, labelled)))
    out = tmp_path / "report"
    assert main(["eval", "labelled", str(tmp_path / "labelled.jsonl"), "--model", str(tiny_dir), "--precision", "fp32", "--adapter", f"a={first}", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["adapter"] == "a" and report["base"]["questions"] == report["tuned"]["questions"] == 4
    assert report["base"]["log_loss"] != report["tuned"]["log_loss"]
    assert "| overall | 4 | log_loss |" in (out / "report.md").read_text()
    assert main(["batch", str(tmp_path / "labelled.jsonl"), str(tmp_path / "out.jsonl"), "--ray", "--adapter", str(first)]) == 2


@pytest.mark.parametrize("row_slots", [[0, 1, 0, -1], [1, 1, 0, 0], [-1, -1, -1, -1], [1, 1, 1, 1]], ids=["interleaved", "runs", "base", "one"])
def test_routed_projection_against_rows_one_by_one(row_slots):
    """LoraLinear's grouped update (gathered indices or slices, every layout) against each row alone."""
    from types import SimpleNamespace

    from clef_flash.model.lora import AdapterBank, LoraLinear, LoraPair

    generator = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(24, 40, bias=False)
    pairs = [LoraPair(torch.randn(4, 24, generator=generator), torch.randn(40, 4, generator=generator), 0.5 * (slot + 1)) for slot in range(2)]
    bank = AdapterBank([SimpleNamespace(name=f"a{slot}") for slot in range(2)], default=None)
    linear = LoraLinear(base, bank)
    linear.pairs = dict(enumerate(pairs))
    counts, width = [5, 3, 7, 2], 7
    x = torch.randn(4, width, 24, generator=generator)  # [B, L, I]

    def alone(row: torch.Tensor, slot: int) -> torch.Tensor:
        out = base(row)
        return out if slot < 0 else out + (row @ pairs[slot].down.T) @ pairs[slot].up.T * pairs[slot].scale

    expected = torch.stack([alone(x[b], slot) for b, slot in enumerate(row_slots)])  # [B, L, O]
    real = torch.cat([torch.arange(b * width, b * width + count) for b, count in enumerate(counts)])
    with torch.no_grad(), bank.route(row_slots, counts, width):
        full = linear(x)
        flat = linear(x.reshape(-1, 24))
        real_rows = linear(x.reshape(-1, 24)[real])
    torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat, expected.reshape(-1, 40), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(real_rows, expected.reshape(-1, 40)[real], rtol=1e-5, atol=1e-5)
