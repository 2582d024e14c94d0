"""Agreement with the fp32 reference: our paths beside the reference's own bf16 path, same requests.

    python benchmarks/agreement.py [--configs 9b-heads,9b-heads-outliers] [--seeds 1,2] [--requests 30] [--json OUT]
    python benchmarks/agreement.py --gpu-rows [...]   the GPU path's rows, measured on this CPU (`gpu_paths`)
    python benchmarks/agreement.py --yardsticks [...] the int8 table beside llama.cpp's formats (`yardstick_paths`)

For each random release (the plain one, and one with three hidden channels 50x the rest at every
projection's input): the reference (transformers + the authors' head) in fp32 is the truth; every other
path answers the same generated requests. Rows: decisions that differ (with the fp32 top-2 margin of
each flip), median and max |dp|, and whether the path is *qualified*: no more decisions differing than
the reference's own bf16, median |dp| at most 1.5x its (issue 40's target).

Paths: our bf16; the int8 scheme (checkpoint/quant.py: smoothed and rotated, no calibration) from the release in
weight-only and in W8A8 with 7-bit activations (FBGEMM's, the kernel of AVX2-only CPUs: one digit where a norm is read,
two elsewhere) and with 8-bit ones (oneDNN's and _int_mm's), both through the exact reference twin, the converted bundle in W8A8 on this CPU's kernel, and each
release's and bundle's default (`precision=None`) on this machine. The kernels are exact, so the figures hold on
every CPU. `--seeds 1,2` runs each config per seed; the summary says which paths meet the target in every run.
Each row's model is built, answers every request and is dropped before the next (a wide config's dozen fp32 models
would not fit at once). `--json OUT --append` adds the runs to OUT's (written after every run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from unittest import mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from conftest import ReferenceModel, load_reference_module  # noqa: E402

import clef_flash  # noqa: E402
import clef_flash.plan  # noqa: E402
import yardsticks  # noqa: E402
from clef_flash.agreement_table import ROWS  # noqa: E402
from clef_flash.checkpoint import loading, quant  # noqa: E402
from clef_flash.checkpoint.rotation import rotate  # noqa: E402
from clef_flash.checkpoint.w8a8 import FBGEMM, W8A8_KERNELS, reference_kernel  # noqa: E402
from clef_flash.model.precision import Precision  # noqa: E402
from clef_flash import machine  # noqa: E402
from clef_flash.checkpoint.random_release import resolve_config, write_random_release  # noqa: E402
from clef_flash.conversion import convert  # noqa: E402
from clef_flash.request.samples import random_requests  # noqa: E402


def probabilities(logits: dict[str, float]) -> torch.Tensor:
    return torch.tensor(list(logits.values()), dtype=torch.float64).softmax(-1)


MEDIAN_DP_LIMIT = 1.5  # x the reference bf16's median |dp|: qualified at most this
REFERENCE = "reference bf16"


def load_on_kernel(source: Path, levels: int):
    """`source` in W8A8 with its activations at `levels` (63: FBGEMM's 7 bits, in mixed digits; 127: 8 bits), through
    the exact reference twin (the integer sums any exact kernel computes), whatever this CPU's probe prefers."""
    name = f"reference-{levels}"
    W8A8_KERNELS[name] = reference_kernel(name, levels)
    chosen = clef_flash.plan.w8a8_kernel
    clef_flash.plan.w8a8_kernel = lambda measured: name
    try:
        return clef_flash.load(source, device="cpu", precision="int8-w8a8")
    finally:
        clef_flash.plan.w8a8_kernel = chosen
        del W8A8_KERNELS[name]


def paths(root: Path, bundle, module) -> dict:
    """name -> a function that builds the row's model and returns its logits function (`compare` builds one row at a
    time); `bundle()` converts the release once, on first use."""
    load = lambda source, precision: lambda: clef_flash.load(source(), device="cpu", precision=precision).logits  # noqa: E731
    release = lambda: root  # noqa: E731
    defaults = clef_flash.plan.defaults(machine.rates())  # what precision=None resolves to here, by kind (as `info`)
    return {
        REFERENCE: lambda: ReferenceModel(module, root, torch.bfloat16).logits,
        "ours bf16": load(release, "bf16"),
        "int8 weight-only (release)": load(release, "int8-weight-only"),
        "int8 w8a8, a7w8 (FBGEMM: AVX2-only CPUs)": lambda: load_on_kernel(root, W8A8_KERNELS[FBGEMM].levels).logits,
        "int8 w8a8, a8w8 (oneDNN, _int_mm)": lambda: load_on_kernel(root, 127).logits,
        "int8 w8a8 (bundle, this CPU's kernel)": load(bundle, "int8-w8a8"),
        f"default of the release: {defaults['release'].name}": load(release, None),
        f"default of the bundle: {defaults['bundle'].name}": load(bundle, None),
    }


@contextlib.contextmanager
def gpu_numerics():
    """The 8-bit precisions compute in bf16 on this CPU, as on CUDA (`Precision.on`): the decoder's activations,
    norms' outputs and the 16-bit weights in bf16, each product's output rounded to bf16."""
    on = Precision.on
    Precision.on = lambda self, device: dataclasses.replace(self, compute_dtype=torch.bfloat16) if self.quantized else self
    try:
        yield
    finally:
        Precision.on = on


class RotatedFp8Linear(quant.Int8Linear):
    """fp8 in the int8 scheme's frame: the weight `(W diag(s)) R` in e4m3 per channel, the input `(x / s) R` in e4m3 per
    token (measured beside plain row-wise fp8, the precision's way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shaped(quant.fp8_linear(self.inputs(x), self.weight, self.weight_scale, x.dtype), x)


class RotatedFp8Source(quant.Fp8QuantizingSource):
    smoothed = True

    def quantize(self, weight_name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quant.quantize_fp8_per_channel(rotate(weight, column_scale=self.input_smoothing(weight_name)))


def load_rotated_fp8(source: Path):
    """`source` in fp8 (GPU numerics) with the scheme's smoothing and rotation (`RotatedFp8Linear`)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(gpu_numerics())
        for module, name, value in ((quant, "Fp8Linear", RotatedFp8Linear), (loading, "Fp8QuantizingSource", RotatedFp8Source)):
            stack.callback(setattr, module, name, getattr(module, name))
            setattr(module, name, value)
        return clef_flash.load(source, device="cpu", precision="fp8")


def rotation_in_bf16(logits):
    """`logits` with every projection's input rotated in bf16 (`quant.ROTATION_DTYPE`), as a GPU's bf16 tensor cores
    would: measured beside the fp32 rotation the runtime keeps."""

    def call(request):
        with mock.patch.object(quant, "ROTATION_DTYPE", torch.bfloat16):
            return logits(request)

    return call


def gpu_paths(root: Path, bundle, module) -> dict:
    """The GPU path's rows on this CPU, with the GPU's numerics: compute in bf16 (`gpu_numerics`); int8 W8A8 on
    _int_mm's integers (8-bit activations, exact int32 sums: the reference twin's are the same), the fp32 parts
    around it as the CUDA kernel has them; fp8 row-wise through torch._scaled_mm (on CPU here), bf16 out. Each row
    on a model of its own (the bf16 rotation's too: a shared one would share kept states)."""

    def with_gpu_numerics(build):
        def make():
            with gpu_numerics():
                return build()

        return make

    return {
        REFERENCE: lambda: ReferenceModel(module, root, torch.bfloat16).logits,
        "ours bf16": lambda: clef_flash.load(root, device="cpu", precision="bf16").logits,
        "int8 w8a8 (_int_mm's integers), bf16": with_gpu_numerics(lambda: load_on_kernel(root, 127).logits),
        "int8 w8a8 (_int_mm's integers), bf16, its rotation in bf16": with_gpu_numerics(
            lambda: rotation_in_bf16(load_on_kernel(root, 127).logits)
        ),
        "fp8 row-wise e4m3 (_scaled_mm), bf16": with_gpu_numerics(lambda: clef_flash.load(root, device="cpu", precision="fp8").logits),
        "fp8 smoothed+rotated e4m3, bf16": lambda: load_rotated_fp8(root).logits,
    }


def yardstick_paths(root: Path, bundle, module) -> dict:
    """The int8 table beside the formats people know (issue 50), in this CPU's fp32 numerics around every product:
    ours in fp32, bf16, int8 weight-only and W8A8 with 8-bit activations and in the 7-bit mix of AVX2-only CPUs (both on
    the exact reference twin), fp8 row-wise (`Fp8Linear` on CPU: e4m3 products, fp32 out), and benchmarks/yardsticks.py's
    emulations: llama.cpp's Q8_0 and Q4_0, the scheme with weight groups of 32, 128 and 256."""
    load = lambda precision: lambda: clef_flash.load(root, device="cpu", precision=precision).logits  # noqa: E731
    return {
        ROWS["reference-bf16"]: lambda: ReferenceModel(module, root, torch.bfloat16).logits,
        ROWS["fp32"]: load("fp32"),
        ROWS["bf16"]: load("bf16"),
        ROWS["int8-weight-only"]: load("int8-weight-only"),
        ROWS["int8-w8a8/8"]: lambda: load_on_kernel(root, 127).logits,
        ROWS["int8-w8a8/7"]: lambda: load_on_kernel(root, W8A8_KERNELS[FBGEMM].levels).logits,
        ROWS["fp8"]: load("fp8"),
        **{ROWS[format.key]: lambda format=format: yardsticks.load_emulated(root, format).logits for format in yardsticks.FORMATS},
    }


def answers(make, requests: list[dict]) -> tuple[list[dict], float]:
    """(the logits of each request from the model `make()` builds, seconds taken): one model alive at a time, so a
    set of many rows at a wide config fits in memory."""
    start = time.perf_counter()
    logits = make()
    answered = [logits(request) for request in requests]
    del logits
    gc.collect()
    return answered, time.perf_counter() - start


def compare(config: str, requests: int, seed: int, module, candidates_of=paths) -> dict:
    """`candidates_of(release, bundle, module)` -> name -> a function building that row's logits function (the
    reference bf16 among them); the rows are built and answered one after another."""
    generated = random_requests(seed, requests)
    seconds = {}
    with tempfile.TemporaryDirectory() as work:
        root = write_random_release(Path(work) / config, config, seed=seed)
        bundle = functools.cache(lambda: convert(root, Path(work) / "bundle", progress=False))
        expected, seconds["reference fp32"] = answers(lambda: ReferenceModel(module, root, torch.float32).logits, generated)
        results = {}
        for name, make in candidates_of(root, bundle, module).items():
            results[name], seconds[name] = answers(make, generated)
            print(f"  {name}: {seconds[name]:.0f} s", flush=True)
    flips = {name: [] for name in results}
    deltas = {name: [] for name in results}
    questions = 0
    for index, reference_logits in enumerate(expected):
        for question_id, logits in reference_logits.items():
            questions += 1
            p = probabilities(logits)
            top2 = p.topk(min(2, len(p))).values
            margin = float(top2[0] - top2[1]) if len(top2) > 1 else 1.0
            for name, answered in results.items():
                q = probabilities(answered[index][question_id])
                deltas[name] += (q - p).abs().tolist()
                if int(q.argmax()) != int(p.argmax()):
                    flips[name].append(margin)
    rows = {
        name: {
            "decisions_differing": len(flips[name]),
            "flip_margins": sorted(flips[name]),
            "median_dp": statistics.median(deltas[name]),
            "max_dp": max(deltas[name]),
            "seconds": round(seconds[name], 1),
        }
        for name in results
    }
    reference = rows[REFERENCE]
    for row in rows.values():
        row["qualified"] = (
            row["decisions_differing"] <= reference["decisions_differing"]
            and row["median_dp"] <= MEDIAN_DP_LIMIT * reference["median_dp"]
        )
    return {
        "config": config,
        "hidden_size": resolve_config(config).text.hidden_size,
        "seed": seed,
        "requests": requests,
        "questions": questions,
        "rows": rows,
    }


def summarize(results: list[dict]) -> dict:
    """Per candidate over every run: decisions differing (total, and the reference bf16's), median |dp| / the
    reference bf16's per run, and whether it meets the target in every run."""
    summary = {}
    for name in results[0]["rows"]:
        flips, ratios, meets = [], [], True
        for result in results:
            row, reference = result["rows"][name], result["rows"][REFERENCE]
            flips.append(row["decisions_differing"])
            ratios.append(row["median_dp"] / reference["median_dp"])
            meets &= row["decisions_differing"] <= reference["decisions_differing"] and ratios[-1] <= MEDIAN_DP_LIMIT
        summary[name] = {
            "decisions_differing": sum(flips),
            "decisions_differing_per_run": flips,
            "median_dp_ratio_per_run": ratios,
            "median_dp_ratio_worst": max(ratios),
            "meets_target": meets,
        }
    return summary


def print_summary(results: list[dict], summary: dict) -> None:
    runs = ", ".join(f"{result['config']} s{result['seed']}" for result in results)
    reference_flips = summary[REFERENCE]["decisions_differing"]
    questions = sum(result["questions"] for result in results)
    print(f"\nsummary over {len(results)} runs ({runs}; {questions} questions); per run in that order")
    width = max(map(len, summary))
    print(f"{'path':>{width}} {'differing':>10} {'per run':>14} {'median |dp| / ref bf16 per run':>32} {'worst':>6} {'meets target':>13}")
    for name, row in summary.items():
        per_run = " ".join(f"{flips}" for flips in row["decisions_differing_per_run"])
        ratios = " ".join(f"{ratio:.2f}" for ratio in row["median_dp_ratio_per_run"])
        print(
            f"{name:>{width}} {row['decisions_differing']:>4} ({reference_flips:>2}) {per_run:>14} {ratios:>32} "
            f"{row['median_dp_ratio_worst']:6.2f} {'yes' if row['meets_target'] else 'NO':>13}"
        )
    print(
        f"(differing: total (the reference bf16's); meets target: no more decisions differing than the reference bf16 "
        f"and median |dp| <= {MEDIAN_DP_LIMIT}x its, in every run)"
    )


def print_report(result: dict) -> None:
    print(
        f"\nrandom release {result['config']} (seed {result['seed']}), {result['requests']} requests, "
        f"{result['questions']} questions, vs reference fp32"
    )
    width = max(map(len, result["rows"]))
    print(f"{'path':>{width}} {'differing':>10} {'median |dp|':>12} {'max |dp|':>10} {'qualified':>10}  fp32 margins of the flips")
    for name, row in result["rows"].items():
        margins = ", ".join(f"{m:.1e}" for m in row["flip_margins"]) or "-"
        print(
            f"{name:>{width}} {row['decisions_differing']:>10} {row['median_dp']:12.2e} {row['max_dp']:10.2e} "
            f"{'yes' if row['qualified'] else 'NO':>10}  {margins}"
        )


def run(candidates_of, description: str) -> None:
    """The command line of an agreement table: `candidates_of` over --configs x --seeds, each run's table, the summary."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="9b-heads,9b-heads-outliers")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--json", help="also write the figures to this file (after every run)")
    parser.add_argument("--append", action="store_true", help="keep the runs already in --json's file, add these")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--gpu-rows", action="store_true", help="the GPU path's rows with its numerics (`gpu_paths`)")
    rows.add_argument("--yardsticks", action="store_true", help="the int8 table beside llama.cpp's formats (`yardstick_paths`)")
    args = parser.parse_args()
    candidates_of = gpu_paths if args.gpu_rows else yardstick_paths if args.yardsticks else candidates_of
    module = load_reference_module()
    results = json.loads(Path(args.json).read_text())["runs"] if args.append else []
    for seed in args.seeds.split(","):
        for config in args.configs.split(","):
            results.append(compare(config, args.requests, int(seed), module, candidates_of=candidates_of))
            print_report(results[-1])
            if args.json:
                Path(args.json).write_text(json.dumps({"runs": results, "summary": summarize(results)}, indent=1) + "\n")
    print_summary(results, summarize(results))


if __name__ == "__main__":
    run(paths, __doc__)
