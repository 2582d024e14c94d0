"""Layer-major calibration (issue 25, step 3): equal to its whole-model twin, each layer read once, nothing
else of the model built, the hidden states carried in groups within a budget, and the same bundle as before."""

from __future__ import annotations

import base64
import dataclasses
import io
import itertools
import json

import numpy as np
import pytest
import torch

import clef_flash
from clef_flash.checkpoint import bundle
from clef_flash.checkpoint.loading import text_config_of
from clef_flash.checkpoint.names import DECODER_PREFIX, LM_HEAD
from clef_flash.checkpoint.outliers import find_outliers
from clef_flash.checkpoint.random_release import write_random_release
from clef_flash.checkpoint.safetensors_io import mapped_files
from clef_flash.checkpoint.sources import open_release
from clef_flash.cli import main
from clef_flash.conversion import (
    ACTIVATION_BUDGET,
    activation_groups,
    calibrate,
    calibrate_layer_major,
    default_calibration_requests,
)
from clef_flash.errors import BundleError
from clef_flash.model.precision import PRECISIONS, Plan
from clef_flash.plan import fastest_dense
from clef_flash.prefill import DEFAULT_SEGMENT_TOKENS
from clef_flash.request.protocol import parse_request
from clef_flash.request.records import encode_record

CPU = torch.device("cpu")
SEGMENT = 100  # tokens per step, both paths: the built-in requests (206 to 705 tokens) run in 3 to 8 steps


def layer_major(root, requests, precision, segment_tokens=SEGMENT):
    checkpoint = open_release(root, files=mapped_files)
    records = [encode_record(checkpoint.tokenizer, parse_request(request), image_processor=checkpoint.image_processor) for request in requests]
    return calibrate_layer_major(checkpoint, records, plan=Plan(PRECISIONS[precision], CPU), segment_tokens=segment_tokens)


def twin(root, requests, precision):
    model = clef_flash.load(root, device="cpu", precision=precision)
    model.segment_tokens = SEGMENT
    return calibrate(model, requests)


def assert_equal(ours, reference, label):
    assert ours.activation_absmax.keys() == reference.activation_absmax.keys() != set()
    worst = max(
        ((ours.activation_absmax[name] - absmax).abs() / absmax.clamp_min(1e-30)).max().item()
        for name, absmax in reference.activation_absmax.items()
    )
    print(f"{label}: {len(ours.activation_absmax)} projections, {ours.tokens} tokens, largest relative difference {worst:.1e}")
    assert all(torch.equal(ours.activation_absmax[name], absmax) for name, absmax in reference.activation_absmax.items())
    assert (ours.records, ours.tokens) == (reference.records, reference.tokens)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_layer_major_equals_the_whole_model_twin(tiny_dir, precision):
    requests = default_calibration_requests(5)
    assert_equal(layer_major(tiny_dir, requests, precision), twin(tiny_dir, requests, precision), f"tiny {precision}")


