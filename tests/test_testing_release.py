"""Random releases have the exact layout of `Cloudflare/clef-flash` (SPEC §2).

Checked against the oracles: transformers loads the decoder with no missing or unexpected keys and
re-saves it to the same bytes; the reference JointSchemaHead loads the head strictly; the tensor
table equals transformers' state_dict (names, shapes, order) up to the full 9B, whose parameter
counts are those of qwen35.md §1.
"""

from __future__ import annotations

import dataclasses
import filecmp
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clef_flash.checkpoint import random_release as release_module
from clef_flash.checkpoint.random_release import (
    HEAD_SCALARS,
    RANDOM_CONFIGS,
    draw_tensor,
    head_tensor_table,
    plan_shards,
    release_config,
    tensor_table,
    tiny_release,
    write_random_release,
)

transformers = pytest.importorskip("transformers")


def _load_decoder(path: Path):
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        path, dtype=torch.bfloat16, output_loading_info=True
    )
    print(f"{path.name}: loading info {info}")
    return model, info


def _assert_clean(info) -> None:
    assert sorted(info["missing_keys"]) == []
    assert sorted(info["unexpected_keys"]) == []
    assert sorted(info["mismatched_keys"]) == []
    assert info["error_msgs"] == []


def _safetensors_names(path: Path) -> list[str]:
    names: list[str] = []
    for file in sorted(path.glob("model*.safetensors")):
        with safe_open(file, "pt") as handle:
            names += list(handle.keys())
    return names


@pytest.fixture(scope="module")
def tiny(module_tmp) -> Path:
    return tiny_release(cache_dir=module_tmp("cache"))


@pytest.mark.parametrize("which", ["tiny", "9b-heads"])
def test_transformers_loads_with_no_missing_or_unexpected_keys(which, tiny, heads_dir):
    path = tiny if which == "tiny" else heads_dir
    model, info = _load_decoder(path)
    _assert_clean(info)
    # The mtp.* tensors are in the file and transformers ignores them silently (SPEC §2).
    names = _safetensors_names(path)
    assert any(name.startswith("mtp.") for name in names)
    assert set(model.state_dict()) == {name for name in names if not name.startswith("mtp.")}
    text = model.config.text_config
    assert text.hidden_size == RANDOM_CONFIGS[which].text.hidden_size
    assert text.vocab_size == 248320 and text.eos_token_id == text.pad_token_id == 248044
    assert text.rope_parameters["rope_theta"] == 1e7 and text.layer_types[3] == "full_attention"
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_sharded_release_is_what_save_pretrained_writes(tmp_path):
    """Shards and index byte-identical to transformers re-saving the release with the same limit."""
    limit = 20_000_000  # the two 31.8 MB embedding tables get shards of their own
    ours = write_random_release(tmp_path / "ours", "tiny", max_shard_bytes=limit, mtp=False)
    files = sorted(p.name for p in ours.glob("model*"))
    print("shards:", files)
    assert files == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    model, info = _load_decoder(ours)
    _assert_clean(info)
    # Re-save from a model that owns its tensors: loaded ones share the mmapped file storage, which
    # huggingface_hub's splitter groups as if tied.
    fresh = transformers.Qwen3_5ForConditionalGeneration(model.config).to(torch.bfloat16)
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.save_pretrained(tmp_path / "hf", max_shard_size=limit)
    for name in files:
        assert filecmp.cmp(ours / name, tmp_path / "hf" / name, shallow=False), name
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == model.num_parameters()
    assert set(index["weight_map"]) == set(model.state_dict())


def test_shard_plan_matches_huggingface_hub():
    from huggingface_hub import split_torch_state_dict_into_shards

    specs = tensor_table("9b-heads")
    with torch.device("meta"):
        state = {spec.name: torch.empty(spec.shape, dtype=torch.bfloat16) for spec in specs}
    for limit in (1_000_000, 50_000_000, 10**12):
        split = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        ours = plan_shards(specs, 2, limit)
        assert {name: [spec.name for spec in shard] for name, shard in ours.items()} == split.filename_to_tensors


