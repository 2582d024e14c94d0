"""Agreement with the fp32 reference: our bf16 and int8 paths beside the reference's own bf16 path, same requests.

    python benchmarks/agreement.py [--config 9b-heads] [--requests 40] [--seed 1] [--no-int8] [--no-w8a8]

int8 rows: both compute modes, and each also with the DeltaNet gate projections (in_proj_a, in_proj_b)
quantized, to measure the predicate's choice of keeping them 16-bit.

Both are compared with the reference (transformers + the authors' head) in fp32 on a random release:
decisions that differ (with the fp32 top-2 margin of each flip) and the median / max |dp|.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from conftest import ReferenceModel, load_reference_module  # noqa: E402

import clef_flash  # noqa: E402
from clef_flash import quant  # noqa: E402
from clef_flash.checkpoint.random_release import write_random_release  # noqa: E402
from clef_flash.request.samples import random_requests  # noqa: E402


def probabilities(logits: dict[str, float]) -> torch.Tensor:
    return torch.tensor(list(logits.values()), dtype=torch.float64).softmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="9b-heads")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 rows")
    parser.add_argument("--no-w8a8", action="store_true", help="skip W8A8 (slow where torch._int_mm has no VNNI)")
    args = parser.parse_args()

    root = write_random_release(Path(tempfile.mkdtemp()) / args.config, args.config, seed=args.seed)
    module = load_reference_module()
    reference_fp32 = ReferenceModel(module, root, torch.float32)
    candidates = {
        "reference bf16": ReferenceModel(module, root, torch.bfloat16).logits,
        "clef-flash bf16": clef_flash.load(root, device="cpu", precision="bf16").logits,
        "clef-flash fp32": clef_flash.load(root, device="cpu", precision="fp32").logits,
    }
    modes = [] if args.no_int8 else ["weight-only"] + ([] if args.no_w8a8 else ["w8a8"])
    for mode in modes:
        candidates[f"int8 {mode}"] = clef_flash.load(root, device="cpu", precision=f"int8-{mode}").logits
        kept, quant.KEPT_HIGH_PRECISION = quant.KEPT_HIGH_PRECISION, ()
        try:
            candidates[f"int8 {mode}, a/b int8"] = clef_flash.load(root, device="cpu", precision=f"int8-{mode}").logits
        finally:
            quant.KEPT_HIGH_PRECISION = kept
    flips = {name: [] for name in candidates}
    deltas = {name: [] for name in candidates}
    questions = 0
    for request in random_requests(args.seed, args.requests):
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
    print(f"random release {args.config} (seed {args.seed}), {args.requests} requests, {questions} questions, vs reference fp32")
    print(f"{'path':>24} {'decisions differing':>20} {'median |dp|':>12} {'max |dp|':>10}  fp32 margins of the flips")
    for name in candidates:
        margins = ", ".join(f"{m:.1e}" for m in sorted(flips[name])) or "-"
        print(f"{name:>24} {len(flips[name]):>20} {statistics.median(deltas[name]):12.2e} {max(deltas[name]):10.2e}  {margins}")


if __name__ == "__main__":
    main()
