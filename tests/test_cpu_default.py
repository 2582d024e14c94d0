"""The per-machine default precision, the W8A8 kernels, and calibrated outlier channels (issue: fast by default)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

import pytest
import torch

import clef_flash
import clef_flash.plan
from clef_flash import machine
from clef_flash.checkpoint.names import outlier_counts
from clef_flash.checkpoint.outliers import find_outliers, outlier_ratios
from clef_flash.conversion import calibrate, default_calibration_requests
from clef_flash.checkpoint.quant import Int8Linear, QuantizingSource, quantize_per_channel
from clef_flash.checkpoint.w8a8 import INT_MM, W8A8_KERNELS, exactness_error, quantize_per_token
from clef_flash.checkpoint.random_release import outlier_channels, write_random_release
from clef_flash.cli import main
from clef_flash.conversion import convert
from clef_flash.model.precision import (
    PRECISION_CHOICES,
    QUALIFIED_RELEASE,
    choose_precision,
    qualified,
    resolve_precision,
)
from clef_flash.request.samples import random_requests
from cpu_families import FAMILIES, imagine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class FakeRates:
    fp32: float
    bf16: float
    int8: float
    int8_kernel: str | None = INT_MM
    excluded: dict = None
    fp16_packed: float = 0.0
    two_digit: float = 0.0


# -- the choice ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rates", "stored_int8", "calibrated", "expected"),
    [
        (FakeRates(fp32=60, bf16=12, int8=2), False, False, "fp32"),  # AVX2 only: bf16 emulated
        (FakeRates(fp32=130, bf16=400, int8=750), False, False, "bf16"),  # a release never picks int8
        (FakeRates(fp32=130, bf16=400, int8=750), True, True, "int8-w8a8"),  # a calibrated bundle on VNNI
        (FakeRates(fp32=60, bf16=12, int8=2), True, True, "int8-weight-only"),  # ... on AVX2 only
        (FakeRates(fp32=130, bf16=400, int8=750), True, False, "int8-weight-only"),  # uncalibrated: W8A8 unqualified
    ],
)
def test_the_default_is_the_fastest_qualified_path(rates, stored_int8, calibrated, expected):
    chosen = choose_precision(CPU, stored_int8=stored_int8, calibrated=calibrated, rates=lambda: rates)
    assert chosen.name == expected and chosen.name in qualified(stored_int8=stored_int8, calibrated=calibrated)
    assert "fastest qualified" in chosen.reason


def test_cuda_defaults_to_bf16_and_the_environment_overrides(monkeypatch):
    never = lambda: pytest.fail("no probe on CUDA")  # noqa: E731
    cuda = torch.device("cuda")
    assert choose_precision(cuda, stored_int8=False, calibrated=False, rates=never).compute_dtype == torch.bfloat16
    monkeypatch.setenv("CLEF_FLASH_PRECISION", "fp32")
    chosen = resolve_precision(None, CPU, stored_int8=False, rates=never)
    assert chosen.name == "fp32" and chosen.reason == "$CLEF_FLASH_PRECISION"


def test_load_picks_a_path_that_exists_here_and_says_why(tiny_dir, monkeypatch):
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    model = clef_flash.load(tiny_dir, device="cpu")
    assert model.precision in QUALIFIED_RELEASE and "probe" in model.precision_policy.reason
    expected = choose_precision(CPU, stored_int8=False, calibrated=False, rates=machine.rates)
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
    assert set(report["default_precision"]) == {"release", "calibrated bundle", "uncalibrated bundle"}
    assert main(["info"]) == 0
    assert "default      release:" in capsys.readouterr().out


def test_info_says_which_kernels_the_default_passes_over():
    assert machine.kernel_note("onednn", 0.096, fp32=180) == "0.096 GOP/s, a reference loop here: used only when forced"
    assert machine.kernel_note("fbgemm", 716.2, fp32=180) == "716 GOP/s, 7-bit activations"
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
    q = torch.cat([pattern.flip(0) * 127, torch.randint(-127, 128, (7, inner), generator=generator).float()]).to(torch.int8)
    return x, q


def _kernel_error(kernel, x, q, scale, outliers=None) -> float:
    """Max |kernel - exact integer products| / max |exact|, through the kernel's own per-token rounding."""
    xq, x_scale = quantize_per_token(x, outliers, kernel.levels)
    exact = (xq.double() @ q.double().t()) * x_scale.double() * scale.double()[None, :]
    got = kernel.linear(x, kernel.pack(q, scale), scale, outliers)
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


