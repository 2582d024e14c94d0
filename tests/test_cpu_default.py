"""The per-machine default precision and the W8A8 kernels, on every CPU family (issues: fast by default; 39, 40)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

import clef_flash
import clef_flash.loader
from clef_flash import machine
from clef_flash.checkpoint.quant import Int8Linear, TwoDigitLinear, W8A8Linear, WeightOnlyLinear, quantize_per_channel
from clef_flash.checkpoint.random_release import write_random_release
from clef_flash.checkpoint.w8a8 import W8A8_KERNELS, exactness_error, quantize_per_token
from clef_flash.cli import main
from clef_flash.model.precision import PRECISION_CHOICES, QUALIFIED, WeightCounts, choose_precision, qualified, resolve_precision
from clef_flash.request.samples import random_requests
from cpu_families import FAMILIES, imagine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
NINE_B = WeightCounts(projections=8_950_000_000)  # about the 9B decoder's parameters, all counted as projections
GIB = 1 << 30


# -- the choice, family by family ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "release", "bundle"),
    [
        ("amx", "int8-w8a8", "int8-w8a8"),  # oneDNN's int8 (3000) over bf16 (1900)
        ("vnni", "int8-w8a8", "int8-w8a8"),
        ("avx2", "int8-w8a8", "int8-w8a8"),  # FBGEMM: one 7-bit digit where a norm is read, two at down/o/out (183 > fp32's 123)
        ("none", "fp32", "int8-weight-only"),  # no exact W8A8 kernel
    ],
)
def test_the_default_is_the_fastest_qualified_path_on_every_family(family, release, bundle):
    rates = FAMILIES[family]
    for stored_int8, expected in ((False, release), (True, bundle)):
        chosen = choose_precision(CPU, stored_int8=stored_int8, rates=lambda: rates)
        print(f"{family} {'bundle' if stored_int8 else 'release'}: {chosen.name} ({chosen.reason})")
        assert chosen.name == expected and chosen.name in qualified(stored_int8=stored_int8)
        assert "fastest qualified" in chosen.reason
        assert ("quantized while loading" in chosen.reason) == (chosen.quantized and not stored_int8)
        assert ("left out: no exact W8A8 kernel" in chosen.reason) == (family == "none")
        assert ("7-bit activations: one int8 digit at the projections that read a norm (q_proj, k_proj, v_proj, in_proj_qkv, in_proj_z, gate_proj, up_proj), two at the others" in chosen.reason) == (family == "avx2")
    assert qualified(stored_int8=False) == QUALIFIED and qualified(stored_int8=True) == ("int8-w8a8", "int8-weight-only")


def test_cuda_defaults_to_bf16_and_the_environment_overrides(monkeypatch):
    never = lambda: pytest.fail("no probe on CUDA")  # noqa: E731
    cuda = torch.device("cuda")
    assert choose_precision(cuda, stored_int8=False, rates=never).compute_dtype == torch.bfloat16
    monkeypatch.setenv("CLEF_FLASH_PRECISION", "fp32")
    chosen = resolve_precision(None, CPU, stored_int8=False, rates=never)
    assert chosen.name == "fp32" and chosen.reason == "$CLEF_FLASH_PRECISION"


def test_load_picks_a_path_that_exists_here_and_says_why(tiny_dir, monkeypatch):
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    model = clef_flash.load(tiny_dir, device="cpu")
    assert model.precision in QUALIFIED and "probe" in model.precision_policy.reason
    expected = choose_precision(CPU, stored_int8=False, rates=machine.rates)
    assert model.precision == expected.name  # deterministic: the probe is cached per machine
    answer = model.answer({"state": "Charged twice", "questions": {"refund": {"type": "noul"}}})
    assert 0 <= answer["answers"]["refund"]["noul"] <= 1


def test_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEF_FLASH_CACHE", str(tmp_path))
    machine.rates.cache_clear()
    here = machine.this_machine()
    measured, measure = [], machine.measure
    # the probe's own code on a product 16x smaller than PROBE_SHAPE (the full one takes ~7 s a probe on Zen 4)
    monkeypatch.setattr(machine, "measure", lambda: measured.append(1) or measure(shape=(128, 1024, 2048)))
    try:
        monkeypatch.setattr(machine.os, "getloadavg", lambda: (64.0, 64.0, 64.0))  # a busy machine: used, not kept
        busy = machine.rates(here)
        assert busy.fp32 > 0 and not machine.probe_path(here).exists()
        machine.rates.cache_clear()
        monkeypatch.setattr(machine.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        first = machine.rates(here)
        assert machine.probe_path(here).is_file() and first.fp32 > 0 and first.bf16 > 0
        assert first.int8_kernel in W8A8_KERNELS and first.int8 > 0 and first.int8_kernel in first.kernels
        machine.rates.cache_clear()
        assert machine.rates(here) == first and len(measured) == 2  # read back, not measured again
    finally:
        machine.rates.cache_clear()


def test_info_command(capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machine"]["threads"] >= 1 and report["probe"]["int8_kernel"] in W8A8_KERNELS
    assert set(report["probe"]["int8_kernels_gops"]) | set(report["probe"]["int8_excluded"]) == set(W8A8_KERNELS)
    assert set(report["default_precision"]) == {"release", "bundle"}
    assert main(["info"]) == 0
    assert "default      release:" in capsys.readouterr().out


def test_info_says_which_kernels_the_default_passes_over():
    assert machine.kernel_note("onednn", 0.096, fp32=180) == "0.096 GOP/s, a reference loop here: used only when forced"
    assert machine.kernel_note("fbgemm", 716.2, fp32=180) == "716 GOP/s, 7-bit activations (two digits at down_proj, o_proj, out_proj)"
    assert machine.kernel_note("int_mm", 632.4, fp32=180) == "632 GOP/s"


# -- kernels ------------------------------------------------------------------------------------------


def _at_the_limits(levels: int, inner: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (fp32 integers, every row reaching `levels`) and int8 weights at +-127: the pairs of
    equal-signed products that saturate int16 pair sums, alternating signs, and random integers."""
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.ones(6, inner)
    pattern[1] = -1
    pattern[2, ::2] = -1
    pattern[3, (torch.arange(inner) // 2) % 2 == 0] = -1
    pattern[4, : inner // 2] = -1
    pattern[5, inner // 3 :] = -1
    x = torch.cat([pattern * levels, torch.randint(-levels, levels + 1, (5, inner), generator=generator).float()])
    x[6:, 1] = -levels
    q = torch.cat([pattern.flip(0) * 127, torch.randint(-127, 128, (7, inner), generator=generator).float()])
    return x, q.to(torch.int8)


def _kernel_error(kernel, x, q, scale) -> float:
    """Max |kernel - exact integer products| / max |exact|, through the kernel's own per-token rounding."""
    xq, x_scale = quantize_per_token(x, kernel.levels)
    exact = (xq.double() @ q.double().t()) * x_scale.double() * scale.double()[None, :]
    got = kernel.linear(x, kernel.pack(q, scale), scale)
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


@pytest.mark.parametrize("name", list(W8A8_KERNELS))
def test_a_w8a8_kernel_runs_only_where_it_is_exact(name):
    """On every CPU kind: the probe accepts a kernel iff it equals exact integer products at the limits
    (an excluded kernel is shown to be excluded, with the reason, not skipped); an accepted one also
    equals them on random products of 1, 7 and 64 rows."""
    kernel, measured = W8A8_KERNELS[name], machine.rates()
    accepted = name in measured.kernels
    assert accepted != (name in measured.excluded)
    if not kernel.available():
        assert not accepted and "torch build" in measured.excluded[name]
        return
    x, q = _at_the_limits(kernel.levels, 1024, seed=7)
    error = _kernel_error(kernel, x, q, torch.ones(q.shape[0]))
    print(f"{name} on {torch.backends.cpu.get_cpu_capability()}: max rel error at the limits {error:.1e}; "
          f"probe: {'accepted' if accepted else measured.excluded[name]}")
    assert accepted == (error == 0)
    if not accepted:
        assert "not exact" in measured.excluded[name]
        return
    for rows in (1, 7, 64):
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 96, generator=generator)
        q, scale = quantize_per_channel(torch.randn(40, 96, generator=generator))
        error = _kernel_error(kernel, x, q, scale)
        assert error < 1e-6, (rows, error)  # the same int32 sums, scaled in another order


def test_onednn_u7_gives_fbgemms_sums_to_the_bit():
    """The two 7-bit kernels round the same integers and sum them exactly: the same fp32 out, bit for bit (so every
    agreement figure measured on FBGEMM holds for onednn-u7), one digit and two."""
    u7, fbgemm = W8A8_KERNELS["onednn-u7"], W8A8_KERNELS["fbgemm"]
    if not (u7.available() and fbgemm.available()):
        pytest.skip("oneDNN or FBGEMM is not in this torch build")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(37, 520, generator=generator) * torch.rand(37, 1, generator=generator) * 9
    q, scale = quantize_per_channel(torch.randn(72, 520, generator=generator))
    one = [kernel.linear(x, kernel.pack(q, scale), scale) for kernel in (u7, fbgemm)]
    two = [kernel.two_digit_linear(x, kernel.pack(q, scale), scale) for kernel in (u7, fbgemm)]
    print(f"onednn-u7 vs fbgemm: max |diff| one digit {(one[0] - one[1]).abs().max():.1e}, two {(two[0] - two[1]).abs().max():.1e}")
    assert torch.equal(one[0], one[1]) and torch.equal(two[0], two[1])


def test_of_kernels_as_fast_the_one_that_packs_fastest_runs():
    """The load waits for packing: of the kernels within 10% of the fastest, the fastest to pack; a kernel more than
    10% slower is never chosen for its packing; 8-bit activations before 7 as before."""
    fast_pack = {"onednn-u7": 41.0, "fbgemm": 191.0}
    assert machine.w8a8_choice({"fbgemm": 254.0, "onednn-u7": 268.0}, 151.0, fast_pack) == "onednn-u7"
    assert machine.w8a8_choice({"fbgemm": 268.0, "onednn-u7": 254.0}, 151.0, fast_pack) == "onednn-u7"
    assert machine.w8a8_choice({"fbgemm": 300.0, "onednn-u7": 254.0}, 151.0, fast_pack) == "fbgemm"
    assert machine.w8a8_choice({"fbgemm": 300.0, "onednn-u7": 254.0}, 151.0) == "fbgemm"  # no pack times: the fastest
    assert machine.w8a8_choice({"onednn": 700.0, "onednn-u7": 760.0}, 151.0, {"onednn": 90.0, "onednn-u7": 40.0}) == "onednn"
    assert machine.w8a8_choice({}, 151.0) is None


@pytest.mark.parametrize("family", ["amx", "vnni", "avx2"])
def test_each_familys_default_runs_w8a8_on_its_kernel(tiny_dir, monkeypatch, family):
    """On each family with a fast exact kernel, a release's default is W8A8 on that kernel, 1 byte a weight, packed by
    `load`: one int8 product per projection with 8-bit activations; with FBGEMM's 7 bits, one digit where a norm is
    read and two at down/o/out. Its decisions are those of the fp32 model."""
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    rates = imagine(monkeypatch, family, int8_bits=7 if family == "avx2" else 8)
    model = clef_flash.load(tiny_dir, device="cpu")
    plan = model.plan.describe()
    assert model.precision == "int8-w8a8" and plan["kernel"] == rates.int8_kernel
    assert plan["activation_bits"] == (7 if family == "avx2" else 8)
    linears = {name: module for name, module in model.parts.decoder.named_modules() if isinstance(module, Int8Linear)}
    assert linears and all(isinstance(linear, W8A8Linear) and linear.kernel.name == rates.int8_kernel for linear in linears.values())
    two_digits = {name for name, linear in linears.items() if isinstance(linear, TwoDigitLinear)}
    expected = {name for name in linears if name.endswith(("down_proj", "o_proj", "out_proj"))} if family == "avx2" else set()
    assert expected or family != "avx2"
    assert two_digits == expected
    assert all(linear.packed is not None for linear in linears.values())  # packed while loading: the first answer is a warm one
    assert all(linear.weight.dtype == torch.int8 for linear in linears.values())
    monkeypatch.undo()
    fp32 = clef_flash.load(tiny_dir, device="cpu", precision="fp32")
    worst = 0.0
    for request in random_requests(3, 4):
        a, b = model.probabilities(request), fp32.probabilities(request)
        for question_id, p in a.items():
            worst = max(worst, max(abs(p[option] - b[question_id][option]) for option in p))
    print(f"{family}: {plan['kernel']} ({plan['activation_bits']}-bit activations) vs fp32: max |dp| {worst:.2e}")
    assert worst < 2e-2


def test_forced_w8a8_runs_the_exact_kernel_or_is_refused(tiny_dir, monkeypatch):
    """Forcing int8-w8a8 never runs an excluded kernel: the probe's fastest exact one, or a one-line refusal."""
    imagine(monkeypatch, "none")
    with pytest.raises(clef_flash.errors.ClefError, match="no W8A8 kernel is exact here.*onednn: not exact"):
        clef_flash.load(tiny_dir, device="cpu", precision="int8-w8a8")
    monkeypatch.undo()
    model = clef_flash.load(tiny_dir, device="cpu", precision="int8-w8a8")
    kernels = {module.kernel.name for module in model.parts.decoder.modules() if isinstance(module, W8A8Linear)}
    assert kernels == {machine.rates().int8_kernel}


@pytest.mark.parametrize("precision", [name for name in PRECISION_CHOICES if name.startswith("int8")])
def test_forced_precisions_run_everywhere(tiny_dir, precision):
    model = clef_flash.load(tiny_dir, device="cpu", precision=precision)
    assert model.precision.startswith("int8")
    assert set(model.logits({"state": "hi", "questions": {"u": {"type": "noul"}}})["u"]) == {"true", "false"}
    assert 0 <= model.answer({"state": "hi", "questions": {"u": {"type": "noul"}}})["answers"]["u"]["noul"] <= 1


@pytest.fixture(scope="module")
def outlier_release(module_tmp):
    return write_random_release(module_tmp("outliers") / "release", "9b-heads-outliers", seed=1)


@pytest.mark.slow  # the 9b-heads-outliers release in three precisions
@pytest.mark.parametrize("family", ["vnni"])
def test_w8a8_stays_close_on_the_outlier_release_without_calibration(outlier_release, monkeypatch, family):
    """Three hidden channels 50x the rest at every projection's input: the scheme's W8A8 (8-bit activations, no
    calibration) keeps about as close to fp32 as int8 weight-only does."""
    imagine(monkeypatch, family)
    w8a8 = clef_flash.load(outlier_release, device="cpu", precision="int8-w8a8")
    monkeypatch.undo()
    fp32 = clef_flash.load(outlier_release, device="cpu", precision="fp32")
    weight_only = clef_flash.load(outlier_release, device="cpu", precision="int8-weight-only")
    deltas, flips = {"w8a8": [], "weight-only": []}, {"w8a8": 0, "weight-only": 0}
    for request in random_requests(5, 8):
        truth = fp32.probabilities(request)
        for name, model in (("w8a8", w8a8), ("weight-only", weight_only)):
            for question_id, probabilities in model.probabilities(request).items():
                p, q = truth[question_id], probabilities
                deltas[name] += [abs(q[option] - p[option]) for option in p]
                flips[name] += max(p, key=p.get) != max(q, key=q.get)
    medians = {name: statistics.median(values) for name, values in deltas.items()}
    print(f"{family}: median |dp| vs fp32 {medians}; decisions differing {flips}")
    assert medians["w8a8"] < 4 * medians["weight-only"] and flips["w8a8"] <= flips["weight-only"] + 1


# -- every memory size (issue 25) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "memory_gib", "expected", "left_out"),
    [
        ("avx2", 23, "int8-w8a8", ["fp32 33.3"]),
        ("none", 23, "int8-weight-only", ["fp32 33.3"]),  # bf16 fits but is slower than int8 weight-only there
        ("amx", 12, "int8-w8a8", ["fp32 33.3", "bf16 16.7"]),
        ("none", 64, "fp32", []),
    ],
)
def test_a_release_default_always_fits_the_memory(family, memory_gib, expected, left_out):
    rates = FAMILIES[family]
    chosen = choose_precision(CPU, stored_int8=False, rates=lambda: rates, weights=NINE_B, memory_bytes=memory_gib * GIB)
    print(f"{family}, {memory_gib} GiB: {chosen.name} ({chosen.reason})")
    assert chosen.name == expected
    for item in left_out:
        assert item in chosen.reason
    assert ("too big for memory" in chosen.reason) == bool(left_out)


def test_nothing_fitting_is_one_line_with_the_sizes():
    rates = FAMILIES["vnni"]
    with pytest.raises(ValueError, match=r"no qualified precision fits .*int8-w8a8 8\.3 GiB, int8-weight-only 8\.3 GiB of weights, 3\.2 GiB usable"):
        choose_precision(CPU, stored_int8=False, rates=lambda: rates, weights=NINE_B, memory_bytes=4 * GIB)


def test_load_quantizes_a_release_that_does_not_fit_dense(tiny_dir, monkeypatch):
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    weights = clef_flash.checkpoint.open_checkpoint(tiny_dir).weight_counts()
    room = int((weights.bytes_in("int8-weight-only") + weights.bytes_in("bf16")) / 2 / 0.8)  # int8 fits, no dense copy does
    imagine(monkeypatch, "none")
    monkeypatch.setattr(clef_flash.loader, "available_memory_bytes", lambda: room)
    model = clef_flash.load(tiny_dir, device="cpu")
    assert model.precision == "int8-weight-only" and "too big for memory" in model.plan.reason
    assert all(isinstance(m, WeightOnlyLinear) for m in model.parts.decoder.modules() if isinstance(m, Int8Linear))
    assert 0 <= model.answer({"state": "hi", "questions": {"u": {"type": "noul"}}})["answers"]["u"]["noul"] <= 1


def test_fbgemm_ops_are_there_on_x86():
    """FBGEMM's ops are called directly (torch.ao's Python flows are deprecated): fail loudly if a torch upgrade
    drops one, rather than the probe quietly falling back."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return
    for op in ("linear_prepack", "linear_dynamic"):
        assert hasattr(torch.ops.quantized, op), op
    assert W8A8_KERNELS["fbgemm"].available()