def test_config_json_round_trips_through_transformers_unchanged(tiny, tmp_path):
    config = transformers.Qwen3_5Config.from_pretrained(tiny)
    config.save_pretrained(tmp_path)
    assert (tiny / "config.json").read_text() == (tmp_path / "config.json").read_text()
    written = json.loads((tiny / "config.json").read_text())
    assert written["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert written["clef_flash_random"] == {"config": "tiny", "seed": 0}
    assert written["text_config"]["rope_parameters"] == {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True,
    }


def test_vision_and_special_token_ids_are_the_real_ones(tiny):
    from clef_flash.checkpoint.vocab import special_tokens

    ids = {text: token_id for token_id, text in special_tokens().items()}
    config = json.loads((tiny / "config.json").read_text())
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert config["text_config"]["eos_token_id"] == ids["<|endoftext|>"]
    assert (tiny / "tokenizer.json").is_file() and (tiny / "tokenizer_config.json").is_file()
    assert "random" in (tiny / "RANDOM_RELEASE.md").read_text()


@pytest.mark.parametrize("which", ["tiny", "9b-heads", "9b-part", "9b", "27b-part", "27b"])
def test_tensor_table_is_transformers_state_dict(which):
    config = transformers.Qwen3_5Config.from_dict(release_config(RANDOM_CONFIGS[which]))
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    theirs = [(name, tuple(value.shape)) for name, value in model.state_dict().items()]
    ours = [(spec.name, spec.shape) for spec in tensor_table(which, mtp=False)]
    assert ours == theirs


@pytest.mark.parametrize("which", ["tiny", "9b-heads", "9b-part", "9b", "27b-part", "27b"])
def test_configs_read_back_as_the_runtime_configs(which):
    """config.json and joint_head_config.json load, through the runtime's readers, as the very
    TextConfig and HeadConfig the release was built from (they are the runtime's classes)."""
    from clef_flash.checkpoint import random_release
    from clef_flash.model.config import QWEN3_5_9B, TextConfig
    from clef_flash.model.joint_head import HeadConfig

    assert random_release.TextConfig is TextConfig and random_release.HeadConfig is HeadConfig
    config = RANDOM_CONFIGS[which]
    written = json.loads(json.dumps(release_config(config)))
    assert TextConfig.from_release_config(written) == config.text
    assert HeadConfig.from_dict(json.loads(json.dumps(config.head_config()))) == config.head
    # Every config keeps the 9B's vocabulary, special tokens and RoPE.
    for name in ("vocab_size", "eos_token_id", "pad_token_id", "rope_theta", "max_position_embeddings"):
        assert getattr(config.text, name) == getattr(QWEN3_5_9B, name), name
    if which == "9b":
        assert config.text == QWEN3_5_9B


def test_random_config_rejects_a_head_of_another_width():
    from clef_flash.checkpoint.random_release import RandomConfig

    tiny = RANDOM_CONFIGS["tiny"]
    with pytest.raises(ValueError, match="hidden_size 32 is not the decoder's 64"):
        RandomConfig("bad", tiny.text, dataclasses.replace(tiny.head, hidden_size=32))


def test_9b_parameter_counts_are_those_of_qwen35_md():
    specs = {spec.name: spec.numel for spec in tensor_table("9b")}
    prefix = "model.language_model."
    decoder = sum(n for name, n in specs.items() if name.startswith(prefix) and "embed_tokens" not in name)
    embeddings = specs[prefix + "embed_tokens.weight"]
    mtp = sum(n for name, n in specs.items() if name.startswith("mtp."))
    print(f"9b: decoder {decoder:,}, embeddings {embeddings:,}, mtp {mtp:,}")
    assert decoder == 6_919_565_824
    assert embeddings == 1_017_118_720
    assert decoder + 2 * embeddings == 8_953_803_264
    assert specs["lm_head.weight"] == embeddings
    assert 0.23e9 < mtp < 0.25e9  # "~0.24B MTP" on the model card


def test_head_loads_strictly_into_the_reference(reference, tiny):
    config = json.loads((tiny / "joint_head_config.json").read_text())
    assert config == {"hidden_size": 64, "width": 32, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64}
    head = reference.JointSchemaHead(**config)
    weights = load_file(tiny / "joint_head.safetensors")
    head.load_state_dict(weights, strict=True)
    assert all(value.dtype == torch.float32 for value in weights.values())
    for name, value in HEAD_SCALARS.items():
        assert getattr(head, name).item() == value != 0


@pytest.mark.parametrize("which", ["tiny", "9b-heads", "9b"])
def test_head_table_is_the_reference_state_dict(reference, which):
    config = RANDOM_CONFIGS[which].head_config()
    with torch.device("meta"):
        head = reference.JointSchemaHead(**config)
    theirs = [(name, tuple(value.shape)) for name, value in head.state_dict().items()]
    assert [(spec.name, spec.shape) for spec in head_tensor_table(which)] == theirs


def test_streamed_files_equal_safetensors_save_file(tiny, tmp_path):
    for name, metadata in (("model.safetensors", {"format": "pt"}), ("joint_head.safetensors", None)):
        save_file(load_file(tiny / name), tmp_path / name, metadata=metadata)
        assert filecmp.cmp(tiny / name, tmp_path / name, shallow=False), name


def test_same_seed_same_bytes_other_seed_other_bytes(tiny, tmp_path):
    again = write_random_release(tmp_path / "again", "tiny", seed=0)
    other = write_random_release(tmp_path / "other", "tiny", seed=1)
    for name in ("model.safetensors", "joint_head.safetensors"):
        assert filecmp.cmp(tiny / name, again / name, shallow=False)
        assert not filecmp.cmp(tiny / name, other / name, shallow=False)
    # Every random tensor differs between seeds (each has its own generator).
    first, second = load_file(tiny / "model.safetensors"), load_file(other / "model.safetensors")
    assert all(not torch.equal(first[name], second[name]) for name in first)
    # draw_tensor gives a file's tensor without the file.
    spec = next(spec for spec in tensor_table("tiny") if spec.name.endswith("layers.0.linear_attn.in_proj_qkv.weight"))
    assert torch.equal(draw_tensor(spec, seed=0, dtype=torch.bfloat16), first[spec.name])


# sha256 of every file of `tiny` (seed 0), of every config's tensor table (name, shape, init) and of the
# outlier config's tensors: a random release's bytes never change without a RELEASE_BUILDER_VERSION bump.
TINY_SHA256 = {
    "RANDOM_RELEASE.md": "b72297b2314e5cd1f9d362f6f08d48b1fb5c1dc1ef16b63e3de944a7dd68d2e1",
    "config.json": "9fa9f2f6cce75c94b60601e450b6f2bc7515a0b5ed1a0f0c22e0464eb0056b68",
    "joint_head.safetensors": "01a6c7f45eb7953f72e95885b71ba1048214d20596369a454350a24b27cbfc5e",
    "joint_head_config.json": "11e731d251d13bfee23236fde9cc058bed86c56976ead702d1e3b9ae9c30f3eb",
    "model.safetensors": "5b55fd92ed9101e76b64489e994c958f68050f37ded111898e726553d4a33f5c",
    "tokenizer.json": "a55e811cf46500ea80fbe1a965843a2fb6de09b9985452d4a89aac922aa8ebd9",
    "tokenizer_config.json": "431cef9eb547fb91cba44d53b64be216e771eb4bce9873a3710f4ad243e4d158",
    # issue 26: the image and video processors' configs (the reference's AutoProcessor reads them)
    "preprocessor_config.json": "dc9c8630fb98cb03742fb58abd0813472320687a80eef2fee74524b8d8a388d6",
    "video_preprocessor_config.json": "0e25dd2cd24e32d7e2b39c6c049f5d4056abdf7c4c3681841aa076ab2b2c9af8",
}
TABLES_SHA256 = "e9c30723e5f5d967f72c6e1caedd4d992bb3e5b00149906b8291ff7ee792b6d6"
OUTLIERS_SHA256 = "b6493295e2049467759d6f53b0e6edabbd8991a64f588d5be3f1b43c9c2ad1ad"


def test_tiny_files_are_the_recorded_bytes(tiny):
    assert release_module.RELEASE_BUILDER_VERSION == "1"
    files = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(tiny.iterdir())}
    assert files == TINY_SHA256