@pytest.mark.parametrize("name", list(W8A8_KERNELS))
def test_a_w8a8_kernel_runs_only_where_it_is_exact(name):
    """On every CPU kind: the probe accepts a kernel iff it equals exact integer products at the limits
    (an excluded kernel is shown to be excluded, with the reason, not skipped); an accepted one also
    equals them on random products of 1, 7 and 64 rows, with and without outlier channels."""
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
        for outliers in (None, torch.tensor([3, 50])):
            error = _kernel_error(kernel, x, q, scale, outliers)
            assert error < 1e-6, (rows, outliers, error)  # the same int32 sums, scaled in another order


def test_w8a8_on_7_bit_activations_takes_two_digits_but_at_the_mlp_inputs():
    """FBGEMM rounds activations to 7 bits: W8A8 on it runs one digit at the MLP's inputs only and two digits at every
    other projection (benchmarks/agreement.py: that keeps weight-only's decisions), is the default where the probe
    finds that fastest, says so, and is left out (with the reason) where no two-digit rate was measured; an exact
    8-bit kernel, even a slower one, is W8A8's kernel before it."""
    from clef_flash.checkpoint.w8a8 import FBGEMM, ONEDNN
    from clef_flash.model.precision import SEVEN_BIT_KERNELS, TWO_DIGITS, W8A8, WEIGHT_ONLY, int8_mode_of, w8a8_kernel

    assert set(SEVEN_BIT_KERNELS) == {name for name, kernel in W8A8_KERNELS.items() if kernel.levels < 127}
    modes = {
        name: (int8_mode_of(f"layers.0.{name}", W8A8, WEIGHT_ONLY, FBGEMM), int8_mode_of(f"layers.0.{name}", W8A8, WEIGHT_ONLY, ONEDNN))
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "linear_attn.in_proj_qkv", "self_attn.q_proj", "self_attn.o_proj")
    }
    assert modes == {
        "mlp.gate_proj": (W8A8, W8A8),
        "mlp.up_proj": (W8A8, W8A8),
        "mlp.down_proj": (TWO_DIGITS, WEIGHT_ONLY),
        "linear_attn.in_proj_qkv": (TWO_DIGITS, W8A8),
        "self_attn.q_proj": (TWO_DIGITS, W8A8),
        "self_attn.o_proj": (TWO_DIGITS, WEIGHT_ONLY),
    }
    avx2 = FakeRates(fp32=120, bf16=20, int8=300, int8_kernel=FBGEMM, fp16_packed=125, two_digit=150)  # Zen 3's kernels
    chosen = choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: avx2)
    print(chosen.reason)
    assert chosen.name == "int8-w8a8" and not chosen.compact
    assert "7-bit activations: one int8 digit at gate_proj, up_proj (300), two at every other projection (150)" in chosen.reason
    slow_digits = FakeRates(fp32=120, bf16=20, int8=300, int8_kernel=FBGEMM, fp16_packed=125, two_digit=60)
    assert choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: slow_digits).name == "int8-weight-only"
    no_digits = FakeRates(fp32=120, bf16=20, int8=300, int8_kernel=FBGEMM, fp16_packed=125, two_digit=0.0)
    left_out = choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: no_digits)
    assert left_out.name == "int8-weight-only" and "int8-w8a8 left out: its kernel here (fbgemm) rounds activations to 7 bits" in left_out.reason
    assert choose_precision(CPU, stored_int8=True, calibrated=False, rates=lambda: avx2).name == "int8-weight-only"  # uncalibrated
    assert w8a8_kernel(avx2) == FBGEMM
    assert machine.w8a8_choice({FBGEMM: 300.0, INT_MM: 200.0}, 120.0) == INT_MM
    assert machine.w8a8_choice({FBGEMM: 300.0, ONEDNN: 0.1}, 120.0) == FBGEMM  # a reference loop is last
    assert machine.w8a8_choice({FBGEMM: 300.0}, 120.0) == FBGEMM
    assert machine.w8a8_choice({}, 120.0) is None


@pytest.fixture(scope="module")
def tiny_bundle(tiny_dir, module_tmp):
    """The tiny release as a calibrated bundle (read-only: tests load it, none changes it)."""
    return convert(tiny_dir, module_tmp("tiny") / "bundle", progress=False)


