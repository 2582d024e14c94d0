"""Agreement with the fp32 reference: our paths beside the reference's own bf16 path, same requests.

    python benchmarks/agreement.py [--configs 9b-heads,9b-heads-outliers] [--seeds 1,2] [--requests 30] [--json OUT]
    python benchmarks/agreement.py --gpu-rows [...]   the GPU path's rows, measured on this CPU (`gpu_paths`)

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

import torch  # noqa: E402
from conftest import ReferenceModel, load_reference_module  # noqa: E402

import clef_flash  # noqa: E402
import clef_flash.plan  # noqa: E402
from clef_flash.checkpoint import loading, quant  # noqa: E402
from clef_flash.checkpoint.rotation import rotate  # noqa: E402
from clef_flash.checkpoint.w8a8 import FBGEMM, W8A8_KERNELS, reference_kernel  # noqa: E402
from clef_flash.model.precision import Precision  # noqa: E402
from clef_flash.checkpoint.random_release import write_random_release  # noqa: E402
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


def paths(root: Path, bundle: Path, module) -> dict:
    load = lambda source, precision: clef_flash.load(source, device="cpu", precision=precision)  # noqa: E731
    release_default, bundle_default = load(root, None), load(bundle, None)
    return {
        REFERENCE: ReferenceModel(module, root, torch.bfloat16).logits,
        "ours bf16": load(root, "bf16").logits,
        "int8 weight-only (release)": load(root, "int8-weight-only").logits,
        "int8 w8a8, a7w8 (FBGEMM: AVX2-only CPUs)": load_on_kernel(root, W8A8_KERNELS[FBGEMM].levels).logits,
        "int8 w8a8, a8w8 (oneDNN, _int_mm)": load_on_kernel(root, 127).logits,
        "int8 w8a8 (bundle, this CPU's kernel)": load(bundle, "int8-w8a8").logits,
        f"default of the release: {release_default.precision}": release_default.logits,
        f"default of the bundle: {bundle_default.precision}": bundle_default.logits,
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


def gpu_paths(root: Path, bundle: Path, module) -> dict:
    """The GPU path's rows on this CPU, with the GPU's numerics: compute in bf16 (`gpu_numerics`); int8 W8A8 on
    _int_mm's integers (8-bit activations, exact int32 sums: the reference twin's are the same), the fp32 parts
    around it as the CUDA kernel has them; fp8 row-wise through torch._scaled_mm (on CPU here), bf16 out."""
    with gpu_numerics():  # (the bf16 rotation's row on a model of its own: a shared one would share kept states)
        int8, int8_bf16_rotation = load_on_kernel(root, 127), load_on_kernel(root, 127)
        fp8 = clef_flash.load(root, device="cpu", precision="fp8")
    return {
        REFERENCE: ReferenceModel(module, root, torch.bfloat16).logits,
        "ours bf16": clef_flash.load(root, device="cpu", precision="bf16").logits,
        "int8 w8a8 (_int_mm's integers), bf16": int8.logits,
        "int8 w8a8 (_int_mm's integers), bf16, its rotation in bf16": rotation_in_bf16(int8_bf16_rotation.logits),
        "fp8 row-wise e4m3 (_scaled_mm), bf16": fp8.logits,
        "fp8 smoothed+rotated e4m3, bf16": load_rotated_fp8(root).logits,
    }


def compare(config: str, requests: int, seed: int, module, candidates_of=paths) -> dict:
    """`candidates_of(release, bundle, module)` -> name -> logits function: the rows (the reference bf16 among them)."""
    work = Path(tempfile.mkdtemp())
    root = write_random_release(work / config, config, seed=seed)
    bundle = convert(root, work / "bundle", progress=False)
    candidates = candidates_of(root, bundle, module)
    reference_fp32 = ReferenceModel(module, root, torch.float32)
    flips = {name: [] for name in candidates}
    deltas = {name: [] for name in candidates}
    questions = 0
    for request in random_requests(seed, requests):
        expected = reference_fp32.logits(request)
        results = {name: function(request) for name, function in candidates.items()}
        for question_id, logits in expected.items():
            questions += 1
            p = probabilities(logits)
            top2 = p.topk(min(2, len(p))).values
            margin = float(top2[0] - top2[1]) if len(top2) > 1 else 1.0
            for name, result in results.items():
                q = probabilities(result[question_id])
                deltas[name] += (q - p).abs().tolist()
                if int(q.argmax()) != int(p.argmax()):
                    flips[name].append(margin)
    rows = {
        name: {
            "decisions_differing": len(flips[name]),
            "flip_margins": sorted(flips[name]),
            "median_dp": statistics.median(deltas[name]),
            "max_dp": max(deltas[name]),
        }
        for name in candidates
    }
    reference = rows[REFERENCE]
    for row in rows.values():
        row["qualified"] = (
            row["decisions_differing"] <= reference["decisions_differing"]
            and row["median_dp"] <= MEDIAN_DP_LIMIT * reference["median_dp"]
        )
    return {
        "config": config,
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
    print(f"{'path':>42} {'differing':>10} {'per run':>14} {'median |dp| / ref bf16 per run':>32} {'worst':>6} {'meets target':>13}")
    for name, row in summary.items():
        per_run = " ".join(f"{flips}" for flips in row["decisions_differing_per_run"])
        ratios = " ".join(f"{ratio:.2f}" for ratio in row["median_dp_ratio_per_run"])
        print(
            f"{name:>42} {row['decisions_differing']:>4} ({reference_flips:>2}) {per_run:>14} {ratios:>32} "
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
    print(f"{'path':>42} {'differing':>10} {'median |dp|':>12} {'max |dp|':>10} {'qualified':>10}  fp32 margins of the flips")
    for name, row in result["rows"].items():
        margins = ", ".join(f"{m:.1e}" for m in row["flip_margins"]) or "-"
        print(
            f"{name:>42} {row['decisions_differing']:>10} {row['median_dp']:12.2e} {row['max_dp']:10.2e} "
            f"{'yes' if row['qualified'] else 'NO':>10}  {margins}"
        )


def run(candidates_of, description: str) -> None:
    """The command line of an agreement table: `candidates_of` over --configs x --seeds, each run's table, the summary."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="9b-heads,9b-heads-outliers")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--gpu-rows", action="store_true", help="the GPU path's rows with its numerics (`gpu_paths`)")
    args = parser.parse_args()
    candidates_of = gpu_paths if args.gpu_rows else candidates_of
    module = load_reference_module()
    results = []
    for seed in args.seeds.split(","):
        for config in args.configs.split(","):
            results.append(compare(config, args.requests, int(seed), module, candidates_of=candidates_of))
            print_report(results[-1])
    summary = summarize(results)
    print_summary(results, summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    run(paths, __doc__)