def test_every_tensor_table_is_the_recorded_one():
    digest = hashlib.sha256()
    for name in ("tiny", "9b-heads", "9b-heads-outliers", "9b-part", "9b"):  # recorded before tiny-vision existed
        for specs in (tensor_table(name), tensor_table(name, mtp=False), head_tensor_table(name)):
            for s in specs:
                digest.update(f"{s.name} {list(s.shape)} {s.init.kind} {s.init.a!r} {s.init.b!r} {s.init.c}\n".encode())
    assert digest.hexdigest() == TABLES_SHA256


def test_outlier_tensors_are_the_recorded_bytes():
    """The norm_outliers rule, drawn (all but the two vocabulary-sized tables, drawn as tiny's are)."""
    digest = hashlib.sha256()
    for spec in tensor_table("9b-heads-outliers"):
        if spec.shape[0] != RANDOM_CONFIGS["9b-heads-outliers"].text.vocab_size:
            digest.update(spec.name.encode())
            digest.update(draw_tensor(spec, seed=3, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
    assert digest.hexdigest() == OUTLIERS_SHA256


def test_every_tensor_is_random_and_in_its_range(tiny):
    weights = load_file(tiny / "model.safetensors") | load_file(tiny / "joint_head.safetensors")
    for name, value in weights.items():
        value = value.float()
        assert torch.isfinite(value).all(), name
        if value.numel() == 1:
            assert value.item() != 0, name
        else:
            assert value.std() > 0.005, name  # non-degenerate: no zeros, no constants
    layer = "model.language_model.layers.0"
    a_log = weights[f"{layer}.linear_attn.A_log"]
    assert (a_log >= 0).all() and (a_log <= math.log(16) + 1e-2).all()
    dt = torch.nn.functional.softplus(weights[f"{layer}.linear_attn.dt_bias"])
    assert (dt > 5e-4).all() and (dt < 0.2).all()
    for norm in ("input_layernorm", "post_attention_layernorm"):
        assert weights[f"{layer}.{norm}.weight"].abs().mean() < 0.3  # (1+w) offsets near 0
    assert (weights[f"{layer}.linear_attn.norm.weight"].mean() - 1).abs() < 0.1  # plain weight near 1
    assert (weights["hidden_norm.weight"].mean() - 1).abs() < 0.1


def test_activations_stay_order_one_and_answers_are_not_saturated(reference, tiny, hf_tokenizer):
    """Through the decoder (transformers) and the head (reference) on a real record."""
    model, _ = _load_decoder(tiny)
    model = model.float().eval()
    head = reference.JointSchemaHead(**json.loads((tiny / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(tiny / "joint_head.safetensors"), strict=True)
    record = {
        "state": {"ticket": "My card was charged twice for the same order, please refund one.", "priority": 3},
        "questions": {
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
            "topic": {"type": "choice", "criteria": {"billing": "Payments", "shipping": "Delivery", "other": None}},
            "urgency": {"type": "score", "criteria": ["none", "some", "high"]},
        },
    }
    encoded = reference.encode_record(hf_tokenizer, record)
    input_ids = torch.tensor([encoded.input_ids])
    with torch.no_grad():
        out = model.model.language_model(input_ids=input_ids, output_hidden_states=True)
        rms = [round(h.pow(2).mean().sqrt().item(), 3) for h in out.hidden_states]
        logits = head(out.last_hidden_state, input_ids, torch.ones_like(input_ids), [encoded], model.lm_head.weight)
    print(f"hidden rms per layer {rms}")
    assert all(0.3 < value < 3 for value in rms)
    for question, question_logits in zip(encoded.questions, logits[0]):
        probabilities = torch.softmax(question_logits.float(), dim=-1)
        print(f"{question.question_id}: logits {question_logits.tolist()} p {probabilities.tolist()}")
        assert torch.isfinite(question_logits).all()
        assert probabilities.max() < 0.99 and question_logits.std() > 1e-3


def test_tiny_release_is_cached_and_rebuilt_on_version_change(tmp_path, monkeypatch):
    first = tiny_release(cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_release(cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.setattr(release_module, "RELEASE_BUILDER_VERSION", "test-bump")
    second = tiny_release(cache_dir=tmp_path)
    assert second != first and (second / "config.json").is_file() and not first.exists()
    assert [p.name for p in tmp_path.iterdir()] == [second.name]  # no staging directories left


def test_progress_reports_every_byte(tmp_path):
    seen: list[tuple[int, int]] = []
    write_random_release(tmp_path / "r", "tiny", progress=lambda done, total: seen.append((done, total)))
    done, total = seen[-1]
    files = list((tmp_path / "r").glob("*.safetensors"))
    payload = 0
    for file in files:
        with open(file, "rb") as handle:
            payload += file.stat().st_size - 8 - int.from_bytes(handle.read(8), "little")
    assert done == total == payload


def test_refuses_a_non_empty_directory_and_unknown_configs(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("")
    with pytest.raises(FileExistsError):
        write_random_release(tmp_path / "x", "tiny")
    with pytest.raises(ValueError, match="tiny"):
        write_random_release(tmp_path / "y", "9c")