def test_a_7_bit_kernels_w8a8_model_runs_its_digits_and_decides_as_weight_only(tiny_bundle, monkeypatch):
    """A calibrated bundle on FBGEMM (the plan of an AVX2-only CPU): every linear in the mode `int8_mode_of` gives,
    1 byte a weight, the plan says which projections take one digit, and the answers are weight-only's."""
    from clef_flash.checkpoint.w8a8 import FBGEMM

    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    bundle = tiny_bundle
    imagine(monkeypatch, "avx2")
    model = clef_flash.load(bundle, device="cpu")
    assert model.precision == "int8-w8a8" and model.plan.kernel == FBGEMM and model.plan.dense_dtype is None
    assert model.plan.describe()["one_digit"].startswith("gate_proj, up_proj (7-bit")
    linears = {name: module for name, module in model.parts.decoder.named_modules() if isinstance(module, Int8Linear)}
    one_digit = {name for name, module in linears.items() if module.mode == "w8a8"}
    assert one_digit and all(name.endswith(("gate_proj", "up_proj")) for name in one_digit)
    assert {module.mode for name, module in linears.items() if name not in one_digit} == {"w8a8-two-digit"}
    assert {module.kernel for module in linears.values()} == {FBGEMM}
    monkeypatch.undo()
    weight_only = clef_flash.load(bundle, device="cpu", precision="int8-weight-only")
    worst = 0.0
    for request in random_requests(3, 4):
        a, b = model.probabilities(request), weight_only.probabilities(request)
        for question_id, p in a.items():
            worst = max(worst, max(abs(p[option] - b[question_id][option]) for option in p))
    print(f"W8A8 on FBGEMM (7-bit: one digit at the MLP's inputs, two elsewhere) vs int8 weight-only: max |dp| {worst:.2e}")
    assert worst < 2e-2


def test_forced_w8a8_runs_the_exact_kernel_or_is_refused(tiny_dir, monkeypatch):
    """Forcing int8-w8a8 never runs an excluded kernel: the probe's fastest exact one, or a one-line refusal."""
    fake = FakeRates(fp32=60, bf16=12, int8=0.0, int8_kernel=None, excluded={"onednn": "not exact here", "int_mm": "not exact here"})
    monkeypatch.setattr(clef_flash.plan, "machine_rates", lambda: fake)
    with pytest.raises(clef_flash.errors.ClefError, match="no W8A8 kernel is exact here.*onednn: not exact"):
        clef_flash.load(tiny_dir, device="cpu", precision="int8-w8a8")
    assert choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: fake).name == "int8-weight-only"
    monkeypatch.undo()
    model = clef_flash.load(tiny_dir, device="cpu", precision="int8-w8a8")
    kernels = {module.kernel for module in model.parts.decoder.modules() if isinstance(module, Int8Linear) and module.mode == "w8a8"}
    assert kernels == {machine.rates().int8_kernel}


@pytest.mark.parametrize("precision", [name for name in PRECISION_CHOICES if name.startswith("int8")])
def test_forced_precisions_run_everywhere(tiny_dir, precision):
    model = clef_flash.load(tiny_dir, device="cpu", precision=precision)
    assert model.precision.startswith("int8")
    assert set(model.logits({"state": "hi", "questions": {"u": {"type": "noul"}}})["u"]) == {"true", "false"}


