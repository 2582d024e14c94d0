"""Agreement with the fp32 reference: our paths beside the reference's own bf16 path, same requests.

    python benchmarks/agreement.py [--configs 9b-heads,9b-heads-outliers] [--requests 30] [--seed 1] [--json OUT]

For each random release (the plain one, and one with three hidden channels 50x the rest at every
projection's input): the reference (transformers + the authors' head) in fp32 is the truth; every other
path answers the same generated requests. Rows: decisions that differ (with the fp32 top-2 margin of
each flip), median and max |dp|, and whether the path is *qualified*: no more decisions differing than
the reference's own bf16, median |dp| at most 2x its (the rule model/precision.py's QUALIFIED_* encode).

Paths: our bf16; int8 weight-only and W8A8 quantized from the release (no calibration); a converted
bundle calibrated on the built-in requests (outlier channels in fp32) in W8A8 (as this CPU's probe runs its
gated products, then with them forced to a 2-byte copy, to two int8 digits and to int8 widened to bf16 per forward
(compact where bf16 is fast), then on FBGEMM, the kernel of AVX2-only
CPUs: 7-bit, one digit at the MLP's inputs and two elsewhere) and weight-only; each release's and
bundle's default (`precision=None`) on this machine. The outlier ratio (largest / median channel absmax
at each projection's input, from the calibration run) is printed for each release.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from conftest import ReferenceModel, load_reference_module  # noqa: E402

import clef_flash  # noqa: E402
import clef_flash.plan  # noqa: E402
from clef_flash.checkpoint.w8a8 import FBGEMM  # noqa: E402
from clef_flash.model.precision import BF16_SCRATCH, TWO_DIGITS, WEIGHT_ONLY  # noqa: E402
from clef_flash.checkpoint.random_release import write_random_release  # noqa: E402
from clef_flash.checkpoint.outliers import outlier_ratios  # noqa: E402
from clef_flash.conversion import calibrate, default_calibration_requests  # noqa: E402
from clef_flash.conversion import convert  # noqa: E402
from clef_flash.request.samples import random_requests  # noqa: E402


def probabilities(logits: dict[str, float]) -> torch.Tensor:
    return torch.tensor(list(logits.values()), dtype=torch.float64).softmax(-1)


def load_with_gated(source: Path, gated_mode: str):
    """The calibrated bundle in W8A8 with its gated products in `gated_mode` (whatever the probe prefers here)."""
    chosen = clef_flash.plan.gated_mode_for
    clef_flash.plan.gated_mode_for = lambda rates, compact=False: gated_mode
    try:
        return clef_flash.load(source, device="cpu", precision="int8-w8a8")
    finally:
        clef_flash.plan.gated_mode_for = chosen


def load_on_kernel(source: Path, kernel: str):
    """The calibrated bundle in W8A8 on `kernel` (FBGEMM: the one an AVX2-only CPU runs), whatever this CPU's probe
    prefers: the kernels are exact, so the figures are those of any CPU that runs it."""
    chosen = clef_flash.plan.w8a8_kernel
    clef_flash.plan.w8a8_kernel = lambda measured: kernel
    try:
        return clef_flash.load(source, device="cpu", precision="int8-w8a8")
    finally:
        clef_flash.plan.w8a8_kernel = chosen


def paths(root: Path, bundle: Path, module) -> dict:
    load = lambda source, precision: clef_flash.load(source, device="cpu", precision=precision)  # noqa: E731
    release_default, bundle_default = load(root, None), load(bundle, None)
    return {
        "reference bf16": ReferenceModel(module, root, torch.bfloat16).logits,
        "ours bf16": load(root, "bf16").logits,
        "int8 weight-only (release)": load(root, "int8-weight-only").logits,
        "int8 w8a8 (release, uncalibrated)": load(root, "int8-w8a8").logits,
        "int8 w8a8 (calibrated bundle)": load(bundle, "int8-w8a8").logits,
        "  gated products 2-byte copy": load_with_gated(bundle, WEIGHT_ONLY).logits,
        "  gated products two int8 digits": load_with_gated(bundle, TWO_DIGITS).logits,
        "  gated products int8 widened to bf16 per forward": load_with_gated(bundle, BF16_SCRATCH).logits,
        "  on fbgemm (AVX2-only CPUs)": load_on_kernel(bundle, FBGEMM).logits,
        "int8 weight-only (calibrated bundle)": load(bundle, "int8-weight-only").logits,
        f"default of the release: {release_default.precision}": release_default.logits,
        f"default of the bundle: {bundle_default.precision}": bundle_default.logits,
    }


def compare(config: str, requests: int, seed: int, module, candidates_of=paths) -> dict:
    """`candidates_of(release, bundle, module)` -> name -> logits function: the rows (the reference bf16 among them)."""
    work = Path(tempfile.mkdtemp())
    root = write_random_release(work / config, config, seed=seed)
    fp32 = clef_flash.load(root, device="cpu", precision="fp32")
    ratios = outlier_ratios(calibrate(fp32, default_calibration_requests()))
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
    reference = rows["reference bf16"]
    for row in rows.values():
        row["qualified"] = (
            row["decisions_differing"] <= reference["decisions_differing"]
            and row["median_dp"] <= 2 * reference["median_dp"]
        )
    values = sorted(ratios.values())
    return {
        "config": config,
        "seed": seed,
        "requests": requests,
        "questions": questions,
        "outlier_ratio": {"median": statistics.median(values), "max": values[-1]},
        "rows": rows,
    }


def print_report(result: dict) -> None:
    ratio = result["outlier_ratio"]
    print(
        f"\nrandom release {result['config']} (seed {result['seed']}), {result['requests']} requests, "
        f"{result['questions']} questions, vs reference fp32; outlier ratio (max/median channel absmax at a "
        f"projection's input): median {ratio['median']:.1f}, max {ratio['max']:.1f}"
    )
    print(f"{'path':>38} {'differing':>10} {'median |dp|':>12} {'max |dp|':>10} {'qualified':>10}  fp32 margins of the flips")
    for name, row in result["rows"].items():
        margins = ", ".join(f"{m:.1e}" for m in row["flip_margins"]) or "-"
        print(
            f"{name:>38} {row['decisions_differing']:>10} {row['median_dp']:12.2e} {row['max_dp']:10.2e} "
            f"{'yes' if row['qualified'] else 'NO':>10}  {margins}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="9b-heads,9b-heads-outliers")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    module = load_reference_module()
    results = [compare(config, args.requests, args.seed, module) for config in args.configs.split(",")]
    for result in results:
        print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
