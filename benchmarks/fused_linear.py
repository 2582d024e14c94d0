"""Would fusing projections speed up the decoder's GEMMs? Separate vs concatenated weights, same run.

    python benchmarks/fused_linear.py [--tokens 399]

At the 9B sizes: MLP gate+up (2 x 12288x4096 vs one 24576x4096) and the DeltaNet input projections
(qkv 8192, z 4096, b 32, a 32 vs one 12352x4096), in fp32 and bf16, medians of 7.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=399)
    args = parser.parse_args()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(args.tokens, 4096, dtype=dtype)
        groups = {
            "MLP gate+up": [torch.randn(12288, 4096, dtype=dtype) for _ in range(2)],
            "DeltaNet qkv+z+b+a": [torch.randn(rows, 4096, dtype=dtype) for rows in (8192, 4096, 32, 32)],
        }
        for name, weights in groups.items():
            fused = torch.cat(weights)
            separate_ms = median_ms(lambda: [F.linear(x, weight) for weight in weights], repeats=7, warmup=1)
            fused_ms = median_ms(lambda: F.linear(x, fused), repeats=7, warmup=1)
            print(f"{str(dtype):>15} {name:>20}: separate {separate_ms:7.1f} ms, fused {fused_ms:7.1f} ms, "
                  f"gain {100 * (separate_ms / fused_ms - 1):+.1f}%")


if __name__ == "__main__":
    main()
