"""The plan: resolved once, read everywhere; the state cache's key is the whole plan (issue 24)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import clef_flash
from clef_flash import machine, plan
from clef_flash.checkpoint import open_checkpoint
from clef_flash.checkpoint.w8a8 import INT_MM, ONEDNN
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