def test_outlier_channels_are_exact_and_spare_the_int8_rounding():
    """A channel 50x the others: decomposed W8A8 keeps its error near the plain per-token error of the rest."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 128, generator=generator)
    x[:, [10, 90]] *= 50
    weight = torch.randn(64, 128, generator=generator) / 128**0.5
    exact = x @ weight.t()
    channels = torch.tensor([10, 90])
    source = QuantizingSource(_Tensors({"mlp.up_proj.weight": weight}), outliers={"mlp.up_proj.weight": channels})
    assert source.keys() == {f"mlp.up_proj.{leaf}" for leaf in ("weight", "weight_scale", "outlier_channels", "outlier_weight")}
    assert source.shape("mlp.up_proj.outlier_weight") == (64, 2) and torch.equal(source.get("mlp.up_proj.outlier_channels"), channels)
    assert torch.equal(source.get("mlp.up_proj.outlier_weight"), weight[:, channels])
    assert not source.get("mlp.up_proj.weight")[:, channels].any()
    errors = {}
    for kernel in machine.rates().kernels:
        for outliers in (0, 2):
            linear = Int8Linear(128, 64, "w8a8", outliers=outliers, kernel=kernel)
            plain = QuantizingSource(_Tensors({"mlp.up_proj.weight": weight}))
            chosen = source if outliers else plain
            linear.load_state_dict({name.removeprefix("mlp.up_proj."): chosen.get(name) for name in chosen.keys()})
            errors[kernel, outliers] = ((linear(x) - exact).abs().max() / exact.abs().max()).item()
    print(errors)
    for kernel in {kernel for kernel, _ in errors}:
        assert errors[kernel, 2] < errors[kernel, 0] / 5


class _Tensors:
    def __init__(self, tensors):
        self.tensors = tensors

    def keys(self):
        return set(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def get(self, name):
        return self.tensors[name]


# -- calibration, the outlier release, agreement --------------------------------------------------------


@pytest.fixture(scope="module")
def outlier_release(module_tmp):
    return write_random_release(module_tmp("outliers") / "release", "9b-heads-outliers", seed=1)


@pytest.fixture(scope="module")
def calibrated_bundle(outlier_release, module_tmp):
    return convert(outlier_release, module_tmp("outliers") / "bundle", progress=False)


@pytest.mark.slow  # the 9b-heads-outliers release, converted and calibrated
def test_the_outlier_release_has_outliers(outlier_release, tiny_dir):
    fp32 = clef_flash.load(outlier_release, device="cpu", precision="fp32")
    ratios = outlier_ratios(calibrate(fp32, default_calibration_requests(4)))
    plain = outlier_ratios(calibrate(clef_flash.load(tiny_dir, device="cpu", precision="fp32"), default_calibration_requests(4)))
    print(f"largest / median channel absmax: outliers median {statistics.median(ratios.values()):.1f}, "
          f"plain median {statistics.median(plain.values()):.1f}")
    assert statistics.median(ratios.values()) > 20 > 5 > statistics.median(plain.values())


@pytest.mark.slow  # the 9b-heads-outliers release, converted and calibrated
def test_calibration_round_trips_through_the_manifest(calibrated_bundle, outlier_release):
    manifest = json.loads((calibrated_bundle / "manifest.json").read_text())
    recorded = manifest["scheme"]["outliers"]
    assert recorded["projections"] > 0 and recorded["calibration"]["records"] == 16
    model = clef_flash.load(calibrated_bundle, device="cpu")
    assert model.checkpoint.calibrated and model.precision in qualified(stored_int8=True, calibrated=True)
    layer = model.parts.decoder.layers[0].mlp.gate_proj
    injected = outlier_channels(256, 3)  # the hidden channels the release scales by 50
    assert set(injected) <= set(layer.outlier_channels.tolist())
    # The bundle's outlier names (checkpoint/names.py) say which linears keep how many channels apart.
    built = {
        name: len(module.outlier_channels)
        for name, module in model.parts.decoder.named_modules()
        if getattr(module, "outlier_channels", None) is not None
    }
    assert outlier_counts(model.checkpoint.tensors) == built != {}
    as_converted = clef_flash.load(outlier_release, device="cpu")  # convert calibrates in the release's default
    again = find_outliers(calibrate(as_converted, default_calibration_requests()))
    assert torch.equal(again["model.language_model.layers.0.mlp.gate_proj.weight"], layer.outlier_channels)
    uncalibrated = convert(outlier_release, calibrated_bundle.parent / "plain", calibrate=None, progress=False)
    assert json.loads((uncalibrated / "manifest.json").read_text())["scheme"]["outliers"] is None
    assert clef_flash.load(uncalibrated, device="cpu").precision == "int8-weight-only"


@pytest.mark.slow  # the 9b-heads-outliers release, converted and calibrated
def test_calibrated_w8a8_agrees_on_the_outlier_release(calibrated_bundle, outlier_release):
    """Against our fp32, on requests the calibration never saw: calibrated W8A8 keeps close, plain W8A8 does not."""
    fp32 = clef_flash.load(outlier_release, device="cpu", precision="fp32")
    paths = {
        "calibrated": clef_flash.load(calibrated_bundle, device="cpu", precision="int8-w8a8"),
        "plain": clef_flash.load(outlier_release, device="cpu", precision="int8-w8a8"),
    }
    deltas = {name: [] for name in paths}
    flips = {name: 0 for name in paths}
    for request in random_requests(5, 8):
        truth = fp32.probabilities(request)
        for name, model in paths.items():
            for question_id, probabilities in model.probabilities(request).items():
                p, q = truth[question_id], probabilities
                deltas[name] += [abs(q[option] - p[option]) for option in p]
                flips[name] += max(p, key=p.get) != max(q, key=q.get)
    medians = {name: statistics.median(values) for name, values in deltas.items()}
    print(f"median |dp| vs fp32: {medians}; decisions differing: {flips}")
    assert medians["calibrated"] < medians["plain"] / 2
    assert flips["calibrated"] <= flips["plain"]


# -- every memory size, every CPU (issue 25) -----------------------------------------------------------------


NINE_B = 8_950_000_000  # the 9B decoder's parameters, output embeddings aside
GIB = 1 << 30


@pytest.mark.parametrize(
    ("rates", "memory_gib", "expected", "left_out"),
    [
        (FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=125), 23, "int8-weight-only", ["fp32 33.3"]),  # AVX2: bf16 fits, slower
        (FakeRates(fp32=300, bf16=1900, int8=3000, fp16_packed=80), 23, "bf16", ["fp32 33.3"]),  # AMX: bf16 fits
        (FakeRates(fp32=300, bf16=1900, int8=3000, fp16_packed=80), 64, "bf16", []),
        (FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=125), 64, "fp32", []),
    ],
)
def test_a_release_default_always_fits_the_memory(rates, memory_gib, expected, left_out):
    chosen = choose_precision(CPU, stored_int8=False, calibrated=False, rates=lambda: rates, parameters=NINE_B, memory_bytes=memory_gib * GIB)
    print(f"{memory_gib} GiB: {chosen.name} ({chosen.reason})")
    assert chosen.name == expected
    for item in left_out:
        assert item in chosen.reason
    assert ("too big for memory" in chosen.reason) == bool(left_out)


def test_nothing_fitting_is_one_line_with_the_sizes():
    rates = FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=125)
    with pytest.raises(ValueError, match=r"no qualified precision fits .*int8-weight-only 8\.3 GiB of weights, 3\.2 GiB usable"):
        choose_precision(CPU, stored_int8=False, calibrated=False, rates=lambda: rates, parameters=NINE_B, memory_bytes=4 * GIB)


def test_load_quantizes_a_release_that_does_not_fit_dense(tiny_dir, monkeypatch):
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    parameters = clef_flash.plan.decoder_parameters(clef_flash.checkpoint.open_checkpoint(tiny_dir))
    room = int(parameters * 1.5 / 0.8)  # int8 fits, no dense copy does
    monkeypatch.setattr(clef_flash.plan, "available_memory_bytes", lambda: room)
    model = clef_flash.load(tiny_dir, device="cpu")
    assert model.precision == "int8-weight-only" and "too big for memory" in model.plan.reason
    assert 0 <= model.answer({"state": "hi", "questions": {"u": {"type": "noul"}}})["answers"]["u"]["noul"] <= 1


@pytest.mark.parametrize(
    ("rates", "memory_gib", "compact"),
    [
        (FakeRates(fp32=300, bf16=1900, int8=3000, fp16_packed=80, two_digit=1500), 24, False),  # AMX: the 2-byte copies fit
        (FakeRates(fp32=300, bf16=1900, int8=3000, fp16_packed=80, two_digit=1500), 11, True),  # 11.3 GiB does not fit 8.8, 8.3 does
        (FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=160, two_digit=140), 11, True),  # AVX2: still faster than weight-only
    ],
)
def test_a_calibrated_bundle_that_does_not_fit_runs_w8a8_compact(rates, memory_gib, compact):
    chosen = choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: rates, parameters=NINE_B, memory_bytes=memory_gib * GIB)
    print(f"{memory_gib} GiB: {chosen.name} compact={chosen.compact} ({chosen.reason})")
    assert chosen.name == "int8-w8a8" and chosen.compact == compact
    assert ("compact" in chosen.reason) == compact and ("int8-w8a8 11.3 GiB" in chosen.reason) == compact


@pytest.mark.parametrize(
    ("family", "precision", "gated_mode", "compact"),
    [
        ("amx", "int8-w8a8", "weight-only-bf16-scratch", True),  # int8 widened to bf16 per forward
        ("vnni", "int8-w8a8", "w8a8-two-digit", True),  # its fp16-packed copy is faster, but does not fit
        ("avx2", "int8-w8a8", "w8a8-two-digit", False),  # 7-bit: one digit at the MLP's inputs, two elsewhere, 1 byte anyway
        ("none", "int8-weight-only", "weight-only", False),  # no exact kernel
    ],
)
def test_a_calibrated_bundle_whose_2_byte_copies_do_not_fit_loads_at_one_byte(tiny_bundle, monkeypatch, family, precision, gated_mode, compact):
    """On every CPU family, where W8A8's 2-byte copies of the gated products do not fit, the default keeps every weight
    at 1 byte (compact where the family would otherwise copy: int8 widened to bf16 per forward where bf16 is fast,
    else two int8 digits) and answers as W8A8 with the copies on the same CPU."""
    monkeypatch.delenv("CLEF_FLASH_PRECISION", raising=False)
    parameters = clef_flash.plan.decoder_parameters(clef_flash.checkpoint.open_checkpoint(tiny_bundle))
    imagine(monkeypatch, family)
    monkeypatch.setattr(clef_flash.plan, "available_memory_bytes", lambda: int(parameters * 1.2 / 0.8))
    small = clef_flash.load(tiny_bundle, device="cpu")
    print(f"{family}: {small.plan.describe()}")
    assert small.precision == precision and small.plan.dense_dtype is None and ("compact" in small.plan.reason) == compact
    linears = [module for module in small.parts.decoder.modules() if isinstance(module, Int8Linear)]
    assert linears and all(linear.dense_dtype is None for linear in linears)  # no 2-byte copy anywhere
    down = small.parts.decoder.layers[0].mlp.down_proj
    if precision == "int8-weight-only":
        assert small.plan.kernel is None and {linear.mode for linear in linears} == {"weight-only"}
        return
    assert down.mode == gated_mode == small.plan.gated_mode == small.plan.describe()["gated_mode"]
    assert small.plan.kernel == FAMILIES[family].int8_kernel
    if gated_mode == "weight-only-bf16-scratch":
        small.probabilities(random_requests(3, 1)[0])
        assert down._prepared.dtype == torch.int8  # widened into the shared scratch on each forward: no bf16 kept
    full = clef_flash.load(tiny_bundle, device="cpu", precision="int8-w8a8")  # the same CPU, memory no object
    worst = 0.0
    for request in random_requests(3, 4):
        a, b = small.probabilities(request), full.probabilities(request)
        for question_id, p in a.items():
            worst = max(worst, max(abs(p[option] - b[question_id][option]) for option in p))
            assert max(p, key=p.get) == max(b[question_id], key=b[question_id].get)
    print(f"{family}: 1-byte W8A8 ({gated_mode}) vs W8A8 as forced there: max |dp| {worst:.2e}")
    assert worst < 2e-2


def test_int8_w8a8_compact_is_a_precision_to_ask_for(tiny_bundle, monkeypatch):
    """`int8-w8a8-compact` (argument or $CLEF_FLASH_PRECISION): W8A8 with its gated products at 1 byte whatever the
    memory, in the form this CPU's probe gives the compact plan; the decisions are W8A8's."""
    from clef_flash.model.precision import PRECISION_CHOICES, gated_mode_for

    assert "int8-w8a8-compact" in PRECISION_CHOICES
    form = gated_mode_for(machine.rates(), compact=True)
    monkeypatch.setenv("CLEF_FLASH_PRECISION", "int8-w8a8-compact")
    from_environment = clef_flash.load(tiny_bundle, device="cpu")
    monkeypatch.delenv("CLEF_FLASH_PRECISION")
    asked = clef_flash.load(tiny_bundle, device="cpu", precision="int8-w8a8-compact")
    full = clef_flash.load(tiny_bundle, device="cpu", precision="int8-w8a8")
    for model in (from_environment, asked):
        assert model.precision == "int8-w8a8" and model.plan.precision.compact and model.plan.dense_dtype is None
        assert model.plan.gated_mode == form == model.parts.decoder.layers[0].mlp.down_proj.mode
    assert asked.plan.key != full.plan.key or form == full.plan.gated_mode  # the state cache tells them apart
    for request in random_requests(2, 5):
        a, b = asked.probabilities(request), full.probabilities(request)
        assert {q: max(p, key=p.get) for q, p in a.items()} == {q: max(p, key=p.get) for q, p in b.items()}
    with pytest.raises(clef_flash.errors.ClefError, match="int8-w8a8-compact"):
        clef_flash.load(tiny_bundle, device="cpu", precision="int8-w8a8-small")


def test_w8a8_weight_only_projections_are_never_an_fp32_copy():
    from clef_flash.model.precision import BF16, PACKED_FP16, dense_dtype_for

    assert dense_dtype_for(FakeRates(fp32=300, bf16=1900, int8=3000, fp16_packed=80)) == BF16
    assert dense_dtype_for(FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=125)) == PACKED_FP16
    assert dense_dtype_for(FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=0.0)) is None  # tile by tile


def test_fbgemm_ops_are_there_on_x86():
    """FBGEMM's ops are called directly (torch.ao's Python flows are deprecated): fail loudly if a torch upgrade
    drops one, rather than the probe quietly falling back."""
    import platform

    from clef_flash.checkpoint.w8a8 import fp16_packed_available

    if platform.machine() not in ("x86_64", "AMD64"):
        assert not W8A8_KERNELS["fbgemm"].available() or fp16_packed_available()
        return
    for op in ("linear_prepack", "linear_dynamic", "linear_prepack_fp16", "linear_dynamic_fp16"):
        assert hasattr(torch.ops.quantized, op), op
    assert W8A8_KERNELS["fbgemm"].available() and fp16_packed_available()


def test_the_fp16_packed_weight_only_projection_is_fp32_arithmetic_on_fp16_storage():
    from clef_flash.checkpoint.quant import dequantize
    from clef_flash.model.precision import PACKED_FP16

    generator = torch.Generator().manual_seed(3)
    q, scale = quantize_per_channel(torch.randn(48, 80, generator=generator))
    x = torch.randn(9, 80, generator=generator) * 4
    linear = Int8Linear(80, 48, "weight-only", dense_dtype=PACKED_FP16)
    linear.load_state_dict({"weight": q, "weight_scale": scale})
    exact = x.double() @ dequantize(q, scale).double().t()
    error = ((linear(x).double() - exact).abs().max() / exact.abs().max()).item()
    print(f"fp16-packed weight-only vs dequantized fp64: {error:.1e}")
    assert linear(x).dtype == torch.float32 and error < 2e-3  # fp16 rounding of the weights (2^-11), no fp16 math


# -- two int8 digits per activation: W8A8's gated products at 1 byte -----------------------------------------


@pytest.mark.parametrize(
    ("rates", "expected", "compact"),
    [
        (FakeRates(fp32=217, bf16=64, int8=785, fp16_packed=253, two_digit=390), "w8a8-two-digit", "w8a8-two-digit"),  # VNNI: faster than fp16-packed
        (FakeRates(fp32=300, bf16=1900, int8=3000, fp16_packed=80, two_digit=1500), "weight-only", "weight-only-bf16-scratch"),  # AMX: bf16 copies faster
        (FakeRates(fp32=146, bf16=892, int8=1041, fp16_packed=163, two_digit=1323), "weight-only", "weight-only-bf16-scratch"),  # AMX (E): a lucky probe
        (FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=125, two_digit=150), "w8a8-two-digit", "w8a8-two-digit"),  # AVX2 (FBGEMM)
        (FakeRates(fp32=120, bf16=20, int8=300, fp16_packed=125), "weight-only", "weight-only"),  # no two-digit rate measured
    ],
)
def test_the_gated_products_run_in_two_digits_where_the_probe_finds_it_fastest(rates, expected, compact):
    from clef_flash.model.precision import gated_mode_for

    assert gated_mode_for(rates) == expected
    assert gated_mode_for(rates, compact=True) == compact  # where bf16 is fast, 1 byte is int8 widened to bf16 per forward
    chosen = choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: rates, parameters=NINE_B, memory_bytes=11 * GIB)
    print(f"{expected}: {chosen.name} compact={chosen.compact} ({chosen.reason})")
    assert chosen.name == "int8-w8a8"  # 8.3 GiB at 1 byte fits 8.8 GiB usable either way
    one_byte = compact if chosen.compact else expected  # the 1-byte form the reason names
    assert ("two int8 digits" in chosen.reason) == (one_byte == "w8a8-two-digit")
    assert ("widened to bf16 per forward" in chosen.reason) == (one_byte == "weight-only-bf16-scratch")


def test_the_compact_form_is_taken_only_where_the_copies_do_not_fit():
    """On AMX (E) the probe's small product can time W8A8 compact (two digits) ahead of the bf16 copies; the
    9B record measured it slower, so with room for the copies the default keeps them."""
    amx = FakeRates(fp32=146, bf16=892, int8=1041, fp16_packed=163, two_digit=1323)
    roomy = choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: amx, parameters=NINE_B, memory_bytes=23 * GIB)
    tight = choose_precision(CPU, stored_int8=True, calibrated=True, rates=lambda: amx, parameters=NINE_B, memory_bytes=11 * GIB)
    assert (roomy.name, roomy.compact) == ("int8-w8a8", False)
    assert (tight.name, tight.compact) == ("int8-w8a8", True) and "widened to bf16 per forward" in tight.reason


def test_the_bf16_scratch_linear_rounds_once_and_keeps_one_byte():
    """W8A8's gated products in compact form where bf16 is fast: the int8 weight widened to bf16 per forward
    (exact), one rounding of the output; the buffer is shared by the linears of a shape, and the weight stays int8."""
    from clef_flash.checkpoint.quant import bf16_scratch, dequantize

    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 80, generator=generator)
    channels = torch.tensor([5, 60])
    q, scale = quantize_per_channel(weight.index_fill(1, channels, 0.0))
    x = torch.randn(9, 80, generator=generator) * torch.logspace(0, 2, 9)[:, None]
    x[:, channels] *= 60
    state = {"weight": q, "weight_scale": scale, "outlier_channels": channels, "outlier_weight": weight[:, channels]}
    scratch, copy = (Int8Linear(80, 48, mode, outliers=2, dense_dtype=dense) for mode, dense in (("weight-only-bf16-scratch", None), ("weight-only", torch.bfloat16)))
    for linear in (scratch, copy):
        linear.load_state_dict(state)
    exact = x.double() @ (dequantize(q, scale).double() + torch.zeros(48, 80, dtype=torch.float64).index_copy(1, channels, weight[:, channels].double())).t()
    errors = [((linear(x).double() - exact).abs().max() / exact.abs().max()).item() for linear in (scratch, copy)]
    print(f"bf16 scratch vs fp64: {errors[0]:.2e}; the bf16 copy: {errors[1]:.2e}")
    assert scratch(x).dtype == torch.float32 and errors[0] < 4e-3 and errors[0] <= errors[1] * 1.5
    assert scratch._prepared is scratch.weight  # nothing kept per linear (a weight in memory already is read as it is)
    assert bf16_scratch((48, 80), torch.device("cpu")) is bf16_scratch((48, 80), torch.device("cpu"))


def test_two_digits_match_the_exact_product_to_15_bits():
    """Each activation as hi * base + lo, both int8, through the kernel's exact integer product: the error is
    the activation rounding at ~15 bits per token (13 for FBGEMM's 7-bit digits), ~300x below one digit's."""
    from clef_flash.checkpoint.quant import dequantize
    from clef_flash.checkpoint.w8a8 import quantize_two_digits

    generator = torch.Generator().manual_seed(5)
    x = torch.randn(37, 512, generator=generator) * torch.logspace(0, 2, 37)[:, None]  # rows spread 100x
    x[:, 3] *= 50  # and a channel 50x the rest
    q, scale = quantize_per_channel(torch.randn(96, 512, generator=generator))
    digits, x_scale, base = quantize_two_digits(x)
    hi, lo = digits[:37].int(), digits[37:].int()
    assert base == 254 and hi.abs().max() <= 127 and lo.abs().max() <= 127
    off = (hi * base + lo - torch.round(x / x_scale).int()).abs()  # the digits are the rounded value, but for
    assert off.max() <= 1 and off.sum() <= off.numel() // 1000  # the odd tie of x / scale rounded in two steps
    exact = x.double() @ dequantize(q, scale).double().t()
    for kernel in W8A8_KERNELS.values():
        if not kernel.available() or exactness_error(kernel) != 0:
            continue
        packed = kernel.pack(q, scale)
        one = ((kernel.linear(x, packed, scale).double() - exact).abs().max() / exact.abs().max()).item()
        two = ((kernel.two_digit_linear(x, packed, scale).double() - exact).abs().max() / exact.abs().max()).item()
        print(f"{kernel.name}: one digit {one:.2e}, two digits {two:.2e}")
        assert two < (2e-3 if kernel.levels < 127 else 4e-4) and two < one / 50


def test_a_two_digit_linear_carries_its_outliers_and_keeps_one_byte():
    from clef_flash.checkpoint.quant import dequantize

    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(48, 80, generator=generator)
    channels = torch.tensor([2, 41])
    q, scale = quantize_per_channel(weight.index_fill(1, channels, 0.0))
    x = torch.randn(9, 80, generator=generator)
    x[:, channels] *= 60
    kernel = machine.rates().int8_kernel or INT_MM
    linear = Int8Linear(80, 48, "w8a8-two-digit", outliers=2, kernel=kernel)
    linear.load_state_dict({"weight": q, "weight_scale": scale, "outlier_channels": channels, "outlier_weight": weight[:, channels]})
    exact = x.double() @ (dequantize(q, scale).double() + torch.zeros_like(weight, dtype=torch.float64).index_copy(1, channels, weight[:, channels].double())).t()
    error = ((linear(x).double() - exact).abs().max() / exact.abs().max()).item()
    print(f"two-digit linear with 2 outlier channels ({kernel}): {error:.1e}")
    assert error < 2e-3 and "kernel=" in repr(linear)
    assert linear._prepared is linear.weight or kernel != INT_MM  # no second copy of the weight for _int_mm
