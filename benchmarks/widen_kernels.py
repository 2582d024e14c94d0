"""W8A8's gated products at 1 byte where bf16 is fast: the kept bf16 copy against the int8 weight widened to bf16 per
forward (`quant.bf16_scratch_linear`'s way: one copy into a scratch that exists, then the bf16 product), widened in
row chunks, and `torch._weight_int8pack_mm` (bf16 activations, int8 weight, PyTorch's own weight-only kernel).

    python benchmarks/widen_kernels.py [--tokens 272] [--json out.json]

G(OP)/s of one product per projection shape of the 9B (down_proj 12288 -> 4096, a 4096 -> 4096 one), best of 7.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {"down_proj": (12288, 4096), "o_proj / out_proj": (4096, 4096)}


def best_seconds(run, repeats: int = 7) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def rates(tokens: int, inputs: int, outputs: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, inputs, generator=generator).bfloat16()
    weight = torch.randn(outputs, inputs, generator=generator)
    absmax = weight.abs().amax(dim=1, keepdim=True)
    q = (weight / absmax * 127).round().to(torch.int8)
    copy, scale = weight.bfloat16(), (absmax[:, 0] / 127).bfloat16()
    scratch = torch.empty(outputs, inputs, dtype=torch.bfloat16)
    out = torch.empty(tokens, outputs, dtype=torch.bfloat16)
    chunk_rows = 512
    chunk = torch.empty(chunk_rows, inputs, dtype=torch.bfloat16)

    def chunked() -> None:
        for start in range(0, outputs, chunk_rows):
            torch.mm(x, chunk.copy_(q[start : start + chunk_rows]).t(), out=out[:, start : start + chunk_rows])

    runs = {
        "bf16 copy": lambda: x @ copy.t(),
        "widened per forward": lambda: x @ scratch.copy_(q).t(),
        f"widened in {chunk_rows}-row chunks": chunked,
        "_weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, q, scale),
    }
    ops = 2 * tokens * inputs * outputs
    return {name: ops / best_seconds(run) / 1e9 for name, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=272, help="rows of the product (272: a record's uncached tokens)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    results = {}
    for name, (inputs, outputs) in SHAPES.items():
        results[name] = rates(args.tokens, inputs, outputs)
        print(f"{name} ({args.tokens} x {inputs} -> {outputs}), G(OP)/s: " + ", ".join(f"{k} {v:.0f}" for k, v in results[name].items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tokens": args.tokens, "threads": torch.get_num_threads(), "gops": results}, handle, indent=1)


if __name__ == "__main__":
    main()
