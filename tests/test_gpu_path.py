"""The GPU path without a GPU (issue 49): the whole forward on the device, no host sync inside it, buckets that do not
change an answer.

`FakeGpu` (clef_flash/testing/fake_gpu.py) loads through the real `load` onto a device whose tensors hold no data and
takes it for a GPU: every CUDA-only branch runs (buckets, whole steps through the graph pool, int8 on `_int_mm`), and
a device tensor read on the host, a copy back before the forward's one readback, a host tensor meeting a device one,
or an upload inside a graph's capture fails. Planted faults show that each of these is caught. The padding of the
buckets is held to the unpadded CPU path in fp32 (the GPU's code path run on the CPU, with data).
"""

from __future__ import annotations

import random

import pytest
import torch

import clef_flash
from clef_flash import buckets, device_io
from clef_flash.model import qwen3_5
from clef_flash.request.samples import random_request, random_requests
from clef_flash.testing.adapters import write_random_adapter
from clef_flash.testing.fake_gpu import DeviceMix, FakeGpu, HostSync


@pytest.fixture(scope="module")
def adapter_dir(module_tmp):
    return write_random_adapter(module_tmp("gpu-adapter") / "tuned", "tiny", seed=3)


@pytest.fixture(scope="module")
def gpu_model(tiny_dir):
    """tiny in bf16 on the stand-in GPU (its tensors hold no data: a test enters `FakeGpu()` again to run it)."""
    with FakeGpu() as gpu:
        return clef_flash.load(tiny_dir, device=gpu.device, precision="bf16", state_cache_mb=0)


@pytest.fixture(scope="module")
def bundle_dir(tiny_dir, module_tmp):
    from clef_flash.conversion import convert

    return convert(tiny_dir, module_tmp("gpu-bundle") / "bundle", progress=False)


@pytest.fixture(scope="module")
def shared_state_requests():
    """Two question sets on one long state (kept, then continued), and two unrelated records."""
    rng = random.Random(49)
    state = random_request(rng, state_words=60)["state"]
    asked = [{"model": "clef-flash", "state": state, "questions": random_request(rng, questions=count)["questions"]} for count in (1, 3)]
    return [*asked, *random_requests(5, 2)]


def run_everything(model, requests, adapter_name=None):
    """answer, answer_many, a request continuing a kept state, and (with `adapter_name`) an adapter's request."""
    model.answer(requests[0])
    model.answer_many(requests)
    model.answer(requests[1])  # the same state as requests[0]: continued from the cache
    assert model.last_timings.tokens_reused > 0
    if adapter_name is not None:
        model.answer({**requests[2], "adapter": adapter_name})
        model.answer_many([requests[3], {**requests[0], "adapter": adapter_name}])


@pytest.mark.parametrize("precision", ["bf16", "int8-w8a8", "fp8", "fp32"])
def test_the_whole_forward_runs_on_the_device_without_a_host_sync(tiny_dir, adapter_dir, shared_state_requests, precision):
    with FakeGpu() as gpu:
        model = clef_flash.load(tiny_dir, device=gpu.device, precision=precision, adapters={"tuned": adapter_dir})
        assert model.engine.backend.bucketed and model.engine.backend.graphs is not None
        run_everything(model, shared_state_requests, adapter_name="tuned")
        replays = model.engine.backend.graphs.replays
    print(f"\n{precision} on the stand-in GPU: {gpu.uploads} uploads, {gpu.readbacks} readbacks, {gpu.captures} captured steps, {replays} replays")
    assert gpu.readbacks >= 5  # answer, answer_many, answer (a kept state), the adapter's answer and answer_many: a forward each
    assert gpu.captures >= 1 and replays >= 1  # whole steps went through the graph pool, inside `capturing`


def test_an_8bit_bundle_runs_on_the_device(bundle_dir, shared_state_requests):
    with FakeGpu() as gpu:
        model = clef_flash.load(bundle_dir, device=gpu.device, precision="int8-w8a8")
        run_everything(model, shared_state_requests)
    assert gpu.readbacks >= 3


# -- planted faults: each kind of host sync makes the forward fail ---------------------------------------------------


def _plant(monkeypatch, fault):
    """Run `fault(x)` on the input of every decoder RMSNorm (inside every forward)."""
    original = qwen3_5.RMSNorm.forward

    def planted(self, x):
        fault(x)
        return original(self, x)

    monkeypatch.setattr(qwen3_5.RMSNorm, "forward", planted)


