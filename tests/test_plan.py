"""The plan: resolved once, read everywhere; the state cache's key is the whole plan (issue 24)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import clef_flash
from clef_flash import machine, plan
from clef_flash.checkpoint import open_checkpoint
from clef_flash.checkpoint.w8a8 import INT_MM, ONEDNN, W8A8_KERNELS
from clef_flash.loader import plan_of
from cpu_families import imagine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_two_engines_whose_plans_differ_only_in_the_kernel_never_share_a_cache_entry(tiny_dir, monkeypatch):
    """A CPU with two exact 8-bit kernels (VNNI: oneDNN and _int_mm): two loads whose plans differ in the kernel alone
    keep their states apart (the kernels' reference twins stand in where one is not exact on this CPU)."""
    models = []
    for kernel in (ONEDNN, INT_MM):
        imagine(monkeypatch, "vnni", int8_kernel=kernel)
        models.append(clef_flash.load(tiny_dir, device="cpu", precision="int8-w8a8", state_cache_mb=64))
    first_kernel, second_kernel = ONEDNN, INT_MM
    a, b = models
    assert a.precision == b.precision == "int8-w8a8" and (a.plan.kernel, b.plan.kernel) == (first_kernel, second_kernel)
    assert dataclasses.replace(a.plan, kernel=None) == dataclasses.replace(b.plan, kernel=None)
    request = {"state": "My card was charged twice. " * 120, "questions": {"refund": {"type": "noul"}}}  # kept: > 512 tokens
    record = a.encode(request)
    assert a.state_cache.key(record.input_ids) != b.state_cache.key(record.input_ids)
    a.answer(request)
    b.answer(request)
    assert a.state_cache.stats.misses == b.state_cache.stats.misses == 1  # each computed its own


def test_the_plan_is_what_load_builds_and_what_batch_records(tiny_dir):
    checkpoint = open_checkpoint(tiny_dir)
    resolved = plan_of(checkpoint, device="cpu", precision="int8-w8a8")
    model = clef_flash.load(tiny_dir, device="cpu", precision="int8-w8a8")
    assert model.plan == resolved and model.plan.kernel in machine.rates().kernels
    linears = [m for m in model.parts.decoder.modules() if type(m).__name__ == "W8A8Linear"]
    assert linears and {linear.kernel.name for linear in linears} == {resolved.kernel}
    described = model.describe()["plan"]
    assert described["kernel"] == resolved.kernel and described["precision"] == "int8-w8a8" and described["reason"]
    assert plan_of(checkpoint, device="cpu", precision="fp32").kernel is None


def test_render_is_the_facades_and_the_clis_alike(tiny_dir, tmp_path, capsys):
    from clef_flash.cli import main

    model = clef_flash.load(tiny_dir, device="cpu", precision="fp32")
    request = {"state": "Charged twice", "questions": {"team": {"type": "choice", "criteria": {"billing": None, "eng": None}}}}
    text = model.render(request)
    assert "⟦Q team:" in text and "⟦O billing:" in text and "⟦O eng:" in text and text.count("⟧") == 3
    (tmp_path / "request.json").write_text(json.dumps(request))
    assert main(["render", str(tmp_path / "request.json"), "--model", str(tiny_dir)]) == 0
    assert capsys.readouterr().out.strip() == text.strip()


def test_an_emulated_probe_never_reads_the_native_one(monkeypatch):
    """The probe's cache key holds the ISA limits: a run under the AVX2 emulation variables (.ci/run's second pass)
    measures its own kernels, never the native probe's (and each variable alone makes another machine)."""
    for name in machine.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    native = machine.this_machine()
    keys = {native.key}
    for name, value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")):
        monkeypatch.setenv(name, value)
        emulated = machine.this_machine()
        assert f"{name}={value}" in emulated.isa_limits and emulated.key not in keys
        keys.add(emulated.key)
    assert machine.probe_path(emulated) != machine.probe_path(native)


# -- the plan on CUDA, decided on a CPU-only machine: the device is handed in (machine.cuda_gpu's place) ---------------

CUDA = plan.torch.device("cuda")
H100 = machine.Gpu("NVIDIA H100 80GB HBM3", (9, 0))
V100 = machine.Gpu("Tesla V100-SXM2-16GB", (7, 0))


def no_probe():
    pytest.fail("no CPU probe on CUDA")


def cuda_plan(checkpoint, gpu, requested=None):
    return plan.resolve(checkpoint, CUDA, requested, rates=no_probe, available_memory=no_probe, gpu=lambda device: gpu)


@pytest.mark.parametrize("stored_int8", [False, True], ids=["release", "bundle"])
def test_cuda_with_int8_tensor_cores_runs_w8a8_on_int_mm(tiny_dir, monkeypatch, stored_int8):
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    checkpoint = dataclasses.replace(open_checkpoint(tiny_dir), stored_int8=stored_int8)
    resolved = cuda_plan(checkpoint, H100)
    print(f"\n{'bundle' if stored_int8 else 'release'} on {H100.name}: {resolved.name} ({resolved.reason})")
    assert (resolved.name, resolved.kernel, resolved.activation_bits) == ("int8-w8a8", INT_MM, 8)
    assert resolved.compute_dtype == plan.torch.bfloat16
    assert "int8 tensor cores (torch._int_mm)" in resolved.reason and "sm_90" in resolved.reason and H100.name in resolved.reason
    assert ("quantized while loading" in resolved.reason) == (not stored_int8)
    assert W8A8_KERNELS[resolved.kernel].activation_bits == resolved.activation_bits  # the policy's names are w8a8.py's


@pytest.mark.parametrize(("stored_int8", "expected"), [(False, "bf16"), (True, "int8-weight-only")], ids=["release", "bundle"])
def test_cuda_without_int8_tensor_cores_runs_bf16_or_the_bundles_weight_only(tiny_dir, monkeypatch, stored_int8, expected):
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    checkpoint = dataclasses.replace(open_checkpoint(tiny_dir), stored_int8=stored_int8)
    for gpu in (V100, None):  # sm_70, and a device whose capability is unknown
        resolved = cuda_plan(checkpoint, gpu)
        print(f"\n{gpu}: {resolved.name} ({resolved.reason})")
        assert resolved.name == expected and resolved.kernel is None and resolved.compute_dtype == plan.torch.bfloat16
        assert ("no int8 tensor cores" in resolved.reason) and (gpu is None or "sm_70" in resolved.reason)


def test_fp8_is_asked_for_on_cuda_and_cpu_and_refused_for_a_bundle(tiny_dir):
    release = open_checkpoint(tiny_dir)
    for device in (CUDA, plan.torch.device("cpu")):
        resolved = plan.resolve(release, device, "fp8", rates=machine.rates, available_memory=lambda: None, gpu=lambda device: H100)
        expected_dtype = plan.torch.bfloat16 if device.type == "cuda" else plan.torch.float32
        assert (resolved.name, resolved.int8_mode, resolved.kernel, resolved.compute_dtype) == ("fp8", "fp8", None, expected_dtype)
    bundle = dataclasses.replace(release, stored_int8=True)
    with pytest.raises(clef_flash.ClefError, match=r"8-bit bundle \(stored int8\): it cannot run in fp8; load the release") as refused:
        plan.resolve(bundle, CUDA, "fp8", rates=no_probe, available_memory=no_probe, gpu=lambda device: H100)
    print(f"\n{refused.value}")
    assert "\n" not in str(refused.value)


def test_a_release_loads_and_answers_in_fp8_on_the_cpu(tiny_dir):
    request = {"state": "Charged twice", "questions": {"refund": {"type": "noul"}}}
    fp32 = clef_flash.load(tiny_dir, device="cpu", precision="fp32").answer(request)["answers"]["refund"]["noul"]
    model = clef_flash.load(tiny_dir, device="cpu", precision="fp8")
    linears = [m for m in model.parts.decoder.modules() if type(m).__name__ == "Fp8Linear"]
    assert linears and all(linear.weight.dtype == plan.torch.float8_e4m3fn for linear in linears)
    fp8 = model.answer(request)["answers"]["refund"]["noul"]
    print(f"\nfp8 {fp8} vs fp32 {fp32}")
    assert abs(fp8 - fp32) < 0.02
