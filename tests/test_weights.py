"""Strict, memory-mapped loading of releases; model sources and their errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import clef_flash
from clef_flash.errors import ModelSourceError, WeightsError
from clef_flash.checkpoint.random_release import write_random_release
from clef_flash.request.samples import random_requests


@pytest.fixture()
def release_copy(tiny_dir, tmp_path):
    out = tmp_path / "release"
    shutil.copytree(tiny_dir, out)
    return out


def rewrite_model(root, change):
    tensors = load_file(str(root / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_are_listed(release_copy):
    def change(tensors):
        del tensors["model.language_model.layers.0.linear_attn.A_log"]
        del tensors["lm_head.weight"]
        tensors["model.language_model.layers.0.extra.weight"] = torch.zeros(2)
        tensors["model.language_model.norm.weight"] = torch.zeros(3)

    rewrite_model(release_copy, change)
    with pytest.raises(WeightsError) as caught:
        clef_flash.load(release_copy, device="cpu", precision="fp32")
    message = str(caught.value)
    print(f"\n{message}")
    assert "missing: lm_head.weight, model.language_model.layers.0.linear_attn.A_log" in message
    assert "unexpected: model.language_model.layers.0.extra.weight" in message
    assert "wrong shape: model.language_model.norm.weight [3] (expected [64])" in message


def test_vision_and_mtp_tensors_are_ignored_by_name(release_copy, tiny_dir):
    keys = load_file(str(tiny_dir / "model.safetensors")).keys()
    assert any(key.startswith("model.visual.") for key in keys) and any(key.startswith("mtp.") for key in keys)
    clef_flash.load(release_copy, device="cpu", precision="fp32")  # loads: they are skipped


def test_head_keys_are_strict(release_copy):
    head = load_file(str(release_copy / "joint_head.safetensors"))
    del head["residual_gate"]
    save_file(head, str(release_copy / "joint_head.safetensors"))
    with pytest.raises(WeightsError, match="missing: residual_gate"):
        clef_flash.load(release_copy, device="cpu", precision="fp32")


def test_sharded_release_gives_the_same_logits(tiny_dir, tmp_path):
    sharded = write_random_release(tmp_path / "sharded", "tiny", seed=0, max_shard_bytes=20_000_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    request = random_requests(3, 1)[0]
    whole = clef_flash.load(tiny_dir, device="cpu", precision="fp32").logits(request)
    assert clef_flash.load(sharded, device="cpu", precision="fp32").logits(request) == whole


def test_missing_shard_is_named(tmp_path):
    sharded = write_random_release(tmp_path / "sharded", "tiny", seed=0, max_shard_bytes=20_000_000)
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(WeightsError, match=victim.name):
        clef_flash.load(sharded, device="cpu", precision="fp32")


@pytest.mark.parametrize("name", ["config.json", "joint_head_config.json", "tokenizer.json"])
def test_missing_release_file_is_named(release_copy, name):
    (release_copy / name).unlink()
    with pytest.raises(ModelSourceError, match=name):
        clef_flash.load(release_copy, device="cpu", precision="fp32")


def test_unsupported_rope_is_a_clear_error(release_copy):
    config = json.loads((release_copy / "config.json").read_text())
    config["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    (release_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match="yarn"):
        clef_flash.load(release_copy, device="cpu", precision="fp32")


def test_sources_and_their_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelSourceError, match="no model at"):
        clef_flash.load(tmp_path / "absent", device="cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError) as caught:
        clef_flash.load("Cloudflare/clef-flash", device="cpu")
    print(f"\n{caught.value}")
    assert "offline" in str(caught.value) and "hf download" in str(caught.value)
    with pytest.raises(clef_flash.ClefError, match="unknown precision"):
        clef_flash.load("tiny", precision="fp16")


def test_parameters_sit_where_and_in_the_dtype_expected(tiny_dir):
    model = clef_flash.load(tiny_dir, device="cpu", precision="bf16")
    decoder = model.parts.decoder
    assert all(parameter.device.type == "cpu" for parameter in decoder.parameters())
    assert decoder.layers[0].linear_attn.A_log.dtype == torch.float32
    assert decoder.embed_tokens.weight.dtype == torch.bfloat16
    assert all(parameter.dtype == torch.float32 for parameter in model.parts.head.parameters())
    assert "random weights" in repr(model)