@pytest.mark.parametrize(
    "fault, error",
    [
        (lambda x: x.sum().item(), HostSync),  # a scalar read
        (lambda x: x.amax().tolist(), HostSync),
        (lambda x: bool((x > 0).any()), HostSync),
        (lambda x: x[x > 0], HostSync),  # a data-dependent shape
        (lambda x: x.float().cpu(), HostSync),  # a copy back
        (lambda x: x + torch.ones(x.shape[-1], dtype=x.dtype), DeviceMix),  # a host tensor meeting a device one
        (lambda x: x.index_select(0, torch.zeros(1, dtype=torch.long)), DeviceMix),
    ],
    ids=["item", "tolist", "bool", "mask-index", "cpu-copy", "host-tensor", "host-index"],
)
def test_a_planted_host_sync_fails_the_forward(gpu_model, monkeypatch, fault, error):
    with FakeGpu():
        gpu_model.answer(random_requests(1, 1)[0])  # unplanted: runs
        _plant(monkeypatch, fault)
        with pytest.raises(error):
            gpu_model.answer(random_requests(1, 1)[0])


def test_an_upload_inside_a_capture_fails(gpu_model, monkeypatch):
    """A whole step's decoder sends nothing up: an upload planted in it fails inside the graph pool's capture (the
    pool's warm-up for a new shape runs outside it, as a CUDA capture's does: a shape seen before is taken here)."""
    request = random_requests(2, 1)[0]
    with FakeGpu() as gpu:
        gpu_model.answer(request)
        _plant(monkeypatch, lambda x: torch.ones(3).to(gpu.device))
        with pytest.raises(HostSync, match="capturing"):
            gpu_model.answer(request)


def test_the_boolean_causal_mask_is_torch_lower_right_causal_bias():
    """The boolean mask for queries after a past (the decoder's on a CPU, fake_gpu's on its stand-in) is exactly torch's
    CausalBias (the decoder's on a GPU)."""
    from torch.nn.attention.bias import causal_lower_right

    query, key, value = (torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n)) for n in (5, 9, 9))
    for queries, keys in ((5, 9), (1, 9), (5, 5)):
        q = query[:, :, :queries]
        expected = torch.nn.functional.scaled_dot_product_attention(q, key[:, :, :keys], value[:, :, :keys], attn_mask=causal_lower_right(queries, keys))
        got = torch.nn.functional.scaled_dot_product_attention(q, key[:, :, :keys], value[:, :, :keys], attn_mask=qwen3_5.causal_lower_right(queries, keys, torch.device("cpu")))
        assert torch.equal(got, expected)


# -- buckets: chosen everywhere, and padding changes no answer -------------------------------------------------------


def test_bucket_choice():
    assert [buckets.sequence_bucket(n) for n in (1, 64, 65, 300, 385, 2048, 2049, 5000)] == [64, 64, 128, 384, 512, 2048, 4096, 6144]
    assert [buckets.batch_bucket(n) for n in (1, 3, 8, 9, 33, 64, 65)] == [1, 4, 8, 16, 64, 64, 65]
    for bad in (0, -1):
        with pytest.raises(ValueError):
            buckets.sequence_bucket(bad)
        with pytest.raises(ValueError):
            buckets.batch_bucket(bad)


def test_int_mm_shape_rules_are_met_by_the_buckets():
    from clef_flash.checkpoint.w8a8 import int_mm_shape_ok

    for rows in (1, 3, 5, 64):
        for tokens in (1, 17, 300, 2048):
            assert int_mm_shape_ok(buckets.batch_bucket(rows) * buckets.sequence_bucket(tokens), 4096, 12288)
            assert int_mm_shape_ok(rows * buckets.sequence_bucket(tokens), 4096, 4096)  # a continuing step: rows as they are
    assert not int_mm_shape_ok(291, 64, 128)