def image_request(seed: int, width: int, height: int) -> dict:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    from PIL import Image

    Image.fromarray(pixels).save(buffer, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    questions = {"urgent": {"type": "noul", "instructions": "Is it urgent?"}, "kind": {"type": "choice", "criteria": {"a": "A", "b": None}}}
    return {"state": "See the attached screenshots of the parcel, please.", "images": [uri, uri], "questions": questions}


@pytest.fixture(scope="module")
def vision_release(module_tmp):
    # sharded: the memory-mapped source is several files
    return write_random_release(module_tmp("vision") / "release", "tiny-vision", seed=3, max_shard_bytes=20_000_000)


def test_layer_major_equals_the_twin_with_images(vision_release):
    """Images (their features, M-RoPE positions) built by the backend's own code, over steps that cut them."""
    requests = [image_request(1, 80, 60), *default_calibration_requests(2), image_request(2, 300, 40)]
    ours = layer_major(vision_release, requests, "fp32")
    assert_equal(ours, twin(vision_release, requests, "fp32"), "tiny-vision fp32, 2 records with images")
    assert ours.tokens > 2 * SEGMENT


class CountingSource:
    """A tensor source that counts what is read, by name."""

    def __init__(self, source):
        self.source, self.reads = source, {}

    def keys(self):
        return self.source.keys()

    def shape(self, name):
        return self.source.shape(name)

    def dtype(self, name):
        return self.source.dtype(name)

    def get(self, name):
        self.reads[name] = self.reads.get(name, 0) + 1
        return self.source.get(name)


def test_each_layer_is_read_once_per_pass_and_nothing_else(tiny_dir, monkeypatch):
    from clef_flash.model import joint_head

    monkeypatch.setattr(joint_head.JointHead, "__init__", lambda *args, **kwargs: pytest.fail("the head was built"))
    release = open_release(tiny_dir, files=mapped_files)
    counted = CountingSource(release.tensors)
    checkpoint = dataclasses.replace(release, tensors=counted, head_tensors=None)
    requests = default_calibration_requests(4)
    records = [encode_record(checkpoint.tokenizer, parse_request(request)) for request in requests]
    layer_names = {name for name in counted.keys() if name.startswith(f"{DECODER_PREFIX}layers.")}
    config = text_config_of(checkpoint)
    bytes_per_token = (config.hidden_size + config.rotary_dim) * 4
    for budget in (ACTIVATION_BUDGET, max(record.token_count for record in records) * bytes_per_token):
        passes = len(activation_groups([record.token_count for record in records], bytes_per_token, budget))
        assert passes == 1 if budget == ACTIVATION_BUDGET else passes > 1
        counted.reads.clear()
        calibrate_layer_major(checkpoint, records, plan=Plan(PRECISIONS["fp32"], CPU), budget_bytes=budget)
        assert counted.reads == {**{name: passes for name in layer_names}, f"{DECODER_PREFIX}embed_tokens.weight": passes}
        assert LM_HEAD not in counted.reads


def test_activation_groups_respect_the_budget():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 3000, 200).tolist()
    tokens[17] = 50_000  # larger than the budget alone
    bytes_per_token, budget = 16 * 1024, 1 << 26  # 4,096 tokens a group
    groups = activation_groups(tokens, bytes_per_token, budget)
    assert [index for group in groups for index in group] == list(range(len(tokens)))  # all, in order, once
    for group in groups:
        assert sum(tokens[index] for index in group) * bytes_per_token <= budget or group == [17]
    for group, after in itertools.pairwise(groups):  # greedy: the next record would not have fitted
        assert sum(tokens[index] for index in group + after[:1]) * bytes_per_token > budget
    assert activation_groups([], bytes_per_token, budget) == []


def test_convert_calibrates_as_the_twin_did(tiny_dir, tmp_path):
    """`clef-flash convert` (layer-major) writes the bundle the whole-model calibration made, byte for byte."""
    assert main(["convert", str(tiny_dir), str(tmp_path / "new")]) == 0
    requests = default_calibration_requests()
    reference = calibrate(clef_flash.load(tiny_dir, device="cpu", precision=fastest_dense(CPU).name), requests)
    old = bundle.convert(tiny_dir, tmp_path / "old", calibration=reference, calibration_source=f"built-in ({len(requests)} generated requests)", progress=False)
    new_manifest, old_manifest = (json.loads((root / "manifest.json").read_text()) for root in (tmp_path / "new", old))
    assert new_manifest == old_manifest and new_manifest["scheme"]["outliers"]["calibration"]["records"] == len(requests)
    # tiny has no outlier channels at the threshold: at a lower one, the same channels too
    new = clef_flash.load(tmp_path / "new", device="cpu")
    assert new.checkpoint.calibrated
    ours = layer_major(tiny_dir, requests, fastest_dense(CPU).name, segment_tokens=DEFAULT_SEGMENT_TOKENS)
    lowered = {name: indices.tolist() for name, indices in find_outliers(ours, threshold=2.0).items()}
    assert lowered == {name: indices.tolist() for name, indices in find_outliers(reference, threshold=2.0).items()} != {}


def test_an_existing_destination_or_a_bundle_is_refused_before_calibrating(tiny_dir, tmp_path, monkeypatch):
    from clef_flash import conversion

    monkeypatch.setattr(conversion, "_calibrate", lambda *args, **kwargs: pytest.fail("calibrated first"))
    (tmp_path / "taken").mkdir()
    with pytest.raises(BundleError, match="exists: remove it or pass --overwrite"):
        conversion.convert(tiny_dir, tmp_path / "taken")
    made = conversion.convert(tiny_dir, tmp_path / "bundle", calibrate=None, progress=False)
    with pytest.raises(BundleError, match="already a bundle"):
        conversion.convert(made, tmp_path / "again")