def test_padding_to_buckets_changes_no_answer_fp32(tiny_dir, shared_state_requests, monkeypatch, figures):
    """The GPU's code path (buckets, the whole padded grid in every projection, whole steps through the graph pool,
    kept states continued past padding) on the CPU in fp32, against the CPU's unpadded path: logits within 1e-6."""

    def logits(model):
        calls = {
            "whole": random_requests(7, 2),  # whole steps (through the graph pool on the GPU path)
            "mixed": shared_state_requests,  # a state kept, then continued beside whole records in one padded step
            "continued": shared_state_requests[:2],  # continued from kept states
        }
        out = {name: [{r.question_id: r.logits for r in per} for per in model._run(requests)[1]] for name, requests in calls.items()}
        assert model.last_timings.tokens_reused > 0  # the last call continued kept states
        return out

    expected = logits(clef_flash.load(tiny_dir, device="cpu", precision="fp32"))
    monkeypatch.setattr(device_io, "GPU_TYPES", ("cuda", "cpu"))
    padded_model = clef_flash.load(tiny_dir, device="cpu", precision="fp32", graphs="eager")
    assert padded_model.engine.backend.bucketed
    got = logits(padded_model)
    assert padded_model.engine.backend.graphs.replays > 0
    worst = {}
    for call, records in expected.items():
        worst[call] = 0.0
        for want, have in zip(records, got[call]):
            for question, values in want.items():
                reference = torch.tensor(values, dtype=torch.float64)
                error = (torch.tensor(have[question], dtype=torch.float64) - reference).abs().max() / reference.abs().max()
                worst[call] = max(worst[call], error.item())
    figures(f"bucketed and padded vs unpadded, fp32, worst relative logit difference: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert worst["whole"] <= 1e-6 and worst["continued"] <= 1e-6
    # A step that mixes continued and whole records: 1.2e-6 measured with a 120-word state (0 with this one), rounding
    # (float64: 0, exactly); the unpadded path's own spread between those records run together and alone was 1.9e-6.
    assert worst["mixed"] <= 2e-6


def test_the_gpu_benchmark_dry_run(tmp_path):
    """benchmarks/gpu.py --dry-run: every stage of the GPU measurement on the stand-in GPU, its JSON with every key the
    issue names (values meaningless: no data on the stand-in), so a first GPU run spends its minutes measuring."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_benchmark", Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gpu.json"
    assert module.main(["--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    keys = (
        "nvidia_smi_name commit fp32_max_rel_logit_error bf16_record_p50_ms bf16_records_per_s int8_records_per_s "
        "int8_decisions_differing reference_bf16_decisions_differing int8_median_dp reference_bf16_median_dp server_batching_speedup"
    ).split()
    assert not [key for key in keys if key not in result]
    assert result["dry_run"] and not result["skipped"]
    assert result["stand_in"]["readbacks"] > 0 and result["stand_in"]["captures"] > 0
    assert result["stages"]["speed 9b-part bf16"]["raw"]["record_ms"]


def test_images_run_on_the_device_without_a_host_sync(vision_release):
    """A state with images: the vision tower and the features scattered into the embeddings, on the stand-in GPU,
    then a second question set continuing the kept state."""
    import base64
    import io

    import numpy as np

    image_module = pytest.importorskip("PIL.Image")
    release = vision_release("gpu-vision", 3, preprocessor_config=256 * 256)
    pixels = np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    image_module.fromarray(pixels).save(buffer, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    request = {"model": "clef-flash", "state": "Look at these.", "images": [uri, uri], "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}}
    with FakeGpu() as gpu:
        model = clef_flash.load(release, device=gpu.device, precision="bf16")
        model.keep_from_tokens = 1
        model.answer(request)
        model.answer({**request, "questions": {"other": {"type": "noul", "instructions": "Other?"}}})
        assert model.last_timings.tokens_reused > 0
    assert gpu.readbacks == 2


def test_info_names_the_plan_on_cuda(capsys):
    """`clef-flash info` on a CUDA machine (here the stand-in's H100: sm_90) names the GPU's default and why."""
    from clef_flash.cli import main

    with FakeGpu():
        main(["info"])
    out = capsys.readouterr().out
    assert "on CUDA      release: int8-w8a8 (on cuda (NVIDIA H100" in out and "int8 tensor cores" in out
    assert "on CUDA      bundle: int8-w8a8" in out
    with FakeGpu(capability=(7, 0), name="Tesla V100"):
        main(["info"])
    assert "on CUDA      release: bf16 (on cuda (Tesla V100, sm_70): bf16; no int8 tensor cores" in capsys.readouterr().out


def test_a_ray_spec_for_gpu_workers_resolves_on_a_head_without_a_gpu(tiny_dir):
    """`--ray --gpus-per-worker 1` from a head without a GPU: the workers' plan is resolved for cuda (bf16: the head cannot
    read their capability); from a head with an H100 (the stand-in), their int8 tensor cores' int8-w8a8."""
    from clef_flash.distributed import EngineSpec

    spec = EngineSpec.resolve(str(tiny_dir), precision=None, device="cuda")
    assert (spec.device, spec.precision) == ("cuda", "bf16") and spec.plan_key.endswith("|cuda")
    with FakeGpu():
        spec = EngineSpec.resolve(str(tiny_dir), precision=None, device="cuda")
    assert spec.precision == "int8-w8a8" and "|int_mm|" in spec.plan_key
